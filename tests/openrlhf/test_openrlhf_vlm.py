"""OpenRLHF's VLM example (`examples/scripts/train_vlm_math_hybrid_engine.sh`) through `tiller openrlhf`, in both
spellings: v0.11.0 (= OpenRLHF's main, DeepSpeed `--ds.*` flags) and the FSDP2 backend's branch `automodel`
(`--fsdp.param_dtype`, `--fsdp.attn_implementation`, `--fsdp.enable_sleep`). The command lines of
`data/examples.txt` with only their paths changed (the tiny Qwen2-VL, a synthetic verl-schema parquet of the shapes
task with a `label` column, a reward_func file, a run dir) and their sizes cut to one CPU step (batch sizes,
lengths, episodes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiller.data.files import write_rows
from tiller.openrlhf.cli import main, resolve
from tiller.tasks import shapes

EXAMPLES = Path(__file__).parent / "data" / "examples.txt"
SCRIPTS = {"v0.11.0": "# v0.11.0 examples/scripts/train_vlm_math_hybrid_engine.sh",
           "fsdp": "# automodel@c37c32d7 examples/scripts/train_vlm_math_hybrid_engine.sh"}

REWARD_FUNC = '''
import json, os

def reward_func(queries, prompts, labels, **kwargs):
    with open(os.environ["TILLER_TEST_REWARD_LOG"], "a") as fh:
        fh.write(json.dumps({"labels": labels, "n": len(queries)}) + "\\n")
    # a reward that differs between samples, so the group baseline leaves a gradient
    rewards = [sum(map(ord, q[len(p):])) % 5 / 4 for q, p in zip(queries, prompts)]
    return {"rewards": rewards, "scores": rewards}
'''


def example_argv(version: str) -> list[str]:
    """The VLM example's argv, verbatim, from data/examples.txt."""
    lines = EXAMPLES.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(SCRIPTS[version]))
    return lines[at + 2].split()


def with_values(argv: list[str], values: dict[str, str]) -> list[str]:
    """`argv` with the value after each flag of `values` replaced (every flag must be there)."""
    out = list(argv)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


@pytest.fixture(scope="module")
def vlm_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_openrlhf")
    rows = shapes.make_splits(n_train=8, n_test=0, seed=0)["train"]
    for row in rows:  # the example reads its answers from --data.label_key label
        row["label"] = row["reward_model"]["ground_truth"]
    write_rows(rows, root / "shapes.parquet")
    (root / "reward_func.py").write_text(REWARD_FUNC)
    return root


def vlm_argv(tmp_path: Path, model_dir: Path, data: Path, version: str = "v0.11.0") -> list[str]:
    paths = {"--actor.model_name_or_path": str(model_dir), "--reward.remote_url": str(data / "reward_func.py"),
             "--ckpt.output_dir": str(tmp_path / "run"), "--ckpt.path": str(tmp_path / "run" / "ckpt"),
             "--data.prompt_dataset": str(data / "shapes.parquet")}
    sizes = {"--train.batch_size": "8", "--rollout.batch_size": "2", "--rollout.n_samples_per_prompt": "4",
             "--train.num_episodes": "1", "--data.max_len": "64", "--rollout.max_new_tokens": "4"}
    return with_values(example_argv(version), {**paths, **sizes})


@pytest.mark.parametrize("version", SCRIPTS)
def test_the_vlm_example_resolves_on_the_tiny_vlm(tmp_path, tiny_vlm_dir, vlm_data, version):
    argv = vlm_argv(tmp_path, tiny_vlm_dir, vlm_data, version)
    cmd, tr, cfg = resolve(argv)
    assert cmd.version == {"v0.11.0": "dotted", "fsdp": "fsdp"}[version]
    arr = cfg.actor_rollout_ref
    assert cfg.data.image_key == "images" and cfg.data.prompt_key == "prompt" and cfg.data.label_key == "label"
    assert arr.actor.freeze_vision_tower is True  # --actor.freeze_visual_encoder
    assert arr.rollout.name == "native"  # tiller's own engine takes image prompts (OpenRLHF samples with vLLM)
    assert any(n.startswith("--data.max_images_per_prompt 1:") for n in tr.notices)
    # reinforce_baseline with the KL as a k2 loss of coefficient 0 (--algo.kl.init_coef 0 --algo.kl.use_loss)
    assert cfg.algorithm.adv_estimator == "reinforce_plus_plus_baseline"
    assert arr.actor.use_kl_loss is False and arr.actor.kl_loss_type == "mse" and not cfg.algorithm.use_kl_in_reward
    assert cfg.data.train_batch_size == 2 and arr.rollout.n == 4 and arr.actor.ppo_mini_batch_size == 2
    assert arr.actor.dtype == "bfloat16"  # --ds.param_dtype / --fsdp.param_dtype bf16
    backend = "ds" if version == "v0.11.0" else "fsdp"
    for flag in (f"--{backend}.attn_implementation eager:", f"--{backend}.enable_sleep:"):
        assert any(n.startswith(flag) for n in tr.notices), flag
    assert list(tmp_path.iterdir()) == []  # resolving writes nothing


def test_a_text_model_keeps_the_default_engine(tmp_path, tiny_model_dir, vlm_data):
    _, tr, cfg = resolve(vlm_argv(tmp_path, tiny_model_dir, vlm_data))
    assert cfg.actor_rollout_ref.rollout.name == "native"
    assert not any("a vision-language model" in n for n in tr.notices)


@pytest.mark.parametrize("version", SCRIPTS)
def test_the_vlm_example_runs_one_step(tmp_path, tiny_vlm_dir, vlm_data, monkeypatch, version):
    from safetensors.torch import load_file

    from tiller.models.checkpoint import latest_checkpoint

    log = tmp_path / "rewards.jsonl"
    monkeypatch.setenv("TILLER_TEST_REWARD_LOG", str(log))
    argv = vlm_argv(tmp_path, tiny_vlm_dir, vlm_data, version)
    assert main([*argv, "trainer.total_training_steps=1", "trainer.logger=[jsonl]", "trainer.num_threads=1"]) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["actor/grad_norm"] > 0 and "actor/pg_loss" in rows[0]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    labels = {row["reward_model"]["ground_truth"] for row in shapes.make_splits(n_train=8, n_test=0, seed=0)["train"]}
    assert sum(c["n"] for c in calls) == 8 and {lb for c in calls for lb in c["labels"]} <= labels
    before = load_file(Path(tiny_vlm_dir) / "model.safetensors")
    after = load_file(latest_checkpoint(run / "checkpoints") / "model" / "model.safetensors")
    vision = [k for k in before if "visual." in k]  # Qwen2-VL's checkpoint names: visual.* and model.*
    lm = [k for k in before if k not in vision]
    assert lm and vision and set(after) == set(before)
    assert any(not torch.equal(before[k], after[k]) for k in lm)  # the language model trained
    assert all(torch.equal(before[k], after[k]) for k in vision)  # --actor.freeze_visual_encoder


def test_fsdp_flags_with_ds_flags_are_one_error(tmp_path, tiny_vlm_dir, vlm_data):
    from tiller.errors import ConfigError

    argv = vlm_argv(tmp_path, tiny_vlm_dir, vlm_data, "fsdp") + ["--ds.zero_stage", "3"]
    with pytest.raises(ConfigError, match=r"mixes --fsdp.\* flags .* with --ds.\* ones .*--ds.zero_stage"):
        resolve(argv)
    # context parallelism splits sequences without changing the math: a notice (tiller's split is Ulysses on Ray)
    _, translation, _ = resolve(vlm_argv(tmp_path, tiny_vlm_dir, vlm_data, "fsdp") + ["--fsdp.cp_size", "2"])
    assert any(n.startswith("--fsdp.cp_size 2: context parallelism: a sequence split") for n in translation.notices)
