"""A `tiller serve` app on a uvicorn server in a thread of the test process, for the tests that talk HTTP to it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_model(model_dir, *flags: str):
    """`tiller serve MODEL_DIR FLAGS...`'s served model (fp32, named `tiny`), built in this process."""
    from tiller.serve.cli import _parser, build_served_model

    return build_served_model(_parser().parse_args([str(model_dir), "--dtype", "float32", "--served-model-name",
                                                    "tiny", *flags]))


@contextlib.contextmanager
def serving(served):
    """Serve `served` on 127.0.0.1 until the block ends; yields the port."""
    import uvicorn

    from tiller.serve.app import create_app

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(served), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):  # bounded: 20 s
        if srv.started:
            break
        time.sleep(0.1)
    assert srv.started, "server did not start"
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(10)
