"""Image prompts through tiller.trl's GRPO on the tiny Qwen2-VL: TRL's `image` / `images` columns and its
multimodal messages (checked against TRL's own `prepare_multimodal_messages` where TRL is installed), the run's
parquet rows, what reward functions receive, and the refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch

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


@pytest.mark.slow
def test_grpo_on_image_prompts_learns(tmp_path, tiny_vlm_dir):
    """12 GRPO steps on 32 image prompts (the text example's digit reward, the completions of a VLM seeing an
    image): the mean reward rises (0.016 -> 0.795 for the first / last 3 steps on the dev host, 28-76 s)."""
    pytest.importorskip("datasets")
    from datasets import Dataset

    def digit_reward(completions, image, **kwargs):
        assert all(im.size == (64, 64) for im in image)
        return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Question {i}: count the squares."}],
                                  "image": _image(i)} for i in range(32)])
    args = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=8, per_device_train_batch_size=32,
                      max_completion_length=6, learning_rate=1e-2, max_steps=12, bf16=False, seed=0)
    trainer = GRPOTrainer(model=str(tiny_vlm_dir), reward_funcs=digit_reward, args=args, train_dataset=dataset)
    trainer.train()
    rewards = [row["reward"] for row in trainer.state.log_history]
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards


def test_rloo_with_an_image_eval_dataset(tmp_path, tiny_vlm_dir):
    """RLOO takes image prompts the same way; an eval_dataset with images validates on them, its rows reaching
    the reward function (a list of dicts: the images as given)."""
    from tiller.trl import RLOOConfig, RLOOTrainer

    seen = []

    def size_reward(prompts, completions, images, **kwargs):
        seen.append([im.size for ims in images for im in ims])
        return [float(len(c[0]["content"])) for c in completions]

    def rows(n, size):
        return [{"prompt": [{"role": "user", "content": f"Which colours ({i})?"}],
                 "images": [_image(i, size), _image(i + 1, size)]} for i in range(n)]

    args = RLOOConfig(output_dir=str(tmp_path / "run"), num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=3, max_steps=1, bf16=False, eval_strategy="steps", eval_steps=1, beta=0.0)
    trainer = RLOOTrainer(str(tiny_vlm_dir), size_reward, args=args, train_dataset=rows(4, 64),
                          eval_dataset=rows(2, 32))
    trainer.train()
    assert trainer.tiller_keys["data.val_files"][0].endswith("data/eval.parquet")
    assert trainer.tiller_keys["algorithm.adv_estimator"] == "rloo"
    assert [(64, 64)] * 8 in seen  # a training batch: 2 prompts x 2 completions x 2 images, as given
    assert [(32, 32)] * 8 in seen  # validation: 2 prompts x 2 completions x 2 images
    assert math.isfinite(trainer.state.log_history[-1]["eval_reward"])


def test_image_prompt_ids_are_trls(tmp_path, tiny_vlm_dir, trl_processor):
    """The prompt ids and pixels tiller trains on (its RL data path reading the run's parquet) equal TRL's own
    `GRPOTrainer._tokenize_prompts` with the real Qwen2VLProcessor on TRL's multimodal messages."""
    trl_utils = pytest.importorskip("trl.data_utils")
    from types import SimpleNamespace

    from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer

    from tiller.data.rl_dataset import RLDataset
    from tiller.models.loading import load_tokenizer
    from tiller.models.vision import load_processor

    dataset = _dataset(4, column="images")
    trainer = GRPOTrainer(model=str(tiny_vlm_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=_args(tmp_path / "run"), train_dataset=dataset)
    keys, _ = trainer.translate()
    tokenizer = load_tokenizer(tiny_vlm_dir)
    ours = RLDataset(keys["data.train_files"], tokenizer, max_prompt_length=keys["data.max_prompt_length"],
                     processor=load_processor(tiny_vlm_dir, tokenizer=tokenizer), image_key="images")
    prompts = [trl_utils.prepare_multimodal_messages(row["prompt"], images=row["images"]) for row in dataset]
    trl_self = SimpleNamespace(processing_class=trl_processor, _is_vlm=True, environment_factories=None, tools=None,
                               chat_template=None, chat_template_kwargs={})
    ids, images, fields = TRLGRPOTrainer._tokenize_prompts(trl_self, prompts)
    assert [item.prompt_ids for item in ours.items] == [list(x) for x in ids]
    assert all(x.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 32 for x in ids)  # 2 images x 16
    assert torch.equal(torch.cat([item.multi_modal_inputs["pixel_values"] for item in ours.items]),
                       torch.as_tensor(fields["pixel_values"]))
    assert keys["data.max_prompt_length"] == max(len(x) for x in ids)


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
