"""`tiller serve`: a streamed request (n=64, max_tokens=2000) whose client disconnects while its rows decode leaves
the batch at the next decode step instead of generating all 128,000 tokens; the next small request is served.
A real uvicorn on 127.0.0.1 in front of the tiny model's native engine (continuous batching); the client is a
plain socket so it can hang up at a chosen moment (once the engine shows the 64 rows decoding)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.serving import served_model, serving


@pytest.fixture()
def server(tiny_model_dir):
    served = served_model(tiny_model_dir, "--max-model-len", "2048", "--engine", "native")
    with serving(served) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        yield client, served, port


def _wait_for(what, check, limit_s=120):
    """Poll `check()` until true; the limit only bounds a broken run (the assertions are on the engine's counts)."""
    for _ in range(int(limit_s / 0.05)):
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "count:"}]}),
    ("/v1/completions", {"prompt": "1 2 3"}),
], ids=["chat", "completion"])
def test_a_streamed_request_whose_client_leaves_frees_its_rows(server, path, body):
    client, served, port = server
    batcher = served.batcher
    assert batcher.max_rows >= 64
    request = {"model": "tiny", "stream": True, "n": 64, "max_tokens": 2000, "ignore_eos": True, **body}
    payload = json.dumps(request).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    try:
        # the 64 rows decode: at least 5 steps past the admission
        _wait_for("the rows to decode", lambda: batcher.stats["peak_rows"] >= 64 and batcher.stats["steps"] >= 5)
    finally:
        sock.close()  # the client hangs up mid-generation
    _wait_for("the request to leave", lambda: client.get("/health").json()["queue"] == 0)
    stats = client.get("/stats").json()
    assert stats["abandoned"] == 1 and stats["dropped"] == 0, stats
    assert stats["tokens"] < 64 * 2000, stats  # the rows left the batch: not generated to their end
    steps = stats["steps"]
    small = client.post("/v1/completions", json={"model": "tiny", "prompt": "2+3=", "max_tokens": 3,
                                                 "ignore_eos": True})
    assert small.status_code == 200, small.text
    assert small.json()["usage"]["completion_tokens"] == 3
    after = client.get("/stats").json()
    # the small request ran alone: 3 tokens in 3 samplings, 2 decode steps (its rows are the only ones)
    assert after["steps"] - steps == 3 and after["tokens"] - stats["tokens"] == 3, (stats, after)
    assert after["abandoned"] == 1
