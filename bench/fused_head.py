"""The LM head run with the log-probs (`model.use_fused_kernels`) against the logits made whole, forward + backward.

    python bench/fused_head.py [--tokens 4096] [--hidden 896] [--vocab 151936] [--device cpu|cuda]
                               [--dtype float32|bfloat16]

K = `--tokens` response positions' hidden states [K, E] and a head [V, E] (Qwen2.5-0.5B's: E 896, V 151,936): the
unfused path is `logprobs_and_entropy(F.linear(hidden, weight))` (the packed update's: the [K, V] logits, then the
chunked log-prob / entropy pass), the fused one `head_logprobs_and_entropy(hidden, weight, ...)`; each with the
entropy's gradient, as the update with an entropy bonus runs. Prints one JSON line: seconds each way (best of
`--repeats` after one untimed call), the ratio, the largest tensor over the vocabulary each made (numel, from a
dispatch mode) and, on CUDA, each way's peak device memory above the inputs (bytes). The same values and gradients
either way is tests/algos' check; this measures what it saves and costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Largest(TorchDispatchMode):
    """The largest numel of an op output whose last dim is `vocab` (the weight's transpose, [E, V], aside)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden, self.numel = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == self.vocab and t.shape[0] != self.hidden:
                self.numel = max(self.numel, t.numel())
        return out


def main(argv=None) -> int:
    from tiller.algos.entropy import head_logprobs_and_entropy, logprobs_and_entropy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = (torch.randn(a.tokens, a.hidden, generator=g, device=dev) * 0.5).to(dtype).requires_grad_(True)
    weight = (torch.randn(a.vocab, a.hidden, generator=g, device=dev) * a.hidden ** -0.5).to(dtype).requires_grad_(True)
    labels = torch.randint(0, a.vocab, (a.tokens,), generator=g, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run(fused: bool):
        hidden.grad = weight.grad = None
        if fused:
            lp, ent = head_logprobs_and_entropy(hidden, weight, None, labels, 1.0, True, True)
        else:
            lp, ent = logprobs_and_entropy(torch.nn.functional.linear(hidden, weight), labels, 1.0, True, True)
        (lp.sum() + 0.01 * ent.sum()).backward()

    out = {"tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab, "device": a.device, "dtype": a.dtype,
           "threads": torch.get_num_threads()}
    for name, fused in (("unfused", False), ("fused", True)):
        run(fused)  # (untimed: compiles where the chunks compile, allocates)
        with Largest(a.vocab, a.hidden) as seen:
            run(fused)
        out[f"{name}_largest_vocab_tensor"] = seen.numel
        if dev.type == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            run(fused)
            sync()
            out[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated(dev) - base
        times = []
        for _ in range(a.repeats):
            sync()
            t = time.perf_counter()
            run(fused)
            sync()
            times.append(time.perf_counter() - t)
        out[f"{name}_s"] = round(min(times), 4)
    out["fused_over_unfused_time"] = round(out["fused_s"] / out["unfused_s"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
