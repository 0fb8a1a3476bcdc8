"""Config loading: defaults <- preset / file <- overrides, and the errors a user sees."""

import subprocess
import sys

import pytest
import yaml

from tiller.config import RLConfig, load_config, schema_paths, to_dict, to_yaml
from tiller.config.validate import ADV_ESTIMATORS
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


def test_adv_estimator_names_match_registry():
    algos = pytest.importorskip("tiller.algos")
    for name in ADV_ESTIMATORS:
        assert callable(algos.get_advantage_estimator(name))
