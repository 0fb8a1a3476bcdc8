"""verl 0.10's own launch scripts (verl-project/verl 1dda039b, 2026-08-22, 0.10.0.dev; issue 38), read by tiller's
config loader.

The override lists under tests/data/verl_examples/verl010/ were taken from every launch script of verl's examples/
(the SFT ones aside) by `extract.py --out verl010 ...`: each script run with stubbed `python` / `uv` / `srun` / `ray`,
its trainer call recorded, paths replaced by tiny local names. Each must load with `tiller.config.load_config` (what
`tiller config show` runs), or stop with its named reason; none stops on an unknown key. docs/verl-sweep.md reports
the sweep. The whole sweep is slow (one load a script); a fast test covers one script of each kind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiller.config import edge, load_config
from tiller.errors import ConfigError

DATA = Path(__file__).parent / "data" / "verl_examples" / "verl010"
SCRIPTS = sorted(DATA.glob("*.json"))
COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"
# verl entry points that are not a training run: what tiller runs instead
NOT_TRAINING = {"verl.trainer.main_generation_server": "tiller generate (offline generation)"}

# script (examples/<dir>/<name>.sh as <dir>__<name>) -> a phrase of its stop (None: it loads)
EXPECTED = {
    "ascend_extras__run_qwen3_235b_256k_megatron": "trainer.device='npu' is refused: tiller runs on CPU and",
    "ascend_extras__run_qwen3_30b_a3b_megatron": "trainer.device='npu' is refused: tiller runs on CPU and",
    "ascend_extras__run_qwen3_32b_fsdp": "trainer.device='npu' is refused: tiller runs on CPU and",
    "ascend_extras__run_qwen3_5_122b_a10b_32k_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "ascend_extras__run_qwen3_8b_fsdp": None,
    "ascend_extras__run_qwen3_next_80b_fsdp": "trainer.device='npu' is refused: tiller runs on CPU and",
    "cispo_trainer__run_qwen3_8b_fsdp": None,
    "dppo_trainer__run_qwen3_30b_a3b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "gdpo_trainer__run_qwen3_8b_fsdp": None,
    "gmpo_trainer__run_qwen3_8b_fsdp": None,
    "gpg_trainer__run_qwen3_8b_fsdp": None,
    "gpg_trainer__run_qwen3_8b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_deepseek_v3_671b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_deepseek_v4_flash_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_deepseek_v4_veomni": "model_engine='veomni' is refused: VeOmni (verl's",
    "grpo_trainer__run_glm4_1v_9b_fsdp": None,
    "grpo_trainer__run_gpt_oss_20b_fsdp": "'actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend' is not a key",  # verl stops too (no +)
    "grpo_trainer__run_hy_v3_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_minicpm_o_2_6_fsdp": "data.custom_cls={'path': 'recipe/minicpmo/rl_dataset.py',",
    "grpo_trainer__run_mistral_nemo_12b_skyworkrm_fsdp": None,
    "grpo_trainer__run_moonlight_16b_a3b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_nemotron_nano_v3_30b_a3b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_qwen2-7b_math_megatron_fsdp": "actor_rollout_ref.actor.strategy='megatron' is refused:",
    "grpo_trainer__run_qwen2_5_32b_fsdp": None,
    "grpo_trainer__run_qwen2_5_vl_7b_fsdp": None,
    "grpo_trainer__run_qwen2_5_vl_7b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_qwen3_235b_a22b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_qwen3_30b_a3b_fsdp": None,
    "grpo_trainer__run_qwen3_30b_a3b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_qwen3_30b_veomni": "model_engine='veomni' is refused: VeOmni (verl's",
    "grpo_trainer__run_qwen3_4b_fsdp": None,
    "grpo_trainer__run_qwen3_5-122b-a10b_veomni": "model_engine='veomni' is refused: VeOmni (verl's",
    "grpo_trainer__run_qwen3_5_122b_a10b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_qwen3_5_27b_fsdp": None,
    "grpo_trainer__run_qwen3_5_27b_fsdp_turbo": "actor_rollout_ref.actor.strategy = 'fsdp_turbo' is not",
    "grpo_trainer__run_qwen3_5_2b_openr1_fsdp": None,
    "grpo_trainer__run_qwen3_5_2b_video_fsdp": None,
    "grpo_trainer__run_qwen3_5_35b_a3b_veomni": "model_engine='veomni' is refused: VeOmni (verl's",
    "grpo_trainer__run_qwen3_5_35b_fsdp": None,
    "grpo_trainer__run_qwen3_5_35b_fsdp_turbo": "actor_rollout_ref.actor.strategy = 'fsdp_turbo' is not",
    "grpo_trainer__run_qwen3_5_35b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_qwen3_5_35b_megatron_lite": "command line: 'actor@actor_rollout_ref.actor=mlite_actor'",
    "grpo_trainer__run_qwen3_5_397b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_qwen3_8b_fsdp": None,
    "grpo_trainer__run_qwen3_8b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_qwen3_next_80b_a3b_fsdp": None,
    "grpo_trainer__run_qwen3_vl_235b_a22b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_qwen3_vl_30b_a3b_fsdp": None,
    "grpo_trainer__run_qwen3_vl_30b_a3b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_qwen3_vl_30b_moe_veomni": "model_engine='veomni' is refused: VeOmni (verl's",
    "grpo_trainer__run_qwen3_vl_8b_fsdp": None,
    "grpo_trainer__run_qwen3_vl_8b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "grpo_trainer__run_seed_oss_36b_fsdp": None,
    "gspo_trainer__run_qwen3_30b_a3b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "gspo_trainer__run_qwen3_8b_fsdp": None,
    "mtp_trainer__run_mimo_7b_mtp_fully_async_megatron_multinode": "actor_rollout_ref.actor.strategy='megatron' is refused:",
    "mtp_trainer__run_mimo_7b_mtp_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "mtp_trainer__run_mimo_7b_mtp_rl_vllm_sgl_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "on_policy_distillation_trainer__run_qwen3_0.6b_opd_veomni": "model_engine='veomni' is refused: VeOmni (verl's",
    "on_policy_distillation_trainer__run_qwen3_5_4b_fsdp": None,
    "on_policy_distillation_trainer__run_qwen3_8b_fsdp": None,
    "on_policy_distillation_trainer__run_qwen3_8b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "on_policy_distillation_trainer__run_qwen3_8b_mopd_fsdp": None,
    "on_policy_distillation_trainer__run_qwen3_8b_mopd_veomni": "model_engine='veomni' is refused: VeOmni (verl's",
    "on_policy_distillation_trainer__run_qwen3_vl_8b_fsdp": None,
    "otb_trainer__run_qwen3_8b_fsdp": None,
    "ppo_trainer__run_qwen3_8b_fsdp": None,
    "ppo_trainer__run_qwen3_8b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "prefix_grouper__run_qwen3_8b_fsdp": None,
    "profile__run_qwen2_5_7b_torch_profile": None,
    "profile__run_qwen2_5_vl_7b_torch_memory": "actor_rollout_ref.rollout.name='sglang' is refused:",
    "profile__run_qwen3_8b_npu_profile_discrete": None,
    "profile__run_qwen3_8b_npu_profile_e2e": None,
    "reinforce_plus_plus_trainer__run_qwen3_8b_fsdp": None,
    "remax_trainer__run_qwen2.5_math_7b_sync_fsdp": None,
    "remax_trainer__run_qwen3_8b_fsdp": None,
    "rloo_trainer__run_qwen3_8b_fsdp": None,
    "rollout_correction__run_qwen2_5_7b_fsdp": 'algorithm.adv_estimator=rloo compares the samples of one',
    "rollout_correction__run_qwen2_5_7b_fsdp_multi_rs": 'algorithm.adv_estimator=grpo compares the samples of one',
    "router_replay__run_qwen3_30b_a3b_megatron": "actor_rollout_ref.actor.strategy='megatron' is refused:",
    "router_replay__run_qwen3_5_35b_a3b_veomni": "model_engine='veomni' is refused: VeOmni (verl's",
    "sapo_trainer__run_qwen3_30b_a3b_fsdp": None,
    "sapo_trainer__run_qwen3_8b_fsdp": None,
    "tuning__run_qwen2_5_32b_megatron": "actor_rollout_ref.actor.strategy='megatron' is refused:",
    "tuning__run_qwen2_5_72b_fsdp": None,
    "tuning__run_qwen2_5_vl_7b_fsdp": None,
    "tuning__run_qwen3_30b_a3b_megatron": "model_engine='megatron' is refused: Megatron-Core (tensor",
    "tuning__run_qwen3_8b_from_adapter_fsdp": None,
    "tuning__run_qwen3_8b_fsdp": None,
    "tuning__run_qwen3_8b_merge_fsdp": None,
}
FAST = ("cispo_trainer__run_qwen3_8b_fsdp", "gdpo_trainer__run_qwen3_8b_fsdp", "grpo_trainer__run_qwen3_8b_fsdp",
        "on_policy_distillation_trainer__run_qwen3_8b_fsdp", "on_policy_distillation_trainer__run_qwen3_8b_mopd_fsdp",
        "profile__run_qwen2_5_7b_torch_profile", "gpg_trainer__run_qwen3_8b_megatron",
        "grpo_trainer__run_qwen3_30b_veomni", "sapo_trainer__run_qwen3_8b_fsdp", "tuning__run_qwen3_8b_fsdp")


def _case(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def _overrides(case: dict) -> list[str]:
    out = list(case["overrides"])
    if "megatron" in case["config"].get("config-name", ""):
        out.append("actor_rollout_ref.actor.strategy=megatron")  # what verl's ppo_megatron_trainer.yaml sets
    return out


def _check(name: str) -> None:
    case = _case(name)
    assert case["commit"] == COMMIT and case["file"].startswith("examples/")
    if case["main"] in NOT_TRAINING:
        assert name not in EXPECTED
        return
    expected = EXPECTED[name]
    if expected is None:
        cfg = load_config(_overrides(case))
        assert cfg.data.train_files == ["data/train.parquet"] and cfg.actor_rollout_ref.model.path == "tiny-model"
        for item in case["overrides"]:  # what the script sets is what tiller resolved (spot checks)
            key, _, value = item.lstrip("+").partition("=")
            if key == "algorithm.adv_estimator":
                assert cfg.algorithm.adv_estimator == value
            if key == "actor_rollout_ref.rollout.n" and value.isdigit():
                assert cfg.actor_rollout_ref.rollout.n == int(value)
    else:
        with pytest.raises(ConfigError) as err:
            load_config(_overrides(case))
        msg = str(err.value)
        assert expected in msg and "unknown key" not in msg


def test_every_stored_script_has_an_expectation():
    names = {p.stem for p in SCRIPTS}
    training = {n for n in names if _case(n)["main"] not in NOT_TRAINING}
    assert sorted(training) == sorted(EXPECTED) and len(names) == 91
    assert sum(v is None for v in EXPECTED.values()) == 42  # docs/verl-sweep.md: 42 of 91 load


@pytest.mark.parametrize("name", FAST)
def test_one_verl010_script_of_each_kind(name, capsys):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [p.stem for p in SCRIPTS], ids=[p.stem for p in SCRIPTS])
def test_every_verl010_script_loads_or_stops_with_its_reason(name, capsys):
    _check(name)


def test_verl010_distillation_and_gdpo_resolve_verls_meaning(capsys):
    # one teacher under verl 0.10's teacher_models: its model_path is tiller's teacher; pure distillation (task rewards
    # off) with n=1 needs no group baseline
    cfg = load_config(_case("on_policy_distillation_trainer__run_qwen3_8b_fsdp")["overrides"])
    d = cfg.algorithm.distill
    assert d.teacher_path == "Qwen/Qwen3-32B" and not d.use_outcome_reward and d.use_policy_gradient
    assert cfg.actor_rollout_ref.rollout.n == 1
    # GDPO: verl 0.10's gdpo reward manager is its naive one; the named components feed the estimator
    cfg = load_config(_case("gdpo_trainer__run_qwen3_8b_fsdp")["overrides"])
    assert cfg.reward_model.reward_manager == "gdpo" and cfg.algorithm.gdpo_reward_keys == ["accuracy_reward",
                                                                                             "format_reward"]


def test_sapo_example_policy_loss_tau_is_named_as_a_noop(capsys):
    """verl's sapo example sets +actor.policy_loss.tau_pos, which verl's SAPO does not read (it reads actor.tau_pos):
    the same here, and the start-up line says so."""
    cfg = load_config(_case("sapo_trainer__run_qwen3_8b_fsdp")["overrides"])
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "sapo"
    assert (cfg.actor_rollout_ref.actor.tau_pos, cfg.actor_rollout_ref.actor.tau_neg) == (1.0, 1.05)
    assert "actor_rollout_ref.actor.policy_loss.tau_pos=1.0" in edge.noop_line(cfg)


@pytest.mark.parametrize("items, phrase", [
    (["model_engine=megatron", "actor_rollout_ref.actor.megatron.no_such_key=1"], "Megatron-Core"),
    (["model_engine=veomni", "actor_rollout_ref.actor.veomni.param_offload=True"], "VeOmni"),
    (["trainer.v1.trainer_mode=separate_async"], "trainer.v1.trainer_mode='separate_async' is refused"),
    (["actor_rollout_ref.actor.qat.enable=True"], "quantization-aware training"),
    (["skip.async_rollout.enable=True"], "dumped rollouts of verl.s TransferQueue / asynchronous trainers"),
    (["actor_rollout_ref.rollout.nnodes=2"], "standalone rollout pool"),
])
def test_verl010_refusals_name_the_key_and_reason(items, phrase):
    """An engine tiller does not have stops the command line first, before keys only that engine has."""
    with pytest.raises(ConfigError, match=phrase) as err:
        load_config(items)
    key = items[0].split("=")[0]
    assert "unknown key" not in str(err.value) and key.rsplit(".", 1)[0] in str(err.value)


def test_issue38_keys_load_as_noops_with_a_notice():
    """The keys issue 38 found refused as unknown: verl 0.10's critic.fsdp, reward-model server, distillation pool and
    Ray runtime env, and an old script's fsdp_config.grad_offload (a key verl dropped): accepted, named at start-up."""
    items = ["critic.fsdp.param_offload=True", "reward.reward_model.rollout.name=vllm",
             "distillation.n_gpus_per_node=4", "ray_kwargs.ray_init.runtime_env.py_executable=uv run python",
             "actor_rollout_ref.actor.fsdp_config.grad_offload=True"]
    line = edge.noop_line(load_config(items))
    for item in items:
        key = item.split("=")[0]
        assert key in line or key.rsplit(".", 1)[0] in line or key.split(".")[0] + "={" in line, key



def test_the_multi_teacher_distillation_script_routes_by_data_source():
    """verl's MOPD example (two teachers under distillation.teacher_models, routed by data_source) resolves onto
    algorithm.distill.teachers, keyed by each teacher's `key`."""
    cfg = load_config(_overrides(_case("on_policy_distillation_trainer__run_qwen3_8b_mopd_fsdp")))
    d = cfg.algorithm.distill
    assert d.teachers == {"openai/gsm8k": "Qwen/Qwen3-32B", "hiyouga/geometry3k": "Qwen/Qwen3-VL-32B-Instruct"}
    assert (d.teacher_key, d.teacher_path, d.loss_mode) == ("data_source", None, "k1")
