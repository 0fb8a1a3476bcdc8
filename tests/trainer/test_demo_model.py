"""The demo's model is prompted as it was trained wherever it goes (issue 41, item 1).

The demo trains on short prompts (`"47+38="`); its tokenizer carries that template (`demo.PROMPT_TEMPLATE`),
so `tiller eval` (default `data.apply_chat_template=true`), `tiller serve`'s chat API through the `openai`
client and transformers' `apply_chat_template` + `generate` on the model dir give the same greedy answers as
the demo's own validation. With the tiny kit's ChatML template instead, every one of them prompted differently
(the demo's model then scored 0 outside the demo).
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

from tiller.cli import main as cli_main
from tiller.data.rl_dataset import write_rows
from tiller.tasks import arithmetic
from tiller.trainer import demo

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("demo_model_example", ROOT / "examples" / "demo_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_like(tiny_model_dir, tmp_path_factory):
    """(model dir, held-out rows, parquet): the 1M tiny model with the demo starter's tokenizer template."""
    import shutil

    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("demo_model")
    shutil.copytree(tiny_model_dir, root / "model")
    tok = AutoTokenizer.from_pretrained(root / "model")
    tok.chat_template = demo.PROMPT_TEMPLATE  # as demo.starter_model saves it
    tok.save_pretrained(root / "model")
    rows = arithmetic.make_splits(n_train=8, n_test=8, seed=0)[1]
    write_rows(rows, root / "test.parquet")
    return root / "model", rows, root / "test.parquet"


@pytest.fixture(scope="module")
def reference(demo_like):
    """The greedy answers to the prompts the demo trained on (`"47+38="` as is): native engine, 6 new tokens."""
    from tiller.models.loading import load_causal_lm, load_tokenizer
    from tiller.rollout import build_rollout_engine, SamplingParams

    model_dir, rows, _ = demo_like
    tok = load_tokenizer(model_dir, padding_side="left")
    engine = build_rollout_engine("native", load_causal_lm(model_dir).eval(), tok, dtype=None)
    out = engine.generate([tok(r["prompt"][0]["content"], add_special_tokens=False)["input_ids"] for r in rows],
                          SamplingParams(do_sample=False, max_new_tokens=6))
    return tok.batch_decode(out.response_ids, skip_special_tokens=True)


def test_the_template_renders_the_prompt_as_the_demo_trained_it(demo_like):
    from transformers import AutoTokenizer

    model_dir, rows, _ = demo_like
    tok = AutoTokenizer.from_pretrained(model_dir)
    for row in rows:
        text = row["prompt"][0]["content"]  # "47+38="
        plain = tok(text, add_special_tokens=False)["input_ids"]
        assert demo._prompt_ids(tok, row) == plain
        assert tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False) == text
    # a reply in a longer chat ends with eos; turns are joined by a newline
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2="}]
    assert tok.apply_chat_template(chat, tokenize=False) == f"1+2=\n3{tok.eos_token}\n2+2="


def test_tiller_eval_gives_the_demos_answers(demo_like, reference, tmp_path):
    model_dir, _, parquet = demo_like
    samples = tmp_path / "samples.jsonl"
    assert cli_main(["eval", "--model", str(model_dir), "--data", str(parquet), "--out", str(tmp_path / "e.json"),
                     "--samples", str(samples), "--no-progress", "data.max_response_length=6",
                     "actor_rollout_ref.rollout.dtype=float32"]) == 0
    records = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["prompt_index"])
    assert [r["response"] for r in records] == reference


def test_transformers_generate_gives_the_demos_answers(demo_like, reference):
    model_dir, rows, _ = demo_like
    assert _example().answers_transformers(str(model_dir), rows) == reference


def test_serve_with_the_openai_client_gives_the_demos_answers(demo_like, reference):
    pytest.importorskip("openai")
    import socket

    import uvicorn

    from tiller.serve.app import create_app
    from tiller.serve.cli import _parser, build_served_model

    model_dir, rows, _ = demo_like
    served = build_served_model(_parser().parse_args([str(model_dir), "--dtype", "float32"]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(served), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):  # bounded: 20 s
            if server.started:
                break
            time.sleep(0.1)
        assert server.started, "server did not start"
        assert _example().answers_openai(f"http://127.0.0.1:{port}/v1", rows) == reference
    finally:
        server.should_exit = True
        thread.join(10)
