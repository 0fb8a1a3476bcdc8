"""The verl edge: every RL key honoured, refused or a stated no-op; deprecated keys converted; the doc
generated from the table is the committed one; verl's own launch scripts parse and land in the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiller.config import load_config
from tiller.config.edge import DEPRECATED, HONOURED, NOOP, REFUSED, RULES, key_states, markdown, noop_keys
from tiller.config.readers import config_reads
from tiller.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "data" / "verl_scripts"
BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=[/t.parquet]"]


def test_every_key_has_a_reader_or_a_declared_state():
    # key_states raises on a key with no reader and no rule, and on a declared no-op / refusal that is read
    states = key_states()
    by_state = {s: [k.key for k in states if k.state == s] for s in (HONOURED, NOOP, REFUSED)}
    assert sum(map(len, by_state.values())) == len(states)
    assert "actor_rollout_ref.actor.fsdp_config.param_offload" in by_state[NOOP]
    assert "transfer_queue.enable" in by_state[REFUSED]
    assert "actor_rollout_ref.actor.use_dynamic_bsz" in by_state[HONOURED]


def test_the_reader_scan_follows_aliases_and_calls():
    reads = config_reads()
    # `a = self.actor_cfg` (set in __init__ from config.actor_rollout_ref.actor), then `a.ppo_epochs`
    assert any(r.startswith("workers/actor.py:") for r in reads["actor_rollout_ref.actor.ppo_epochs"])
    # passed down a call: build_scheduler(optimizer, self.actor_cfg.optim, ...) -> optim_cfg.lr_warmup_steps
    assert any(r.startswith("workers/common.py:") for r in reads["actor_rollout_ref.actor.optim.lr_warmup_steps"])
    # reads in tiller/config (validation, this edge) do not count
    assert not any(r.startswith("config/") for rs in reads.values() for r in rs)


def test_docs_verl_keys_is_up_to_date():
    doc = ROOT / "docs" / "verl-keys.md"
    assert doc.read_text() == markdown(), "regenerate: tiller config keys --markdown > docs/verl-keys.md"


def test_noop_keys_are_the_ones_the_user_set(capsys):
    cfg = load_config(["actor_rollout_ref.actor.fsdp_config.param_offload=True",
                       "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",  # the default, but set: listed
                       "actor_rollout_ref.actor.ppo_epochs=2"])
    assert noop_keys(cfg) == ["actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
                              "actor_rollout_ref.actor.fsdp_config.param_offload=True"]
    # a conditional no-op is honoured when its condition holds: vLLM knobs with rollout.name=vllm
    assert noop_keys(load_config(["actor_rollout_ref.rollout.name=vllm",
                                  "actor_rollout_ref.rollout.gpu_memory_utilization=0.8"])) == []
    assert noop_keys(load_config([])) == []
    # enforce_eager: vLLM's, or the native engine's compiled decode step; the hf engine has neither
    assert noop_keys(load_config(["actor_rollout_ref.rollout.enforce_eager=False"])) == []
    assert noop_keys(load_config(["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.enforce_eager=False"])) == [
        "actor_rollout_ref.rollout.enforce_eager=False"]


def test_refused_values_say_why_and_what_to_use():
    with pytest.raises(ConfigError, match=r"data_parallel_size=2 is refused: .*one engine per actor.*Instead: 1"):
        load_config(["actor_rollout_ref.rollout.data_parallel_size=2"])
    # verl's split layout is asynchronous RL on Ray's rollout pool (tests/test_verl_examples.py), refused without it
    with pytest.raises(ConfigError, match=r"hybrid_engine=False \(verl's split layout.*trainer.backend=ray"):
        load_config(["actor_rollout_ref.hybrid_engine=False"])
    with pytest.raises(ConfigError, match=r"multi_turn.format='gpt_oss': one of hermes, qwen3_coder, glm, seed"):
        load_config(["actor_rollout_ref.rollout.multi_turn.format=gpt_oss"])
    assert load_config(["actor_rollout_ref.rollout.multi_turn.format=qwen3_coder"])


@pytest.mark.parametrize("old,new,world,value,expected", [
    ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1, 16, 16),
    ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 4, 16, 4),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size",
     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 2, 32, 16),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 2, 8, 4),
    ("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu", 2, 8, 4),
    ("critic.forward_micro_batch_size", "critic.forward_micro_batch_size_per_gpu", 2, 8, 4),
    ("reward_model.micro_batch_size", "reward_model.micro_batch_size_per_gpu", 2, 8, 4),
])
def test_deprecated_global_sizes_become_per_worker(old, new, world, value, expected, capsys):
    ray = ["trainer.backend=ray", "trainer.nnodes=1", f"trainer.n_gpus_per_node={world}"] if world > 1 else []
    cfg = load_config([f"{old}={value}", *ray])
    section, _, leaf = new.rpartition(".")
    node = cfg
    for part in section.split("."):
        node = getattr(node, part)
    assert getattr(node, leaf) == expected
    err = capsys.readouterr().err
    assert err.count("deprecated") == 1 and f"{new}={expected}" in err
    with pytest.raises(ConfigError, match=f"{old} and {new} are both set"):
        load_config([f"{old}={value}", f"{new}={expected}", *ray])


def test_critic_forward_size_follows_the_deprecated_ppo_size():
    cfg = load_config(["critic.ppo_micro_batch_size=6"])
    assert cfg.critic.ppo_micro_batch_size_per_gpu == cfg.critic.forward_micro_batch_size_per_gpu == 6


def test_use_token_level_loss_becomes_loss_agg_mode():
    assert load_config(["actor_rollout_ref.actor.use_token_level_loss=False"]).actor_rollout_ref.actor.loss_agg_mode \
        == "seq-mean-token-mean"
    assert set(DEPRECATED) <= {k for k, r in RULES.items() if r.state == HONOURED}


def _script(path: Path) -> tuple[list[str], list[str]]:
    """(tiller config show arguments, the keys the script sets) of a collected verl launch script."""
    args = [line.replace("{here}", str(SCRIPTS)) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    keys = [a.split("=", 1)[0].lstrip("+~") for a in args if not a.startswith("--")]
    return args, keys


SCRIPT_FILES = sorted(SCRIPTS.glob("*.txt"))


def test_a_dozen_verl_scripts_are_collected_with_their_source():
    assert len(SCRIPT_FILES) >= 12
    for path in SCRIPT_FILES:
        assert "# source: https://github.com/volcengine/verl/blob/" in path.read_text(), path


@pytest.mark.parametrize("path", SCRIPT_FILES, ids=[p.stem for p in SCRIPT_FILES])
def test_verl_script_parses_and_every_key_has_a_state(path, capsys):
    from tiller.config.cli import main

    args, keys = _script(path)
    assert main(["show", *args]) == 0
    out, err = capsys.readouterr()
    shown = yaml.safe_load(out)
    states = {k.key: k for k in key_states()}
    # dict-valued keys: their sub-keys are the dict's (ray_kwargs: a no-op as a whole)
    open_sections = ("actor_rollout_ref.model.override_config", "reward_model.reward_kwargs", "ray_kwargs.")
    for key in keys:
        if key.startswith(open_sections):
            continue
        assert key in states, f"{path.name}: {key} has no state"
        if states[key].state == NOOP and RULES[key].honoured_if is None:
            assert key in err, f"{path.name}: the no-op {key} is missing from the start-up line"
    # values land where the script put them
    node = shown
    for part in "actor_rollout_ref.model.path".split("."):
        node = node[part]
    assert node


def test_one_verl_script_through_the_command_line():
    args, _ = _script(SCRIPTS / "dapo_recipe.txt")
    proc = subprocess.run([sys.executable, "-m", "tiller.cli", "config", "show", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["data"]["gen_batch_size"] == 1536 and cfg["algorithm"]["filter_groups"]["max_num_gen_batches"] == 10
    assert cfg["actor_rollout_ref"]["actor"]["use_dynamic_bsz"] is True
    assert cfg["actor_rollout_ref"]["rollout"]["log_prob_use_dynamic_bsz"] is True
    assert "accepted with no effect here" in proc.stderr and "ulysses_sequence_parallel_size=8" in proc.stderr


def test_compute_dtype_left_unset_follows_the_device_and_verls_mixed_precision(capsys):
    """actor / critic dtype unset: bf16 on a GPU (verl's FSDP mixed precision), fp32 on a CPU; a role's
    fsdp_config.mixed_precision.param_dtype sets it; a given dtype wins and must agree with it; fp16 and unknown keys
    are refused by name; a reduce dtype other than fp32 loads (verl's Qwen3-Next example) with a no-effect line.
    `tiller sft` likewise."""
    from tiller.config.jobs import SFTConfig, validate_job

    def dtypes(*extra):
        cfg = load_config([*BASE, *extra])
        return cfg.actor_rollout_ref.actor.dtype, cfg.critic.dtype

    assert dtypes() == ("float32", "float32")
    assert dtypes("trainer.device=cuda") == ("bfloat16", "bfloat16")
    assert dtypes("trainer.device=cuda", "actor_rollout_ref.actor.dtype=float32") == ("float32", "bfloat16")
    assert dtypes("trainer.device=cuda", "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
                  "+critic.model.fsdp_config.mixed_precision.param_dtype=fp32") == ("float32", "float32")
    assert dtypes("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
                  "actor_rollout_ref.actor.dtype=bf16") == ("bf16", "float32")
    for extra, match in (
            (["actor_rollout_ref.actor.dtype=float32", "+actor_rollout_ref.actor.fsdp_config.mixed_precision."
              "param_dtype=bf16"], "actor.dtype='float32' contradicts its fsdp_config.mixed_precision.param_dtype"),
            (["+critic.fsdp.mixed_precision.param_dtype=fp16"], r"critic.fsdp.mixed_precision.param_dtype='fp16'"),
            (["+actor_rollout_ref.actor.fsdp_config.mixed_precision.cast=1"], "mixed_precision.cast: not a mixed")):
        with pytest.raises(ConfigError, match=match):
            dtypes(*extra)
    capsys.readouterr()
    assert dtypes("trainer.device=cuda", "+actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=bf16") \
        == ("bfloat16", "bfloat16")
    assert "mixed_precision.reduce_dtype='bf16' (tiller reduces gradients" in capsys.readouterr().err
    job = ["model.partial_pretrain=/m", "data.train_files=[/t.jsonl]"]
    sft = [load_config([*job, *extra], schema=SFTConfig, validate=validate_job).optim.dtype
           for extra in ([], ["trainer.device=cuda"], ["trainer.device=cuda", "optim.dtype=float32"])]
    assert sft == ["float32", "bfloat16", "float32"]
