"""`actor_rollout_ref.rollout.multi_turn.enable=true` in `tiller rl`: refused by name before a model loads (it was
silently ignored: RL trained single-turn), while `tiller config keys` says where it is honoured and that rl refuses
it, and verl's `data.tool_config_path` spelling or a full tool setup changes nothing about that."""

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
    return root


CASES = [
    ["actor_rollout_ref.rollout.multi_turn.enable=true"],
    ["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.tool_config_path={ws}/tools.yaml"],
    ["actor_rollout_ref.rollout.multi_turn.enable=true", "data.tool_config_path={ws}/tools.yaml",
     "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"],
    ["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
     "actor_rollout_ref.rollout.multi_turn.tool_config_path={ws}/tools.yaml"],
]


@pytest.mark.parametrize("extra", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_tiller_rl_refuses_the_multi_turn_tool_loop_by_name(capsys, ws, tiny_model_dir, extra):
    argv = ["rl", f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{ws}/arith/train.parquet]",
            "data.val_files=[]", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={ws}/run", *[e.replace("{ws}", str(ws)) for e in extra]]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tiller rl: error: actor_rollout_ref.rollout.multi_turn.enable=true: tiller rl does not"), err
    assert "rollout.agent.path" in last
    assert not (ws / "run" / "metrics.jsonl").exists()


def test_config_keys_says_where_multi_turn_is_honoured():
    """Read from docs/verl-keys.md, which tests/test_verl_edge.py keeps equal to `tiller config keys --markdown`
    (the package scan behind it takes seconds)."""
    table = (Path(__file__).resolve().parents[2] / "docs" / "verl-keys.md").read_text()
    line = next(x for x in table.splitlines() if x.startswith("| `actor_rollout_ref.rollout.multi_turn.enable` |"))
    assert "| honoured |" in line and "in tiller eval" in line and "tiller rl refuses it" in line, line
