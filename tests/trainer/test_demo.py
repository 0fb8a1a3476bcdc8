"""`tiller demo`: the pieces (warm-up, accuracy, plot) fast; the whole command end to end (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from tiller.tasks import arithmetic
from tiller.trainer import demo


def test_sft_batch_masks_the_prompt():
    # two examples: prompt lengths 2 and 1; labels are -100 on prompt and padding, the token ids elsewhere
    ids, mask, labels = demo._sft_batch([([5, 6, 7, 8], 2), ([9, 10], 1)], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert labels.tolist() == [[-100, -100, 7, 8], [-100, 10, -100, -100]]


def test_warm_up_lowers_the_loss_and_accuracy_is_scored(tiny_model_dir):
    from tiller.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_model_dir, padding_side="left")
    model = load_causal_lm(tiny_model_dir)
    train, test = arithmetic.make_splits(64, 8, seed=0)
    examples = demo._encode_sft(tok, train[:16])
    ids, mask, labels = demo._sft_batch(examples, tok.pad_token_id)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    acc, steps = demo.warm_up(model, tok, train[:16], test, target=2.0, seed=0, lr=3e-3, batch_size=16,
                              eval_every=10, max_steps=20, log=lambda s: None)
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    assert steps == 20 and 0.0 <= acc <= 1.0
    assert after < before - 0.5
    assert 0.0 <= demo.greedy_accuracy(model, tok, test) <= 1.0


def test_a_stalled_warm_up_restarts_from_a_fresh_initialisation(tmp_path, monkeypatch):
    """Below half the target at max_steps: the warm-up restarts with init seed + 1000 (at most WARMUP_ATTEMPTS), the
    first attempt that reaches half the target is kept (or the best of all), and warmup.json says which."""
    import argparse

    monkeypatch.setenv("TILLER_CACHE", str(tmp_path / "cache"))
    seen = []

    def fake_warm_up(model, tokenizer, train_rows, dev_rows, *, target, seed, log):
        seen.append((seed, float(next(model.parameters()).detach().sum())))
        return {0: 0.07, 1000: 0.45}.get(seed, 0.1), 1500 if seed == 0 else 600

    monkeypatch.setattr(demo, "warm_up", fake_warm_up)
    args = argparse.Namespace(seed=0, model_params=100_000, warmup_target=0.4, train_size=2048, rebuild=False)
    lines = []
    out = demo.starter_model(args, log=lines.append)
    assert [s for s, _ in seen] == [0, 1000] and seen[0][1] != seen[1][1]  # a fresh initialisation
    assert json.loads((out / "warmup.json").read_text())["attempt"] == 2
    assert any("restarting from a fresh initialisation (seed 1000, attempt 2 of 3)" in line for line in lines)
    # never reaching the target: every attempt runs and the best starter is kept
    seen.clear()
    monkeypatch.setattr(demo, "warm_up", lambda *a, seed, **k: (seen.append((seed, 0)) or ({2000: 0.15}.get(seed, 0.1),
                                                                                            1500)))
    out = demo.starter_model(argparse.Namespace(**{**vars(args), "rebuild": True}), log=lines.append)
    assert [s for s, _ in seen] == [0, 1000, 2000]
    assert json.loads((out / "warmup.json").read_text())["dev_acc"] == 0.15
    # partly right (>= half the target) at max_steps: kept, no restart
    seen.clear()
    monkeypatch.setattr(demo, "warm_up", lambda *a, seed, **k: (seen.append((seed, 0)) or (0.34, 1500)))
    demo.starter_model(argparse.Namespace(**{**vars(args), "rebuild": True}), log=lines.append)
    assert [s for s, _ in seen] == [0]


def test_plot_curves_writes_a_png(tmp_path):
    key = demo.VAL_KEY
    rows = [{"step": 0, key: 0.3}] + [{"step": s, "critic/score/mean": 0.1 * s} for s in range(1, 5)]
    rows[-1][key] = 0.6
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = demo.plot_curves(tmp_path / "metrics.jsonl", tmp_path / "plots" / "demo_curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_demo_command_end_to_end(tmp_path, monkeypatch):
    from tiller.cli import main

    monkeypatch.setenv("TILLER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["demo", "--out", str(out), "--steps", "2", "--test-freq", "1",
                 "--model-params", "1000000", "--warmup-target", "0.0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("val_acc_before", "val_acc_after", "wall_s"):
        assert key in summary
    assert 0.0 <= summary["val_acc_before"] <= 1.0 and summary["rl_steps"] == 2
    assert (out / "metrics.jsonl").exists() and any((out / "tensorboard").iterdir())
    assert (out / "plots" / "demo_curves.png").exists()
    # the starter model is cached: a second run does not warm up again
    assert main(["demo", "--out", str(tmp_path / "run2"), "--steps", "1", "--model-params", "1000000",
                 "--warmup-target", "0.0"]) == 0
    assert len(list((tmp_path / "cache" / "demo").glob("starter-*"))) == 1


def test_warm_up_rows_are_neither_rl_prompts_nor_held_out():
    # the demo's RL data is make_splits(train_size, 256, seed); the warm-up learns from other additions
    rl_train, held_out = arithmetic.make_splits(n_train=4000, n_test=256, seed=3)
    sft_rows, dev_rows = demo.warmup_rows(4000, seed=3, n_rows=5000)
    pair = lambda r: (r["extra_info"]["a"], r["extra_info"]["b"])  # noqa: E731
    rl, held, sft, dev = ({pair(r) for r in rows} for rows in (rl_train, held_out, sft_rows, dev_rows))
    assert len(sft_rows) == 5000 and len(dev) == 128
    assert not (sft | dev) & (rl | held)
    assert all(10 <= a <= 99 and 10 <= b <= 99 for a, b in dev)  # dev measures the RL task
    digits = {len(str(a)) for a, _ in sft}
    assert digits == {1, 2, 3}  # operands of 1 to 3 digits: carrying in general, nothing to memorise
    assert all(r["reward_model"]["ground_truth"] == str(sum(pair(r))) for r in sft_rows[:50])
    assert demo.warmup_rows(4000, seed=3, n_rows=50)[0] == sft_rows[:50]  # seeded
    with pytest.raises(demo.UserError, match="--train-size 7800"):
        demo.warmup_rows(7800, seed=0)
