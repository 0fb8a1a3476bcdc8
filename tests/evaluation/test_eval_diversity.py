"""NoveltyBench's distinct@k and utility@k: worked numbers on hand-made partitions, the per-source aggregation,
`tiller eval --diversity` with scripted answers (exact classes, hand-computed values) and end to end on the tiny
model (ngram default and a classifier dir)."""

from __future__ import annotations

import json

import pytest

from tests.evaluation.test_eval_cli import ScriptedEngine
from tiller.cli import main as cli
from tiller.evaluation.metrics import distinct_k, evaluation_metrics, utility_k

FAST = ["actor_rollout_ref.rollout.dtype=float32", "data.max_response_length=6"]


def test_distinct_k_counts_classes_of_the_first_k():
    labels = [0, 0, 1, 0, 2, 1]
    assert [distinct_k(labels, k) for k in range(1, 7)] == [1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError):
        distinct_k(labels, 7)


def test_utility_k_worked_numbers():
    # classes 0 0 1 2, quality 5 9 3 7, p = 0.8: the first members are samples 1, 3, 4 (sample 2 repeats class 0)
    # sum = 5 * 1 + 3 * 0.64 + 7 * 0.512 = 5 + 1.92 + 3.584 = 10.504
    # weights 1 + 0.8 + 0.64 + 0.512 = 2.952 = (1 - 0.8^4) / (1 - 0.8)   ->  10.504 / 2.952 = 3.558266...
    assert utility_k([0, 0, 1, 2], [5, 9, 3, 7], 4, 0.8) == pytest.approx(10.504 / 2.952)
    # k = 2: only sample 1 counts: 5 / 1.8
    assert utility_k([0, 0, 1, 2], [5, 9, 3, 7], 2, 0.8) == pytest.approx(5 / 1.8)
    # all distinct and equal quality q: the weighted mean of q is q
    assert utility_k([0, 1, 2], [6, 6, 6], 3) == pytest.approx(6.0)
    # one class: only the first sample counts: u_1 (1 - p) / (1 - p^k) = 10 * 0.2 / (1 - 0.512) = 4.0984
    assert utility_k([0, 0, 0], [10, 10, 10], 3) == pytest.approx(10 * 0.2 / 0.488)
    # NoveltyBench's own form: np.average(generation_scores, weights=p ** arange(k))
    import numpy as np

    assert utility_k([0, 1, 0, 2], [4, 2, 8, 1], 4) == pytest.approx(
        np.average([4, 2, 0, 1], weights=0.8 ** np.arange(4)))
    with pytest.raises(ValueError):
        utility_k([0], [1.0], 1, patience=0.0)


def test_evaluation_metrics_add_distinct_and_utility_per_source():
    def rec(src, p, j, cls, score):
        return {"data_source": src, "prompt_index": p, "sample_index": j, "class": cls, "score": score,
                "acc": float(score > 0.5), "pred": None}

    records = [rec("a", 0, 0, 0, 1.0), rec("a", 0, 1, 1, 0.0),  # 2 classes: utility@2 = (1 + 0) / 1.8
               rec("a", 1, 1, 0, 1.0), rec("a", 1, 0, 0, 0.5),  # out of order: sample 0 first, same class
               rec("b", 0, 0, 0, 2.0), rec("b", 0, 1, 1, 3.0)]
    m = evaluation_metrics(records, patience=0.8)
    assert m["a"]["distinct@1"] == 1.0 and m["a"]["distinct@2"] == pytest.approx(1.5)
    # prompt 1 in sample order: scores 0.5 then 1.0 in one class -> 0.5 / 1.8
    assert m["a"]["utility@2"] == pytest.approx((1 / 1.8 + 0.5 / 1.8) / 2)
    assert m["a"]["utility@1"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["b"]["utility@2"] == pytest.approx((2 + 0.8 * 3) / 1.8) and m["b"]["distinct@2"] == 2.0
    no_classes = evaluation_metrics([{k: v for k, v in r.items() if k != "class"} for r in records])
    assert not any(k.startswith(("distinct@", "utility@")) for k in no_classes["a"])


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as fh:
        for a, b in [(1, 2), (3, 4), (5, 5)]:
            fh.write(json.dumps({"data_source": "tiller/arithmetic",
                                 "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                                 "reward_model": {"style": "rule", "ground_truth": str(a + b)}}) + "\n")
    return path


def test_eval_diversity_with_scripted_answers(tiny_model_dir, prompt_file, monkeypatch):
    """n = 4 scripted answers per prompt, exact-text classes, arithmetic score 1 / 0, p = 0.8 (W4 = 2.952):
    1+2: 3 3 0 0 -> classes 0 0 1 1, scores 1 1 0 0: distinct@4 2, utility@4 = 1 / 2.952
    3+4: 7 1 1 2 -> classes 0 1 1 2, scores 1 0 0 0: distinct@4 3, utility@4 = 1 / 2.952
    5+5: 0 0 0 0 -> one class, scores 0:             distinct@4 1, utility@4 = 0
    distinct@4 = 6 / 3 = 2; utility@4 = (2 / 2.952) / 3
    distinct@2 = (1 + 2 + 1) / 3; utility@2 = (1 / 1.8 + 1 / 1.8 + 0) / 3
    """
    import tiller.evaluation.runner as runner
    from tiller.config import load_config
    from tiller.evaluation.evaluate import run_eval
    from tiller.models.loading import load_tokenizer

    answers = {"1+2": ["3", "3", "0", "0"], "3+4": ["7", "1", "1", "2"], "5+5": ["0"] * 4}
    tok = load_tokenizer(tiny_model_dir, padding_side="left")

    def script(question, j):
        key = next(k for k in answers if k in question)
        return f"{key}={answers[key][j]}"

    import tiller.evaluation.evaluate as evaluate

    monkeypatch.setattr(evaluate, "policy_from_config",
                        lambda cfg: runner.Policy(ScriptedEngine(tok, script), tok, str(tiny_model_dir)))
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.val_files=[{prompt_file}]",
                       "actor_rollout_ref.rollout.val_kwargs.n=4", "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
                       "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
                       "reward_model.diversity.partitioner=exact", "reward_model.diversity.short_answer_tokens=0"])
    report, records = run_eval(cfg, progress=False, diversity=True)
    m = report["metrics"]["tiller/arithmetic"]
    assert [r["class"] for r in records] == [0, 0, 1, 1, 0, 1, 1, 2, 0, 0, 0, 0]
    assert m["distinct@4"] == pytest.approx(2.0) and m["distinct@2"] == pytest.approx(4 / 3)
    assert m["distinct@1"] == 1.0
    assert m["utility@4"] == pytest.approx(2 / 2.952 / 3)
    assert m["utility@2"] == pytest.approx(2 / 1.8 / 3)
    assert report["diversity"]["partitioner"] == "exact" and report["diversity"]["patience"] == 0.8


def test_eval_diversity_cli_on_the_tiny_model(tiny_model_dir, prompt_file, tmp_path, capsys):
    from tiller.models.tiny import build_encoder_classifier, train_tokenizer

    base = ["eval", "--model", str(tiny_model_dir), "--data", str(prompt_file), "--no-progress", "--diversity",
            "actor_rollout_ref.rollout.val_kwargs.n=4", "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
                       "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", *FAST]
    out = tmp_path / "eval.json"
    assert cli([*base, "--out", str(out)]) == 0  # ngram, the default partitioner
    m = json.loads(out.read_text())["metrics"]["tiller/arithmetic"]
    for k in (1, 2, 4):
        assert 1.0 <= m[f"distinct@{k}"] <= k
        assert 0.0 <= m[f"utility@{k}"] <= 1.0  # 0/1 scores: a weighted mean of a subset of them
    assert m["distinct@1"] == 1.0 and m["distinct@2"] <= m["distinct@4"]
    assert "distinct@4" in capsys.readouterr().out  # in the table

    clf = tmp_path / "clf"  # an untrained classifier dir: the plumbing, not the quality
    tok = train_tokenizer(corpus=["1+2=3", "3+4=7"] * 5, vocab_size=280)
    model = build_encoder_classifier(tok)
    model.save_pretrained(clf)
    tok.save_pretrained(clf)
    out2 = tmp_path / "eval2.json"
    assert cli([*base, "--out", str(out2), "reward_model.diversity.partitioner=classifier",
                f"reward_model.diversity.classifier_path={clf}"]) == 0
    report = json.loads(out2.read_text())
    assert report["diversity"]["partitioner"] == "classifier"
    assert 1.0 <= report["metrics"]["tiller/arithmetic"]["distinct@4"] <= 4

    assert cli([*base, "--patience", "0"]) == 2
    assert "--patience=0.0" in capsys.readouterr().err
    assert cli([*base, "reward_model.diversity.partitioner=classifier"]) == 2
    assert "reward_model.diversity.classifier_path" in capsys.readouterr().err
