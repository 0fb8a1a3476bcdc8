"""Peak memory of one actor update: fixed-size micro-batches vs token budgets (`use_dynamic_bsz`).

One GRPO-shaped mini-batch (`--prompts` prompts x `--n` samples, prompt and response lengths drawn
uniformly, responses up to `--response-length`) goes through `ActorRolloutRefWorker.update_actor` once per
setting: fixed micro-batches of `--micro` rows, then token budgets `--budgets` (padded tokens per
micro-batch: rows x (longest prompt + longest response)). Each setting runs in its own process, with
glibc's default malloc (`trainer.tune_cpu_malloc=false`: freed blocks go back to the kernel): a one-row
update first allocates the optimizer state and pays first-call costs, then the peak resident set during
the full update (`ru_maxrss`) minus the resident set before it is the update's working memory
(activations, logits, gradients).

Prints one JSON line per setting: setting, micro-batches, largest micro-batch in padded tokens, peak MB,
peak MB per 1k tokens of the largest micro-batch, the update's wall time; then "host".

    python bench/dynamic_bsz_memory.py                          # ~1-2 minutes on 2 cores
    python bench/dynamic_bsz_memory.py --budgets 1024 2048 4096 8192 --micro 64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _batch(args):
    import torch

    from tiller.protocol import Batch

    g = torch.Generator().manual_seed(0)
    P, T, n, B = args.prompt_length, args.response_length, args.n, args.prompts * args.n
    plen = torch.randint(P // 4, P + 1, (args.prompts,), generator=g).repeat_interleave(n)
    pmask = (torch.arange(P)[None] >= P - plen[:, None]).long()
    prompts = torch.randint(5, 500, (args.prompts, P), generator=g).repeat_interleave(n, 0) * pmask
    rlen = torch.randint(1, T + 1, (B,), generator=g)
    rmask = (torch.arange(T)[None] < rlen[:, None]).long()
    responses = torch.randint(5, 500, (B, T), generator=g) * rmask
    attn = torch.cat([pmask, rmask], 1)
    return Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": attn, "response_mask": rmask,
                  "advantages": torch.randn(B, T, generator=g) * rmask,
                  "old_log_probs": -torch.rand(B, T, generator=g) - 5.0},
                 meta={"mini_batch_size": B, "temperature": 1.0})


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def _one(args) -> dict:
    """Run one setting in this process."""
    import resource

    import torch

    from tiller.config import load_config
    from tiller.workers.actor import ActorRolloutRefWorker
    from tiller.workers.micro_batches import split_micro_batches

    torch.set_num_threads(args.threads)
    budget = None if args.setting == "fixed" else int(args.setting)
    overrides = [f"actor_rollout_ref.model.path={args.model}", "actor_rollout_ref.rollout.name=hf",
                 f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
                 f"actor_rollout_ref.rollout.n={args.n}", f"data.max_prompt_length={args.prompt_length}",
                 f"data.max_response_length={args.response_length}", "trainer.tune_cpu_malloc=false",
                 f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}"]
    if budget is not None:
        overrides += ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                      f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}"]
    worker = ActorRolloutRefWorker(load_config(overrides), total_training_steps=1)
    batch = _batch(args)
    micros = split_micro_batches(batch, rows=args.micro, max_tokens=budget).batches
    widths = [len(mb) * int(mb["attention_mask"][:, :args.prompt_length].sum(-1).max()
                            + mb["response_mask"].sum(-1).max()) for mb in micros]
    one = batch.index([0])
    one.meta = dict(batch.meta, mini_batch_size=1)
    worker.update_actor(one)  # warm-up: optimizer state allocated, first-call costs paid
    before = _rss_bytes()
    start = time.perf_counter()
    worker.update_actor(batch)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"setting": "fixed micro-batches" if budget is None else f"budget {budget}",
            "micro_batches": len(micros), "largest_micro_tokens": max(widths), "peak_mb": round(peak / 2**20, 1),
            "peak_mb_per_1k_tokens": round(peak / 2**20 / (max(widths) / 1000), 2), "update_s": round(wall, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=48)
    p.add_argument("--response-length", type=int, default=160)
    p.add_argument("--micro", type=int, default=64, help="rows per fixed micro-batch")
    p.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--n-params", type=int, default=4_000_000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--setting", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.setting:
        print(json.dumps(_one(args)))
        return
    from tiller.hostinfo import compact_host_facts
    from tiller.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", n_params=args.n_params, seed=0)
        common = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                  if k not in ("setting", "model", "budgets") and v is not None]
        for setting in ["fixed"] + [str(b) for b in args.budgets]:
            out = subprocess.run([sys.executable, __file__, *common, f"--setting={setting}", f"--model={model}"],
                                 capture_output=True, text=True, check=True).stdout
            print(out.strip().splitlines()[-1], flush=True)
    print(json.dumps({"host": compact_host_facts()}))


if __name__ == "__main__":
    main()
