"""GRPO end to end on the tiny VLM and the shapes task (verl keys): a step runs, weights change, the custom
reward function sees the row's images, freeze_vision_tower keeps the vision tower fixed."""

import json
from pathlib import Path

import pytest
import torch

from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.tasks import shapes

REWARD_SRC = '''
import json, os
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
    images = extra_info["images"]
    with open(os.environ["SHAPES_LOG"], "a") as fh:
        fh.write(json.dumps({"n": len(images), "size": list(images[0].size)}) + "\\n")
    return float(solution_str.strip().startswith(str(ground_truth)))
'''


@pytest.fixture(scope="module")
def shapes_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    shapes.write_task(root, n_train=8, n_test=4, seed=0)
    (root / "reward.py").write_text(REWARD_SRC)
    return root


def _cfg(run_dir, model_dir, data, *overrides):
    return load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data / 'train.parquet'}]",
        "data.image_key=images", "data.train_batch_size=2", "data.max_prompt_length=64",
        "data.max_response_length=4", "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.rollout.dtype=float32", "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1",
        "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
        "trainer.save_freq=-1", f"trainer.default_local_dir={run_dir}", *overrides])


def _fit_weights(cfg) -> tuple[dict, dict]:
    """The actor's weights before and after `RLTrainer(cfg).fit()`."""
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    try:
        before = trainer.actor.execute("state_dict")
        trainer.fit()
        return before, trainer.actor.execute("state_dict")
    finally:
        trainer.shutdown()


def test_grpo_step_on_image_prompts(tmp_path, tiny_vlm_dir, shapes_data, monkeypatch):
    log = tmp_path / "reward.log"
    monkeypatch.setenv("SHAPES_LOG", str(log))
    cfg = _cfg(tmp_path / "run", tiny_vlm_dir, shapes_data, "actor_rollout_ref.actor.freeze_vision_tower=true",
               "actor_rollout_ref.actor.use_kl_loss=true", f"custom_reward_function.path={shapes_data / 'reward.py'}")
    before, after = _fit_weights(cfg)
    lm = [k for k in before if "language_model" in k]
    vision = [k for k in before if ".visual." in k]
    assert lm and vision
    assert any(not torch.equal(before[k], after[k]) for k in lm)
    assert all(torch.equal(before[k], after[k]) for k in vision)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 2 * 4 and all(s == {"n": 1, "size": [64, 64]} for s in seen)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("actor/pg_loss" in json.dumps(m) for m in metrics)


def test_the_update_sees_the_pixels(tmp_path, any_vlm_dir, shapes_data):
    """The actor update's forward takes each row's pixels: its probabilities equal the rollout's (which ran
    with the images) and the vision tower learns. (Without the pixels the update trained the language model
    on bare <|image_pad|> tokens: probabilities off by up to 0.66, the vision tower never moved, and GRPO on
    the shapes task lost held-out accuracy.)"""
    # the entropy bonus has a gradient whatever the rewards (a group of equal rewards has none)
    before, after = _fit_weights(_cfg(tmp_path / "run", any_vlm_dir, shapes_data,
                                      "actor_rollout_ref.actor.entropy_coeff=0.01"))
    vision = [k for k in before if ".visual." in k]
    assert vision and any(not torch.equal(before[k], after[k]) for k in vision)
    metrics = {}
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        metrics.update(json.loads(line).get("metrics", json.loads(line)))
    assert metrics["training/rollout_probs_diff_max"] < 1e-2  # the shapes demo without the pixels: up to 0.66


def test_freeze_vision_tower_needs_a_vision_model(tmp_path, tiny_model_dir, shapes_data):
    from tiller.trainer.rl import RLTrainer

    from tiller.errors import DataError

    with pytest.raises((ConfigError, DataError), match="freeze_vision_tower=True but the model|not a vision-language"):
        RLTrainer(_cfg(tmp_path / "run", tiny_model_dir, shapes_data, "actor_rollout_ref.actor.freeze_vision_tower=true"))


def test_openrlhf_vlm_flags_translate():
    from tiller.openrlhf.cli import resolve

    argv = ["train_ppo_ray", "--actor.model_name_or_path", "Qwen/Qwen2.5-VL-3B-Instruct",
            "--data.prompt_dataset", "geo3k.parquet", "--data.input_key", "prompt", "--data.image_key", "images",
            "--data.max_images_per_prompt", "1", "--actor.freeze_visual_encoder",
            "--reward.remote_url", "http://rm:5000/get_reward"]
    cfg = resolve(argv)[2]
    assert cfg.data.image_key == "images" and cfg.actor_rollout_ref.actor.freeze_vision_tower is True
    plain = [a for a in argv if a != "--actor.freeze_visual_encoder"]
    assert resolve(plain)[2].actor_rollout_ref.actor.freeze_vision_tower is False


SCRIPT = Path(__file__).parents[1] / "data" / "verl_scripts" / "grpo_qwen2_5_vl_geo3k.txt"
VERL010 = Path(__file__).parents[1] / "data" / "verl_examples" / "verl010"
QWEN3_VL_SCRIPTS = {"qwen3_vl": "grpo_trainer__run_qwen3_vl_8b_fsdp",
                    "qwen3_vl_distill": "on_policy_distillation_trainer__run_qwen3_vl_8b_fsdp",
                    "qwen3_vl_moe": "grpo_trainer__run_qwen3_vl_30b_a3b_fsdp",
                    "qwen3_5": "grpo_trainer__run_qwen3_5_27b_fsdp",
                    "qwen3_5_moe": "grpo_trainer__run_qwen3_5_35b_fsdp",
                    "glm4v": "grpo_trainer__run_glm4_1v_9b_fsdp"}


def _script_overrides(name: str) -> list[str]:
    """verl's overrides of run_qwen2_5_vl_7b_fsdp.sh (one per line) or of one of verl 0.10's Qwen3-VL scripts."""
    if name == "qwen2_5_vl":
        return [line for line in SCRIPT.read_text().splitlines() if line and not line.startswith("#")]
    return json.loads((VERL010 / f"{QWEN3_VL_SCRIPTS[name]}.json").read_text())["overrides"]


@pytest.mark.slow
@pytest.mark.parametrize("script, model", [("qwen2_5_vl", "tiny_vlm_dir"), ("qwen3_vl", "tiny_qwen3vl_dir"),
                                           ("qwen3_vl_distill", "tiny_qwen3vl_dir"),
                                           ("qwen3_vl_moe", "tiny_qwen3vl_moe_dir"),
                                           ("qwen3_5", "tiny_qwen3_5_vlm_dir"),
                                           ("qwen3_5_moe", "tiny_qwen3_5_moe_vlm_dir"),
                                           ("glm4v", "tiny_glm4v_dir")])
def test_verls_vlm_scripts_run_on_the_tiny_vlms(tmp_path, shapes_data, request, script, model):
    """verl's run_qwen2_5_vl_7b_fsdp.sh (on the tiny Qwen2-VL), run_qwen3_vl_8b_fsdp.sh and the on-policy
    distillation run_qwen3_vl_8b_fsdp.sh (on the tiny Qwen3-VL, its own teacher), run_qwen3_vl_30b_a3b_fsdp.sh (on the
    tiny Qwen3-VL-MoE, with the router loss tiller adds on request) and run_qwen3_5_27b_fsdp.sh (on the tiny Qwen3.5:
    Gated DeltaNet layers, use_remove_padding=True run padded), run_qwen3_5_35b_fsdp.sh (on the tiny Qwen3.5-MoE) and
    run_glm4_1v_9b_fsdp.sh (on the tiny GLM-4.1V) overrides, paths pointed at the tiny VLM and shapes
    data (verl's schema), rollout.name=native in place of vllm, and sizes cut for a CPU (batch, response length, one
    step, no wandb)."""
    from tiller.trainer.rl import RLTrainer

    model_dir = request.getfixturevalue(model)
    paths = {"actor_rollout_ref.model.path": str(model_dir),
             "data.train_files": str(shapes_data / "train.parquet"), "data.val_files": str(shapes_data / "test.parquet"),
             "actor_rollout_ref.rollout.name": "native",
             "distillation.teacher_models.teacher_model.model_path": str(model_dir)}
    args = [f"{k}={paths[k]}" if (k := line.split("=", 1)[0]) in paths else line for line in _script_overrides(script)]
    args += ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_response_length=4",
             "trainer.total_training_steps=1", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
             "data.max_prompt_length=64", f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.resume_mode=disable"]
    if script == "qwen3_vl_moe":
        args.append("actor_rollout_ref.actor.router_aux_loss_coef=0.001")
    trainer = RLTrainer(load_config(args))
    try:
        own = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl_moe": "qwen3_vl_moe", "qwen3_5": "qwen3_5",
               "qwen3_5_moe": "qwen3_5_moe", "glm4v": "glm4v"}
        assert trainer.actor.worker.module.config.model_type == own.get(script, "qwen3_vl")
        trainer.fit()
    finally:
        trainer.shutdown()
    assert trainer.global_step == 1
    step = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    # the rollout (with the pixels) and the actor's recomputed log-probs (with the pixels) agree
    assert step["training/rollout_probs_diff_max"] < 1e-3
    if script == "qwen3_vl_distill":  # the teacher (the same model) sees the pixels too: KL 0 (measured -1.8e-7)
        assert abs(step["distillation/reverse_kl"]) < 1e-5
    if script == "qwen3_vl_moe":  # top-2 of 4 experts: 2 when balanced (measured 2.01)
        assert 1.9 < step["actor/aux_loss"] < 4


@pytest.mark.parametrize("model_type", ["llava"])
def test_a_vlm_tiller_does_not_train_is_refused_naming_its_type(tmp_path, tiny_vlm_dir, shapes_data, model_type,
                                                                capsys):
    """A LLaVA checkpoint (an image-text family tiller does not drive): it stops `tiller rl` (exit 2, one line naming
    the model type) before any row is read, and `load_causal_lm` the same way (no AutoModelForCausalLM traceback)."""
    import shutil

    from tiller.cli import main
    from tiller.errors import UserError
    from tiller.models.loading import load_causal_lm

    model_dir = shutil.copytree(tiny_vlm_dir, tmp_path / model_type)  # its tokenizer, another config
    (model_dir / "config.json").write_text(json.dumps({"model_type": model_type}))
    code = main(["rl", *(f"{k}={v}" for k, v in (("actor_rollout_ref.model.path", model_dir),
                                                  ("data.train_files", f"[{shapes_data / 'train.parquet'}]"),
                                                  ("data.image_key", "images"), ("data.train_batch_size", 2),
                                                  ("actor_rollout_ref.actor.ppo_mini_batch_size", 2),
                                                  ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 2),
                                                  ("trainer.default_local_dir", tmp_path / "run")))])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the plan's info line
    assert code == 2 and err.startswith("tiller rl: error: actor_rollout_ref.model.path="), err
    assert f"model_type '{model_type}' is a vision-language model that tiller does not train yet" in err
    assert "qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe, glm4v, glm4v_moe" in err
    with pytest.raises(UserError, match=f"model_type '{model_type}' is a vision-language model"):
        load_causal_lm(model_dir)


def test_multi_turn_tool_rollouts_on_image_prompts(tmp_path, tiny_vlm_dir, shapes_data):
    """verl's multi-turn tool loop on a vision-language model (its geo3k multi-turn example's combination): the
    prompts carry the tool schemas, every turn is generated with the row's image inputs, and the actor scores the
    whole conversation (image, model turns, tool message) with the rollout's probabilities: a policy that calls the
    calculator, then answers, is teacher-forced through the real VLM, and training/rollout_probs_diff_max stays at
    float32 rounding."""
    from tests.trainer.test_tool_rl import TeacherForcedEngine
    from tiller.trainer.rl import RLTrainer

    (tmp_path / "tools.yaml").write_text("tools:\n  - name: calculator\n")
    cfg = _cfg(tmp_path / "run", tiny_vlm_dir, shapes_data, "actor_rollout_ref.rollout.name=native",
               "data.max_prompt_length=1024", "data.max_response_length=80",
               "actor_rollout_ref.rollout.multi_turn.enable=true",
               f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}")
    trainer = RLTrainer(cfg)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call><|im_end|>'

    def script(context: str, k: int) -> str:  # the calculator, then an answer
        return "so 3<|im_end|>" if "<tool_response>" in context or "<|im_start|>tool" in context else call

    try:
        tok = trainer.tokenizer
        assert '"name": "calculator"' in tok.decode(trainer.train_ds.items[0].prompt_ids)  # the schema is in the prompt
        worker = trainer.actor.worker
        engine = TeacherForcedEngine(worker.module, tok, script)
        worker.rollout = engine
        trainer.global_step = 1
        metrics = trainer.train_step()
    finally:
        trainer.shutdown()
    assert engine.turns == [8, 8]  # 2 prompts x n=4: the tool call, then the answer, each with the images
    assert metrics["agent/turns/mean"] == 2.0 and metrics["agent/tool_calls/mean"] == 1.0
    assert metrics["training/rollout_probs_diff_max"] < 1e-4


def test_the_router_loss_of_a_moe_vlm_update_is_transformers_own_with_the_pixels(tiny_qwen3vl_moe_dir):
    """actor_rollout_ref.actor.router_aux_loss_coef on Qwen3-VL-MoE (verl's run_qwen3_vl_30b_a3b_fsdp.sh model): the
    update's router loss is transformers' own over the micro-batch's forward with each row's pixels (image tokens
    are routed too), and differs from the loss of the same tokens without them."""
    from tests.vision.test_vlm_critic import _image_batch
    from tiller.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={tiny_qwen3vl_moe_dir}", "actor_rollout_ref.rollout.name=hf",
                       "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                       "actor_rollout_ref.actor.router_aux_loss_coef=0.5"])
    worker = ActorRolloutRefWorker(cfg, total_training_steps=1)
    batch, _ = _image_batch(tiny_qwen3vl_moe_dir)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(0)) \
        * batch["response_mask"]
    batch.meta.update(mini_batch_size=4, temperature=1.0)
    model = worker.module
    ids, mask = batch["input_ids"][:, :-1], batch["attention_mask"][:, :-1]  # no response token follows the last
    vision = {k: torch.cat([m[k] for m in batch["multi_modal_inputs"]]) for k in ("pixel_values", "image_grid_thw")}
    with torch.no_grad():
        want = float(model(input_ids=ids, attention_mask=mask, output_router_logits=True,
                           mm_token_type_ids=(ids == model.config.image_token_id).int(), **vision).aux_loss)
        text_only = float(model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss)
    got = worker.update_actor(batch)["actor/aux_loss"]
    assert got == pytest.approx(want, rel=1e-5) and abs(want - text_only) > 1e-4
