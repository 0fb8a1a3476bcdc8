"""Agents and environments that misbehave: a NaN / inf reward is an error naming the agent or environment (never
NaN advantages in the update); `sys.exit()` inside one is an error naming it; Ctrl-C stops a run promptly while a
blocking (non-async) agent function or environment step hangs, as it does for an async agent."""

from __future__ import annotations

import math
import signal
import sys
import time
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


class _Endpoint:
    """What run_agent_episodes needs of an endpoint, for agents that never call it."""

    def open_episode(self):
        return "ep"

    def base_url(self, eid):
        return "http://127.0.0.1:9/episodes/ep/v1"

    def close_episode(self, eid):
        return []


WATCHDOG_S = 10  # the call is released after this long (the run must not need it)


@pytest.mark.parametrize("to", ["process", "other_thread"])
@pytest.mark.parametrize("kind", ["agent", "env"])
def test_ctrl_c_stops_while_user_code_hangs(kind, to):
    """Ctrl-C (SIGINT to this process) while a blocking agent function / environment step waits for an event that
    is set only after the run returned: the run must raise KeyboardInterrupt without waiting for the call. Before
    the fix a blocking agent ran in asyncio's default executor, which asyncio.run joins on the way out, and a
    blocking environment step blocked the event loop; a watchdog then had to release the call (after 60 s).

    `other_thread`: the kernel hands a process's signal to any thread that does not block it, not always the main
    one (seen in a process with Ray's threads around). Python then runs the handler only when the main thread next
    runs bytecode, and an event loop idle on one future slept until the call returned."""
    import os
    import threading

    from tiller.rollout.agent_endpoint import run_agent_episodes

    started, release, returned, watchdog_released = threading.Event(), threading.Event(), threading.Event(), []

    def hang(*args):
        started.set()
        release.wait(120)
        return 1.0

    class Env:
        def reset(self, sample):
            return None

        def step(self, action):
            return "", hang(), True, {}

    def interrupt():
        if started.wait(60):
            time.sleep(0.5)  # the event loop is idle by now, waiting on the hanging calls
            if to == "process":
                os.kill(os.getpid(), signal.SIGINT)
            else:  # delivered to this (non-main) thread
                signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    def watchdog():
        if not returned.wait(WATCHDOG_S):
            watchdog_released.append(True)
            release.set()

    threading.Thread(target=interrupt, daemon=True).start()
    threading.Thread(target=watchdog, daemon=True).start()
    samples = [{"prompt_text": "1+1=", "prompt_ids": [1, 2]}] * 2
    # Python's own Ctrl-C handler, as in a terminal (a shell starts background jobs with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            if kind == "agent":
                run_agent_episodes(_Endpoint(), hang, samples)
            else:
                run_env_episodes(_Engine(), _Tokenizer(), Env, samples, SamplingParams(max_new_tokens=1))
    finally:
        signal.signal(signal.SIGINT, previous)
        returned.set()
        release.set()
    assert started.is_set() and not watchdog_released, "the run waited for the hanging call"


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


def test_agent_requests_sample_with_the_rollouts_penalties(tiny_model_dir):
    """The trainer fixes the endpoint's sampling (tiller.workers.actor: temperature, filters and penalties): a request
    that leaves a penalty out samples with the rollout's (its tokens are the engine's under those penalties), one that
    sets another value is refused, naming the field (the trained logprobs must be those of the sampling
    distribution)."""
    import httpx

    from tiller.models.loading import load_causal_lm, load_tokenizer
    from tiller.rollout import SamplingParams
    from tiller.rollout.agent_endpoint import AgentEndpoint
    from tiller.rollout.native import NativeRolloutEngine
    from tiller.serve.app import agent_app

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    engine = NativeRolloutEngine(load_causal_lm(str(tiny_model_dir), dtype="float32"), tok, dtype="float32")
    pen = {"repetition_penalty": 2.0, "presence_penalty": 0.0, "frequency_penalty": 1.0}
    endpoint = AgentEndpoint(engine, tok, app=agent_app, max_model_len=256, max_tokens_default=6,
                             fixed_sampling={"temperature": 0.0, **pen})
    prompt = tok("1+1=", add_special_tokens=False)["input_ids"]
    want = engine.generate([prompt], SamplingParams(do_sample=False, max_new_tokens=6, ignore_eos=True, **pen))
    plain = engine.generate([prompt], SamplingParams(do_sample=False, max_new_tokens=6, ignore_eos=True))
    assert want.response_ids != plain.response_ids
    body = {"model": "policy", "prompt": "1+1=", "max_tokens": 6, "ignore_eos": True}
    try:
        live = endpoint.open_episode()
        with httpx.Client(timeout=60) as client:
            assert client.post(f"{endpoint.base_url(live)}/completions", json=body).status_code == 200
            reply = client.post(f"{endpoint.base_url(live)}/completions", json={**body, "presence_penalty": 0.5})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "presence_penalty", reply.text
        (segment,) = endpoint.close_episode(live)
        assert list(segment.response_ids) == want.response_ids[0]
    finally:
        endpoint.close()


def test_agent_requests_follow_the_rollouts_regex(tiny_model_dir):
    """rollout.structured_outputs_regex reaches the agent endpoint (fixed as `guided_regex`): a request that leaves
    it out is constrained by it, one that asks for another regex is refused, naming the field."""
    import re

    import httpx

    from tiller.models.loading import load_causal_lm, load_tokenizer
    from tiller.rollout.agent_endpoint import AgentEndpoint
    from tiller.rollout.native import NativeRolloutEngine
    from tiller.serve.app import agent_app

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    engine = NativeRolloutEngine(load_causal_lm(str(tiny_model_dir), dtype="float32"), tok, dtype="float32")
    endpoint = AgentEndpoint(engine, tok, app=agent_app, max_model_len=256, max_tokens_default=8,
                             fixed_sampling={"temperature": 1.0, "guided_regex": "[0-9]{1,3}"})
    body = {"model": "policy", "prompt": "1+1=", "max_tokens": 8, "n": 4, "seed": 3}
    try:
        live = endpoint.open_episode()
        with httpx.Client(timeout=60) as client:
            reply = client.post(f"{endpoint.base_url(live)}/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert all(re.fullmatch("[0-9]{1,3}", c["text"]) for c in reply.json()["choices"]), reply.json()
            other = client.post(f"{endpoint.base_url(live)}/completions", json={**body, "guided_regex": "a+"})
            assert other.status_code == 400 and other.json()["error"]["param"] == "guided_regex", other.text
        endpoint.close_episode(live)
    finally:
        endpoint.close()
