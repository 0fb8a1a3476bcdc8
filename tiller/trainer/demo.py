"""`tiller demo`: watch RL teach a tiny model two-digit addition on a laptop CPU, in a few minutes.

1. Starter model (cached under `~/.cache/tiller/demo/`, or `$TILLER_CACHE/demo/`): a ~2M-parameter Qwen2
   from the tiny-model kit, given a short supervised warm-up on additions of 1-3 digit operands (never an RL
   prompt or a held-out pair; see `warmup_rows`; cross-entropy on the answer tokens, constant lr) that stops as soon as greedy accuracy on a dev split first reaches `--warmup-target`
   (0.4): the model is partly right, so sampled groups contain both right and wrong answers.
2. GRPO (Shao et al. 2024) on `tiller/arithmetic` (`tiller.tasks.arithmetic`): n = 8 samples per prompt,
   group z-score advantages, groups whose answers are all right or all wrong dropped (DAPO's dynamic
   sampling), no KL, AdamW lr 1e-4 after a 10-step warmup, 150 steps of 32 prompts.
3. Greedy accuracy on 256 held-out prompts (pairs never seen in training) before and after RL.

Measured (`bench/demo_seeds.py`, seeds 0-4, fresh cache, two at a time, 2-core Intel Xeon with AVX-512 without
bf16, fp32, 1 thread each, 2026-11-27): held-out gains +0.41 / +0.49 / +0.46 / +0.41 / +0.39 (median +0.41) in
180-275 s (seed 3: its warm-up restarted, see WARMUP_ATTEMPTS), the warm-up 360-705 steps; with torch's AVX2 kernels
forced (ATEN_CPU_CAPABILITY=avx2) +0.43 / +0.56 / +0.35 / +0.51 / +0.60 (docs/benchmarks.md).
One GRPO step of this pipeline equals a plain-torch reference (tests/trainer/test_grpo_reference.py).

The run dir holds `metrics.jsonl`, `tensorboard/`, `checkpoints/`, `plots/demo_curves.png` (reward and
accuracy per step) and `summary.json` (`val_acc_before`, `val_acc_after`, `wall_s`, ...). Any RL config key
can be overridden: `tiller demo actor_rollout_ref.actor.optim.lr=2e-4 trainer.total_training_steps=100`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import torch

from tiller.cache import cache_dir
from tiller.config import load_config
from tiller.data.rl_dataset import render_prompt
from tiller.errors import UserError
from tiller.models.checkpoint import save_pretrained_atomic
from tiller.models.tiny import build_model, train_tokenizer
from tiller.rewards import default_compute_score
from tiller.rollout import build_rollout_engine, SamplingParams
from tiller.tasks import arithmetic
from tiller.trainer import demo_report
from tiller.trainer.demo_report import train_and_report
from tiller.workers.common import lr_lambda

DEMO_VERSION = 8  # 8: a stalled warm-up restarts (a seed that reaches half the target: the same weights as 7)
WARMUP_ATTEMPTS = 3
"""Warm-ups per starter model: one that ends `warm_up`'s max_steps below half the target (stalled: few groups with a
right answer for RL) restarts from a fresh initialisation (seed + RESTART_SEED_STRIDE x attempt). Training trajectories differ from host to host (each CPU's
fp32 kernels round differently), and on a 2-core Intel Xeon (AVX-512 without bf16) seed 3 stalled at 0.07 dev
accuracy after 1500 steps where an AMD EPYC reached 0.4 in 685; RL from such a starter gained +0.05."""
RESTART_SEED_STRIDE = 1_000
VAL_KEY = f"val-core/{arithmetic.DATA_SOURCE}/acc/mean@1"

PROMPT_TEMPLATE = (
    "{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)
"""The chat template the demo's model is trained with, saved in its tokenizer (and so in its checkpoints and
`tiller export`): a user turn is its text as is (`"47+38="`), nothing added for the reply. A short prompt keeps
the demo fast; shipping it as the model's template means `tiller eval` / `tiller serve` / transformers'
`apply_chat_template` prompt the trained model exactly as RL did (a ChatML template there would score 0)."""


def cache_root() -> Path:
    return cache_dir("demo")


# ------------------------------------------------------------------------------------ warm-up
def _prompt_ids(tokenizer, row: dict) -> list[int]:
    """The prompt as the RL run renders it: through the tokenizer's chat template (`PROMPT_TEMPLATE`)."""
    text = render_prompt(row["prompt"], tokenizer, apply_chat_template=True, where="demo")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _encode_sft(tokenizer, rows: list[dict]) -> list[tuple[list[int], int]]:
    """(prompt + answer + eos token ids, prompt length) per row."""
    out = []
    for row in rows:
        p_ids = _prompt_ids(tokenizer, row)
        a_ids = tokenizer(row["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"]
        out.append((p_ids + a_ids + [tokenizer.eos_token_id], len(p_ids)))
    return out


def _sft_batch(examples, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input_ids / attention_mask [b, L] and labels [b, L] (-100 outside the answer)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (seq, p_len) in enumerate(examples):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, p_len:len(seq)] = torch.tensor(seq[p_len:])
    return ids, mask, labels


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 6) -> float:
    """Fraction of `rows` whose greedy answer is right (the task's scorer)."""
    engine = build_rollout_engine("native", model, tokenizer, dtype=None)
    prompts = [_prompt_ids(tokenizer, r) for r in rows]
    out = engine.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=max_new_tokens))
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    scores = [float(default_compute_score(arithmetic.DATA_SOURCE, t, r["reward_model"]["ground_truth"], {}))
              for t, r in zip(texts, rows)]
    return sum(scores) / len(scores)


def warm_up(model, tokenizer, train_rows: list[dict], dev_rows: list[dict], *, target: float, seed: int,
            lr: float = 1e-3, batch_size: int = 64, eval_every: int = 25, fine_every: int = 5,
            max_steps: int = 1500, log=print) -> tuple[float, int]:
    """Supervised steps on (prompt -> answer) until greedy dev accuracy >= target; returns (acc, steps).

    Dev accuracy is checked every `eval_every` steps, and every `fine_every` once it passes half the target:
    near the target it can jump by 0.3 in 25 steps, and a starter far above the target leaves RL little to teach.

    The lr is constant after a 50-step linear warmup, never decayed: a decaying lr lets the model settle
    into a sharp minimum, and how sharp depends on when the target is reached (i.e. on the seed). Measured
    on seed 1 with the cosine decay this replaced: a step of norm 0.03 along the policy gradient took the
    expected reward of the step's own prompts from 0.34 to 0.22, and RL at lr 1e-4 lost accuracy; at a
    constant lr the same step raised it (0.15 -> 0.17, and 0.19 at norm 0.1).
    """
    from functools import partial

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(lr_lambda, warmup=min(50, max_steps // 10), total=max_steps,
                                                            style="constant", min_lr_ratio=1.0))
    acc, step = 0.0, 0
    model.train()
    while step < max_steps:
        idx = torch.randint(len(train_rows), (batch_size,), generator=gen).tolist()
        ids, mask, labels = _sft_batch(_encode_sft(tokenizer, [train_rows[i] for i in idx]), tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % (fine_every if acc >= target / 2 else eval_every) == 0:
            acc = greedy_accuracy(model, tokenizer, dev_rows)
            model.train()
            if step % eval_every == 0 or acc >= target:
                log(f"  warm-up step {step}: loss {loss.item():.3f}, dev greedy accuracy {acc:.3f}")
            if acc >= target:
                break
    model.eval()
    return acc, step


def warmup_rows(rl_train_size: int, seed: int, n_rows: int = 100_000, n_dev: int = 128) -> tuple[list[dict], list[dict]]:
    """(supervised rows, dev rows) for the warm-up.

    Supervised rows: `n_rows` additions whose operands have 1 to 3 digits (each length equally likely), drawn
    fresh for the seed, none of them an RL prompt or a held-out pair. Dev rows: two-digit pairs that are neither
    (`arithmetic.make_splits` shuffles all pairs once per seed: [held-out 256 | RL train | the rest]).
    Why not the two-digit pairs themselves: there are only 8100. Warming up on the RL prompts made RL's
    signal depend on how long the warm-up ran (a long one memorised them, their groups came back all-right and
    were filtered out); warming up on the ~3700 pairs left over let a slow seed memorise those instead (1110
    steps = 19 epochs), and its RL gain was +0.11 where a seed that generalised early gained +0.45. With fresh
    examples every step no seed can memorise: it learns carrying, and RL's prompts are new to it.
    """
    n_pairs = arithmetic.n_pairs()
    rest = n_pairs - 256 - rl_train_size
    if rest < n_dev:
        raise UserError(f"--train-size {rl_train_size} leaves {max(rest, 0)} of the {n_pairs} two-digit pairs for "
                        f"the warm-up's dev split (256 are held out); use at most {n_pairs - 256 - n_dev}")
    every, held_out = arithmetic.make_splits(n_train=n_pairs - 256, n_test=256, seed=seed)
    taken = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in held_out + every[:rl_train_size]}
    rng = random.Random(f"demo-warmup-{seed}")

    def operand() -> int:
        digits = rng.randint(1, 3)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)

    rows: list[dict] = []
    while len(rows) < n_rows:
        a, b = operand(), operand()
        if (a, b) not in taken:
            rows.append(arithmetic.make_row(a, b, "warmup", len(rows)))
    return rows, every[-n_dev:]


def starter_dir(args) -> Path:
    """Where the starter model for these settings is cached."""
    key = hashlib.sha1(json.dumps([DEMO_VERSION, args.seed, args.model_params, args.warmup_target]).encode())
    return cache_root() / f"starter-{key.hexdigest()[:10]}"


def starter_is_cached(args) -> bool:
    return (starter_dir(args) / "config.json").exists() and not args.rebuild


def _time_split(starter_s: float, rl_s: float, built: bool) -> str:
    """What the run's seconds went to: the one-off warm-up (cached for later runs) and RL."""
    first = f"{starter_s:.0f} s supervised warm-up (once; cached for later runs)" if built \
        else f"{starter_s:.0f} s loading the cached starter model"
    return f"{first}, {rl_s:.0f} s GRPO and validation"


def starter_model(args, log=print) -> Path:
    """The cached warmed-up model dir; built (tokenizer, model, warm-up) on first use."""
    out = starter_dir(args)
    if starter_is_cached(args):
        log(f"starter model: {out} (cached)")
        return out
    log(f"building the starter model ({args.model_params / 1e6:.1f}M-parameter Qwen2, supervised warm-up "
        f"to {args.warmup_target:.2f} greedy accuracy) ...")
    t0 = time.time()
    tokenizer = train_tokenizer()
    tokenizer.chat_template = PROMPT_TEMPLATE
    sft_rows, dev_rows = warmup_rows(args.train_size, args.seed)
    best = None
    for attempt in range(WARMUP_ATTEMPTS):
        init_seed = args.seed + RESTART_SEED_STRIDE * attempt  # attempt 0: the seed itself
        model = build_model(tokenizer, "qwen2", n_params=args.model_params, seed=init_seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            acc, steps = warm_up(model, tokenizer, sft_rows, dev_rows, target=args.warmup_target,
                                 seed=init_seed, log=log)
        if best is None or acc > best[1]:
            best = (model, acc, steps, attempt)
        if acc >= args.warmup_target / 2:  # reached, or partly right: RL has groups with right and wrong answers
            break
        if attempt + 1 < WARMUP_ATTEMPTS:
            log(f"  warm-up stalled at dev accuracy {acc:.3f} after {steps} steps; restarting from a fresh "
                f"initialisation (seed {args.seed + RESTART_SEED_STRIDE * (attempt + 1)}, attempt {attempt + 2} of "
                f"{WARMUP_ATTEMPTS})")
    model, acc, steps, attempt = best
    save_pretrained_atomic(out, model, tokenizer, {"warmup.json": json.dumps(
        {"dev_acc": acc, "steps": steps, "attempt": attempt + 1, "seconds": time.time() - t0})})
    log(f"starter model ready in {time.time() - t0:.0f} s (dev accuracy {acc:.3f} after {steps} steps"
        f"{'' if attempt == 0 else f' of attempt {attempt + 1}'}): {out}")
    return out


# ------------------------------------------------------------------------------------------ RL
def rl_overrides(model_dir: Path, data_dir: Path, run_dir: Path, args) -> list[str]:
    """The demo's RL config (verl keys); user overrides are appended after these."""
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files=[{data_dir / 'train.parquet'}]",
        f"data.val_files=[{data_dir / 'test.parquet'}]",
        "data.max_prompt_length=16", "data.max_response_length=6", "data.train_batch_size=32",
        "data.apply_chat_template=true",  # the starter's own template: PROMPT_TEMPLATE
        f"data.seed={args.seed}",
        "algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=1",  # one generation round: train on the groups that pass
        "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=float32",  # a 2M model is overhead-bound: bf16 buys nothing
        "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
        # a 10-step lr warmup: Adam's first steps move every weight by ~lr whatever the gradient's noise
        "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0.0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.overwrite=true", f"trainer.seed={args.seed}",
        f"trainer.num_threads={args.threads}", f"trainer.default_local_dir={run_dir}",
        "trainer.project_name=tiller", "trainer.experiment_name=demo",
    ]


def plot_curves(metrics_path: Path, out_png: Path, val_key: str = VAL_KEY) -> Path | None:
    """Reward and held-out accuracy curves as one PNG (`demo_report.plot_curves`, the arithmetic task's key)."""
    return demo_report.plot_curves(metrics_path, out_png, val_key)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tiller demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("arithmetic", "shapes"), default="arithmetic",
                        help="arithmetic (text, the default) or shapes (a tiny vision-language model counts red "
                             "squares; see tiller/trainer/demo_shapes.py)")
    parser.add_argument("--out", default=None, help="run directory (default: runs/demo, runs/demo-shapes)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: 150 arithmetic, 250 shapes)")
    parser.add_argument("--test-freq", type=int, default=25, help="validate every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a busy 2-core machine a second thread mostly spin-waits)")
    parser.add_argument("--model-params", type=int, default=2_000_000)
    parser.add_argument("--warmup-target", type=float, default=None, help="default: 0.4 arithmetic, 0.45 shapes")
    parser.add_argument("--train-size", type=int, default=None, help="default: 4000 arithmetic, 2000 shapes")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached starter model")
    parser.add_argument("--warmup-max-steps", type=int, default=1500, help="shapes: most supervised warm-up steps")
    parser.add_argument("--val-size", type=int, default=256, help="shapes: held-out images")
    parser.add_argument("--model-type", choices=("qwen2_vl", "qwen3_vl", "qwen3_5", "glm4v", "glm4v_moe"), default=None,
                        help="shapes: the tiny vision-language model's family (default qwen2_vl; qwen3_vl: patch 16, "
                             "deepstack, Qwen3 language model; qwen3_5: Qwen3.5's Gated DeltaNet + attention layers; "
                             "glm4v: GLM-4.1V, patch 14, GLM-4's language model; glm4v_moe: GLM-4.5V, experts)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="RL config overrides (verl keys)")
    args = parser.parse_args(argv)
    shapes = args.task == "shapes"
    if args.model_type is not None and not shapes:
        parser.error("--model-type picks the tiny vision-language model of --task shapes")
    args.model_type = args.model_type or "qwen2_vl"
    defaults = dict(out="runs/demo-shapes" if shapes else "runs/demo", steps=250 if shapes else 150,
                    warmup_target=0.45 if shapes else 0.4, train_size=2000 if shapes else 4000)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if shapes:
        from tiller.trainer.demo_shapes import run_shapes_demo  # import cost: the vision-language path, this task only

        return run_shapes_demo(args, cache_root())
    return run_demo(args)


def run_demo(args) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bars between the demo's own lines
    t0 = time.time()
    torch.set_num_threads(args.threads)
    run_dir = Path(args.out).expanduser().resolve()
    data_dir = run_dir / "data"
    # every key is checked before any work: a typo must not wait for the warm-up (paths are not opened here)
    overrides = list(args.overrides)
    load_config(rl_overrides(starter_dir(args), data_dir, run_dir, args) + overrides)
    warmup_rows(args.train_size, args.seed, n_rows=0)  # --train-size checked too
    built = not starter_is_cached(args)
    model_dir = starter_model(args)
    t_warm = time.time() - t0
    arithmetic.write_task(data_dir, n_train=args.train_size, n_test=256, seed=args.seed)
    cfg = load_config(rl_overrides(model_dir, data_dir, run_dir, args) + overrides)
    print(f"GRPO: {args.steps} steps x {cfg.data.train_batch_size} prompts x n={cfg.actor_rollout_ref.rollout.n}; "
          f"run dir {run_dir}")
    summary = train_and_report(cfg, run_dir, VAL_KEY, t0=t0, warmup_s=t_warm,
                               fields={"val_prompts": 256, "starter_model": str(model_dir), "seed": args.seed,
                                       "threads": args.threads})
    acc_before, acc_after, wall = summary["val_acc_before"], summary["val_acc_after"], summary["wall_s"]
    print(f"held-out accuracy (256 prompts, greedy): before RL {acc_before:.3f} -> after RL {acc_after:.3f} "
          f"({acc_after - acc_before:+.3f}) in {wall:.0f} s: {_time_split(t_warm, wall - t_warm, built)}")
    print(f"run dir: {run_dir} (summary.json, metrics.jsonl, tensorboard/, plots/demo_curves.png)")
    return 0


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main)
