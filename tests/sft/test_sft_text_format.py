"""SFT's plain-text format (loss on every token), whole-conversation loss and the DFT loss in a run."""

from __future__ import annotations

import json

import pytest

from tests.sft.conftest import job_overrides, write_jsonl
from tiller.config import load_config
from tiller.config.jobs import SFTConfig, SFTDataConfig, validate_job
from tiller.data.sft import IGNORE, load_sft_examples
from tiller.errors import ConfigError, DataError
from tiller.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_text_rows_learn_every_token_after_the_first(tmp_path, tok):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "The cat sat on the mat."}, {"text": "Yes.<|im_end|>"}])
    a, b = load_sft_examples([f], SFTDataConfig(), tok)  # auto: a text column and no prompt column
    ids = tok("The cat sat on the mat.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert a.input_ids == ids  # eos appended, one tokenizer call
    assert a.labels == ids[1:] + [IGNORE]  # every next token is a target
    assert b.input_ids == tok("Yes.<|im_end|>", add_special_tokens=False)["input_ids"]  # eos not doubled


def test_text_key_and_errors(tmp_path, tok):
    f = write_jsonl(tmp_path / "t.jsonl", [{"body": "hello"}])
    (ex,) = load_sft_examples([f], SFTDataConfig(format="text", text_key="body"), tok)
    assert tok.decode([x for x in ex.labels if x != IGNORE]).endswith("<|im_end|>")
    with pytest.raises(DataError, match=r"t.jsonl.*missing key 'text' \(data.text_key\)"):
        load_sft_examples([f], SFTDataConfig(format="text"), tok)


def test_messages_every_token_when_not_assistant_only(tmp_path, tok):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": conv}])
    (only,) = load_sft_examples([f], SFTDataConfig(), tok)
    (every,) = load_sft_examples([f], SFTDataConfig(assistant_only_loss=False), tok)
    assert only.input_ids == every.input_ids
    assert tok.decode([x for x in only.labels if x != IGNORE]) == "hello<|im_end|>"
    assert every.labels == every.input_ids[1:] + [IGNORE]


def test_sft_loss_key_is_validated(tiny_model_dir, tmp_path):
    over = job_overrides(tiny_model_dir, tmp_path / "x.jsonl", tmp_path / "run", **{"algorithm.loss": "focal"})
    with pytest.raises(ConfigError, match="algorithm.loss"):
        load_config(over, schema=SFTConfig, validate=validate_job)


def test_text_sft_with_dft_learns(tiny_model_dir, tmp_path):
    from tiller.trainer.sft import train_sft

    f = write_jsonl(tmp_path / "t.jsonl", [{"text": f"{a} plus {a} is {2 * a}."} for a in range(1, 9)])
    over = job_overrides(tiny_model_dir, f, tmp_path / "run", **{
        "algorithm.loss": "dft", "optim.lr": 3e-3, "trainer.total_epochs": 6, "data.train_batch_size": 8,
        "data.micro_batch_size_per_gpu": 4, "trainer.export_hf": False})
    train_sft(load_config(over, schema=SFTConfig, validate=validate_job))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    nll = [r["train/nll"] for r in rows if "train/nll" in r]
    assert len(nll) == 6 and nll[-1] < 0.7 * nll[0]
