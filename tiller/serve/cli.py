"""`tiller serve MODEL_DIR`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over a rollout engine.

    tiller serve ./checkpoint --port 8000 --engine native --dtype bfloat16
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "2+3="}], "max_tokens": 16, "temperature": 0}'

Any OpenAI client works (`OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")`). Endpoints and the
deviations from OpenAI's API are listed in `tiller.serve.app`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tiller.errors import UserError
from tiller.evaluation.runner import load_policy
from tiller.httpguard import Guard, resolve_api_key
from tiller.rollout.base import SamplingParams
from tiller.rollout.graphed_decode import native_decode_options
from tiller.serve.app import create_app, ServedModel
from tiller.serve.tool_calls import SERVE_PARSERS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiller serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL_DIR", help="Hugging Face model dir (e.g. from `tiller export`)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--served-model-name", default=None, help="model id clients pass (default: the dir name)")
    p.add_argument("--engine", default="native", choices=("native", "hf", "vllm"), help="rollout engine")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32 (default bfloat16)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: MODEL_DIR)")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's generator for unseeded requests")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion limit (default: the model's max_position_embeddings)")
    p.add_argument("--max-tokens", type=int, default=512, help="completion length when a request gives none")
    p.add_argument("--max-batch-prompts", type=int, default=64,
                   help="rows decoded together (native) or prompts per engine call (hf, vllm)")
    p.add_argument("--batch-wait-ms", type=float, default=None,
                   help="hf / vllm engines: how long a batch waits for more requests (default 5); the native "
                        "engine batches continuously (requests join between decode steps) and refuses it")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--compile", action="store_true",
                   help="native engine: compile the decode step with torch.compile (needs a C++ compiler; compiles "
                        "at start-up, ~10-30 s; vLLM's default, the inverse of its --enforce-eager); on --device "
                        "cuda the static decode step in CUDA graphs, its layers compiled where Triton is installed "
                        "(the default there; as rollout.enforce_eager=false)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="native engine on --device cuda: decode eagerly, without CUDA graphs (vLLM's flag)")
    p.add_argument("--prompt-cache-mb", type=float, default=None,
                   help="native engine: MiB of keys / values of recent prompts kept so the same prompt again needs "
                        "no prefill (default 64; 0 = off; emptied when the weights change)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health (default: $TILLER_API_KEY)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body, MiB (413 past it)")
    p.add_argument("--max-n", type=int, default=64, help="largest n per request")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting or running at once; past it 429, and /health answers 503 overloaded")
    p.add_argument("--max-prompts-per-request", type=int, default=64, help="most prompts in one request")
    p.add_argument("--max-request-tokens", type=int, default=1 << 20,
                   help="largest prompts x n x max_tokens of one request")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--tool-call-parser", default="hermes", choices=SERVE_PARSERS,
                   help="how the model writes tool calls (vLLM's flag): hermes (Qwen2.5 / Qwen3, default), "
                        "qwen3_coder (Qwen3-Coder / Qwen3.5), glm (GLM-4.5), seed (Seed-OSS), minimax (MiniMax-M2)")
    p.add_argument("--log-level", default="info")
    return p


def build_served_model(args: argparse.Namespace):
    """Load the policy and wrap it in a `ServedModel` (no server started)."""
    if args.batch_wait_ms is not None and args.engine == "native":
        raise UserError("--batch-wait-ms: the native engine batches continuously (no wait window); "
                        "drop the flag or use --engine hf")
    if args.compile and args.engine != "native":
        raise UserError(f"--compile compiles the native engine's decode step; --engine {args.engine} has none "
                        "(drop --compile or use --engine native)")
    if args.enforce_eager and (args.compile or args.engine != "native"):
        raise UserError("--enforce-eager turns off the native engine's CUDA graphs: drop it, or drop --compile"
                        if args.compile else f"--enforce-eager: --engine {args.engine} takes no decode options")
    # the native engine: CUDA graphs by default on a GPU (vLLM's default), the compiled step on CPU with --compile
    eager = False if args.compile else (True if args.enforce_eager else None)
    decode_opts = native_decode_options(eager, args.device) if args.engine == "native" else {}
    policy = load_policy(args.model, engine=args.engine, dtype=args.dtype, seed=args.seed,
                         tokenizer_path=args.tokenizer, device=args.device, trust_remote_code=args.trust_remote_code,
                         engine_kwargs=decode_opts or None)
    max_len = args.max_model_len
    if max_len is None:
        cfg = getattr(policy.model, "config", None)
        max_len = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
    if max_len < 2:
        raise UserError(f"--max-model-len must be >= 2, got {max_len}")
    wait_ms = 5.0 if args.batch_wait_ms is None else args.batch_wait_ms
    name = args.served_model_name or Path(str(args.model).rstrip("/")).name
    served = ServedModel(policy.engine, policy.tokenizer, name=name, max_model_len=max_len,
                         max_tokens_default=args.max_tokens, max_batch_prompts=args.max_batch_prompts,
                         max_wait_s=wait_ms / 1000.0, max_n=args.max_n,
                         max_prompts_per_request=args.max_prompts_per_request,
                         max_request_tokens=args.max_request_tokens, max_queue=args.max_queue,
                         prompt_cache_mb=64.0 if args.prompt_cache_mb is None else args.prompt_cache_mb,
                         processor=policy.processor)
    served.tool_call_parser = args.tool_call_parser
    if decode_opts:  # compiled (CPU) or captured (CUDA) before the first request
        warm_up(served)
    return served


def warm_up(served) -> None:
    """Compile (and on CUDA capture) the decode step before the first request: one row and several rows are two
    graphs."""
    t0 = time.perf_counter()
    print("tiller serve: compiling the decode step (once per process) ...", flush=True)
    for rows in (2, 1):
        served.batcher.generate([[0]] * rows, SamplingParams(max_new_tokens=3, do_sample=False, ignore_eos=True))
    print(f"tiller serve: decode step compiled in {time.perf_counter() - t0:.0f} s", flush=True)


def main(argv: list[str]) -> int:
    import uvicorn

    args = _parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    for flag in ("max_n", "max_prompts_per_request", "max_request_tokens", "max_body_mb", "max_queue"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.prompt_cache_mb is not None and (args.prompt_cache_mb < 0 or args.engine != "native"):
        raise UserError(f"--prompt-cache-mb must be >= 0 and needs --engine native (got {args.prompt_cache_mb}, "
                        f"--engine {args.engine})")
    served = build_served_model(args)
    api_key = resolve_api_key(args.api_key)
    app = Guard(create_app(served), api_key=api_key, max_body_bytes=int(args.max_body_mb * (1 << 20)))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    server = uvicorn.Server(config)
    print(f"tiller serve: model {served.name!r} (engine {args.engine}, context {served.max_model_len}) "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    print(f"tiller serve: limits: {served.limits()}, body <= {args.max_body_mb:g} MiB; "
          f"API key {'required' if api_key else 'off (--api-key or TILLER_API_KEY to require one)'}", flush=True)
    server.run()
    return 0


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main)
