"""verl's own launch scripts and config tree, read by tiller's config loader (issue 22).

The override lists under tests/data/verl_examples/ were taken from verl's examples/ (volcengine/verl b178a3cd,
2026-01-29, 0.8.0.dev) and its DAPO recipes (verl-project/verl-recipe 48ea0a79) by `extract.py` there: each script
run with stubbed `python` / `srun` / `ray`, its trainer call recorded, paths replaced by tiny local names. Each must
load with `tiller.config.load_config` (what `tiller config show` runs), or fail with the documented reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiller.config import edge, load_config
from tiller.config.loader import given_keys
from tiller.errors import ConfigError

DATA = Path(__file__).parent / "data" / "verl_examples"
SCRIPTS = sorted(DATA.glob("*.json"))

# script -> a phrase of the refusal it gets (None: it loads). Every refusal names the key and the reason.
EXPECTED = {
    "run_qwen2-7b.json": None,  # GRPO, GSM8K
    "run_qwen2-7b_seq_balance.json": "rollout.name='sglang' is refused: tiller's rollout engines are native, hf and",
    "run_qwen2_5-3b_gsm8k_grpo_lora.json": None,  # LoRA
    "run_qwen2_5-3b_gsm8k_grpo_lora_from_adapter.json": None,
    "run_qwen2-7b_math_megatron.json": "actor_rollout_ref.actor.strategy='megatron' is refused: Megatron-Core",
    "run_deepseek7b_llm.json": None,  # PPO (gae + critic)
    "run_qwen2-7b_rm.json": None,  # PPO with a reward model
    "run_qwen2-7b_rm_legacy.json": None,
    "run_qwen2-7b_rm_seq_balance.json": None,
    # PPO with code rewards on a SandboxFusion server through verl's prime reward manager
    "run_deepseek7b_llm_sandbox_fusion.json": None,
    "run_deepseek7b_llm_pfppo.json": None,  # PF-PPO (gae, pow)
    "test_gspo_3b_math.json": None,  # GSPO
    "run_qwen30b_sapo.json": None,  # SAPO (actor.tau_pos / tau_neg)
    # verl's rloo / grpo with the default rollout.n=1 silently give zero-baseline advantages; tiller refuses
    "run_with_rollout_corr.json": "algorithm.adv_estimator=rloo compares the samples of one prompt",
    "run_with_rollout_corr_multi_rs.json": "algorithm.adv_estimator=grpo compares the samples of one prompt",
    "run_qwen2_5-7b.json": None,  # optimal token baseline
    # verl's fully-async recipe: separate rollout GPUs (hybrid_engine=False) are tiller's asynchronous RL on Ray; its
    # command line (no trainer.backend: tiller's key) is told so (test_fully_async_layout_resolves adds it)
    "dapo_7b_math_fsdp2_4_4.json": "actor_rollout_ref.hybrid_engine=False (verl's split layout",
    "test_dapo_7b_math.json": None,  # DAPO-style (gmpo example)
    "recipe_test_dapo_7b_math.json": None,  # DAPO recipe
    "recipe_test_dapo_7b_math_lora.json": None,
    "recipe_run_dapo_qwen2.5_32b.json": None,
    # verl 0.9's layout (reward.reward_manager.name, reward.reward_kwargs.overlong_buffer_cfg.* without +), Ulysses 8
    "recipe_run_dapo_qwen2.5_32b_npu.json": None,
    "recipe_run_dapo_qwen3_30b_fsdp_6k_npu.json": "trainer.device='npu' is refused: tiller runs on CPU and CUDA",
    "recipe_run_dapo_qwen3_moe_30b_megatron_npu.json": "actor_rollout_ref.actor.strategy='megatron' is refused",
    # written for verl before #4544 (rollout_rs=geometric, *_threshold_lower); verl b178a3cd lacks the key too
    "recipe_run_dapo_qwen2.5_32b_rollout_corr.json": "unknown key 'algorithm.rollout_correction.rollout_rs_threshold",
}


def _overrides(case: dict) -> list[str]:
    out = list(case["overrides"])
    if "megatron" in case["config"].get("config-name", ""):
        out.append("actor_rollout_ref.actor.strategy=megatron")  # what verl's (p|da)po_megatron_trainer.yaml sets
    return out


def test_every_stored_script_has_an_expectation():
    assert sorted(p.name for p in SCRIPTS) == sorted(EXPECTED)
    for path in SCRIPTS:
        case = json.loads(path.read_text())
        assert case["commit"] and case["file"].endswith(".sh") and case["overrides"], path.name


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_verl_example_script_loads(path, capsys):
    case = json.loads(path.read_text())
    expected = EXPECTED[path.name]
    if expected is None:
        cfg = load_config(_overrides(case))
        if any(o.startswith("data.train_files=") for o in case["overrides"]):  # (the pfppo case stores 3 keys only)
            assert cfg.data.train_files == ["data/train.parquet"]
            assert cfg.actor_rollout_ref.model.path == "tiny-model"
        else:
            assert cfg.algorithm.use_pf_ppo and cfg.algorithm.pf_ppo["reweight_method"] == "pow"
        # what the script sets is what tiller resolved (spot checks of verl's meaning)
        for item in case["overrides"]:
            key, _, value = item.lstrip("+").partition("=")
            if key == "algorithm.adv_estimator":
                assert cfg.algorithm.adv_estimator == value
            if key == "actor_rollout_ref.rollout.n" and value.isdigit():
                assert cfg.actor_rollout_ref.rollout.n == int(value)
        assert given_keys(cfg)
    else:
        with pytest.raises(ConfigError) as err:
            load_config(_overrides(case))
        assert expected in str(err.value)


def test_lora_example_resolves_verl_meaning():
    case = json.loads((DATA / "run_qwen2_5-3b_gsm8k_grpo_lora.json").read_text())
    cfg = load_config(case["overrides"])
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha) == (64, 32)
    assert edge.noop_keys(cfg)  # layered_summon, use_remove_padding, fsdp offload ... are listed at start-up


def test_sandbox_fusion_example_resolves_its_server():
    case = json.loads((DATA / "run_deepseek7b_llm_sandbox_fusion.json").read_text())
    cfg = load_config(case["overrides"])
    assert cfg.reward_model.reward_manager == "prime"
    sandbox = cfg.reward_model.sandbox_fusion
    assert sandbox["url"].endswith(".volceapi.com/run_code") and sandbox["max_concurrent"] == 128
    assert sandbox["memory_limit_mb"] == 1024  # verl's default, unset by the script


def test_sapo_example_reads_tau_and_dapo_reward():
    case = json.loads((DATA / "run_qwen30b_sapo.json").read_text())
    cfg = load_config(case["overrides"])
    actor = cfg.actor_rollout_ref.actor
    assert actor.policy_loss.loss_mode == "sapo" and (actor.tau_pos, actor.tau_neg) == (1.0, 1.05)
    assert cfg.reward_model.reward_manager == "dapo"
    assert cfg.reward_model.reward_kwargs["overlong_buffer_cfg"]["len"] == 4096


def test_verl09_reward_layout_and_ulysses_budgets(capsys):
    """verl 0.9's reward.* keys land on the legacy ones; a per-GPU token budget under Ulysses SP is verl's share of
    a micro-batch of sp GPUs, so tiller's per-worker budget is budget x sp (verl: max_token_len = budget x sp)."""
    case = json.loads((DATA / "recipe_run_dapo_qwen2.5_32b_npu.json").read_text())
    items = dict(o.lstrip("+").split("=", 1) for o in case["overrides"])
    cfg = load_config(case["overrides"])
    rm = cfg.reward_model
    assert rm.reward_manager == "dapo" and rm.reward_kwargs["overlong_buffer_cfg"]["enable"] is True
    assert rm.reward_kwargs["max_resp_len"] == int(items["reward.reward_kwargs.max_resp_len"])
    sp = int(items["actor_rollout_ref.actor.ulysses_sequence_parallel_size"])
    budget = int(items["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"])
    assert sp > 1 and cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == budget * sp
    assert "is verl's per-GPU share" in capsys.readouterr().err
    # without SP nothing is scaled
    cfg = load_config(["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=999"])
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 999


TREES = ("_generated_ppo_trainer.tsv", "_generated_ppo_megatron_trainer.tsv",  # volcengine/verl b178a3cd (0.8.0.dev)
         # verl-project/verl 1dda039b (2026-08-22, 0.10.0.dev; `extract.py --tree ... verl010`)
         "verl010_generated_ppo_trainer.tsv", "verl010_generated_ppo_megatron_trainer.tsv")


def _tree(name: str) -> dict:
    """verl's generated config tree (key path -> default), as stored from verl b178a3cd / 1dda039b."""
    rows = [line.split("\t", 1) for line in (DATA / name).read_text().splitlines() if not line.startswith("#")]
    return {key: json.loads(value) for key, value in rows}


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


@pytest.mark.parametrize("name", TREES)
def test_every_key_of_verls_tree_has_a_state(name):
    """Each key path of verl's generated ppo_trainer / ppo_megatron_trainer trees is a key of tiller's table, or
    inside a section the table declares as a whole (a mapping); `_target_` (verl's class names) is dropped."""
    states = {k.key: k.state for k in edge.key_states()}
    keys = [k for k in _tree(name) if not k.endswith("._target_")]
    assert len(keys) > 400
    missing = []
    for key in keys:
        parts = key.split(".")
        if not any(".".join(parts[:i]) in states for i in range(len(parts), 0, -1)):
            missing.append(key)
    assert missing == []


@pytest.mark.parametrize("trainer, megatron", [TREES[:2], TREES[2:]], ids=["verl0.8", "verl0.10"])
def test_verls_whole_generated_yaml_loads_as_a_config_file(tmp_path, capsys, trainer, megatron):
    """verl's _generated_ppo_trainer.yaml as `--config`: its nulls ("not set"), `${oc.select:...}` interpolations,
    `_target_` keys and both layouts of the same key (equal values) load; its megatron twin is refused by name."""
    import yaml

    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(_nested(_tree(trainer))))
    cfg = load_config([], config_file=path)
    assert cfg.data.train_batch_size == 1024 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8  # verl's null: tiller's default
    assert cfg.actor_rollout_ref.actor.optim.warmup_style == "constant"  # from verl's lr_scheduler_type
    assert cfg.reward_model.reward_manager == "naive"  # verl 0.10: legacy key null, reward.reward_manager.name naive
    assert "accepted with no effect here" in edge.noop_line(cfg)
    path.write_text(yaml.safe_dump(_nested(_tree(megatron))))
    with pytest.raises(ConfigError, match="strategy='megatron' is refused: Megatron-Core"):
        load_config([], config_file=path)


@pytest.mark.parametrize("item, phrase", [
    ("transfer_queue.enable=True", "TransferQueue"),
    ("actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "checkpoint engines"),
    ("critic.strategy=megatron", "Megatron-Core"),
    ("actor_rollout_ref.model.mtp.enable=True", "multi-token-prediction"),
    ("actor_rollout_ref.rollout.quantization=fp8", "unquantized"),
])
def test_refused_verl_machinery_names_key_and_reason(item, phrase):
    with pytest.raises(ConfigError) as err:
        load_config([item])
    msg = str(err.value)
    assert item.lstrip("+").split("=")[0].rsplit(".", 1)[0] in msg and phrase in msg and "Instead:" in msg


def test_renamed_keys_resolve_and_clash():
    cfg = load_config(["data.train_max_samples=7", "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                       "actor_rollout_ref.actor.optim.clip_grad=0.5", "reward_manager.name=dapo"])
    assert cfg.data.max_samples == 7 and cfg.actor_rollout_ref.actor.optim.warmup_style == "cosine"
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5 and cfg.reward_model.reward_manager == "dapo"
    with pytest.raises(ConfigError, match="data.train_max_samples and data.max_samples"):
        load_config(["data.train_max_samples=7", "data.max_samples=8"])
    with pytest.raises(ConfigError, match="reward.reward_manager.name and reward_manager.name|reward_manager.name and "
                                          "reward.reward_manager.name"):
        load_config(["reward_manager.name=dapo", "reward.reward_manager.name=naive"])


def test_copies_of_other_keys_must_agree():
    load_config(["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.rollout_n=4",
                 "algorithm.adv_estimator=grpo", "critic.enable=False"])
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.rollout_n=3 differs"):
        load_config(["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.rollout_n=3"])
    with pytest.raises(ConfigError, match="critic.enable=True but algorithm.adv_estimator=grpo"):
        load_config(["actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=grpo", "critic.enable=True"])


def test_engine_kwargs_nested_by_engine(capsys):
    cfg = load_config(["actor_rollout_ref.rollout.name=vllm",
                       "+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True",
                       "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=fa3"])
    assert cfg.actor_rollout_ref.rollout.engine_kwargs == {"disable_mm_preprocessor_cache": True}
    assert "engine_kwargs.sglang configure an engine this run does not use" in capsys.readouterr().err


def test_noop_sections_are_reported_and_targets_dropped(tmp_path):
    cfg = load_config(["actor_rollout_ref.actor.profiler.enable=True", "global_profiler.tool=nsys"])
    line = edge.noop_line(cfg)
    assert "actor_rollout_ref.actor.profiler=" in line and "global_profiler=" in line
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  _target_: x\n  actor:\n    _target_: verl.workers.config.FSDPActorConfig\n"
                    "    ppo_mini_batch_size: 8\n")
    assert load_config([], config_file=path).actor_rollout_ref.actor.ppo_mini_batch_size == 8


def test_config_show_output_loads_back(tmp_path):
    """`tiller config show` prints one canonical config (verl's newer-layout keys at their defaults); fed back as a
    --config file it loads to the same config (the two layouts do not clash at their defaults)."""
    from tiller.config import to_yaml

    case = json.loads((DATA / "recipe_run_dapo_qwen2.5_32b_npu.json").read_text())
    cfg = load_config(case["overrides"])
    path = tmp_path / "shown.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config([], config_file=path)
    assert again.reward_model.reward_manager == "dapo"
    assert again.data.train_batch_size == cfg.data.train_batch_size
    actor = again.actor_rollout_ref.actor
    assert actor.ppo_max_token_len_per_gpu == cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu  # folded once
    assert actor.ulysses_sequence_parallel_size == 1 and "ulysses_sequence_parallel_size=8" in edge.noop_line(cfg)


def test_fully_async_layout_resolves():
    """verl fully-async's script on Ray (`trainer.backend=ray`, tiller's key, added): train_batch_size=0 +
    require_batches = a step of require_batches mini-batches; hybrid_engine=False and the top-level rollout pool
    (rollout.nnodes x n_gpus_per_node) are tiller's rollout pool; partial rollouts take the native engine (vLLM
    cannot take weights between decode steps), so here rollout.name=native. Without Ray the pool keys are no-ops
    and hybrid_engine=False is refused (test_verl_examples' table above)."""
    case = json.loads((DATA / "dapo_7b_math_fsdp2_4_4.json").read_text())
    items = [o for o in case["overrides"] if not o.startswith("actor_rollout_ref.rollout.name")]
    with pytest.raises(ConfigError, match="partial_rollout=True needs actor_rollout_ref.rollout.name=native"):
        load_config(case["overrides"] + ["trainer.backend=ray"])
    cfg = load_config(items + ["actor_rollout_ref.rollout.name=native", "trainer.backend=ray"])
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.data.train_batch_size == cfg.async_training.require_batches * mini == cfg.data.gen_batch_size
    assert not cfg.actor_rollout_ref.hybrid_engine and cfg.async_training.partial_rollout
    assert (cfg.trainer.n_gpus_per_node, cfg.rollout["nnodes"], cfg.rollout["n_gpus_per_node"]) == (4, 1, 4)
    assert " rollout={" not in (edge.noop_line(cfg) or "")  # the pool is honoured: not named among the no-ops
    with pytest.raises(ConfigError, match="async_training.compute_prox_log_prob=True is refused"):
        load_config(["async_training.compute_prox_log_prob=True"])


def test_ulysses_on_ray_workers_is_kept_and_checked(tmp_path, capsys):
    """With trainer.backend=ray and several workers the actor's and the critic's Ulysses sizes split sequences for
    real (tiller.workers.ulysses): they stay in the resolved config, their budgets stay verl's per-worker values
    (the workers multiply them, as verl's do), `config show` loads back unchanged, and they are no longer named
    among the no-op keys (the reference's still is: it runs split by the actor's size and only scales its budget);
    a size that does not divide the workers, or without use_remove_padding, is refused."""
    from tiller.config import to_yaml

    ray = ["trainer.backend=ray", "trainer.nnodes=1", "trainer.n_gpus_per_node=4",
           "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000", "critic.ppo_max_token_len_per_gpu=500",
           "algorithm.adv_estimator=gae", "critic.model.use_remove_padding=true",
           "critic.ulysses_sequence_parallel_size=2", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
           "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=300"]
    cfg = load_config([*ray, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    actor = cfg.actor_rollout_ref.actor
    assert actor.ulysses_sequence_parallel_size == 2 and actor.ppo_max_token_len_per_gpu == 1000
    assert (cfg.critic.ulysses_sequence_parallel_size, cfg.critic.ppo_max_token_len_per_gpu) == (2, 500)
    assert cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == 600  # the reference's size only scales it
    line = edge.noop_line(cfg) or ""
    assert "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2" in line
    assert "actor_rollout_ref.actor.ulysses_sequence_parallel_size" not in line
    assert "critic.ulysses_sequence_parallel_size" not in line
    path = tmp_path / "shown.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config([], config_file=path).actor_rollout_ref.actor
    assert (again.ulysses_sequence_parallel_size, again.ppo_max_token_len_per_gpu) == (2, 1000)
    # a budget below one sequence but not below it x the size is a worker's share of a split micro-batch (verl's)
    longer = ["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=2000", "critic.ppo_max_token_len_per_gpu=2000"]
    cfg = load_config([*ray, *longer, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                       "data.max_prompt_length=700", "data.max_response_length=800"])
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 1000  # 1000 x 2 >= 1500
    with pytest.raises(ConfigError, match=r"ppo_max_token_len_per_gpu=1000 x 2 .* is below one sequence"):
        load_config([*ray, *longer, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                     "data.max_prompt_length=1500", "data.max_response_length=800"])
    with pytest.raises(ConfigError, match=r"ulysses_sequence_parallel_size=3 must divide the 4 workers"):
        load_config([*ray, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"])
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.use_remove_padding=True"):
        load_config([*ray, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                     "actor_rollout_ref.model.use_remove_padding=false"])
    with pytest.raises(ConfigError, match=r"^critic.ulysses_sequence_parallel_size=2 .* critic.model.use_remove_pad"):
        load_config([*ray, "critic.model.use_remove_padding=false"])
