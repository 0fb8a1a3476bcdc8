"""Image prompts through tiller.trl's GRPO on the tiny Qwen2-VL: TRL's `image` / `images` columns and its
multimodal messages (checked against TRL's own `prepare_multimodal_messages` where TRL is installed), the run's
parquet rows, what reward functions receive, and the refusals."""

from __future__ import annotations

import json
import math

import pytest

from tiller.errors import ConfigError, DataError
from tiller.trl import GRPOConfig, GRPOTrainer
from tiller.trl.images import multimodal_row

COLOURS = [(255, 0, 0), (0, 160, 0), (0, 0, 255), (200, 200, 0)]


def _image(i: int, size: int = 64):
    from PIL import Image

    return Image.new("RGB", (size, size), COLOURS[i % len(COLOURS)])


def _args(run_dir, **kw):
    base = dict(output_dir=str(run_dir), num_generations=2, per_device_train_batch_size=4, max_completion_length=3,
                learning_rate=1e-2, max_steps=1, bf16=False, seed=0, log_completions=True)
    return GRPOConfig(**{**base, **kw})


PROMPTS = [  # TRL's layouts: string contents (a system turn first), and content already in parts
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What colour is it?"}],
    [{"role": "user", "content": [{"type": "text", "text": "Left "}, {"type": "image"}, {"type": "text",
                                                                                        "text": " right"}]}],
]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("n_images", [1, 2])
def test_multimodal_messages_are_trls(prompt, n_images):
    trl_utils = pytest.importorskip("trl.data_utils")
    images = [_image(i) for i in range(n_images)]
    if isinstance(prompt[0]["content"], list):  # parts: one placeholder per image, given in the parts
        prompt = [{"role": "user", "content": [{"type": "image"}] * (n_images - 1) + prompt[0]["content"]}]
    plain, filled, ordered = multimodal_row(prompt, images, "row 0")
    assert filled == trl_utils.prepare_multimodal_messages(prompt, images=images)
    assert ordered == images
    assert plain == [{**m, "content": [{k: v for k, v in p.items() if k != "image"} for p in m["content"]]}
                     for m in filled]


def test_an_image_part_holding_its_image_keeps_it():
    given, column = _image(0), _image(1)
    prompt = [{"role": "user", "content": [{"type": "image", "image": given}, {"type": "image"},
                                           {"type": "text", "text": "Which differs?"}]}]
    plain, filled, ordered = multimodal_row(prompt, [column], "row 0")
    assert ordered == [given, column]  # in the order of their parts
    assert [p.get("image") for p in filled[0]["content"]] == [given, column, None]
    assert plain[0]["content"][:2] == [{"type": "image"}, {"type": "image"}]


def _dataset(n: int = 4, column: str = "image"):
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": f"What colour is picture {i}?"}], "answer": i % 4}
            for i in range(n)]
    for i, row in enumerate(rows):
        row[column] = _image(i) if column == "image" else [_image(i), _image(i + 1)]
    return Dataset.from_list(rows)


def test_grpo_step_on_image_prompts(tmp_path, tiny_vlm_dir):
    pytest.importorskip("datasets")
    from PIL import Image

    seen = []

    def colour_reward(prompts, completions, image, answer, **kwargs):
        seen.append({"prompts": prompts, "image": image, "answer": answer, "completions": completions})
        return [float(len(c[0]["content"]) % 2) for c in completions]

    trainer = GRPOTrainer(model=str(tiny_vlm_dir), reward_funcs=colour_reward, args=_args(tmp_path / "run"),
                          train_dataset=_dataset())
    trainer.train()
    keys = trainer.tiller_keys
    assert keys["data.image_key"] == "images" and keys["data.train_files"][0].endswith("data/train.parquet")
    # one step: 2 prompts x 2 generations, scored in one call; the image kwarg holds the decoded PIL images of the
    # rows (as TRL's data loader yields a datasets image column), the prompts TRL's multimodal messages
    assert len(seen) == 1
    call = seen[0]
    assert len(call["image"]) == 4 and all(isinstance(im, Image.Image) for im in call["image"])
    for prompt, im, answer in zip(call["prompts"], call["image"], call["answer"]):
        assert im.getpixel((0, 0)) == COLOURS[answer]  # the row's own image (answer = row index % 4)
        assert prompt == [{"role": "user", "content": [{"type": "image", "image": im},
                                                       {"type": "text", "text": f"What colour is picture {answer}?"}]}]
    assert all(c[0]["role"] == "assistant" for c in call["completions"])
    # the run's rows: verl's multimodal parquet, each image's PNG bytes as datasets stored them
    from tiller.data.files import read_rows

    rows = read_rows(tmp_path / "run" / "data" / "train.parquet")
    assert [r["extra_info"]["trl_row"] for r in rows] == [0, 1, 2, 3]
    for row, stored in zip(rows, _dataset().to_list()):
        assert row["images"] == [{"bytes": stored["image"]["bytes"]}]
        assert [p["type"] for p in row["prompt"][0]["content"]] == ["image", "text"]
    history = trainer.state.log_history
    assert len(history) == 1 and math.isfinite(history[0]["reward"]) and math.isfinite(history[0]["loss"])
    # the longest prompt counts its 16 image tokens (64 px, patch 8, 2 x 2 merge)
    assert keys["data.max_prompt_length"] > 16
    # log_completions: text records (log_multimodal is a notice: the images are not copied into them)
    dump = [json.loads(line) for line in (tmp_path / "run" / "completions" / "1.jsonl").read_text().splitlines()]
    assert len(dump) == 4 and all(d["input"].endswith("?\nassistant\n") for d in dump), dump[0]["input"]
    assert type(trainer.model).__name__ == "Qwen2VLForConditionalGeneration"  # the trained VLM, loaded back


def test_image_prompt_ids_are_trls_rendering(tmp_path, tiny_vlm_dir):
    """The prompt ids tiller trains on (its RL data path reading the run's parquet) equal the processor applied to
    the chat template of TRL's multimodal messages with their images (what TRL's processor call does)."""
    trl_utils = pytest.importorskip("trl.data_utils")
    from tiller.data.rl_dataset import RLDataset
    from tiller.models.loading import load_tokenizer
    from tiller.models.vision import load_processor

    dataset = _dataset(4, column="images")
    trainer = GRPOTrainer(model=str(tiny_vlm_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=_args(tmp_path / "run"), train_dataset=dataset)
    keys, _ = trainer.translate()
    tokenizer = load_tokenizer(tiny_vlm_dir)
    processor = load_processor(tiny_vlm_dir, tokenizer=tokenizer)
    ours = RLDataset(keys["data.train_files"], tokenizer, max_prompt_length=keys["data.max_prompt_length"],
                     processor=processor, image_key="images")
    for i, row in enumerate(dataset):
        messages = trl_utils.prepare_multimodal_messages(row["prompt"], images=row["images"])
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        want = processor(text=[text], images=row["images"], return_tensors="pt")
        assert ours[i].prompt_ids == list(want["input_ids"][0])
        assert ours[i].prompt_ids.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 32  # 2 images x 16
        assert ours[i].multi_modal_inputs["pixel_values"].equal(want["pixel_values"])
    assert keys["data.max_prompt_length"] == max(len(item.prompt_ids) for item in ours.items)


def test_refusals_name_the_column_and_row(tmp_path, tiny_model_dir, tiny_vlm_dir):
    reward = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731
    rows = [{"prompt": [{"role": "user", "content": "What colour?"}], "image": _image(i)} for i in range(4)]
    with pytest.raises(ConfigError, match="train_dataset: an 'image' column .* is not a vision-language model"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward, args=_args(tmp_path / "a"), train_dataset=rows)
    text = [{"prompt": "What colour?", "image": _image(i)} for i in range(4)]
    trainer = GRPOTrainer(model=str(tiny_vlm_dir), reward_funcs=reward, args=_args(tmp_path / "b"),
                          train_dataset=text)
    with pytest.raises(DataError, match="train_dataset row 0: a standard .string. prompt with images"):
        trainer.translate()
    extra = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                      {"type": "text", "text": "?"}]}], "image": _image(i)}
             for i in range(4)]
    trainer = GRPOTrainer(model=str(tiny_vlm_dir), reward_funcs=reward, args=_args(tmp_path / "c"),
                          train_dataset=extra)
    with pytest.raises(DataError, match=r"train_dataset row 0: 1 image\(s\) in the image column but 2 image "):
        trainer.translate()
    assert not (tmp_path / "c" / "data" / "train.parquet").exists()  # nothing half-written
