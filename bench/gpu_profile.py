"""Where a decode step's time goes on a GPU: the native engine as `rollout.enforce_eager=False` runs it (graphs of the
static step, compiled layers) under `torch.profiler`, at GPU.md's shape (Qwen2.5-0.5B's body, bf16).

    python bench/gpu_profile.py --device cuda --rows 128 --new-tokens 64 --out DIR

Prints (and writes to `DIR/profile.json`): wall seconds of one `generate`, the GPU's busy seconds inside it (kernel
time summed), kernel launches and graph launches per decode step, host syncs (`cudaStreamSynchronize` /
`cudaDeviceSynchronize`), the top kernels by GPU time (calls, us a call); and the decode steps alone, as this
`generate` minus one of a single token (the prefill): `step_wall_ms` (unprofiled), `step_gpu_ms` (kernel time) and
`step_kernels` a step, so a step's wall time splits into the GPU's work and what is not (launch gaps, the host),
and `step_kernels_by_calls` (each kernel's launches a decode step, the most frequent first).
`DIR/profile.txt` holds torch's table. The first `generate` (captures, compiles) is untimed. `--engine` picks
another row of `bench/rollout.py`'s ENGINES (`native` is the eager engine). On `--device cpu` the 2M model runs (to
test this script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout import ENGINES, SIZES, build_sized, make_prompts  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default=None, help="a bench/rollout.py size (default 0.5B on cuda, 2M on cpu)")
    p.add_argument("--engine", default="native-graphs-compiled", choices=sorted(e for e in ENGINES if e != "vllm"))
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--model-dir", default="/tmp/tiller-bench")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiller.rollout import SamplingParams, build_rollout_engine

    size = a.size or ("0.5B" if a.device == "cuda" else "2M")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = build_sized(Path(a.model_dir) / f"qwen2-{size}", SIZES[size])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(a.device)
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    engine = build_rollout_engine(a.engine.split("-")[0], model, tok, dtype=dtype, dtype_fallback=False, seed=0,
                                  **ENGINES[a.engine])
    prompts = make_prompts(tok, a.rows, lengths=(16, 128))
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])

    def run(new_tokens: int, profiled: bool):
        """(wall s, events or None) of one generate of `new_tokens` tokens a row."""
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=0)
        if not profiled:
            sync()
            t = time.perf_counter()
            engine.generate(prompts, params)
            sync()
            return time.perf_counter() - t, None
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            engine.generate(prompts, params)
            sync()
            wall = time.perf_counter() - t
        return wall, prof.key_averages()

    def totals(events):
        dev = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        by_name = {e.key: e for e in events}
        return dev, sum(e.self_device_time_total for e in dev) / 1e6, sum(e.count for e in dev), by_name

    run(a.new_tokens, False)  # captures / compiles
    plain, _ = run(a.new_tokens, False)
    # the prefill and first token alone (the same rows): what the decode steps add is the difference
    one_plain = min(run(1, False)[0] for _ in range(2))
    wall, events = run(a.new_tokens, True)
    _, one_events = run(1, True)
    dev, busy, launches, by_name = totals(events)
    _, one_busy, one_launches, one_by_name = totals(one_events)

    def count(*names: str) -> int:
        return sum(by_name[n].count for n in names if n in by_name)

    steps = a.new_tokens
    decode_steps = max(1, steps - 1)
    top = sorted(dev, key=lambda e: -e.self_device_time_total)[:25]
    graphed = getattr(engine, "_graphed", None)
    info = {"engine": a.engine, "size": size, "dtype": dtype, "rows": a.rows, "new_tokens": a.new_tokens,
            "wall_s": round(plain, 4), "wall_profiled_s": round(wall, 4), "tok_s": round(a.rows * steps / plain, 1),
            "gpu_busy_s": round(busy, 4), "gpu_busy_frac": round(busy / wall, 3) if wall else None,
            # the decode steps alone (this generate minus a 1-token one): wall (unprofiled), kernel time, kernels
            "step_wall_ms": round((plain - one_plain) / decode_steps * 1e3, 4),
            "step_gpu_ms": round((busy - one_busy) / decode_steps * 1e3, 4),
            "step_kernels": round((launches - one_launches) / decode_steps, 1),
            "prefill_wall_s": round(one_plain, 4),
            "kernels_per_step": round(launches / steps, 1),
            "graph_launches_per_step": round(count("cudaGraphLaunch") / steps, 2),
            "host_syncs": count("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
            "host_syncs_prefill": sum(one_by_name[n].count for n in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                                     "cudaEventSynchronize") if n in one_by_name),
            "memcpy_calls": count("cudaMemcpyAsync"),
            "top_kernels": [{"name": e.key[:120], "calls": e.count, "ms": round(e.self_device_time_total / 1e3, 3),
                             "us_per_call": round(e.self_device_time_total / max(1, e.count), 2)} for e in top]}
    # what a decode step's kernels are: each kernel's calls a step (this generate's minus the 1-token one's), the
    # most frequent first: a step's ~500 kernels by name, for the next fusion
    one_calls = {e.key: e.count for e in totals(one_events)[0]}
    per_step = sorted(((e.key, (e.count - one_calls.get(e.key, 0)) / decode_steps) for e in dev), key=lambda kv: -kv[1])
    info["step_kernels_by_calls"] = [{"name": k[:100], "per_step": round(c, 2)} for k, c in per_step[:40] if c > 0]
    if graphed is not None:
        info["graphs"] = {"captures": graphed.captures, "replays": graphed.replays, "eager": graphed.eager_steps,
                          "capture_error": graphed.capture_error, "compile_error": graphed.compile_error}
    sort = "self_cuda_time_total" if a.device == "cuda" else "self_cpu_time_total"
    (out / "profile.txt").write_text(events.table(sort_by=sort, row_limit=60, max_name_column_width=90))
    (out / "profile.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
