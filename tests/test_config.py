"""Config loading: defaults <- preset / file <- overrides, and the errors a user sees."""

import subprocess
import sys

import pytest
import yaml

from tiller.config import RLConfig, load_config, schema_paths, to_dict, to_yaml
from tiller.errors import ConfigError


def test_defaults_are_typed_dataclasses():
    cfg = load_config([])
    assert isinstance(cfg, RLConfig)
    assert cfg.actor_rollout_ref.rollout.n == 1
    assert cfg.algorithm.adv_estimator == "gae"
    # interpolation resolved
    assert cfg.trainer.default_local_dir == "runs/tiller/run"


def test_overrides_lists_and_types():
    cfg = load_config([
        "actor_rollout_ref.rollout.n=8", "algorithm.adv_estimator=grpo",
        "data.train_files=[a.parquet,b.parquet]", "actor_rollout_ref.actor.optim.lr=3e-4",
        "trainer.total_training_steps=null", "trainer.experiment_name=exp1",
    ])
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-4)
    assert cfg.trainer.total_training_steps is None
    assert cfg.trainer.default_local_dir == "runs/tiller/exp1"


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimatr.*did you mean algorithm\.adv_estimator"):
        load_config(["algorithm.adv_estimatr=grpo"])
    with pytest.raises(ConfigError, match=r"did you mean algorithm\.adv_estimator"):
        load_config(["adv_estimator=grpo"])


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError, match=r"data\.train_batch_size = 'abc'.*expected type: int"):
        load_config(["data.train_batch_size=abc"])


def test_plus_only_in_open_sections():
    cfg = load_config(["+custom_reward_function.reward_kwargs.scale=2.5"])
    assert cfg.custom_reward_function.reward_kwargs == {"scale": 2.5}
    with pytest.raises(ConfigError, match="only open-ended sections"):
        load_config(["+data.foo=1"])
    with pytest.raises(ConfigError, match=r"add it with \+custom_reward_function\.reward_kwargs\.x=1"):
        load_config(["custom_reward_function.reward_kwargs.x=1"])


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="must divide data.train_batch_size"):
        load_config(["data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=5"])
    with pytest.raises(ConfigError, match="must divide a mini-batch"):
        load_config(["actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"])
    with pytest.raises(ConfigError, match="needs actor_rollout_ref.rollout.n >= 2"):
        load_config(["algorithm.adv_estimator=rloo"])
    with pytest.raises(ConfigError, match=r"val_kwargs\.do_sample=True needs val_kwargs\.temperature > 0"):
        load_config(["actor_rollout_ref.rollout.val_kwargs.n=4", "actor_rollout_ref.rollout.val_kwargs.do_sample=true"])
    with pytest.raises(ConfigError, match="not one of.*did you mean 'grpo'"):
        load_config(["algorithm.adv_estimator=grp"])


def test_config_file_and_preset_order(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text(yaml.safe_dump({"actor_rollout_ref": {"rollout": {"n": 4}}, "data": {"train_batch_size": 64}}))
    cfg = load_config(["data.train_batch_size=16"], config_file=f, preset="dapo")
    assert cfg.actor_rollout_ref.rollout.n == 4  # file beats preset (8)
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == pytest.approx(0.28)  # preset beats default
    assert cfg.data.train_batch_size == 16  # command line beats file
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"data": {"train_batch_sise": 3}}))
    with pytest.raises(ConfigError, match=rf"{bad}.*data\.train_batch_sise.*did you mean data\.train_batch_size"):
        load_config([], config_file=bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config([], config_file=tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config([], preset="nope")


def test_yaml_round_trip():
    cfg = load_config(["actor_rollout_ref.rollout.n=8", "algorithm.adv_estimator=grpo"])
    text = to_yaml(cfg)
    data = yaml.safe_load(text)
    assert data["actor_rollout_ref"]["rollout"]["n"] == 8
    assert to_dict(cfg)["algorithm"]["adv_estimator"] == "grpo"


def test_every_field_is_documented():
    import ast
    import inspect

    import tiller.config.schema as schema

    tree = ast.parse(inspect.getsource(schema))
    missing = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name != "RLConfig":
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    if not (isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)):
                        missing.append(f"{node.name}.{stmt.target.id}")
    assert not missing, f"fields without a one-line doc: {missing}"
    assert "algorithm.adv_estimator" in schema_paths(RLConfig)


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["show", "actor_rollout_ref.rollout.n=8", "algorithm.adv_estimator=grpo"], 0, "adv_estimator: grpo"),
        (["show", "algorithm.adv_estimatr=grpo"], 2, "algorithm.adv_estimator"),
        (["show", "data.train_batch_size=abc"], 2, "expected type: int"),
    ],
)
def test_cli_config_show(args, code, needle):
    proc = subprocess.run([sys.executable, "-m", "tiller.cli", "config", *args], capture_output=True, text=True)
    assert proc.returncode == code, proc.stderr
    out = proc.stdout + proc.stderr
    assert needle in out
    if code == 0:
        assert yaml.safe_load(proc.stdout)["actor_rollout_ref"]["rollout"]["n"] == 8
    else:
        assert "Traceback" not in out


def test_registered_algorithms_are_valid_config_choices(monkeypatch):
    """Validation reads the live registries: a user's estimator / loss is accepted, a typo still refused."""
    from tiller import algos

    base = ["actor_rollout_ref.model.path=m", "data.train_files=[t.parquet]"]
    with pytest.raises(ConfigError, match="my_estimator"):
        load_config(base + ["algorithm.adv_estimator=my_estimator"])
    monkeypatch.setitem(algos.ADV_ESTIMATORS._fns, "my_estimator", algos.get_advantage_estimator("grpo"))
    monkeypatch.setitem(algos.POLICY_LOSSES._fns, "my_loss", algos.get_policy_loss("vanilla"))
    cfg = load_config(base + ["algorithm.adv_estimator=my_estimator",
                              "actor_rollout_ref.actor.policy_loss.loss_mode=my_loss"])
    assert (cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.actor.policy_loss.loss_mode) == ("my_estimator", "my_loss")
    with pytest.raises(ConfigError, match="did you mean 'my_loss'"):
        load_config(base + ["actor_rollout_ref.actor.policy_loss.loss_mode=my_los"])
    for kind in ("k3+", "abs+", "low_var_kl"):  # every name kl_penalty takes
        assert load_config(base + [f"actor_rollout_ref.actor.kl_loss_type={kind}"])


def test_hydra_override_grammar():
    cfg = load_config([
        "data.train_files=a.parquet",  # a path or a list, as verl
        "data.val_files=['x.parquet', 'y.parquet']",
        'trainer.logger=["console","jsonl"]',
        "+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
        "++actor_rollout_ref.model.override_config.rope={type: linear, factor: 2.0}",
        "++data.max_prompt_length=64",  # ++ sets an existing key
        "+trainer.total_training_steps=5",  # + on a key nothing set yet (None here): added
        "data.gen_batch_size=${data.train_batch_size}",
    ])
    assert cfg.data.train_files == ["a.parquet"] and cfg.data.val_files == ["x.parquet", "y.parquet"]
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.actor_rollout_ref.model.override_config == {"max_position_embeddings": 32768,
                                                           "rope": {"type": "linear", "factor": 2.0}}
    assert cfg.data.max_prompt_length == 64 and cfg.trainer.total_training_steps == 5
    assert cfg.data.gen_batch_size == cfg.data.train_batch_size == 32
    # ~key: an open-ended key is removed; a typed key goes back to its default; ~key=value checks the value
    cfg = load_config(["+actor_rollout_ref.model.override_config.a=1", "~actor_rollout_ref.model.override_config.a",
                       "data.max_prompt_length=64", "~data.max_prompt_length=64"])
    assert cfg.actor_rollout_ref.model.override_config == {} and cfg.data.max_prompt_length == 256
    with pytest.raises(ConfigError, match=r"the value of 'data.max_prompt_length' is 256, not 3"):
        load_config(["~data.max_prompt_length=3"])
    with pytest.raises(ConfigError, match="is already set; drop the '\\+'"):
        load_config(["data.max_prompt_length=64", "+data.max_prompt_length=32"])
    with pytest.raises(ConfigError, match="Hydra sweep"):
        load_config(["trainer.logger=console,jsonl"])
    with pytest.raises(ConfigError, match="not a valid override"):
        load_config(["data.train_files=[a.parquet"])
    with pytest.raises(ConfigError, match="no config groups"):
        load_config(["actor@actor_rollout_ref.actor=dp_actor"])
    with pytest.raises(ConfigError, match=r"unknown key 'data\.max_promt_length'.*did you mean data\.max_prompt_length"):
        load_config(["++data.max_promt_length=3"])


def test_yaml_defaults_list_is_composed_as_hydra_does(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"data": {"max_prompt_length": 77, "train_batch_size": 8},
                                                        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8}}}))
    (tmp_path / "exp.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n"  # verl's own dir: nothing to find there
        "defaults:\n  - ppo_trainer\n  - base\n  - _self_\n"
        "data:\n  max_prompt_length: 99\n  train_files: one.parquet\n")
    cfg = load_config([], config_file=tmp_path / "exp.yaml")
    assert cfg.data.max_prompt_length == 99  # _self_ after base
    assert cfg.data.train_batch_size == 8 and cfg.data.train_files == ["one.parquet"]
    (tmp_path / "bad.yaml").write_text("defaults:\n  - ppo_trainer\n  - missing_base\n  - _self_\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: .*missing_base"):
        load_config([], config_file=tmp_path / "bad.yaml")
    # Hydra's --config-path / --config-name on the command line
    proc = subprocess.run([sys.executable, "-m", "tiller.cli", "config", "show", f"--config-path={tmp_path}",
                           "--config-name=exp", "actor_rollout_ref.rollout.n=8"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["data"]["max_prompt_length"] == 99


def test_tiller_rl_with_overrides_but_no_model_is_an_error(monkeypatch):
    from tiller.trainer import demo, main_ppo

    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path is not set.*tiller demo"):
        main_ppo.main(["data.train_batch_size=32", "trainer.total_training_steps=3"])
    monkeypatch.setattr(demo, "main", lambda argv: 7)  # `tiller rl` alone: the demo
    assert main_ppo.main([]) == 7


def test_verl_new_layout_resolves_onto_the_legacy_keys():
    # verl 0.8+'s reward.* / model.lora.* / fsdp_config.ulysses keys land on the keys tiller reads
    cfg = load_config(["reward.custom_reward_function.path=/x/r.py", "reward.reward_manager.name=dapo",
                       "reward.reward_model.enable=true", "reward.reward_model.model_path=/x/rm",
                       "+reward.reward_kwargs.overlong_buffer_cfg={enable: true, len: 8}",
                       "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=32",
                       "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"])
    assert cfg.custom_reward_function.path == "/x/r.py" and cfg.reward_model.reward_manager == "dapo"
    assert cfg.reward_model.enable and cfg.reward_model.model.path == "/x/rm"
    assert cfg.reward_model.reward_kwargs["overlong_buffer_cfg"]["len"] == 8
    assert (cfg.actor_rollout_ref.model.lora_rank, cfg.actor_rollout_ref.model.lora_alpha) == (8, 32)
    # Ulysses 2 lands on the legacy key and is folded into the token budget (verl: budget x sp per micro-batch)
    from tiller.config.edge import noop_line

    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 2 * 16384
    assert "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2" in noop_line(cfg)
    assert cfg.reward.custom_reward_function.path is None  # one canonical config: the legacy keys
    # verl's engines read fsdp_config's key (critic: verl 0.10's critic.fsdp); 1 there is verl's "no split" default,
    # so a verl tree's 1 beside the section key's 2 is that 2, not a conflict; two different splits are
    ray = ["trainer.backend=ray", "trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=true",
           "critic.model.use_remove_padding=true"]
    both = load_config([*ray, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1",
                        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    assert both.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    critic = load_config([*ray, "algorithm.adv_estimator=gae", "critic.fsdp.ulysses_sequence_parallel_size=2"])
    assert critic.critic.ulysses_sequence_parallel_size == 2
    assert critic.critic.fsdp.ulysses_sequence_parallel_size is None
    with pytest.raises(ConfigError, match="critic.fsdp.ulysses_sequence_parallel_size and critic.ulysses_sequence_"):
        load_config([*ray, "algorithm.adv_estimator=gae", "critic.fsdp.ulysses_sequence_parallel_size=2",
                     "critic.ulysses_sequence_parallel_size=4"])
    # the same setting in both layouts names both keys
    with pytest.raises(ConfigError, match="reward.custom_reward_function.path and custom_reward_function.path"):
        load_config(["reward.custom_reward_function.path=/a.py", "custom_reward_function.path=/b.py"])
    # verl's on-policy distillation resolves onto algorithm.distill (tests/trainer/test_distill.py); on, it needs
    # the teacher
    with pytest.raises(ConfigError, match="distillation.teacher_model.model_path"):
        load_config(["distillation.enable=true"])
    # a saved adapter / an exclusion list in verl 0.8+'s lora section: the flat keys the actor reads (LoRA on with an
    # adapter at rank 0, so the section is not skipped as verl 0.10's rank-0 Megatron defaults are)
    model = load_config(["actor_rollout_ref.model.lora.adapter_path=/x/adapter",
                         "actor_rollout_ref.model.lora.exclude_modules=[v_proj]"]).actor_rollout_ref.model
    assert (model.lora_adapter_path, model.exclude_modules, model.lora_rank) == ("/x/adapter", ["v_proj"], 0)
    assert model.lora.adapter_path is None and model.lora.exclude_modules == []
    with pytest.raises(ConfigError, match="lora.adapter_path and actor_rollout_ref.model.lora_adapter_path"):
        load_config(["actor_rollout_ref.model.lora.adapter_path=/x/a", "actor_rollout_ref.model.lora_adapter_path=/y"])


def test_sapo_tau_names_and_aliases():
    cfg = load_config(["actor_rollout_ref.actor.policy_loss.sapo_tau_pos=2.0"])
    assert cfg.actor_rollout_ref.actor.tau_pos == 2.0 and cfg.actor_rollout_ref.actor.tau_neg == 1.05
    with pytest.raises(ConfigError, match="sapo_tau_neg and actor_rollout_ref.actor.tau_neg are both set"):
        load_config(["actor_rollout_ref.actor.policy_loss.sapo_tau_neg=2.0", "actor_rollout_ref.actor.tau_neg=2.0"])


def test_gdpo_and_bypass_config_checks():
    with pytest.raises(ConfigError, match="gdpo_reward_keys"):
        load_config(["algorithm.adv_estimator=gdpo", "actor_rollout_ref.rollout.n=4"])
    with pytest.raises(ConfigError, match="one weight per key"):
        load_config(["algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"])
    with pytest.raises(ConfigError, match="only applies with algorithm.rollout_correction.bypass_mode=True"):
        load_config(["algorithm.rollout_correction.loss_type=reinforce"])
    cfg = load_config(["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce",
                       "actor_rollout_ref.actor.loss_agg_mode=token-sum"])
    assert cfg.algorithm.rollout_correction.bypass_mode
