"""RL prompt data: verl schema from parquet and jsonl, truncation, filtering, errors, the resumable sampler."""

from __future__ import annotations

import json

import pytest

from tiller.data.preprocess import gsm8k
from tiller.data.rl_dataset import PromptSampler, RLDataset, read_rows, write_rows
from tiller.errors import ConfigError, DataError
from tiller.tasks import arithmetic


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from tiller.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_dir, padding_side="left")


def _row(content="1+2=", gt="3", source="tiller/arithmetic"):
    return {"data_source": source, "prompt": [{"role": "user", "content": content}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": {"i": 1}}


def test_parquet_and_jsonl_give_the_same_prompts(tmp_path, tokenizer):
    rows = [_row(f"{a}+{a}=", str(2 * a)) for a in range(5)]
    pq_ds = RLDataset([write_rows(rows, tmp_path / "d.parquet")], tokenizer)
    js_ds = RLDataset([write_rows(rows, tmp_path / "d.jsonl")], tokenizer)
    assert len(pq_ds) == len(js_ds) == 5
    for a, b in zip(pq_ds.items, js_ds.items):
        assert a.prompt_ids == b.prompt_ids and a.ground_truth == b.ground_truth == b.ground_truth
    item = pq_ds[3]
    # chat template applied with the generation prompt, then tokenized without extra specials
    assert item.prompt_text == "<|im_start|>user\n3+3=<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(item.prompt_ids) == item.prompt_text
    assert item.ground_truth == "6" and item.data_source == "tiller/arithmetic" and item.extra_info == {"i": 1}


def test_plain_string_prompt_and_top_level_ground_truth(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"data_source": "x", "question": "hi", "ground_truth": 7}) + "\n")
    ds = RLDataset([path], tokenizer, prompt_key="question", apply_chat_template=False)
    assert ds[0].prompt_text == "hi" and ds[0].ground_truth == 7


def test_truncation_modes(tmp_path, tokenizer):
    path = write_rows([_row("1234567890" * 3)], tmp_path / "d.parquet")
    full = RLDataset([path], tokenizer, max_prompt_length=1000)[0].prompt_ids
    n = 10
    left = RLDataset([path], tokenizer, max_prompt_length=n, truncation="left")[0].prompt_ids
    right = RLDataset([path], tokenizer, max_prompt_length=n, truncation="right")[0].prompt_ids
    middle = RLDataset([path], tokenizer, max_prompt_length=n, truncation="middle")[0].prompt_ids
    assert left == full[-n:] and right == full[:n] and middle == full[:5] + full[-5:]
    with pytest.raises(DataError, match=r"d\.parquet row 0.*max_prompt_length=10"):
        RLDataset([path], tokenizer, max_prompt_length=n, truncation="error")


def test_filter_overlong_counts_and_all_filtered_is_an_error(tmp_path, tokenizer):
    path = write_rows([_row("1+1="), _row("1234567890" * 5)], tmp_path / "d.parquet")
    ds = RLDataset([path], tokenizer, max_prompt_length=20, filter_overlong_prompts=True)
    assert len(ds) == 1 and ds.num_filtered == 1
    with pytest.raises(DataError, match="no prompts left.*all 2 prompts are longer"):
        RLDataset([path], tokenizer, max_prompt_length=3, filter_overlong_prompts=True)


def test_bad_files(tmp_path, tokenizer):
    with pytest.raises(DataError, match="not found"):
        RLDataset([tmp_path / "missing.parquet"], tokenizer)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no rows"):
        RLDataset([empty], tokenizer)
    nocol = write_rows([{"data_source": "x", "question": "q"}], tmp_path / "nocol.parquet")
    with pytest.raises(DataError, match="missing column 'prompt'.*question"):
        RLDataset([nocol], tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        read_rows(bad)
    with pytest.raises(DataError, match="unsupported"):
        read_rows(tmp_path / "x.csv") if (tmp_path / "x.csv").write_text("a") else None
    with pytest.raises(ConfigError, match="data.train_files is empty"):
        RLDataset([], tokenizer)


def test_sampler_seeded_whole_batches_and_resumable():
    a = PromptSampler(10, 3, shuffle=True, seed=5)
    seq = [a.next_batch() for _ in range(7)]  # 3 batches per epoch (the 10th prompt is dropped)
    assert all(len(b) == 3 for b in seq)
    assert sorted(sum(seq[:3], [])) == sorted(set(sum(seq[:3], [])))  # no repeats inside an epoch
    assert a.epoch == 2
    b = PromptSampler(10, 3, shuffle=True, seed=5)
    for _ in range(4):
        b.next_batch()
    c = PromptSampler(10, 3, shuffle=True, seed=5)
    c.load_state_dict(b.state_dict())
    assert [c.next_batch() for _ in range(3)] == seq[4:]
    assert PromptSampler(10, 3, shuffle=False).next_batch() == [0, 1, 2]
    assert PromptSampler(10, 3, seed=6).next_batch() != seq[0] or PromptSampler(10, 3, seed=7).next_batch() != seq[0]
    with pytest.raises(ConfigError, match="train_batch_size=11"):
        PromptSampler(10, 11)


def test_gsm8k_conversion_matches_verl(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    row = {"question": "Tom has 3 apples and buys 1,000 more. How many?", "answer": "3+1000=1003\n#### 1,003"}
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    paths = gsm8k.convert(src, tmp_path / "out")
    rows = read_rows(paths["test"])
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["ability"] == "math"
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "1003"}
    assert rows[0]["prompt"][0]["content"].endswith('Let\'s think step by step and output the final answer after "####".')
    (src / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(DataError, match="row 0"):
        gsm8k.convert(src, tmp_path / "out2")


def test_gsm8k_without_src_loads_the_dataset_by_name(tmp_path, monkeypatch, capsys):
    # no --src: openai/gsm8k through datasets.load_dataset (a stand-in module here: no hub in tests)
    import sys
    import types

    from tiller.cli import main

    row = {"question": "Tom has 2 apples and buys 3 more. How many?", "answer": "2+3=5\n#### 5"}
    calls = []

    def load_dataset(name, config):
        calls.append((name, config))
        return {"train": [row, row], "test": [row]}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert main(["data", "gsm8k", "--out", str(tmp_path / "g")]) == 0
    assert calls == [("openai/gsm8k", "main")]
    assert len(read_rows(tmp_path / "g" / "train.parquet")) == 2
    assert read_rows(tmp_path / "g" / "test.parquet")[0]["reward_model"]["ground_truth"] == "5"

    def offline(name, config):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    assert main(["data", "gsm8k", "--out", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err
    assert "openai/gsm8k" in err and "--src" in err and "Traceback" not in err
    assert not (tmp_path / "h").exists()
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: import raises ImportError
    assert main(["data", "gsm8k", "--out", str(tmp_path / "i")]) == 2
    assert "pip install datasets" in capsys.readouterr().err


def test_library_defaults_hold_no_machine_paths():
    # a default pointing into one machine's checkout breaks on every other machine
    import pathlib

    import tiller

    root = pathlib.Path(tiller.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if "/work/" in p.read_text()]
    assert offenders == []


def test_data_cli_writes_parquet(tmp_path, capsys):
    from tiller.cli import main

    assert main(["data", "arithmetic", "--out", str(tmp_path / "a"), "--train", "20", "--test", "5"]) == 0
    train, test = read_rows(tmp_path / "a" / "train.parquet"), read_rows(tmp_path / "a" / "test.parquet")
    assert len(train) == 20 and len(test) == 5
    pairs = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in train}
    assert not pairs & {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in test}  # disjoint splits
    r = train[0]
    assert int(r["reward_model"]["ground_truth"]) == r["extra_info"]["a"] + r["extra_info"]["b"]
    assert main(["data", "gsm8k", "--out", str(tmp_path / "g"), "--src", str(tmp_path / "nope")]) == 2


def test_arithmetic_splits_are_deterministic():
    assert arithmetic.make_splits(10, 5, seed=3) == arithmetic.make_splits(10, 5, seed=3)
    assert arithmetic.make_splits(10, 5, seed=3) != arithmetic.make_splits(10, 5, seed=4)


def test_reasoning_gym_rows_round_trip_through_the_scorer(tmp_path):
    pytest.importorskip("reasoning_gym")
    from tiller.cli import main
    from tiller.rewards import default_compute_score

    assert main(["data", "reasoning-gym", "--task", "letter_counting", "--out", str(tmp_path), "--train", "6",
                 "--test", "3"]) == 0
    train, test = read_rows(tmp_path / "train.parquet"), read_rows(tmp_path / "test.parquet")
    assert len(train) == 6 and len(test) == 3
    r = test[0]
    assert r["data_source"] == "reasoning_gym/letter_counting" and "<answer>" in r["prompt"][0]["content"]
    gt = r["reward_model"]["ground_truth"]
    assert default_compute_score(r["data_source"], f"<answer>{gt}</answer>", gt, r["extra_info"]) == 1.0
    assert default_compute_score(r["data_source"], f"<answer>{int(gt) + 1}</answer>", gt, r["extra_info"]) == 0.0
    assert main(["data", "reasoning-gym", "--task", "no_such_task", "--out", str(tmp_path / "x")]) == 2
