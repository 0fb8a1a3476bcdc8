"""GRPO with `actor_rollout_ref.rollout.name=vllm` against the stand-in `vllm` module (tests/fake_vllm.py):
the worker builds vLLM from the actor's model dir with the rollout keys, pushes the actor's weights (LoRA
merged) into it after every update, wakes it before generation and sleeps it after, and resumes it
with the checkpoint's weights. A missing vLLM is a user error naming the extra (exit 2)."""

from __future__ import annotations

import copy
import sys

import torch

from tests.fake_vllm import FakeLLM
from tests.trainer.test_rl import make_cfg, rl_data  # noqa: F401  (rl_data is a fixture)

VLLM = ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.max_num_batched_tokens=512", "actor_rollout_ref.rollout.dtype=float32",
        "+actor_rollout_ref.rollout.engine_kwargs.max_num_seqs=8", "data.val_files=[]")


def _trainer(cfg):
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    engine = trainer.actor.worker.rollout
    engine.sleep_mode = True  # on a GPU free_cache_engine turns it on; here the stand-in records the calls
    return trainer, engine, FakeLLM.instances[-1]


def _assert_same(loaded: dict, expected: dict):
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(loaded[key], value.float(), rtol=0, atol=0, msg=key)


def test_grpo_syncs_weights_and_sleeps_between_rollouts(tmp_path, tiny_model_dir, rl_data, fake_vllm):  # noqa: F811
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *VLLM, "trainer.save_freq=1",
                   "+actor_rollout_ref.model.override_config.attention_dropout=0.0")
    trainer, _, llm = _trainer(cfg)
    assert llm.model_dir == str(tiny_model_dir) and llm.logprobs_mode == "processed_logprobs"
    kw = llm.kwargs
    assert (kw["gpu_memory_utilization"], kw["max_num_batched_tokens"], kw["max_num_seqs"]) == (0.3, 512, 8)
    assert (kw["tensor_parallel_size"], kw["enforce_eager"], kw["dtype"], kw["seed"]) == (1, True, "float32", cfg.trainer.seed)
    # vLLM reads the model dir's config itself: the actor's config overrides go along; weights sync by name
    assert kw["hf_overrides"] == {"attention_dropout": 0.0} and kw["trust_remote_code"] is False
    assert kw["worker_extension_cls"] == "tiller.rollout.vllm_worker.TillerWorkerExtension"
    # verl's vLLM knobs left unset: vLLM's own defaults (they depend on its device and the model)
    assert not {"enable_prefix_caching", "scheduling_policy", "disable_log_stats"} & kw.keys()
    assert "compilation_config" not in kw  # (no capture sizes set: vLLM's own)
    before = trainer.actor.execute("state_dict")
    metrics = trainer.fit()
    after = trainer.actor.execute("state_dict")
    trainer.shutdown()
    assert metrics["training/global_step"] == 2
    assert any(not torch.equal(before[k], after[k]) for k in before), "the actor did not move"
    # per step: wake (already awake: no call) -> generate -> sleep, then sync: wake_up -> load_weights
    assert llm.events == ["generate", "sleep", "wake_up", "load_weights"] * 2
    assert len(llm.loaded) == 2
    _assert_same(llm.loaded[-1], after)  # vLLM holds exactly the updated actor
    assert any(not torch.equal(llm.loaded[0][k], llm.loaded[1][k]) for k in after)

    # resume from step 1: the fresh engine gets the checkpoint's weights before its first rollout
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_1"
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *VLLM, "trainer.total_training_steps=1",
                   "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}")
    trainer, _, llm2 = _trainer(cfg)
    trainer.fit()  # loads the checkpoint (step 1 of 1 already done: no new step)
    trainer.shutdown()
    assert llm2 is not llm and llm2.events[0] == "load_weights"
    _assert_same(llm2.loaded[0], llm.loaded[0])


def test_lora_actor_pushes_merged_weights(tmp_path, tiny_model_dir, rl_data, fake_vllm):  # noqa: F811
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *VLLM, "trainer.total_training_steps=1",
                   "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")
    trainer, _, llm = _trainer(cfg)
    trainer.fit()
    peft_model = trainer.actor.worker.module
    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()  # peft's own merge, for reference
    trainer.shutdown()
    assert not any("lora" in k for k in llm.loaded[-1])
    assert set(llm.loaded[-1]) == set(merged)
    for key, value in merged.items():
        torch.testing.assert_close(llm.loaded[-1][key], value, msg=key)
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # the adapters moved, so the merge is not the base


def test_missing_vllm_exits_2_naming_the_extra(tmp_path, tiny_model_dir, rl_data, monkeypatch, capsys):  # noqa: F811
    from tests.trainer.test_rl import _overrides
    from tiller.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    code = main(["rl", *_overrides(tmp_path / "run", tiny_model_dir, rl_data, "actor_rollout_ref.rollout.name=vllm",
                                   "trainer.total_training_steps=1")])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'tiller[vllm]'" in err and "Traceback" not in err, err


def test_capture_sizes_and_set_knobs_go_to_vllm(tmp_path, tiny_model_dir, rl_data, fake_vllm):  # noqa: F811
    """rollout.cudagraph_capture_sizes reaches vLLM as compilation_config.cudagraph_capture_sizes (sorted,
    deduplicated), merged into a compilation_config given by engine_kwargs (a JSON string too), as verl passes it; a
    size < 1 is refused naming the key."""
    import pytest

    from tiller.errors import UserError

    sizes = "actor_rollout_ref.rollout.cudagraph_capture_sizes=[16,1,8,8]"
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *VLLM, sizes,
                   """+actor_rollout_ref.rollout.engine_kwargs.compilation_config='{"mode": 0}'""",
                   "actor_rollout_ref.rollout.scheduling_policy=priority",
                   "actor_rollout_ref.rollout.enable_prefix_caching=false")
    trainer, _, llm = _trainer(cfg)
    trainer.shutdown()
    assert llm.kwargs["compilation_config"] == {"mode": 0, "cudagraph_capture_sizes": [1, 8, 16]}
    # verl's vLLM knobs the user set go to vLLM by their names
    assert (llm.kwargs["scheduling_policy"], llm.kwargs["enable_prefix_caching"]) == ("priority", False)
    cfg = make_cfg(tmp_path / "run2", tiny_model_dir, rl_data, *VLLM,
                   "actor_rollout_ref.rollout.cudagraph_capture_sizes=[0,4]")
    with pytest.raises(UserError, match="cudagraph_capture_sizes"):
        _trainer(cfg)
