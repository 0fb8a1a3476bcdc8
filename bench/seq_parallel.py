"""Ulysses sequence parallelism: a worker's memory and time for one update micro-batch, whole vs split over 2 ranks.

    python bench/seq_parallel.py [--hidden 256] [--layers 4] [--rows 2] [--tokens 4096] [--vocab 8192]

Builds a Qwen2 (random init, `--hidden` / 32 heads) and one micro-batch of `--rows` rows of `--tokens` tokens each
(prompt 64, the rest response), then runs the actor's packed forward (logits on response positions only), response
logprobs and entropy, and backward, in fresh processes (gloo, 1 thread each):

- `whole`: one process runs the micro-batch (tiller's packed forward, `use_remove_padding`; the baseline);
- `split`: two ranks run it with `ulysses_sequence_parallel_size=2` (`tiller.workers.ulysses`).

Memory is each process's peak resident set during the step minus its resident set just before (the weights and
the library are already loaded then), from `getrusage` / `/proc/self/statm`. Prints one JSON line: the peak
increments (MiB), their ratio (split rank / whole), each way's seconds, and the host. The gradients of both ways are
compared (the sum of the split ranks' equals the whole one's) so the numbers belong to a correct run.

Measured (2026-12-02, 2-core Intel Xeon with AVX-512 BF16, idle; defaults: 2 rows x 4,096 tokens, hidden 256, 4
layers, vocabulary 8,192, fp32), two runs: whole 1,949 / 1,957 MiB, split 974 / 1,067 and 1,038 / 1,034 MiB per
rank: memory_ratio 0.548 / 0.530.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _batch(rows: int, tokens: int, vocab: int):
    prompt = 64
    ids = torch.randint(5, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    rmask = torch.ones(rows, tokens - prompt)
    return ids, mask, rmask, prompt


def _step(rank: int, world: int, port: int, path: str, args, out) -> None:
    from transformers import AutoModelForCausalLM

    from tiller.algos.entropy import entropy_from_logits, logprobs_from_logits
    from tiller.distributed import context
    from tiller.workers.packed import packed_response_forward
    from tiller.workers.ulysses import seq_parallel_groups, ulysses_response_forward

    torch.set_num_threads(1)
    if world > 1:
        context.init_distributed(rank, world, "127.0.0.1", port, backend="gloo", timeout_s=600)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.config._attn_implementation = "sdpa"
        ids, mask, rmask, P = _batch(args.rows, args.tokens, args.vocab)
        before = _rss_mib()
        start = time.perf_counter()
        if world > 1:
            local, layout = ulysses_response_forward(model, ids, mask, P, rmask, seq_parallel_groups(world))
            labels = layout.local(ids[:, P: P + layout.t_used])
            cols = layout.gather(torch.stack([logprobs_from_logits(local, labels), entropy_from_logits(local)], -1))
            logp, ent = cols[..., 0], cols[..., 1]
        else:
            logits, t = packed_response_forward(model, ids, mask, P, rmask)
            logp, ent = logprobs_from_logits(logits, ids[:, P: P + t]), entropy_from_logits(logits)
        (logp.mean() + 0.01 * ent.mean()).backward()
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out[rank] = {"peak_increment_mib": peak - before, "seconds": seconds,
                     "grad": torch.cat([p.grad.flatten() for p in model.parameters()])}
    finally:
        if world > 1:
            context.destroy_distributed()


def _run(world: int, path: str, args) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_step, args=(world, port, path, args, out), nprocs=world, join=True)
    return [out[r] for r in range(world)]


def main(argv=None) -> int:
    from tiller.hostinfo import compact_host_facts
    from tiller.models.tiny import build_model, train_tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (the logits' width)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        host = compact_host_facts()
        model = build_model(train_tokenizer(), hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab)
        model.save_pretrained(tmp)
        whole = _run(1, tmp, args)[0]
        split = _run(2, tmp, args)
    diff = float((split[0]["grad"] + split[1]["grad"] - whole["grad"]).abs().max())
    scale = float(whole["grad"].abs().max())
    if diff > 1e-4 * scale:
        raise SystemExit(f"split gradients differ from the whole step's: {diff:g} (scale {scale:g})")
    worst = max(r["peak_increment_mib"] for r in split)
    print(json.dumps({
        "rows": args.rows, "tokens_per_row": args.tokens, "hidden": args.hidden, "layers": args.layers,
        "vocab": args.vocab, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "whole_peak_increment_mib": round(whole["peak_increment_mib"], 1),
        "split_peak_increment_mib": [round(r["peak_increment_mib"], 1) for r in split],
        "memory_ratio": round(worst / whole["peak_increment_mib"], 3),
        "whole_s": round(whole["seconds"], 2), "split_s": [round(r["seconds"], 2) for r in split],
        "grad_max_rel_diff": diff / scale, "host": host}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
