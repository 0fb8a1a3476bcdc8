"""`tiller train-partitioner` and `reward_model.diversity.partitioner=classifier`: the cross-encoder pair
encoding, NoveltyBench's greedy classes against representatives, a tiny BERT that learns "same number" on a
synthetic pair set (slow lane), and bad input that exits 2 naming the flag or key."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiller.cli import main as cli
from tiller.config.schema import DiversityConfig, RLConfig
from tiller.config.validate import validate_rl as validate
from tiller.errors import ConfigError
from tiller.rewards.diversity import ClassifierPartitioner, build_partitioner
from tiller.rewards.pair_classifier import encode_pairs
from tiller.trainer.partitioner import METRICS_FILE, synthetic_pairs


def _tiny_encoder(path, corpus, seed=0):
    from tiller.models.tiny import build_encoder_classifier, train_tokenizer

    tok = train_tokenizer(corpus=corpus, vocab_size=280)
    model = build_encoder_classifier(tok, hidden_size=64, num_layers=2, seed=seed)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pair_encoding_is_cls_a_sep_b_sep_with_segment_ids(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tiny_encoder(tmp_path / "enc", ["answer 07", "answer 7.0"] * 5))
    batch = encode_pairs(tok, ["answer 07", "x"], ["answer 7.0", "answer 3"], max_length=3)
    first = tok.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    # "answer 07" -> answer, Ġ, 0, 7 cut to 3 tokens; "answer 7.0" -> answer, Ġ, 7
    assert first == ["[CLS]", "answer", "Ġ", "0", "[SEP]", "answer", "Ġ", "7", "[SEP]"]
    assert batch["token_type_ids"][0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    # [CLS] x [SEP] answer Ġ 3 [SEP]: 7 tokens, right padded to 9
    assert batch["attention_mask"][1].tolist() == [1] * 7 + [0, 0]


class _Scripted:
    """Stands in for PairClassifier: P(same) = 0.9 when the texts end in the same word, else 0.1."""

    def __init__(self):
        self.pairs = []

    def prob_same(self, a, b):
        self.pairs += list(zip(a, b))
        return np.array([0.9 if x.split()[-1] == y.split()[-1] else 0.1 for x, y in zip(a, b)])


def test_classifier_partition_is_greedy_against_representatives():
    part = ClassifierPartitioner.__new__(ClassifierPartitioner)
    part.short_answer_tokens, part.count_tokens = 0, lambda t: len(t.split())
    part.classifier, part.threshold = _Scripted(), 0.5
    texts = ["so it is seven", "we get nine", "the result is seven", "again nine", "and then two"]
    assert part.partition(texts) == [0, 1, 0, 1, 2]
    # each text is asked only against the first member of each class, never against later members
    assert part.classifier.pairs == [
        ("so it is seven", "we get nine"),
        ("so it is seven", "the result is seven"), ("we get nine", "the result is seven"),
        ("so it is seven", "again nine"), ("we get nine", "again nine"),
        ("so it is seven", "and then two"), ("we get nine", "and then two")]
    # the classes of the first k texts are the first k labels (what distinct@k over prefixes relies on)
    assert part.greedy_partition(texts[:3]) == [0, 1, 0]


def test_greedy_partition_differs_from_union_find_on_a_non_transitive_chain():
    from tiller.rewards.diversity import NgramPartitioner

    # unigram Jaccard: x~y 0.6, y~z 0.6, x vs z 2/6: union-find joins all three through y; greedy keeps z apart
    # (z is compared with the representative x only)
    x, y, z = "a b c d", "b c d e", "c d e f"
    ngram = NgramPartitioner(1, 0.5, short_answer_tokens=0)
    assert ngram.partition([x, y, z]) == [0, 0, 0]
    assert ngram.greedy_partition([x, y, z]) == [0, 0, 1]


def test_bad_partitioner_keys_name_the_key(tmp_path):
    def check(message, **div):
        cfg = RLConfig()
        cfg.reward_model.diversity = DiversityConfig(**div)
        with pytest.raises(ConfigError, match=message):
            validate(cfg)

    check("reward_model.diversity.classifier_path=DIR", enable=True, partitioner="classifier")
    check("classifier_path=http://host:8000 is a served classifier: set reward_model.diversity.classifier_tokenizer",
          partitioner="classifier", classifier_path="http://host:8000")
    check("classifier_tokenizer is only used with a served classifier_path", partitioner="classifier",
          classifier_path="x", classifier_tokenizer="y")
    check("classifier_model is set but reward_model.diversity.partitioner=ngram", classifier_model="m")
    check(r"reward_model.diversity.threshold=1.5", partitioner="classifier", classifier_path="x", threshold=1.5)
    check("classifier_path is set but reward_model.diversity.partitioner=ngram", classifier_path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"classifier_path=.*not a model dir"):
        build_partitioner(DiversityConfig(partitioner="classifier", classifier_path=str(tmp_path)))


def _classify_app():
    """vLLM's /classify as DARLING calls it: probs [P(different), P(same)] per input; same when both segments end
    in the same number."""
    import re

    from fastapi import FastAPI

    app = FastAPI()
    app.state.bodies = []

    @app.post("/classify")
    def classify(body: dict) -> dict:
        app.state.bodies.append(body)
        rows = []
        for text in body["input"]:
            a, b = text.split("[SEP]")[:2]
            same = re.findall(r"\d+", a)[-1] == re.findall(r"\d+", b)[-1]
            rows.append({"index": len(rows), "label": "same" if same else "different",
                         "probs": [0.2, 0.8] if same else [0.9, 0.1], "num_classes": 2})
        return {"id": "x", "object": "list", "model": body["model"], "data": rows}

    return app


def test_served_classifier_as_darling_calls_it(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewards"))
    from test_rewards_remote import serve

    enc = _tiny_encoder(tmp_path / "enc", ["answer 1", "answer 2"] * 5)
    app = _classify_app()
    with serve(app) as url:
        cfg = DiversityConfig(partitioner="classifier", classifier_path=url.replace("/score", ""),
                              classifier_tokenizer=str(enc), classifier_model="similarity_gpu_0", short_answer_tokens=0)
        part = build_partitioner(cfg)
        assert part.partition(["so it is 7", "we get 9", "the result is 7", "9 again"]) == [0, 1, 0, 1]
    first = app.state.bodies[0]
    assert first == {"model": "similarity_gpu_0", "input": ["[CLS] so it is 7 [SEP] we get 9 [SEP]"]}
    assert [len(b["input"]) for b in app.state.bodies] == [1, 2, 2]  # each text against every representative


def test_train_partitioner_bad_input_exits_2_naming_the_flag(tmp_path, capsys):
    enc = _tiny_encoder(tmp_path / "enc", ["answer 1", "answer 2"] * 5)
    good = _write(tmp_path / "good.jsonl", synthetic_pairs(20, sentences=False, max_value=4))
    cases = [
        (["--data", str(tmp_path / "missing.jsonl")], "--data"),
        (["--data", str(_write(tmp_path / "b1.jsonl", [{"a": "x", "b": "y", "same": "yes"}]))], "'same'"),
        (["--data", str(_write(tmp_path / "b2.jsonl", [{"a": "x", "same": True}]))], "'b' must be a string"),
        (["--data", str(good), "--epochs", "0"], "--epochs=0"),
        (["--data", str(good), "--val-fraction", "1.5"], "--val-fraction=1.5"),
        (["--data", str(good), "--lr", "-1"], "--lr=-1"),
        (["--data", str(_write(tmp_path / "one.jsonl", [{"a": "x y", "b": "x z", "same": True}] * 10))],
         "no 'different' example"),
    ]
    for args, needle in cases:
        code = cli(["train-partitioner", *args, "--model", str(enc), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert needle in err, (args, err)
    assert cli(["train-partitioner", "--data", str(good)]) == 2
    assert "--out is required" in capsys.readouterr().err
    assert cli(["train-partitioner", "--data", str(good), "--out", str(tmp_path / "o"), "--model",
                str(tmp_path)]) == 2
    assert "--model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 0.17M-parameter BERT trained by the CLI on 600 synthetic pairs (values 1..4, four surface forms)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("partitioner")
    rows = synthetic_pairs(600, seed=0, max_value=4, sentences=False)
    data = _write(tmp / "pairs.jsonl", rows)
    enc = _tiny_encoder(tmp / "enc", [r["a"] for r in rows] + [r["b"] for r in rows])
    out = tmp / "clf"
    assert cli(["train-partitioner", "--data", str(data), "--model", str(enc), "--out", str(out), "--epochs", "10",
                "--lr", "1e-3", "--batch-size", "32", "--max-length", "16", "--val-fraction", "0.2"]) == 0
    return out


@pytest.mark.slow
def test_tiny_classifier_learns_same_number(trained):
    metrics = json.loads((trained / METRICS_FILE).read_text())
    # balanced labels: chance is ~0.5 (the majority-label rate of the 120 held-out pairs)
    assert metrics["val"]["majority_rate"] < 0.6
    assert metrics["val_before"]["accuracy"] < 0.65
    assert metrics["val"]["accuracy"] >= 0.85, metrics["history"]
    assert metrics["train_loss_last_epoch"] < 0.5 * metrics["train_loss_first_step"]
    assert metrics["num_train_pairs"] == 480 and metrics["num_val_pairs"] == 120
    assert sorted(p.name for p in trained.parent.iterdir() if p.name.startswith(".")) == []  # no temp dir left


@pytest.mark.slow
def test_classifier_partitioner_groups_by_number(trained):
    cfg = DiversityConfig(partitioner="classifier", classifier_path=str(trained), short_answer_tokens=0)
    part = build_partitioner(cfg)
    texts = ["answer 2", "answer +2", "answer (3)", "answer 2.0", "answer 1", "answer 3.0", "answer (1)"]
    assert part.partition(texts) == [0, 0, 1, 0, 2, 1, 2]


@pytest.mark.slow
def test_classifier_partitioner_in_the_darling_reward(trained):
    """reward_model.diversity.enable with partitioner=classifier through build_reward_manager: one group of 4,
    classes {2, +2} {(3)} {1}: Div = (n - |class|) / (n - 1) = 2/3, 2/3, 1, 1; multiplicative fusion with the
    arithmetic score (ground truth 2: 1, 1, 0, 0) gives 2/3, 2/3, 0, 0."""
    from tiller.rewards import RewardRequest, build_reward_manager

    cfg = RLConfig()
    cfg.reward_model.diversity = DiversityConfig(enable=True, partitioner="classifier", classifier_path=str(trained),
                                                 short_answer_tokens=0)
    validate(cfg)
    reward = build_reward_manager(cfg)
    texts = ["answer 2", "answer +2", "answer (3)", "answer 1"]
    result = reward([RewardRequest("tiller/arithmetic", "1+1=", t, "2", {}, 2, "g0") for t in texts])
    assert np.allclose(result.extras["diversity"], [2 / 3, 2 / 3, 1, 1])
    assert np.allclose(result.scores, [2 / 3, 2 / 3, 0, 0])
