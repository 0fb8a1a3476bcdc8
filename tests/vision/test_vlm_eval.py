"""`tiller eval` / `tiller data filter-difficulty` on a vision-language model: the image prompts go through the
model's processor, every sample is generated with its row's pixels (the greedy answers are the engine's with the
images, not without them) and the reward function gets the row's images, as in `tiller rl`."""

from __future__ import annotations

import json

import pytest

from tests.vision.test_vlm_rl import REWARD_SRC
from tiller.cli import main
from tiller.tasks import shapes


@pytest.fixture(scope="module")
def shapes_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes_eval")
    shapes.write_task(root, n_train=4, n_test=6, seed=0)
    (root / "reward.py").write_text(REWARD_SRC)
    return root


def test_eval_generates_with_the_images_and_scores_with_them(tmp_path, tiny_vlm_dir, shapes_data, monkeypatch):
    from tiller.data.rl_dataset import RLDataset
    from tiller.models.loading import load_causal_lm, load_tokenizer
    from tiller.models.vision import load_processor
    from tiller.rollout import SamplingParams
    from tiller.rollout.native import NativeRolloutEngine

    log = tmp_path / "reward.log"
    monkeypatch.setenv("SHAPES_LOG", str(log))
    samples = tmp_path / "samples.jsonl"
    code = main(["eval", "--model", str(tiny_vlm_dir), "--data", str(shapes_data / "test.parquet"),
                 "--out", str(tmp_path / "eval.json"), "--samples", str(samples), "data.max_response_length=6",
                 "data.max_prompt_length=512", "actor_rollout_ref.rollout.dtype=float32",
                 f"custom_reward_function.path={shapes_data / 'reward.py'}"])
    assert code == 0
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == len(seen) == 6 and all(s == {"n": 1, "size": [64, 64]} for s in seen)
    # the same greedy decoding by the engine directly, with and without the pixels
    tok = load_tokenizer(str(tiny_vlm_dir), padding_side="left")
    processor = load_processor(str(tiny_vlm_dir), tokenizer=tok)
    items = RLDataset([shapes_data / "test.parquet"], tok, processor=processor, max_prompt_length=512).items
    engine = NativeRolloutEngine(load_causal_lm(str(tiny_vlm_dir), dtype="float32"), tok, dtype="float32")
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    with_images = engine.generate([it.prompt_ids for it in items], greedy,
                                  multi_modal=[it.multi_modal_inputs for it in items])
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in with_images.response_ids]
    assert [r["response"] for r in records] == texts


def test_filter_difficulty_takes_image_prompts(tmp_path, tiny_vlm_dir, shapes_data):
    code = main(["data", "filter-difficulty", "--model", str(tiny_vlm_dir), "--data",
                 str(shapes_data / "test.parquet"), "--k", "2", "--keep", "0:1", "--out", str(tmp_path / "kept.parquet"),
                 "data.max_response_length=4", "data.max_prompt_length=512", "actor_rollout_ref.rollout.dtype=float32"])
    assert code == 0 and (tmp_path / "kept.parquet").is_file()


def test_generate_writes_image_rows_to_parquet_and_refuses_jsonl_before_generating(tmp_path, tiny_vlm_dir,
                                                                                    tiny_model_dir, shapes_data,
                                                                                    capsys):
    from tiller.data.rl_dataset import read_rows

    base = ["generate", "--data", str(shapes_data / "test.parquet"), "data.max_response_length=4",
            "data.max_prompt_length=512", "actor_rollout_ref.rollout.dtype=float32", "--no-progress"]
    assert main(base + ["--model", str(tiny_vlm_dir), "--out", str(tmp_path / "gens.parquet")]) == 0
    rows = read_rows(tmp_path / "gens.parquet")
    assert len(rows) == 6 and all(len(r["responses"]) == 1 for r in rows) and rows[0]["images"]
    capsys.readouterr()
    assert main(base + ["--model", str(tiny_vlm_dir), "--out", str(tmp_path / "gens.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "gens.jsonl: row 0 field 'images' cannot be written as JSON" in err and "write a .parquet" in err
    assert not (tmp_path / "gens.jsonl").exists()
    assert main(base + ["--model", str(tiny_model_dir), "--out", str(tmp_path / "text.parquet")]) == 2
    assert "row 0: the row has images (column 'images') but the model is not a vision-language" in \
        capsys.readouterr().err
