"""Agents and environments that misbehave: a NaN / inf reward is an error naming the agent or environment (never
NaN advantages in the update); `sys.exit()` inside one is an error naming it; Ctrl-C stops a run promptly while a
blocking (non-async) agent function or environment step hangs, as it does for an async agent."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tiller.cli import main
from tiller.errors import UserError
from tiller.rollout import SamplingParams
from tiller.rollout.environments import run_env_episodes
from tiller.rollout.episodes import episode_reward, finite_reward

NON_FINITE = [float("nan"), float("inf"), -float("inf"), np.float64("nan"), np.float32("inf"), torch.tensor(math.nan),
              torch.tensor([float("-inf")]), {"reward": float("nan")}, {"score": float("inf"), "turns": 2}]


@pytest.mark.parametrize("value", NON_FINITE, ids=[f"v{i}" for i in range(len(NON_FINITE))])
def test_a_non_finite_agent_reward_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"agent on sample 3: the reward is (nan|inf|-inf), not a finite number"):
        episode_reward(value, "agent on sample 3")


@pytest.mark.parametrize("value, expect", [(1, 1.0), (np.float32(0.5), 0.5), (torch.tensor([2.0]), 2.0),
                                           ({"reward": -1.5, "turns": 3}, -1.5)])
def test_finite_rewards_of_every_numeric_kind_pass(value, expect):
    assert episode_reward(value, "agent")[0] == expect


@pytest.mark.parametrize("value", ["1.0", None, True, [1.0]])
def test_a_reward_that_is_not_a_number_is_a_type_error(value):
    with pytest.raises(TypeError, match="must return a number"):
        episode_reward(value, "agent on sample 0")
    with pytest.raises(TypeError, match="a reward must be a number"):
        finite_reward(value, "step")


class _Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3] * max(1, len(text) // 4)}

    def decode(self, ids, skip_special_tokens=True):
        return "7"


class _Engine:
    """One token per call, fixed: the environment loop's engine for tests that are about the environment."""

    def generate(self, prompts, sampling):
        return SimpleNamespace(response_ids=[[5]], logprobs=[[-0.5]], finish_reason=["stop"])


def _env(reward_at_step_2):
    class Env:
        def reset(self, sample):
            self.t = 0

        def step(self, action):
            self.t += 1
            return " next:", (reward_at_step_2 if self.t == 2 else 1.0), self.t >= 3, {}

    return Env


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), torch.tensor(float("nan")), np.float64("-inf")],
                         ids=["nan", "inf", "tensor_nan", "np_neg_inf"])
def test_an_environment_with_a_non_finite_reward_is_named(reward):
    samples = [{"prompt_text": "1+1=", "prompt_ids": [1, 2]}] * 2
    with pytest.raises(UserError) as info:
        run_env_episodes(_Engine(), _Tokenizer(), _env(reward), samples, SamplingParams(max_new_tokens=2))
    msg = str(info.value)
    assert msg.startswith("actor_rollout_ref.rollout.agent.env: the environment _env.<locals>.Env")
    assert "turn 2's step(): the reward is" in msg and "not a finite number" in msg, msg


def test_an_environment_that_calls_sys_exit_is_named():
    class Quits:
        def reset(self, sample):
            sys.exit(4)

    with pytest.raises(UserError, match=r"the environment .*Quits.* failed on sample 0: called sys.exit\(4\)"):
        run_env_episodes(_Engine(), _Tokenizer(), Quits, [{"prompt_text": "1+1=", "prompt_ids": [1]}],
                         SamplingParams(max_new_tokens=2))


def test_tiller_rl_refuses_an_agent_that_returns_nan(tmp_path, capsys, tiny_model_dir):
    from tiller.tasks import arithmetic

    arithmetic.write_task(tmp_path / "arith", n_train=8, n_test=4, seed=0)
    (tmp_path / "agent.py").write_text("def run(base_url, sample):\n    return {'reward': float('nan')}\n")
    code = main(["rl", f"actor_rollout_ref.model.path={tiny_model_dir}",
                 f"data.train_files=[{tmp_path}/arith/train.parquet]", "data.val_files=[]", "data.max_prompt_length=32",
                 "data.max_response_length=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1", "trainer.logger=[jsonl]",
                 f"trainer.default_local_dir={tmp_path}/run", f"actor_rollout_ref.rollout.agent.path={tmp_path}/agent.py"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert f"the agent run ({tmp_path}/agent.py:1) failed on sample 0" in last and "reward is nan" in last, last
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or "nan" not in (tmp_path / "run" / "metrics.jsonl").read_text()


# Ctrl-C while user code hangs. A child process runs the episodes with user code that never returns (an hour's
# sleep); once it has started (a marker file), the test sends SIGINT: the child must print "interrupted" and exit
# 130 well before the hour. Before the fix a blocking agent ran in asyncio's default executor, which asyncio.run
# joins on the way out, and a blocking environment step blocked the event loop itself.
CHILD = textwrap.dedent('''
    import asyncio, pathlib, sys, time
    from types import SimpleNamespace
    from tiller.rollout import SamplingParams
    from tiller.rollout.agent_endpoint import run_agent_episodes
    from tiller.rollout.environments import run_env_episodes

    MARK = pathlib.Path(sys.argv[2])

    def hang(*args):
        MARK.touch()
        time.sleep(3600)
        return 1.0

    async def hang_async(*args):
        MARK.touch()
        await asyncio.sleep(3600)
        return 1.0

    class Endpoint:
        def open_episode(self): return "ep"
        def base_url(self, eid): return "http://127.0.0.1:9/episodes/ep/v1"
        def close_episode(self, eid): return []

    class Env:
        def reset(self, sample): return None
        def step(self, action): return hang()

    class Tok:
        def __call__(self, text, add_special_tokens=False): return {"input_ids": [3]}
        def decode(self, ids, skip_special_tokens=True): return "x"

    class Engine:
        def generate(self, prompts, sampling):
            return SimpleNamespace(response_ids=[[5]], logprobs=[[-0.5]], finish_reason=["stop"])

    samples = [{"prompt_text": "1+1=", "prompt_ids": [1]}] * 2
    try:
        if sys.argv[1] == "env":
            run_env_episodes(Engine(), Tok(), Env, samples, SamplingParams(max_new_tokens=1))
        else:
            run_agent_episodes(Endpoint(), hang if sys.argv[1] == "agent" else hang_async, samples)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
''')


def test_ctrl_c_stops_while_user_code_hangs(tmp_path):
    """A blocking agent function and a blocking environment step, each in its own child (started together)."""
    import os
    import time

    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    kids = {kind: subprocess.Popen([sys.executable, str(tmp_path / "child.py"), kind, str(tmp_path / kind)],
                                   stderr=subprocess.PIPE, text=True, env=env) for kind in ("agent", "env")}
    try:
        for kind, child in kids.items():
            for _ in range(1200):  # up to 2 minutes to import torch and start, on a loaded host
                if (tmp_path / kind).exists() or child.poll() is not None:
                    break
                time.sleep(0.1)
            assert (tmp_path / kind).exists(), (kind, child.poll())
        for child in kids.values():
            child.send_signal(signal.SIGINT)
        for kind, child in kids.items():  # the user code sleeps an hour: only a prompt stop ends by then
            err = child.communicate(timeout=60)[1]
            assert child.returncode == 130 and err.strip().endswith("interrupted"), (kind, err)
    finally:
        for child in kids.values():
            if child.poll() is None:
                child.kill()
                child.wait()


def test_a_request_outside_a_live_episode_is_404(tiny_model_dir):
    """The agent endpoint (tiller.rollout.agent_endpoint, serving tiller.serve.app.agent_app): no episode, an unknown
    one, or one already closed is refused with 404 / episode_not_found; a live one is served."""
    import httpx

    from tiller.models.loading import load_causal_lm, load_tokenizer
    from tiller.rollout.agent_endpoint import AgentEndpoint
    from tiller.rollout.native import NativeRolloutEngine
    from tiller.serve.app import agent_app

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    engine = NativeRolloutEngine(load_causal_lm(str(tiny_model_dir), dtype="float32"), tok, dtype="float32")
    endpoint = AgentEndpoint(engine, tok, app=agent_app, max_model_len=256, max_tokens_default=2)
    body = {"model": "policy", "prompt": "1+1=", "max_tokens": 2}
    try:
        live = endpoint.open_episode()
        closed = endpoint.open_episode()
        endpoint.close_episode(closed)
        with httpx.Client(timeout=60) as client:
            for url, headers in ((f"{endpoint.root}/v1/completions", {}),
                                 (f"{endpoint.root}/v1/completions", {"Authorization": "Bearer ep-nope"}),
                                 (f"{endpoint.base_url(closed)}/completions", {})):
                reply = client.post(url, json=body, headers=headers)
                assert reply.status_code == 404 and reply.json()["error"]["code"] == "episode_not_found", reply.text
            assert client.post(f"{endpoint.base_url(live)}/completions", json=body).status_code == 200
        segments = endpoint.close_episode(live)
        assert len(segments) == 1 and len(segments[0].response_ids) == 2
    finally:
        endpoint.close()
