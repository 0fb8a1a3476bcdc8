"""SFT data: loss masks (response only, every assistant turn), key aliases, lengths, bad inputs."""

from __future__ import annotations

import pytest

from tests.sft.conftest import write_jsonl
from tiller.config.jobs import SFTDataConfig
from tiller.data.sft import IGNORE, _encode_incremental, encode_messages, load_sft_examples, shifted_labels
from tiller.errors import DataError
from tiller.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _targets(example, tok) -> str:
    return tok.decode([x for x in example.labels if x != IGNORE])


def test_shifted_labels_predict_next_masked_token():
    # ids 10 11 12 13, mask on 12 13 -> position 1 predicts 12, position 2 predicts 13, last is ignored
    assert shifted_labels([10, 11, 12, 13], [0, 0, 1, 1]) == [IGNORE, 12, 13, IGNORE]


def test_prompt_response_loss_on_response_and_eos_only(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 1 + 2?", "response": "3"}])
    (ex,) = load_sft_examples([f], SFTDataConfig(), tok)
    assert _targets(ex, tok) == "3<|im_end|>"
    # the sequence is the RL prompt rendering followed by the response and eos
    text = tok.decode(ex.input_ids)
    assert text == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n3<|im_end|>"


def test_openrlhf_input_output_keys(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"question": "hi", "answer": "yes"}])
    cfg = SFTDataConfig(input_key="question", output_key="answer")
    (ex,) = load_sft_examples([f], cfg, tok)
    assert _targets(ex, tok) == "yes<|im_end|>"


def test_parquet_and_messages_every_assistant_turn(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2"},
            {"role": "assistant", "content": "3"}, {"role": "user", "content": "2 + 2"},
            {"role": "assistant", "content": "4"}]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": msgs}]), path)
    (ex,) = load_sft_examples([str(path)], SFTDataConfig(), tok)
    assert _targets(ex, tok) == "3<|im_end|>4<|im_end|>"
    # incremental rendering (for templates without {% generation %}) marks the same turns; it also
    # takes the "\n" the template writes after <|im_end|>, which the generation markers leave out
    ids, _ = encode_messages(msgs, tok, "x")
    ids2, mask2 = _encode_incremental(msgs, tok, "x")
    assert ids == ids2
    assert tok.decode([t for t, m in zip(ids2, mask2) if m]) == "3<|im_end|>\n4<|im_end|>\n"


@pytest.mark.parametrize("row, needle", [
    ({"question": "x", "response": "y"}, "missing key 'prompt'"),
    ({"prompt": "x", "response": "  "}, "response is empty"),
    ({"prompt": "x", "response": 5}, "response must be a string"),
])
def test_bad_rows_name_file_and_row(tmp_path, tok, row, needle):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "response": "fine"}, row])
    with pytest.raises(DataError, match=needle) as err:
        load_sft_examples([f], SFTDataConfig(), tok)
    assert "bad.jsonl row 1" in str(err.value)


def test_messages_without_assistant_turn(tmp_path, tok):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match="no assistant turn"):
        load_sft_examples([f], SFTDataConfig(), tok)


def test_too_long_errors_or_truncates(tmp_path, tok):
    f = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 40, "response": "the answer is 7"}])
    with pytest.raises(DataError, match=r"long.jsonl row 0: sequence has \d+ tokens > data.max_length=20"):
        load_sft_examples([f], SFTDataConfig(max_length=20), tok)
    (left,) = load_sft_examples([f], SFTDataConfig(max_length=20, truncation="left"), tok)
    assert len(left.input_ids) == 20 and _targets(left, tok) == "the answer is 7<|im_end|>"
    # right truncation keeps the prompt start: no response token left -> a clear error
    with pytest.raises(DataError, match="no response token is left"):
        load_sft_examples([f], SFTDataConfig(max_length=20, truncation="right"), tok)


def test_missing_file(tmp_path, tok):
    with pytest.raises(DataError, match="not found"):
        load_sft_examples([tmp_path / "nope.jsonl"], SFTDataConfig(), tok)
