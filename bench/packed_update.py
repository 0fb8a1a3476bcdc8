"""The update's forward + backward with padding (trimmed per micro-batch) against packed rows (use_remove_padding).

    python bench/packed_update.py [--size 30M] [--rows 16] [--device cpu|cuda] [--dtype float32|bfloat16]

Builds a kit Qwen2 (random init), one micro-batch of `--rows` RL samples with prompts of 16-128 tokens and responses
of 16-512 (uniform), and times the actor's forward (logits on response positions), response logprobs and backward
both ways: best of `--repeats`, after one untimed call. Prints one JSON line: seconds per micro-batch each way, the
real / padded token counts, packed_speedup (padded seconds / packed seconds), each way's TFLOP/s by verl's formula
over the real tokens (`tiller.trainer.flops`) and, on a GPU in verl's table, its MFU.

Measured (2026-11-26, this repo's CPU host, 1 thread, fp32, 16 rows of 16-128 + 16-512 tokens: 5,673 real tokens,
9,664 padded): 2M model padded 10.8 s, packed 6.0 s (1.8x); 30M padded 110.6 s, packed 63.1 s (1.75x; the two
cores were shared with other jobs). Packing with one SDPA call over a block-diagonal
`[N, N]` mask instead of per-row calls was 0.53x at 30M (the mask path costs N^2), hence the per-row attention.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def micro_batch(rows: int, seed: int, prompt: tuple[int, int], response: tuple[int, int]):
    """input_ids / attention_mask [B, P + T] (left-padded prompts, right-padded responses), response_mask [B, T]."""
    rng = random.Random(seed)
    pl = [rng.randint(*prompt) for _ in range(rows)]
    rl = [rng.randint(*response) for _ in range(rows)]
    P, T = max(pl), max(rl)
    ids = torch.zeros(rows, P + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rmask = torch.zeros(rows, T)
    g = torch.Generator().manual_seed(seed)
    for b in range(rows):
        ids[b, P - pl[b] : P + rl[b]] = torch.randint(5, 500, (pl[b] + rl[b],), generator=g)
        mask[b, P - pl[b] : P + rl[b]] = 1
        rmask[b, : rl[b]] = 1
    return ids, mask, rmask, P


def main(argv=None) -> int:
    from tiller.algos.entropy import logprobs_from_logits
    from tiller.models.compile import compile_layers
    from tiller.models.tiny import make_tiny_model
    from tiller.trainer.flops import device_peak_flops, update_flops
    from tiller.workers.common import autocast, response_forward
    from tiller.workers.packed import packed_response_forward
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="30M", choices=("2M", "30M"))
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt", default="16,128")
    p.add_argument("--response", default="16,512")
    p.add_argument("--autocast", action="store_true",
                   help="fp32 weights, the forward under --dtype autocast (the trainer's actor.dtype=bfloat16 way)")
    p.add_argument("--compile-layers", action="store_true",
                   help="also time the packed way with each decoder layer compiled (actor.use_torch_compile=true); "
                        "its compile is the untimed first call")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    path = Path(tempfile.mkdtemp(prefix="tiller-packed-")) / "m"
    make_tiny_model(path, n_params={"2M": 2_000_000, "30M": 30_000_000}[a.size], seed=0)
    weights = torch.float32 if a.autocast else getattr(torch, a.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=weights).to(a.device)
    host = micro_batch(a.rows, 0, tuple(map(int, a.prompt.split(","))), tuple(map(int, a.response.split(","))))
    ids, mask, rmask, P = (t.to(a.device) if torch.is_tensor(t) else t for t in host)
    hids, hmask, hrmask = host[:3]  # the forwards get the host's tensors, as the trainer's: trimmed / packed there

    def step(fn):
        model.zero_grad(set_to_none=True)
        if compiled is not None:
            compiled.zero_grad(set_to_none=True)
        with autocast(a.dtype if a.autocast else "float32", a.device):
            logits, t = fn()
        logp = logprobs_from_logits(logits.float(), ids[:, P : P + t])
        (logp * rmask[:, :t]).sum().backward()
        if a.device == "cuda":
            torch.cuda.synchronize()

    ways = {"padded": lambda: response_forward(model, hids, hmask, P, hrmask, logits_to_keep=True, device=a.device),
            "packed": lambda: packed_response_forward(model, hids, hmask, P, hrmask, device=a.device)}
    compiled = None
    if a.compile_layers:  # a copy (a deep copy is eager) with its layers compiled, as the actor compiles its own
        compiled = copy.deepcopy(model)
        state = compile_layers(compiled, "--compile-layers")
        ways["packed_compiled"] = lambda: packed_response_forward(compiled, hids, hmask, P, hrmask, device=a.device)
    best = {}
    for name, fn in ways.items():
        step(fn)
    for _ in range(a.repeats):
        for name, fn in ways.items():  # alternate, best of: other processes share the cores
            t0 = time.perf_counter()
            step(fn)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    row = {"size": a.size, "rows": a.rows, "device": a.device, "dtype": a.dtype, "autocast": a.autocast,
           "threads": a.threads,
           "real_tokens": int(mask.sum()), "padded_tokens": int(mask.shape[0] * (P + int(rmask.sum(1).max()) - 1)),
           "padded_s": round(best["padded"], 4), "packed_s": round(best["packed"], 4),
           "packed_speedup": round(best["padded"] / best["packed"], 3)}
    if compiled is not None:
        row.update(packed_compiled_s=round(best["packed_compiled"], 4), compile_error=state.error,
                   compiled_speedup=round(best["packed"] / best["packed_compiled"], 3))
    # verl's FLOPs formula (tiller.trainer.flops) over the real tokens: the rate each way, and MFU on a GPU in its table
    flops = update_flops(model.config, mask.sum(1).tolist())
    peak = device_peak_flops(torch.cuda.get_device_name()) if a.device == "cuda" else None
    for name in ways:
        row[f"{name}_tflops"] = round(flops / best[name] / 1e12, 3)
        if peak:
            row[f"{name}_mfu"] = round(flops / best[name] / peak, 4)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
