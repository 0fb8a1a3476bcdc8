"""TRL's DPO / KTO / reward trainers on `tiller dpo|kto|rm`: field rules, TRL's row formats, runs that learn, the
same run through the tiller job with the translated keys, refusals naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from tiller.config.jobs import KTODataConfig, PreferenceDataConfig
from tiller.data.preference import load_preference_examples
from tiller.data.sft import IGNORE
from tiller.errors import ConfigError
from tiller.models.loading import load_tokenizer
from tiller.trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer
from tiller.trl.common import TRAINING_ARGS_RULES, overrides
from tiller.trl.fields import FIELDS
from tiller.trl.preference import dpo_rows, extract_prompt, kto_rows, reward_rows, unpair

datasets = pytest.importorskip("datasets")

FAST = dict(bf16=False, gradient_checkpointing=False, report_to="none", lr_scheduler_type="constant",
            per_device_train_batch_size=4)
SUMS = [(1, 2), (3, 4), (5, 1), (2, 7), (8, 1), (4, 4), (6, 3), (9, 0)]
PAIRS = [(f"What is {a} + {b}?", str(a + b), str(a + b + 1)) for a, b in SUMS]


def _conv_pairs():
    return [{"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
             "rejected": [{"role": "assistant", "content": r}]} for p, c, r in PAIRS]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.mark.parametrize("cls", [DPOConfig, KTOConfig, RewardConfig])
def test_every_field_has_exactly_one_rule(cls):
    name = cls.__name__
    assert set(cls.RULES) == set(FIELDS[name])
    own = {f for f in FIELDS[name] if f not in TRAINING_ARGS_RULES}
    assert own and all(cls.RULES[f].kind in ("mapped", "noop", "refused") and cls.RULES[f].text for f in own)
    assert cls(output_dir="o").learning_rate == {"DPOConfig": 1e-6, "KTOConfig": 1e-6, "RewardConfig": 1e-4}[name]


def test_implicit_prompt_and_unpairing_as_trl():
    conv = {"chosen": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}],
            "rejected": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Green."}]}
    assert extract_prompt(conv) == {"prompt": [{"role": "user", "content": "Sky?"}],
                                    "chosen": [{"role": "assistant", "content": "Blue."}],
                                    "rejected": [{"role": "assistant", "content": "Green."}]}
    # strings: the common prefix, the space before the answers left to them
    assert extract_prompt({"chosen": "The sky is blue.", "rejected": "The sky is green."}) == {
        "prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    rows = [{"prompt": "a", "chosen": "x", "rejected": "y"}, {"prompt": "b", "chosen": "z", "rejected": "w"}]
    assert [(r["prompt"], r["completion"], r["label"]) for r in unpair(rows)] == [
        ("a", "x", True), ("b", "z", True), ("a", "y", False), ("b", "w", False)]
    trl = pytest.importorskip("trl")
    for example in (conv, {"chosen": "The sky is blue.", "rejected": "The sky is green."}):
        assert extract_prompt(example) == trl.extract_prompt(example)
    assert unpair(rows) == trl.unpair_preference_dataset(datasets.Dataset.from_list(rows)).to_list()


def _targets(rows, keys, tok, kind="paired"):
    cls = KTODataConfig if kind == "unpaired" else PreferenceDataConfig
    import tempfile
    from pathlib import Path

    cfg = cls(**{k.split(".", 1)[1]: v for k, v in keys.items()})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return load_preference_examples([str(path)], cfg, tok, kind)


def test_dpo_rows_learn_the_completions_trl_learns(tok):
    # implicit conversational prompt: the completions are the last assistant turns
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in _conv_pairs()]
    rows, keys = dpo_rows(implicit, tok.eos_token, "train_dataset")
    (first, *_) = _targets(rows, keys, tok)
    assert tok.decode([x for x in first.chosen.labels if x != IGNORE]) == "3<|im_end|>"
    assert tok.decode(first.chosen.input_ids).startswith("<|im_start|>user\nWhat is 1 + 2?<|im_end|>")
    # standard strings: no chat template, eos appended once (TRL adds it only when missing)
    rows, keys = dpo_rows([{"prompt": "Q: 1 + 2 = ", "chosen": "3<|im_end|>", "rejected": "4"}], tok.eos_token, "t")
    (pair,) = _targets(rows, keys, tok)
    assert tok.decode(pair.chosen.input_ids) == "Q: 1 + 2 = 3<|im_end|>"
    assert tok.decode([x for x in pair.rejected.labels if x != IGNORE]) == "4<|im_end|>"


def test_kto_and_reward_rows(tok):
    rows, keys = kto_rows(_conv_pairs()[:2], tok.eos_token, "train_dataset")
    assert [r["label"] for r in rows] == [True, True, False, False]
    examples = _targets(rows, keys, tok, "unpaired")
    assert tok.decode(examples[2].completion_ids) == "4<|im_end|>" and examples[2].desirable is False
    # reward: whole sequences as TRL tokenizes them (template for conversations, text + eos for strings)
    rows, keys = reward_rows([{**_conv_pairs()[0], "margin": 0.5}], tok.eos_token, "train_dataset")
    (pair,) = _targets(rows, keys, tok, "rm")
    full = _conv_pairs()[0]["prompt"] + _conv_pairs()[0]["chosen"]
    assert pair.chosen.input_ids == tok(tok.apply_chat_template(full, tokenize=False))["input_ids"]
    assert pair.margin == 0.5
    rows, keys = reward_rows([{"chosen": "good", "rejected": "bad<|im_end|>"}], tok.eos_token, "t")
    (pair,) = _targets(rows, keys, tok, "rm")
    assert tok.decode(pair.rejected.input_ids) == "bad<|im_end|>"
    assert tok.decode(pair.chosen.input_ids) == "good<|im_end|>"


def _history(trainer):
    return trainer.state.log_history


def test_dpo_trainer_margin_grows_and_equals_tiller_dpo(tiny_model_dir, tmp_path):
    from tiller.trainer.preference import main_dpo

    ds = datasets.Dataset.from_list(_conv_pairs())
    trainer = DPOTrainer(model=str(tiny_model_dir), train_dataset=ds, eval_dataset=ds, args=DPOConfig(
        output_dir=str(tmp_path / "trl"), learning_rate=1e-3, num_train_epochs=3, **FAST))
    out = trainer.train()
    h = _history(trainer)
    assert out.global_step == 6 and h[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # log 2 at the reference
    assert h[-1]["rewards/margins"] > 0.2 and trainer.evaluate()["eval_rewards_margins"] > 0.2
    keys = trainer.tiller_keys()
    assert keys["algorithm.loss"] == "dpo" and keys["algorithm.beta"] == 0.1 and "model.ref_path" not in keys
    keys["trainer.default_local_dir"] = str(tmp_path / "cli")
    assert main_dpo(overrides(keys)) == 0
    cli = [json.loads(x) for x in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in cli] == [r["loss"] for r in h]


def test_dpo_keys_reference_lora_and_refusals(tiny_model_dir, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    rows = _conv_pairs()
    make = lambda ref=None, peft=None, **kw: DPOTrainer(  # noqa: E731
        model=str(tiny_model_dir), ref_model=ref, train_dataset=rows, peft_config=peft,
        args=DPOConfig(output_dir=str(tmp_path / "k"), **kw))
    keys = make(loss_type="ipo", beta=0.5).tiller_keys()
    assert (keys["algorithm.loss"], keys["algorithm.beta"], keys["model.disable_dropout"]) == ("ipo", 0.5, True)
    keys = make(loss_type=["robust"], label_smoothing=0.1).tiller_keys()
    assert (keys["algorithm.loss"], keys["algorithm.label_smoothing"]) == ("robust", 0.1)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert make(ref=ref).tiller_keys()["model.ref_path"] == str(tmp_path / "k" / "input_ref_model")
    lora = make(peft=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).tiller_keys()
    assert (lora["model.lora_rank"], lora["model.lora_alpha"]) == (4, 8) and "model.ref_path" not in lora
    keys = make(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0], f_divergence_type="js_divergence",
                use_weighting=True, ld_alpha=0.5, discopop_tau=0.1).tiller_keys()
    assert keys["algorithm.loss"] == ["sigmoid", "bco_pair", "sft"] and keys["algorithm.loss_weights"] == [0.8, 0.2, 1.0]
    assert (keys["algorithm.f_divergence"], keys["algorithm.use_weighting"], keys["algorithm.ld_alpha"],
            keys["algorithm.discopop_tau"]) == ("js_divergence", True, 0.5, 0.1)
    for kw, needle in [(dict(loss_type=["sigmoid", "sppo"]), "loss_type=\\['sigmoid', 'sppo'\\]: refused"),
                       (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]), "loss_weights=\\[1.0\\]: refused"),
                       (dict(label_smoothing=0.1), "label_smoothing=0.1: refused: TRL 1.16 reads it for robust"),
                       (dict(sync_ref_model=True, precompute_ref_log_probs=True),
                        "precompute_ref_log_probs=True: refused: with sync_ref_model")]:
        with pytest.raises(ConfigError, match=needle):
            make(**kw).tiller_keys()
    with pytest.raises(ConfigError, match="ref_model: a int"):
        make(ref=3)
    keys = make(sync_ref_model=True, ref_model_sync_steps=3, ref_model_mixup_alpha=0.5).tiller_keys()
    assert (keys["algorithm.ref_model_sync_steps"], keys["algorithm.ref_model_mixup_alpha"]) == (3, 0.5)


def test_kto_trainer_rewards_separate_and_equals_tiller_kto(tiny_model_dir, tmp_path):
    from tiller.trainer.preference import main_kto

    rows = []
    for p, c, r in PAIRS:  # unpaired, labels alternating (sequential sampling keeps this order)
        rows += [{"prompt": p + " ", "completion": c, "label": True},
                 {"prompt": p + " ", "completion": r, "label": False}]
    trainer = KTOTrainer(model=str(tiny_model_dir), train_dataset=datasets.Dataset.from_list(rows), args=KTOConfig(
        output_dir=str(tmp_path / "trl"), learning_rate=5e-4, num_train_epochs=2, **{**FAST,
                                                                                    "per_device_train_batch_size": 8}))
    trainer.train()
    h = _history(trainer)
    assert len(h) == 4 and h[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # 1 - sigma(0) at the reference
    assert h[-1]["rewards/chosen"] > 0 > h[-1]["rewards/rejected"] and h[-1]["loss"] < 0.49
    keys = trainer.tiller_keys()
    assert keys["data.shuffle"] is False and keys["data.truncation"] == "right"
    keys["trainer.default_local_dir"] = str(tmp_path / "cli")
    assert main_kto(overrides(keys)) == 0
    cli = [json.loads(x) for x in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in cli] == [r["loss"] for r in h]
    apo = KTOTrainer(model=str(tiny_model_dir), train_dataset=rows, args=KTOConfig(
        output_dir=str(tmp_path / "apo"), loss_type="apo_zero_unpaired", train_sampling_strategy="random", max_steps=1,
        **{**FAST, "per_device_train_batch_size": 8}))
    assert apo.tiller_keys()["algorithm.loss"] == "apo_zero_unpaired" and apo.tiller_keys()["data.shuffle"] is True
    apo.train()
    assert apo.state.log_history[0]["kl"] == 0.0 and apo.state.log_history[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    with pytest.raises(ConfigError, match="loss_type='bco': refused"):
        KTOTrainer(model=str(tiny_model_dir), train_dataset=rows,
                   args=KTOConfig(output_dir=str(tmp_path / "r"), loss_type="bco")).tiller_keys()
    with pytest.raises(ConfigError, match="train_sampling_strategy='random': refused"):
        KTOTrainer(model=str(tiny_model_dir), train_dataset=rows,
                   args=KTOConfig(output_dir=str(tmp_path / "r"), train_sampling_strategy="random")).tiller_keys()


def test_reward_trainer_learns_and_saves_a_scorer(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from tiller.rewards.reward_model import RewardModelScorer
    from tiller.trainer.rm import main as rm_main

    rows = [{"prompt": p + " ", "chosen": c, "rejected": r} for p, c, r in PAIRS]
    trainer = RewardTrainer(model=str(tiny_model_dir), train_dataset=datasets.Dataset.from_list(rows),
                            args=RewardConfig(output_dir=str(tmp_path / "trl"), num_train_epochs=4,
                                              center_rewards_coefficient=0.01, **FAST))
    trainer.train()
    h = _history(trainer)
    assert h[-1]["margin"] > h[0]["margin"] + 0.5 and h[-1]["accuracy"] >= 0.75
    keys = trainer.tiller_keys()
    assert keys["algorithm.center_rewards_coefficient"] == 0.01 and keys["data.prompt_key"] is None
    trainer.save_model()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "trl")
    assert model.config.num_labels == 1
    scorer = RewardModelScorer(str(tmp_path / "trl"), device="cpu")
    good, bad = scorer.score_full_texts([rows[0]["prompt"] + "3<|im_end|>", rows[0]["prompt"] + "4<|im_end|>"])
    assert good > bad
    keys["trainer.default_local_dir"] = str(tmp_path / "cli")
    assert rm_main(overrides(keys)) == 0
    cli = [json.loads(x) for x in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in cli] == [r["loss"] for r in h]
    assert torch.tensor([r["train/loss"] for r in cli]).isfinite().all()


def test_sequences_match_trl_own_tokenization(tiny_model_dir, tok, tmp_path):
    """DPO / KTO / reward rows against TRL's own prepared datasets: the same ids and completion tokens; the one
    documented difference: a conversational completion ends at its end-of-turn token (TRL also trains ChatML's
    newline after it)."""
    trl = pytest.importorskip("trl")
    kw = dict(output_dir=str(tmp_path / "trl"), report_to="none", bf16=False, use_cpu=True)
    conv = _conv_pairs()[:2]
    std = [{"prompt": p + "\n", "chosen": c, "rejected": r} for p, c, r in PAIRS[:2]]
    newline = tok("\n")["input_ids"]
    for rows, conversational in ((std, False), (conv, True)):
        cut = -len(newline) if conversational else None
        ref = trl.DPOTrainer(model=str(tiny_model_dir), processing_class=tok, args=trl.DPOConfig(**kw),
                             train_dataset=datasets.Dataset.from_list(rows)).train_dataset[0]
        (pair, _) = _targets(*dpo_rows(rows, tok.eos_token, "t"), tok)
        if conversational:
            assert ref["chosen_ids"][cut:] == newline
        assert pair.chosen.input_ids == ref["prompt_ids"] + ref["chosen_ids"][:cut]
        assert [x for x in pair.rejected.labels if x != IGNORE] == ref["rejected_ids"][:cut]
        ref = trl.RewardTrainer(model=str(tiny_model_dir), processing_class=tok, args=trl.RewardConfig(**kw),
                                train_dataset=datasets.Dataset.from_list(rows)).train_dataset[0]
        (pair, _) = _targets(*reward_rows(rows, tok.eos_token, "t"), tok, "rm")
        assert (pair.chosen.input_ids, pair.rejected.input_ids) == (ref["chosen_ids"], ref["rejected_ids"])
        ref = trl.KTOTrainer(model=str(tiny_model_dir), processing_class=tok,
                             args=trl.KTOConfig(per_device_train_batch_size=2, **kw),
                             train_dataset=datasets.Dataset.from_list(rows)).train_dataset
        ours = _targets(*kto_rows(rows, tok.eos_token, "t"), tok, "unpaired")
        assert [e.prompt_ids for e in ours] == ref["prompt_ids"]
        assert [e.completion_ids for e in ours] == [ids[:cut] for ids in ref["completion_ids"]]
        assert [e.desirable for e in ours] == ref["label"]


def test_dpo_with_lora_starts_at_the_base_and_saves_a_merged_model(tiny_model_dir, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    trainer = DPOTrainer(model=str(tiny_model_dir), train_dataset=_conv_pairs(), peft_config=LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
        args=DPOConfig(output_dir=str(tmp_path / "lora"), learning_rate=1e-2, max_steps=2, **FAST))
    trainer.train()
    h = _history(trainer)
    assert h[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # the reference is the base: adapters disabled
    assert h[1]["rewards/margins"] != 0.0
    trainer.save_model()
    assert not (tmp_path / "lora" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [n for n, p in merged.named_parameters() if not torch.equal(p, base.state_dict()[n])]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)


@pytest.mark.parametrize("name", ["CPOConfig", "ORPOConfig"])
def test_experimental_reference_free_configs_have_one_rule_per_field(name):
    from tiller.trl import experimental  # noqa: F401  (the package imports)
    import tiller.trl as trl

    cls = getattr(trl, name)
    assert set(cls.RULES) == set(FIELDS[name])
    assert cls(output_dir="o").learning_rate == 1e-6 and cls(output_dir="o").beta == 0.1


def test_orpo_and_simpo_trainers_learn_and_equal_tiller_dpo(tiny_model_dir, tmp_path):
    """TRL's experimental ORPOTrainer / CPOTrainer (import path tiller.trl.experimental.*): no reference, the
    chosen-over-rejected margin grows, and the translated keys run the same steps through `tiller dpo`."""
    from tiller.trainer.preference import main_dpo
    from tiller.trl.experimental.cpo import CPOConfig, CPOTrainer
    from tiller.trl.experimental.orpo import ORPOConfig, ORPOTrainer

    ds = datasets.Dataset.from_list(_conv_pairs())
    runs = {
        "orpo": ORPOTrainer(model=str(tiny_model_dir), train_dataset=ds, args=ORPOConfig(
            output_dir=str(tmp_path / "orpo"), learning_rate=1e-3, num_train_epochs=3, **FAST)),
        "simpo": CPOTrainer(model=str(tiny_model_dir), train_dataset=ds, args=CPOConfig(
            output_dir=str(tmp_path / "simpo"), loss_type="simpo", beta=2.0, simpo_gamma=0.5, cpo_alpha=0.5,
            learning_rate=1e-3, num_train_epochs=3, **FAST)),
    }
    for name, trainer in runs.items():
        trainer.train()
        h = _history(trainer)
        assert h[-1]["rewards/margins"] > h[0]["rewards/margins"] + 0.05, (name, h[0], h[-1])
        keys = trainer.tiller_keys()
        assert "model.ref_path" not in keys
        keys["trainer.default_local_dir"] = str(tmp_path / f"cli-{name}")
        assert main_dpo(overrides(keys)) == 0
        cli = [json.loads(x) for x in (tmp_path / f"cli-{name}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["train/loss"] for r in cli] == [r["loss"] for r in h]
    assert runs["orpo"].tiller_keys()["algorithm.loss"] == "orpo" and "log_odds_ratio" in _history(runs["orpo"])[-1]
    simpo = runs["simpo"].tiller_keys()
    assert (simpo["algorithm.loss"], simpo["algorithm.loss_weights"], simpo["algorithm.simpo_gamma"]) == (
        ["simpo", "sft"], [1.0, 0.5], 0.5)


def test_cpo_keys_and_refusals(tiny_model_dir, tmp_path):
    from tiller.trl import CPOConfig, CPOTrainer

    make = lambda **kw: CPOTrainer(model=str(tiny_model_dir), train_dataset=_conv_pairs(),  # noqa: E731
                                   args=CPOConfig(output_dir=str(tmp_path / "c"), **kw))
    keys = make(cpo_alpha=0.3, label_smoothing=0.1).tiller_keys()
    assert (keys["algorithm.loss"], keys["algorithm.cpo_alpha"], keys["algorithm.label_smoothing"]) == ("cpo", 0.3, 0.1)
    assert make(loss_type="simpo", cpo_alpha=0.0).tiller_keys()["algorithm.loss"] == "simpo"
    keys = make(loss_type="ipo", cpo_alpha=0.5, alpha=0.2).tiller_keys()  # TRL's ipo with AlphaPO's rewards
    assert (keys["algorithm.loss"], keys["algorithm.cpo_alpha"], keys["algorithm.alphapo_alpha"]) == ("cpo_ipo",
                                                                                                     0.5, 0.2)
    assert "algorithm.label_smoothing" not in keys  # hinge / ipo do not read it
    assert make(loss_type="hinge").tiller_keys()["algorithm.loss"] == "cpo_hinge"
    for kw, needle in [(dict(loss_type="hinge", label_smoothing=0.1),
                        "label_smoothing=0.1: refused: loss_type 'hinge'"),
                       (dict(loss_type="kto_pair"), "loss_type='kto_pair': refused"),
                       (dict(alpha=0.2), "alpha=0.2: refused: AlphaPO's reward transformation on summed log-probs"),
                       (dict(max_completion_length=64), "max_completion_length=64: refused"),
                       (dict(is_encoder_decoder=True), "is_encoder_decoder=True: refused")]:
        with pytest.raises(ConfigError, match=needle):
            make(**kw).tiller_keys()
