"""Remote rewards against a real uvicorn server on 127.0.0.1 (random free port): scores, server down,
server slow, server errors; `tiller serve-rm` end to end."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tiller.config.schema import RLConfig
from tiller.errors import UserError
from tiller.rewards import RewardRequest, build_reward_manager
from tiller.rewards.remote import RemoteRewardClient
from tiller.rewards.server import RuleScorer, create_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app):
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/score"
    finally:
        server.should_exit = True
        thread.join(10)


class LengthScorer:
    """A stand-in model: score = number of characters in the response, after an optional delay."""

    def __init__(self, delay=0.0, fail_first=0):
        self.delay, self.fail_first, self.calls = delay, fail_first, 0

    def score_texts(self, prompts, responses):
        self.calls += 1
        if self.calls <= self.fail_first:
            raise RuntimeError("transient failure")  # FastAPI answers 500
        time.sleep(self.delay)
        return [float(len(r)) for r in responses]


def _requests():
    return [RewardRequest("openai/gsm8k", "q1", "#### 7", "7", {}, 2, "a"),
            RewardRequest("openai/gsm8k", "q2", "#### 70", "7", {"k": np.int64(3)}, 3, "a")]


def test_remote_scores_through_build_reward_manager():
    with serve(create_app(LengthScorer())) as url:
        cfg = RLConfig()
        cfg.reward_model.remote_url = url
        result = build_reward_manager(cfg)(_requests())
    assert result.scores.tolist() == [6.0, 7.0]  # len("#### 7"), len("#### 70")


def test_rule_server_uses_the_labels():
    with serve(create_app(RuleScorer())) as url:
        client = RemoteRewardClient(url)
        assert client.score(_requests()).scores.tolist() == [1.0, 0.0]


def test_server_down_is_a_clear_user_error():
    url = f"http://127.0.0.1:{_free_port()}/score"  # nothing listens there
    client = RemoteRewardClient(url, timeout=1.0, max_retries=2, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(UserError, match=r"unreachable after 3 attempts"):
        client.score(_requests())
    assert time.monotonic() - start < 5.0


def test_slow_server_times_out_with_retries():
    scorer = LengthScorer(delay=1.5)
    with serve(create_app(scorer)) as url:
        client = RemoteRewardClient(url, timeout=0.3, max_retries=1, backoff_s=0.05)
        with pytest.raises(UserError, match="timed out"):
            client.score(_requests())
        assert scorer.calls >= 1
        patient = RemoteRewardClient(url, timeout=10.0)
        assert patient.score(_requests()).scores.tolist() == [6.0, 7.0]


def test_transient_server_errors_are_retried():
    scorer = LengthScorer(fail_first=2)
    with serve(create_app(scorer)) as url:
        client = RemoteRewardClient(url, max_retries=3, backoff_s=0.01)
        assert client.score(_requests()).scores.tolist() == [6.0, 7.0]
        assert scorer.calls == 3  # two 500s, then success


def test_bad_requests_are_not_retried():
    with serve(create_app(LengthScorer())) as url:
        client = RemoteRewardClient(url.replace("/score", "/nope"), max_retries=3)
        with pytest.raises(UserError, match="HTTP 404"):
            client.score(_requests())
    with pytest.raises(UserError, match="http://"):
        RemoteRewardClient("localhost:8000")


def test_serve_rm_cli_end_to_end():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tiller.cli", "serve-rm", "rules", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = RemoteRewardClient(f"http://127.0.0.1:{port}/score", timeout=5.0, max_retries=40, backoff_s=0.25)
        client.backoff_s = 0.25
        # retries with backoff cover the server's start-up
        assert client.score(_requests()).scores.tolist() == [1.0, 0.0]
    finally:
        proc.terminate()
        proc.wait(10)
