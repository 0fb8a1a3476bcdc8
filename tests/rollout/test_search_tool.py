"""Search-agent RL as verl's Search-R1-like example: `tiller retrieval-server` (Search-R1's /retrieve API, a real
encoder, real HTTP), verl's `SearchTool` against it, `tiller data search-r1`'s rows and tool config, the searchR1_*
scorer, and a scripted policy trained through `tiller rl`'s multi-turn loop whose answers are only right when the
retrieval is."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serving import free_port
from tests.trainer.test_tool_rl import ScriptedEngine
from tiller.rewards.registry import default_compute_score
from tiller.rewards.scorers import search_r1
from tiller.rollout.agent import execute_tool_calls, parse_tool_calls
from tiller.rollout.tools import load_tools

# fictional facts: only the corpus knows them
FACTS = {"Zorblat": "the capital of Quentaria", "Mirelle Okafor": "the inventor of the thermal harp",
         "Lake Tsuvani": "the deepest lake on the island of Brell", "Pelgrin": "the currency of the Vashti republic"}
FILLER = ["Bread is baked from flour, water and yeast.", "Volcanoes erupt molten rock called lava.",
          "Chess is a board game for two players.", "Penguins are flightless birds of the southern hemisphere."]
QUESTIONS = {"Zorblat": "What is the capital of Quentaria?", "Mirelle Okafor": "Who invented the thermal harp?",
             "Lake Tsuvani": "Which is the deepest lake on the island of Brell?",
             "Pelgrin": "What is the currency of the Vashti republic?"}


def _write_corpus(path):
    rows = [{"id": str(i), "contents": f"{title}\n{title} is {fact}."} for i, (title, fact) in enumerate(FACTS.items())]
    rows += [{"id": str(len(rows) + i), "contents": f"Note {i}\n{text}"} for i, text in enumerate(FILLER)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def retrieval_server(tmp_path_factory):
    """`tiller retrieval-server` as a user starts it (the shipped MiniLM encoder), on a free port."""
    root = tmp_path_factory.mktemp("retrieval")
    _write_corpus(root / "corpus.jsonl")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tiller.cli", "retrieval-server", "--corpus",
                             str(root / "corpus.jsonl"), "--index", str(root / "index.npy"), "--port", str(port),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):  # bounded: 60 s (torch import, the encoder, the corpus)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()["passages"] == 8:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
            assert proc.poll() is None, proc.stdout.read()
        yield f"http://127.0.0.1:{port}/retrieve", root
    finally:
        proc.terminate()
        proc.wait(10)


def test_retrieval_server_speaks_search_r1s_api(retrieval_server):
    url, root = retrieval_server
    body = httpx.post(url, json={"queries": [QUESTIONS["Zorblat"], QUESTIONS["Pelgrin"]], "topk": 2,
                                 "return_scores": True}).json()
    (first, second) = body["result"]
    assert [len(first), len(second)] == [2, 2]
    assert first[0]["document"]["contents"].startswith("Zorblat\n") and first[0]["document"]["id"] == "0"
    assert second[0]["document"]["contents"].startswith("Pelgrin\n")
    assert first[0]["score"] > first[1]["score"]
    plain = httpx.post(url, json={"queries": [QUESTIONS["Zorblat"]]}).json()["result"]  # server's --topk, no scores
    assert len(plain[0]) == 3 and set(plain[0][0]) == {"id", "contents"}
    assert (root / "index.npy").is_file()  # the passage embeddings, kept for the next start


def test_search_tool_formats_results_as_verl(retrieval_server, tmp_path):
    url, _ = retrieval_server
    from tiller.data.preprocess.search_r1 import tool_config

    (tmp_path / "tools.yaml").write_text(tool_config(url))
    tools = load_tools(tmp_path / "tools.yaml")
    assert tools["search"].schema["function"]["parameters"]["properties"]["query_list"]["type"] == "array"
    call = json.dumps({"name": "search", "arguments": {"query_list": [QUESTIONS["Mirelle Okafor"]]}})
    (result,) = execute_tool_calls(parse_tool_calls(f"<tool_call>{call}</tool_call>"), tools, 10_000)
    text = json.loads(result.text)["result"]
    assert text.startswith("Doc 1 (Title: Mirelle Okafor)\nMirelle Okafor is the inventor of the thermal harp.\n\n"
                           "Doc 2 (Title: ") and text.count("Doc ") == 3 and result.reward == 0.0
    two = json.dumps({"name": "search", "arguments": {"query_list": ["a", "b"]}})
    (both,) = execute_tool_calls(parse_tool_calls(f"<tool_call>{two}</tool_call>"), tools, 10_000)
    assert json.loads(both.text)["result"].count("\n---\n") == 1  # one block per query
    bad = json.dumps({"name": "search", "arguments": {"query_list": "not a list"}})
    (refused,) = execute_tool_calls(parse_tool_calls(f"<tool_call>{bad}</tool_call>"), tools, 10_000)
    assert json.loads(refused.text) == {"result": "Error: 'query_list' is missing, empty, or not a list in parameters."}


class _Flaky(http.server.BaseHTTPRequestHandler):
    """503 for the first request, then one passage; counts requests."""

    hits = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        type(self).hits += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = (503, b"busy") if type(self).hits == 1 else (200, json.dumps({"result": [[{
            "document": {"contents": "T\nx"}, "score": 1.0}]]}).encode())
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _flaky_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()


def test_search_tool_retries_a_5xx_and_reports_an_unreachable_server(tmp_path):
    from tiller.data.preprocess.search_r1 import tool_config

    call = parse_tool_calls('<tool_call>{"name": "search", "arguments": {"query_list": ["q"]}}</tool_call>')
    with _flaky_server() as url:
        (tmp_path / "t.yaml").write_text(tool_config(url).replace("timeout: 30", "timeout: 5\n      max_retries: 2"))
        (result,) = execute_tool_calls(call, load_tools(tmp_path / "t.yaml"), 10_000)
    assert json.loads(result.text) == {"result": "Doc 1 (Title: T)\nx"} and _Flaky.hits == 2  # retried once
    dead = f"http://127.0.0.1:{free_port()}/retrieve"
    (tmp_path / "t.yaml").write_text(tool_config(dead).replace("timeout: 30", "timeout: 5\n      max_retries: 1"))
    (result,) = execute_tool_calls(call, load_tools(tmp_path / "t.yaml"), 10_000)
    assert json.loads(result.text)["result"].startswith("Search error: API Call Failed: ConnectError")


@pytest.mark.parametrize("response,want", [
    ("<think>x</think><answer> The Zorblat! </answer>", 1.0),  # normalised: articles, punctuation, case
    ("<answer>Zorb</answer>", 0.0),
    ("no answer tag Zorblat", 0),
    ("<answer>x</answer>" * 11 + "<answer>Zorblat</answer>", 0.25),  # verl's tag-spam guard: score / 4
])
def test_search_r1_scorer_is_verls_exact_match(response, want):
    truth = {"target": ["Zorblat", "Zorblat City"]}
    assert search_r1.compute_score(response, truth) == want
    assert default_compute_score("searchR1_nq", response, truth) == want


def test_search_agent_trains_with_answers_found_by_retrieval(retrieval_server, tmp_path, tiny_model_dir):
    """`tiller data search-r1` + its tool config + the running server through `tiller rl`'s multi-turn loop: the
    scripted policy searches its question and answers the first document's title, so every score is 1.0 only when
    each sample's search reached the server and came back with the right passage."""
    from tiller.config import load_config
    from tiller.data_cli import main as data_main
    from tiller.trainer.rl import RLTrainer

    url, _ = retrieval_server
    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "test"):
        with open(src / f"{split}.jsonl", "w") as fh:
            for title, question in QUESTIONS.items():
                fh.write(json.dumps({"question": question, "golden_answers": [title], "data_source": "nq"}) + "\n")
    assert data_main(["search-r1", "--src", str(src), "--out", str(tmp_path / "sr1"), "--retrieval-url", url]) == 0

    def script(context: str, k: int) -> str:
        if "<|im_start|>tool\n" in context:
            found = re.search(r"Doc 1 \(Title: ([^)]*)\)", context.rsplit("<|im_start|>tool\n", 1)[1]).group(1)
            return f"<answer>{found}</answer><|im_end|>"
        question = context.rsplit("Question: ", 1)[1].split("<|im_end|>")[0]
        call = json.dumps({"name": "search", "arguments": {"query_list": [question]}})
        return f"<tool_call>{call}</tool_call><|im_end|>"

    data = tmp_path / "sr1"
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{data}/train.parquet]",
                       "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_prompt_length=2048",
                       "data.max_response_length=600", "trainer.total_training_steps=1",
                       "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
                       f"trainer.default_local_dir={tmp_path / 'run'}",
                       "actor_rollout_ref.rollout.multi_turn.enable=True",
                       "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=2000",
                       f"actor_rollout_ref.rollout.multi_turn.tool_config_path={data}/tool_config.yaml"])
    trainer = RLTrainer(cfg)
    try:
        trainer.actor.worker.rollout = ScriptedEngine(trainer.tokenizer, script)
        trainer.global_step = 1
        m: dict = {}
        batch = trainer._collect_batch(m, 1)
        assert len(batch) == 8 and batch["data_source"][0] == "searchR1_nq"
        assert [float(s) for s in batch["score"]] == [1.0] * 8
        assert m["agent/tool_calls/mean"] == 1.0 and m["agent/tool_errors/mean"] == 0.0
    finally:
        trainer.shutdown()
