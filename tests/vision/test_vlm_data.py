"""verl's multimodal RL schema: image rows encoded through the processor, bad rows named, geo3k converter."""

import io

import pytest
import torch
from PIL import Image

from tiller.data.preprocess import geo3k
from tiller.data.rl_dataset import RLDataset, read_rows, write_rows
from tiller.errors import DataError
from tiller.models.vision import IMAGE_PAD, load_processor


def _png(color=(255, 0, 0), size=(64, 64)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _row(content="<image>How many?", images=None, gt="2"):
    return {"data_source": "tiller/shapes", "prompt": [{"role": "user", "content": content}],
            "images": [{"bytes": _png()}] if images is None else images,
            "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": {"k": 1}}


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_processor(tiny_vlm_dir)


def test_image_rows_encode_like_the_processor(tmp_path, processor):
    path = write_rows([_row(), _row("two <image><image>", [{"bytes": _png()}, {"path": str(tmp_path / "b.png")}])],
                      tmp_path / "d.parquet")
    Image.new("RGB", (64, 64), (0, 0, 255)).save(tmp_path / "b.png")
    ds = RLDataset([path], processor.tokenizer, processor=processor, max_prompt_length=256)
    pad = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    one, two = ds[0], ds[1]
    assert one.prompt_ids.count(pad) == 16 and two.prompt_ids.count(pad) == 32
    assert one.multi_modal_inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert two.multi_modal_inputs["pixel_values"].shape == (128, 384) and len(two.images) == 2
    assert one.prompt_text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many?")
    # the second image (blue, from a path) differs from the first (red, bytes)
    pv = two.multi_modal_inputs["pixel_values"]
    assert not torch.equal(pv[:64], pv[64:])


@pytest.mark.parametrize("row, message", [
    (_row(images=[{"bytes": b"garbage"}]), r"d.parquet row 1 images\[0\]: unreadable image"),
    (_row(images=[{"path": "/no/such.png"}]), r"d.parquet row 1 images\[0\]: image file not found"),
    (_row("no placeholder"), r"d.parquet row 1: the prompt has 0 image placeholder\(s\).*row has 1"),
    ({**_row(), "videos": [{"bytes": b"x"}]}, r"d.parquet row 1: the row has videos"),
])
def test_bad_rows_are_named(tmp_path, processor, row, message):
    path = write_rows([{**_row(), "videos": []}, row], tmp_path / "d.parquet")
    with pytest.raises(DataError, match=message):
        RLDataset([path], processor.tokenizer, processor=processor)


def test_image_rows_need_a_vision_model(tmp_path, tiny_model_dir):
    from tiller.models.loading import load_tokenizer

    path = write_rows([_row()], tmp_path / "d.parquet")
    with pytest.raises(DataError, match="row 0: the row has images .* not a vision-language model"):
        RLDataset([path], load_tokenizer(tiny_model_dir))


def test_image_prompts_are_filtered_never_truncated(tmp_path, processor):
    path = write_rows([_row(), _row("short")], tmp_path / "d.parquet")
    with pytest.raises(DataError, match="row 0: image prompt has .* tokens > data.max_prompt_length=20"):
        RLDataset([path], processor.tokenizer, processor=processor, max_prompt_length=20, truncation="left")


def test_image_key_picks_the_column(tmp_path, processor):
    row = _row()
    row["pics"] = row.pop("images")
    ds = RLDataset([write_rows([row], tmp_path / "d.parquet")], processor.tokenizer, processor=processor,
                   image_key="pics")
    assert ds[0].multi_modal_inputs is not None


def test_geo3k_converter_writes_verls_schema(tmp_path, processor):
    src = tmp_path / "geometry3k" / "data"
    for split in ("train", "test"):
        rows = [{"images": [{"bytes": _png(), "path": None}], "problem": f"<image>Find x. ({split} {i})",
                 "answer": str(i + 1)} for i in range(3)]
        write_rows(rows, src / f"{split}-00000-of-00001.parquet")
    paths = geo3k.convert(tmp_path / "geometry3k", tmp_path / "out")
    rows = read_rows(paths["train"])
    assert len(rows) == 3 and rows[1]["data_source"] == "hiyouga/geometry3k"
    assert rows[1]["prompt"][0]["content"].startswith("<image>Find x. (train 1) You FIRST think")
    assert rows[1]["reward_model"]["ground_truth"] == "2" and rows[1]["images"][0]["bytes"] == _png()
    ds = RLDataset([paths["test"]], processor.tokenizer, processor=processor, max_prompt_length=512)
    assert len(ds) == 3 and ds[2].ground_truth == "3"
    bad = tmp_path / "bad" / "data"
    write_rows([{"images": [{"bytes": b"zz"}], "problem": "<image>", "answer": "1"}], bad / "train-0.parquet")
    with pytest.raises(DataError, match=r"train-0.parquet row 0 images\[0\]: unreadable image"):
        geo3k.convert(tmp_path / "bad", tmp_path / "out2")


def test_geo3k_tool_layout_renders_the_schema_into_image_prompts(tmp_path, processor):
    """`tiller data geo3k --tool`: verl's geo3k_multiturn_w_tool.py rows (system message, per-row tools_kwargs) and
    its tool config; the image prompts carry the tool's schema (as text prompts do), and verl's Geo3kTool grades
    the answer against the row's ground truth from create_kwargs."""
    from tiller.data.preprocess.geo3k import TOOL_SYSTEM
    from tiller.rollout.agent import execute_tool_calls, parse_tool_calls, tools_kwargs_of
    from tiller.rollout.tools import load_tools

    src = tmp_path / "geometry3k" / "data"
    for split in ("train", "test"):
        rows = [{"images": [{"bytes": _png(), "path": None}], "problem": f"<image>Find x. ({split} {i})",
                 "answer": str(i + 1)} for i in range(2)]
        write_rows(rows, src / f"{split}-00000-of-00001.parquet")
    paths = geo3k.convert(tmp_path / "geometry3k", tmp_path / "out", tool=True)
    rows = read_rows(paths["train"])
    assert rows[1]["prompt"][0] == {"role": "system", "content": TOOL_SYSTEM}
    assert rows[1]["extra_info"]["tools_kwargs"] == {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "2"}}}
    tools = load_tools(paths["tool_config"])
    schema = tools["calc_geo3k_reward"].schema
    ds = RLDataset([paths["train"]], processor.tokenizer, processor=processor, max_prompt_length=2048,
                   tool_schemas=[schema])
    assert '"name": "calc_geo3k_reward"' in ds[1].prompt_text and ds[1].multi_modal_inputs is not None
    plain = RLDataset([paths["train"]], processor.tokenizer, processor=processor, max_prompt_length=2048)
    assert "calc_geo3k_reward\"" not in plain[1].prompt_text  # (the system message names it; the schema is extra)
    calls = parse_tool_calls('<tool_call>{"name": "calc_geo3k_reward", "arguments": {"answer": "2"}}</tool_call>'
                             '<tool_call>{"name": "calc_geo3k_reward", "arguments": {"answer": "3"}}</tool_call>')
    right, wrong = execute_tool_calls(calls, tools, 1000, tools_kwargs=tools_kwargs_of(ds[1].extra_info))
    assert (right.text, right.reward) == ("Current parsed answer='2' reward=1.0", 0.0)
    assert (wrong.text, wrong.reward) == ("Current parsed answer='3' reward=0.0", -0.05)
