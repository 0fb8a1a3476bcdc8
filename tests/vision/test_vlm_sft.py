"""`tiller sft` on image + text conversations (verl's multi-turn SFT parquet with an `images` column): encoding
(image tokens expanded, loss on assistant tokens only), the forward with pixels (micro-batch invariant, the
images matter), learning on the shapes task, the saved dir loading back as a VLM with its processor, errors."""

from __future__ import annotations

import random

import pytest
import torch

from tiller.config import load_config
from tiller.config.jobs import SFTConfig, validate_job
from tiller.data.files import write_rows
from tiller.errors import ConfigError, DataError, UserError
from tiller.tasks import shapes


def shapes_conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        png, count = shapes.draw(rng)
        rows.append({"messages": [{"role": "user", "content": shapes.QUESTION},
                                  {"role": "assistant", "content": str(count)}],
                     "images": [{"bytes": png}]})
    return rows


@pytest.fixture(scope="module")
def sft_parquet(tmp_path_factory):
    return write_rows(shapes_conversations(16), tmp_path_factory.mktemp("vsft") / "sft.parquet")


def _cfg(model_dir, train, run_dir, *overrides) -> SFTConfig:
    return load_config([f"model.partial_pretrain={model_dir}", f"data.train_files=[{train}]",
                        "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4", "data.max_length=128",
                        "optim.lr=3e-3", "trainer.total_training_steps=6", "trainer.logger=[jsonl]",
                        f"trainer.default_local_dir={run_dir}", *overrides], schema=SFTConfig, validate=validate_job)


def _examples(model_dir, path, **data):
    from tiller.data.sft import load_sft_examples
    from tiller.models.loading import load_tokenizer
    from tiller.models.vision import load_processor

    tok = load_tokenizer(model_dir)
    cfg = _cfg(model_dir, path, "/tmp/unused", *[f"data.{k}={v}" for k, v in data.items()])
    return tok, load_sft_examples([str(path)], cfg.data, tok, processor=load_processor(model_dir, tokenizer=tok))


def test_image_conversation_tokens_and_loss_mask(any_vlm_dir, sft_parquet):
    from tiller.models.vision import image_token, load_processor

    tok, examples = _examples(any_vlm_dir, sft_parquet)
    pad_id = tok.convert_tokens_to_ids(image_token(load_processor(any_vlm_dir)))
    e = examples[0]
    grid = e.multi_modal["image_grid_thw"]
    # 64 x 64 image, patch 8 -> an 8 x 8 grid, merged 2 x 2 -> 16 image tokens
    assert grid.tolist() == [[1, 8, 8]] and e.input_ids.count(pad_id) == 16
    assert e.multi_modal["pixel_values"].shape[0] == 64
    # the loss is on the assistant's answer and its end-of-turn token only (never on image tokens): Qwen's
    # <|im_end|>, the eos <|endoftext|> in the tiny GLM-4.1V's template
    targets = tok.decode([t for t in e.labels if t != -100])
    count = shapes_conversations(1)[0]["messages"][1]["content"]
    assert targets == f"{count}{tok.eos_token}" and tok.eos_token in ("<|im_end|>", "<|endoftext|>")


def test_image_forward_is_micro_batch_invariant_and_reads_the_pixels(any_vlm_dir, sft_parquet):
    from tiller.models.loading import load_causal_lm
    from tiller.trainer.sft import SFTJob

    tok, examples = _examples(any_vlm_dir, sft_parquet)
    model = load_causal_lm(any_vlm_dir).eval()
    batch = examples[:4]
    norm = SFTJob(tok.pad_token_id, 4).normalizer(batch)

    def step_loss(items, micro):
        job = SFTJob(tok.pad_token_id, micro)
        with torch.no_grad():
            return sum(float(job.loss(model, m, norm)[0]) for m in job.micro_batches(items))

    whole, single = step_loss(batch, 4), step_loss(batch, 1)
    assert whole == pytest.approx(single, rel=1e-5)
    # the same conversations over other images give another loss: the pixels reach the model
    swapped = [type(e)(e.input_ids, e.labels, batch[(i + 1) % 4].multi_modal) for i, e in enumerate(batch)]
    assert abs(step_loss(swapped, 4) - whole) > 1e-4


def test_sft_on_shapes_learns_and_saves_a_vlm_with_its_processor(any_vlm_dir, sft_parquet, tmp_path):
    import json

    from tiller.models.loading import is_vision_checkpoint, load_causal_lm
    from tiller.models.vision import image_token, load_processor
    from tiller.trainer.sft import train_sft

    run = tmp_path / "run"
    train_sft(_cfg(any_vlm_dir, sft_parquet, run))
    losses = [json.loads(line)["train/loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    out = run / "hf_model"
    assert (out / "preprocessor_config.json").is_file() and is_vision_checkpoint(out)
    model = load_causal_lm(out)
    assert type(model).__name__ == type(load_causal_lm(any_vlm_dir)).__name__  # Qwen2VL... / Qwen3VL...
    proc = load_processor(out)
    assert proc.image_processor.merge_size == 2 and image_token(proc) in proc.chat_template
    # the checkpoint dir too carries the processor (a resumed / exported run keeps it)
    ckpt = next((run / "checkpoints").glob("global_step_*"))
    assert (ckpt / "model" / "preprocessor_config.json").is_file()


def test_lora_sft_adapts_the_language_model_and_exports_a_merged_vlm(tiny_vlm_dir, sft_parquet, tmp_path):
    from tiller.models.loading import load_causal_lm
    from tiller.trainer import sft as sft_trainer

    cfg = _cfg(tiny_vlm_dir, sft_parquet, tmp_path / "run", "model.lora_rank=4", "model.lora_alpha=8",
               "trainer.total_training_steps=2")
    model, _ = sft_trainer.build_model_and_tokenizer(cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".language_model." in n for n in trainable)
    sft_trainer.train_sft(cfg)
    out = tmp_path / "run" / "hf_model"
    assert type(load_causal_lm(out)).__name__ == "Qwen2VLForConditionalGeneration"
    assert (out / "preprocessor_config.json").is_file() and not (out / "adapter_config.json").exists()


def test_freeze_vision_tower_in_sft(tiny_vlm_dir, tiny_model_dir, sft_parquet, tmp_path):
    from tiller.trainer import sft as sft_trainer

    model, _ = sft_trainer.build_model_and_tokenizer(
        _cfg(tiny_vlm_dir, sft_parquet, tmp_path / "a", "model.freeze_vision_tower=true"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert trainable and all(".visual." not in n for n in trainable)
    assert frozen and all(".visual." in n for n in frozen)
    with pytest.raises(ConfigError, match="model.freeze_vision_tower=True but .* has no vision tower"):
        sft_trainer.build_model_and_tokenizer(_cfg(tiny_model_dir, sft_parquet, tmp_path / "b",
                                                   "model.freeze_vision_tower=true"))


def test_rl_starts_from_the_sft_output(tiny_vlm_dir, sft_parquet, tmp_path):
    """The SFT'd dir is a model `tiller rl` takes: the trainer loads it, its processor encodes image prompts."""
    from tiller.trainer.rl import RLTrainer
    from tiller.trainer.sft import train_sft

    run = tmp_path / "sft"
    train_sft(_cfg(tiny_vlm_dir, sft_parquet, run, "trainer.total_training_steps=1"))
    data = shapes.write_task(tmp_path / "rl", n_train=4, n_test=2, seed=0)
    cfg = load_config([
        f"actor_rollout_ref.model.path={run / 'hf_model'}", f"data.train_files=[{data['train']}]",
        "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=2",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1", "trainer.val_before_train=false",
        "trainer.logger=[jsonl]", "trainer.resume_mode=disable", "trainer.save_freq=-1",
        f"trainer.default_local_dir={tmp_path / 'rl_run'}"])
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
        assert trainer.train_ds.items[0].multi_modal_inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    finally:
        trainer.shutdown()
    assert (tmp_path / "rl_run" / "metrics.jsonl").is_file()


def test_placeholders_without_images_name_the_row(tiny_vlm_dir, tmp_path):
    rows = shapes_conversations(2)
    del rows[1]["images"]
    rows[0]["images"] = None
    path = write_rows([{"messages": r["messages"]} for r in rows], tmp_path / "noimg.parquet")
    with pytest.raises(DataError, match=r"noimg.parquet row 0: the messages have 1 image placeholder\(s\).*no images "
                                        r"\(column 'images', data.image_key\)"):
        _examples(tiny_vlm_dir, path)


def test_image_rows_errors(tiny_vlm_dir, tiny_model_dir, sft_parquet, tmp_path):
    from tiller.trainer.sft import train_sft

    # two placeholders, one image
    rows = shapes_conversations(1)
    rows[0]["messages"][0]["content"] = "<image><image>How many?"
    two = write_rows(rows, tmp_path / "two.parquet")
    with pytest.raises(DataError, match=r"two.parquet row 0: the prompt has 2 image placeholder\(s\).* 1 image"):
        _examples(tiny_vlm_dir, two)
    # image tokens are never truncated
    with pytest.raises(DataError, match=r"sft.parquet row 0: the conversation has \d+ tokens \(image tokens included\)"
                                        r" > data.max_length=20"):
        _examples(tiny_vlm_dir, sft_parquet, max_length=20, truncation="right")
    # a text-only model cannot take the images
    with pytest.raises(DataError, match="sft.parquet row 0: the row has images .* not a vision-language model"):
        train_sft(_cfg(tiny_model_dir, sft_parquet, tmp_path / "text"))
    # packing is refused with its reason, before anything is written
    with pytest.raises(UserError, match="data.packing=True: the data has image conversations"):
        train_sft(_cfg(tiny_vlm_dir, sft_parquet, tmp_path / "packed", "data.packing=true"))
    assert not (tmp_path / "packed").exists()


def test_cli_image_error_exits_2(tiny_vlm_dir, tmp_path, capsys):
    from tiller.cli import main

    rows = [{"messages": r["messages"]} for r in shapes_conversations(1)]
    path = write_rows(rows, tmp_path / "bad.parquet")
    code = main(["sft", f"model.partial_pretrain={tiny_vlm_dir}", f"data.train_files=[{path}]",
                 f"trainer.default_local_dir={tmp_path / 'r'}"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.parquet row 0" in err and "no images" in err
