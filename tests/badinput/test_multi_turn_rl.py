"""`actor_rollout_ref.rollout.multi_turn.enable=true` in `tiller rl` trains on the tool loop
(tests/trainer/test_tool_rl.py); the combinations it does not support are refused by name before a model
loads, and `tiller config keys` says that rl honours it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiller.cli import main


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from tiller.tasks import arithmetic

    root = tmp_path_factory.mktemp("multi_turn")
    arithmetic.write_task(root / "arith", n_train=8, n_test=4, seed=0)
    (root / "tools.yaml").write_text("tools:\n  - name: calculator\n")
    (root / "env.py").write_text("class Env:\n    def reset(self, sample):\n        return None\n")
    return root


ON = ["actor_rollout_ref.rollout.multi_turn.enable=true",
      "actor_rollout_ref.rollout.multi_turn.tool_config_path={ws}/tools.yaml"]
CASES = [
    (ON + ["algorithm.adv_estimator=prime"],
     "actor_rollout_ref.rollout.multi_turn.enable=true with algorithm.adv_estimator=prime: "),
    (ON + ["actor_rollout_ref.rollout.agent.env_path={ws}/env.py", "actor_rollout_ref.rollout.agent.env_name=Env"],
     "actor_rollout_ref.rollout.agent.env_path={ws}/env.py and actor_rollout_ref.rollout.multi_turn.enable=true are "
     "both on"),
    (["data.function_tool_path={ws}/tools.py"],
     "actor_rollout_ref.rollout.multi_turn.function_tool_path={ws}/tools.py: its tools run in the multi-turn tool "
     "loop; set actor_rollout_ref.rollout.multi_turn.enable=true"),
    (ON + ["actor_rollout_ref.rollout.multi_turn.max_parallel_calls=0"],
     "actor_rollout_ref.rollout.multi_turn.max_parallel_calls must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("extra,message", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_tiller_rl_refuses_what_the_tool_loop_does_not_support_by_name(capsys, ws, tiny_model_dir, extra, message):
    argv = ["rl", f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{ws}/arith/train.parquet]",
            "data.val_files=[]", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={ws}/run", *[e.replace("{ws}", str(ws)) for e in extra]]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tiller rl: error: " + message.replace("{ws}", str(ws))), err
    assert not (ws / "run" / "metrics.jsonl").exists()


def test_config_keys_says_where_multi_turn_is_honoured():
    """Read from docs/verl-keys.md, which tests/test_verl_edge.py keeps equal to `tiller config keys --markdown`
    (the package scan behind it takes seconds)."""
    table = (Path(__file__).resolve().parents[2] / "docs" / "verl-keys.md").read_text()
    line = next(x for x in table.splitlines() if x.startswith("| `actor_rollout_ref.rollout.multi_turn.enable` |"))
    assert "| honoured |" in line and "in tiller eval and tiller rl" in line and "async_training" in line, line
