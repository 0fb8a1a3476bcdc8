"""Standard (string) rows with a tokenizer that prepends a BOS token (as Llama's does): TRL's tokenizer call adds it,
so tiller's TRL front end sets data.add_special_tokens and the sequences equal TRL's; conversations get only what the
chat template renders (no BOS added), in both."""

from __future__ import annotations

import shutil

import pytest

from tiller.config.jobs import PreferenceDataConfig, SFTDataConfig
from tiller.data.preference import load_preference_examples
from tiller.data.sft import IGNORE, load_sft_examples
from tiller.models.loading import load_tokenizer
from tiller.trl import SFTConfig
from tiller.trl.common import classify
from tiller.trl.preference import dpo_rows, reward_rows
from tiller.trl.sft import sft_rows

BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a tokenizer whose post-processor prepends <|endoftext|> (a BOS token)."""
    from tokenizers.processors import TemplateProcessing

    out = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_model_dir, out)
    tok = load_tokenizer(out)
    bos_id = tok.convert_tokens_to_ids(BOS)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                              special_tokens=[(BOS, bos_id)])
    tok.bos_token = BOS
    tok.save_pretrained(out)
    return out


def _write(tmp_path, rows):
    import json

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sft(rows, args, tok, tmp_path):
    out, keys = sft_rows(rows, args, "train_dataset")
    logical, _ = classify(args)
    keys.update({k: v for k, v in logical.items() if k.startswith("data.")})
    cfg = SFTDataConfig(**{k.split(".", 1)[1]: v for k, v in keys.items()})
    return load_sft_examples([_write(tmp_path, out)], cfg, tok)[0]


def _pairs(convert, rows, tok, tmp_path, kind):
    out, keys = convert(rows, tok.eos_token, "train_dataset")
    cfg = PreferenceDataConfig(**{k.split(".", 1)[1]: v for k, v in keys.items()})
    return load_preference_examples([_write(tmp_path, out)], cfg, tok, kind)[0]


def test_standard_rows_start_with_bos_and_conversations_do_not(bos_model_dir, tmp_path):
    tok = load_tokenizer(bos_model_dir)
    bos = tok.convert_tokens_to_ids(BOS)
    args = SFTConfig(output_dir="o")
    assert _sft([{"text": "a b"}], args, tok, tmp_path).input_ids[0] == bos
    ex = _sft([{"prompt": "Q: 1 + 2 =", "completion": " 3"}], args, tok, tmp_path)
    assert ex.input_ids[0] == bos and tok.decode([x for x in ex.labels if x != IGNORE]) == " 3<|im_end|>"
    conv = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    assert _sft(conv, args, tok, tmp_path).input_ids[0] != bos
    pair = _pairs(dpo_rows, [{"prompt": "Q: 1 + 2 =", "chosen": " 3", "rejected": " 4"}], tok, tmp_path, "paired")
    assert pair.chosen.input_ids[0] == pair.rejected.input_ids[0] == bos
    pair = _pairs(reward_rows, [{"chosen": "good", "rejected": "bad"}], tok, tmp_path, "rm")
    assert pair.chosen.input_ids[0] == bos


def test_standard_rows_equal_trl_with_a_bos_tokenizer(bos_model_dir, tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tok = load_tokenizer(bos_model_dir)
    kw = dict(output_dir=str(tmp_path / "trl"), report_to="none", bf16=False, use_cpu=True)
    for rows in ([{"text": "The cat sat."}], [{"prompt": "What is 1 + 2?\n", "completion": "3"}]):
        ref = trl.SFTTrainer(model=str(bos_model_dir), processing_class=tok, args=trl.SFTConfig(**kw),
                             train_dataset=datasets.Dataset.from_list(rows)).train_dataset[0]
        ours = _sft(rows, SFTConfig(output_dir="o"), tok, tmp_path)
        assert ours.input_ids == ref["input_ids"] and ours.labels[:-1] == ref["labels"][1:]
    rows = [{"prompt": "What is 1 + 2?\n", "chosen": "3", "rejected": "4"}]
    ref = trl.DPOTrainer(model=str(bos_model_dir), processing_class=tok, args=trl.DPOConfig(**kw),
                         train_dataset=datasets.Dataset.from_list(rows)).train_dataset[0]
    pair = _pairs(dpo_rows, rows, tok, tmp_path, "paired")
    assert pair.chosen.input_ids == ref["prompt_ids"] + ref["chosen_ids"]
    ref = trl.RewardTrainer(model=str(bos_model_dir), processing_class=tok, args=trl.RewardConfig(**kw),
                            train_dataset=datasets.Dataset.from_list(rows)).train_dataset[0]
    pair = _pairs(reward_rows, rows, tok, tmp_path, "rm")
    assert (pair.chosen.input_ids, pair.rejected.input_ids) == (ref["chosen_ids"], ref["rejected_ids"])
