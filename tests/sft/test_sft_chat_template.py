"""`tiller sft` with verl's SFT chat-template keys: `model.custom_chat_template` and
`data.apply_chat_template_kwargs` render the training sequences, and the saved model keeps the template."""

from __future__ import annotations

import pytest

from tests.sft.conftest import MEMO, job_overrides
from tiller.config import load_config
from tiller.config.jobs import SFTConfig, validate_job
from tiller.data.sft import IGNORE
from tiller.models.loading import load_tokenizer
from tiller.trainer.sft import train_sft

# a template of its own shape, with a variable of its own (the tiny model's is ChatML)
TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}{% if style == 'terse' %}SHORT {% endif %}ANSWER:{% endif %}")


def test_sft_trains_on_the_custom_template_with_the_kwargs_and_saves_it(tiny_model_dir, sft_file, tmp_path):
    import yaml

    from tiller.data.sft import load_sft_examples
    from tiller.trainer.sft import build_model_and_tokenizer

    conf = tmp_path / "chat.yaml"
    conf.write_text(yaml.safe_dump({"model": {"custom_chat_template": TEMPLATE},
                                    "data": {"apply_chat_template_kwargs": {"style": "terse"}}}))
    run = tmp_path / "run"
    cfg = load_config(job_overrides(tiny_model_dir, sft_file, run, **{
        "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 8, "trainer.total_training_steps": 1}),
        config_file=conf, schema=SFTConfig, validate=validate_job)
    _, tok = build_model_and_tokenizer(cfg)
    examples = load_sft_examples(cfg.data.train_files, cfg.data, tok)
    plain = load_tokenizer(tiny_model_dir)
    for (prompt, response), ex in zip(MEMO, examples):
        text = plain.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False, chat_template=TEMPLATE, style="terse")
        assert text.endswith("USER: " + prompt + "\nSHORT ANSWER:")
        p_ids = plain(text, add_special_tokens=False)["input_ids"]
        r_ids = plain(response, add_special_tokens=False)["input_ids"] + [plain.eos_token_id]
        assert ex.input_ids == p_ids + r_ids
        assert ex.labels[:len(p_ids) - 1] == [IGNORE] * (len(p_ids) - 1)  # loss on the response only
    train_sft(cfg)
    assert load_tokenizer(run / "checkpoints" / "global_step_1" / "model").chat_template == TEMPLATE


@pytest.mark.parametrize("override, needle", [
    ("+data.apply_chat_template_kwargs.add_generation_prompt=true", "data.apply_chat_template_kwargs.add_generation"),
    ("model.custom_chat_template='{% if %}'", "model.custom_chat_template: the chat template does not compile"),
])
def test_sft_bad_chat_template_values_exit_2(tiny_model_dir, sft_file, tmp_path, capsys, override, needle):
    from tiller.cli import main

    code = main(["sft", *job_overrides(tiny_model_dir, sft_file, tmp_path / "r"), override])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err


def test_openrlhf_tokenizer_chat_template_maps_onto_custom_chat_template():
    from tiller.openrlhf.cli import resolve

    sft = resolve(["train_sft", "--pretrain", "m", "--dataset", "d.jsonl", "--input_key", "q", "--output_key", "a",
                   "--tokenizer_chat_template", TEMPLATE])[2]
    assert sft.model.custom_chat_template == TEMPLATE
    dpo = resolve(["train_dpo", "--model.model_name_or_path", "m", "--data.dataset", "d.jsonl",
                   "--data.tokenizer_chat_template", TEMPLATE])[2]
    assert dpo.model.custom_chat_template == TEMPLATE
