"""TRL's SFTConfig / SFTTrainer on `tiller sft`: field rules, TRL's dataset formats -> loss tokens, a run that
learns, the same run through `tiller sft` with the translated keys, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiller.config.jobs import SFTDataConfig
from tiller.data.sft import IGNORE, load_sft_examples
from tiller.errors import ConfigError, DataError
from tiller.models.loading import load_tokenizer
from tiller.trl import SFTConfig, SFTTrainer
from tiller.trl.common import TRAINING_ARGS_RULES, classify
from tiller.trl.fields import FIELDS
from tiller.trl.sft import SFT_RULES, sft_rows

datasets = pytest.importorskip("datasets")

SUMS = [(1, 2), (3, 4), (5, 1), (2, 7), (8, 1), (4, 4), (6, 3), (9, 0)]
MEMO = [(f"What is {a} + {b}?", str(a + b)) for a, b in SUMS]
FAST = dict(bf16=False, gradient_checkpointing=False, report_to="none", lr_scheduler_type="constant")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_every_sft_field_has_exactly_one_rule():
    own = [name for name in FIELDS["SFTConfig"] if name not in TRAINING_ARGS_RULES]
    assert sorted(own) == sorted(set(SFT_RULES) - set(TRAINING_ARGS_RULES))  # no stray rule, none missing
    assert set(SFTConfig.RULES) == set(FIELDS["SFTConfig"])
    for name, rule in SFTConfig.RULES.items():
        assert rule.kind in ("mapped", "noop", "refused") and rule.text, name
    args = SFTConfig(output_dir="o")
    assert (args.learning_rate, args.max_length, args.packing, args.completion_only_loss) == (2e-5, 1024, False, None)


def _loss_text(rows, args, tok) -> list[str]:
    out, keys = sft_rows(rows, args, "train_dataset")
    cfg = SFTDataConfig(**{k.split(".", 1)[1]: v for k, v in {**keys, **_data_keys(args)}.items()})
    examples = _load(out, cfg, tok)
    return [tok.decode([x for x in e.labels if x != IGNORE]) for e in examples]


def _data_keys(args) -> dict:
    logical, _ = classify(args)
    return {k: v for k, v in logical.items() if k.startswith("data.")}


def _load(rows, cfg, tok):
    """tiller's SFT examples of `rows` written as a data file (a temporary one)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return load_sft_examples([str(path)], cfg, tok)


def test_trl_formats_put_the_loss_where_trl_does(tok):
    args = SFTConfig(output_dir="o")
    # language modeling: every token after the first, eos appended
    ids = tok("The cat sat.<|im_end|>")["input_ids"]
    assert _loss_text([{"text": "The cat sat."}], args, tok) == [tok.decode(ids[1:])]
    # prompt-completion: the completion + eos (completion_only_loss=None -> True); no chat template
    assert _loss_text([{"prompt": "What is 1 + 2? ", "completion": "3"}], args, tok) == ["3<|im_end|>"]
    everything = _loss_text([{"prompt": "What is 1 + 2? ", "completion": "3"}],
                            SFTConfig(output_dir="o", completion_only_loss=False), tok)
    assert everything == [tok.decode(tok("What is 1 + 2? 3<|im_end|>")["input_ids"][1:])]
    # conversational prompt-completion: the assistant's text and its end of turn
    conv = [{"prompt": [{"role": "user", "content": "What is 1 + 2?"}],
             "completion": [{"role": "assistant", "content": "3"}]}]
    assert _loss_text(conv, args, tok) == ["3<|im_end|>"]
    # messages: every token by default (TRL's assistant_only_loss=False), the assistant turns with it
    msgs = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    rendered = tok.apply_chat_template(msgs[0]["messages"], tokenize=False)
    assert _loss_text(msgs, args, tok) == [tok.decode(tok(rendered)["input_ids"][1:])]
    assert _loss_text(msgs, SFTConfig(output_dir="o", assistant_only_loss=True), tok) == ["hello<|im_end|>"]
    # ShareGPT conversations become messages; dataset_text_field names the text column
    share = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]
    assert _loss_text(share, SFTConfig(output_dir="o", assistant_only_loss=True), tok) == ["hello<|im_end|>"]
    assert _loss_text([{"body": "Yes."}], SFTConfig(output_dir="o", dataset_text_field="body"), tok)[0].endswith(
        "<|im_end|>")
    with pytest.raises(DataError, match=r"train_dataset: columns \['foo'\].*'text'.*'messages'.*'prompt'"):
        sft_rows([{"foo": 1}], args, "train_dataset")


def test_loss_tokens_match_trl_own_tokenization(tiny_model_dir, tok, tmp_path):
    trl = pytest.importorskip("trl")
    cases = [
        ([{"text": "The cat sat on the mat."}], {}),
        ([{"prompt": "What is 1 + 2?\n", "completion": "3"}], {}),
        ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}], {}),
        ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}],
         {"assistant_only_loss": True}),
    ]
    for rows, extra in cases:
        ref = trl.SFTTrainer(model=str(tiny_model_dir), processing_class=tok,
                             args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **FAST, **extra),
                             train_dataset=datasets.Dataset.from_list(rows)).train_dataset[0]
        out, keys = sft_rows(rows, SFTConfig(output_dir="o", **extra), "train_dataset")
        cfg = SFTDataConfig(**{k.split(".", 1)[1]: v for k, v in {**keys, **_data_keys(SFTConfig(
            output_dir="o", **extra))}.items()})
        (ours,) = _load(out, cfg, tok)
        assert ours.input_ids == ref["input_ids"], rows
        # TRL's labels are unshifted (the model shifts them): the target of position t-1 is labels[t]
        assert ours.labels[:-1] == ref["labels"][1:], rows


def _train(model, tmp_path, name, rows, **kw):
    args = SFTConfig(output_dir=str(tmp_path / name), learning_rate=3e-3, num_train_epochs=3,
                     per_device_train_batch_size=4, **FAST, **kw)
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         eval_dataset=datasets.Dataset.from_list(rows[:4]))
    return trainer, trainer.train()


def test_sft_trainer_learns_saves_and_equals_tiller_sft(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from tiller.trainer.sft import main as sft_main
    from tiller.trl.common import overrides

    rows = [{"prompt": p + " ", "completion": c} for p, c in MEMO]
    trainer, out = _train(str(tiny_model_dir), tmp_path, "trl", rows)
    history = trainer.state.log_history
    assert out.global_step == trainer.state.global_step == 6 and len(history) == 6
    assert history[-1]["loss"] < 0.6 * history[0]["loss"]
    assert "learning_rate" in history[0] and history[-1]["epoch"] == 3.0
    assert trainer.evaluate()["eval_loss"] == history[-1]["val/loss"]
    trainer.save_model()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "trl").num_parameters() > 0
    assert (tmp_path / "trl" / "data" / "train.jsonl").exists()
    # the same run through `tiller sft` with the translated keys: the same losses
    keys = trainer.tiller_keys()
    keys["trainer.default_local_dir"] = str(tmp_path / "cli")
    assert keys["data.format"] == "prompt_response" and keys["data.apply_chat_template"] is False
    assert sft_main(overrides(keys)) == 0
    cli = [json.loads(x) for x in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in cli] == [r["loss"] for r in history]


def test_refusals_name_the_field_or_argument(tiny_model_dir, tmp_path):
    rows = datasets.Dataset.from_list([{"text": "a b c"}])
    make = lambda **kw: SFTTrainer(model=str(tiny_model_dir), train_dataset=rows,  # noqa: E731
                                   args=SFTConfig(output_dir=str(tmp_path / "r"), **kw))
    with pytest.raises(ConfigError, match="packing_strategy='wrapped': refused"):
        make(packing=True, packing_strategy="wrapped")
    with pytest.raises(ConfigError, match="loss_type='chunked_nll': refused: nll | dft"):
        make(loss_type="chunked_nll")
    with pytest.raises(ConfigError, match="dataset_kwargs=.*refused"):
        make(dataset_kwargs={"skip_prepare_dataset": True})
    with pytest.raises(ConfigError, match=r"SFTTrainer\(compute_metrics=...\): refused"):
        SFTTrainer(model=str(tiny_model_dir), train_dataset=rows, args=SFTConfig(output_dir="o"),
                   compute_metrics=lambda p: {})
    with pytest.raises(TypeError, match="did you mean 'max_length'"):
        SFTConfig(max_len=12)
    with pytest.raises(DataError, match="train_dataset is empty"):
        SFTTrainer(model=str(tiny_model_dir), train_dataset=[], args=SFTConfig(output_dir="o"))
    with pytest.raises(ConfigError, match=r"eval_dataset: a dict of 2 datasets \(a, b\): refused"):
        SFTTrainer(model=str(tiny_model_dir), train_dataset=rows, eval_dataset={"a": rows, "b": rows},
                   args=SFTConfig(output_dir="o"))
    with pytest.raises(ConfigError, match=r"evaluate\(\): call train\(\) first"):
        SFTTrainer(model=str(tiny_model_dir), train_dataset=rows, eval_dataset=rows,
                   args=SFTConfig(output_dir="o")).evaluate()


def test_eos_token_chat_template_path_and_dft_map_to_tiller_keys(tiny_model_dir, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    trainer = SFTTrainer(model=str(tiny_model_dir), train_dataset=[{"text": "a b"}] * 4, args=SFTConfig(
        output_dir=str(tmp_path / "k"), eos_token="<|endoftext|>", chat_template_path=str(template),
        loss_type="dft", packing=True, max_length=64, truncation_mode="keep_end", neftune_noise_alpha=5,
        use_liger_kernel=True))
    keys = trainer.tiller_keys()
    assert keys["model.custom_chat_template"] == template.read_text() and keys["model.neftune_noise_alpha"] == 5.0
    assert keys["model.use_liger"] is True  # the LM head run with the log-probs (Liger's fused linear loss)
    assert keys["algorithm.loss"] == "dft" and keys["data.truncation"] == "left"
    assert keys["data.packing"] is True and keys["data.pack_length"] == 64 and keys["data.max_length"] == 64
    assert load_tokenizer(keys["model.tokenizer_path"]).eos_token == "<|endoftext|>"
    with pytest.raises(ConfigError, match="eos_token='<nope>': refused"):
        SFTTrainer(model=str(tiny_model_dir), train_dataset=[{"text": "a"}],
                   args=SFTConfig(output_dir=str(tmp_path / "e"), eos_token="<nope>")).tiller_keys()


def test_load_best_model_at_end_maps_to_the_best_metric(tiny_model_dir, tmp_path):
    # TRL's load_best_model_at_end + metric_for_best_model (eval_X -> val/X; None: the loss) + greater_is_better
    def keys(**kw):
        return SFTTrainer(model=str(tiny_model_dir), train_dataset=[{"text": "a b"}] * 4, eval_dataset=[
            {"text": "a b"}] * 2, args=SFTConfig(output_dir=str(tmp_path / "b"), eval_strategy="steps", eval_steps=2,
                                               save_steps=4, **kw)).tiller_keys()

    best = keys(load_best_model_at_end=True)
    assert (best["trainer.best_metric"], best["trainer.test_freq"], best["trainer.save_freq"]) == ("val/loss", 2, 4)
    assert "trainer.best_metric_greater" not in best  # None: tiller's default (lower for a loss), as HF's
    best = keys(load_best_model_at_end=True, metric_for_best_model="eval_mean_token_accuracy", greater_is_better=True)
    assert (best["trainer.best_metric"], best["trainer.best_metric_greater"]) == ("val/mean_token_accuracy", True)
    assert "trainer.best_metric" not in keys(metric_for_best_model="eval_loss")  # alone: nothing to load


def test_loaded_model_and_tokenizer_objects_and_noop_notices(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = SFTTrainer(model=model, processing_class=load_tokenizer(tiny_model_dir),
                         train_dataset=[{"text": "a b"}] * 4,
                         args=SFTConfig(output_dir=str(tmp_path / "o"), padding_free=True, dataset_num_proc=4))
    out = capsys.readouterr().out
    assert "tiller.trl: padding_free=True: no effect in tiller: tiller pads micro-batches" in out
    assert "tiller.trl: dataset_num_proc=4: no effect in tiller" in out
    keys = trainer.tiller_keys()
    assert keys["model.partial_pretrain"] == str(tmp_path / "o" / "input_model")
    saved = AutoModelForCausalLM.from_pretrained(keys["model.partial_pretrain"])
    assert saved.num_parameters() == model.num_parameters()


def test_resume_from_checkpoint_continues_the_same_run(tiny_model_dir, tmp_path):
    rows = [{"prompt": p + " ", "completion": c} for p, c in MEMO]

    def run(name, max_steps, resume=None):
        args = SFTConfig(output_dir=str(tmp_path / name), learning_rate=3e-3, max_steps=max_steps, save_steps=1,
                         per_device_train_batch_size=4, **FAST)
        trainer = SFTTrainer(model=str(tiny_model_dir), args=args, train_dataset=rows)
        return trainer, trainer.train(resume_from_checkpoint=resume)

    straight, _ = run("straight", 4)
    run("resumed", 2)
    resumed, out = run("resumed", 4, resume=True)
    assert out.global_step == 4
    assert [r["loss"] for r in resumed.state.log_history] == [r["loss"] for r in straight.state.log_history]


def test_torch_compile_maps_to_the_models_compiled_layers(tiny_model_dir, tmp_path):
    """SFTConfig's torch_compile (or a backend, which turns it on in transformers) is model.use_torch_compile."""
    rows = [{"prompt": p + " ", "completion": c} for p, c in MEMO]
    for i, (kw, want) in enumerate([({}, False), ({"torch_compile": True}, True),
                                    ({"torch_compile_backend": "inductor"}, True)]):
        args = SFTConfig(output_dir=str(tmp_path / str(i)), **FAST, **kw)
        trainer = SFTTrainer(model=str(tiny_model_dir), args=args, train_dataset=datasets.Dataset.from_list(rows))
        assert trainer.tiller_keys().get("model.use_torch_compile", False) is want, kw
