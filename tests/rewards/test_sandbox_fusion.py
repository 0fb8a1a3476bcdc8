"""tiller's SandboxFusion client (tiller.rewards.sandbox_fusion) against the /run_code contract.

CI has no SandboxFusion server: a local HTTP server replays the request / answer pairs that
`scripts/check_sandbox_fusion.py --record` saved from the real one (tests/data/sandbox_fusion/replay.json, SandboxFusion
at bytedance/SandboxFusion main, isolation none), so the script's whole table runs here against the same answers. With
TILLER_SANDBOX_FUSION_URL set, the script runs against that server instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tiller.cli import main as cli
from tiller.config.loader import load_config
from tiller.errors import ConfigError, UserError
from tiller.rewards import RewardRequest, build_reward_manager, default_compute_score, sandbox_fusion
from tiller.rollout.tools import load_tools

ROOT = Path(__file__).resolve().parents[2]
REPLAY = json.loads((ROOT / "tests/data/sandbox_fusion/replay.json").read_text())
SCRIPT = ROOT / "scripts/check_sandbox_fusion.py"


def _key(path: str, body: dict) -> str:
    return path + " " + json.dumps(body, sort_keys=True)


class _Server:
    """A threaded HTTP server on a free localhost port; `answer(path, body) -> (status, text)` decides each reply."""

    def __init__(self, answer):
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                status, text = answer(self.path, body)
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/run_code"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _replay_answer():
    recorded = {_key(r["path"], r["request"]): r for r in REPLAY}

    def answer(path, body):
        r = recorded.get(_key(path, body))
        if r is None:
            return 500, json.dumps({"detail": f"no recorded answer for {body.get('code', '')[:80]!r}"})
        return r["status_code"], json.dumps(r["response"]) if r["status_code"] == 200 else r["response"]
    return answer


@pytest.fixture(scope="module")
def replay():
    server = _Server(_replay_answer())
    yield server
    server.close()


@pytest.fixture
def scripted():
    servers = []

    def make(answer):
        servers.append(_Server(answer))
        return servers[-1]
    yield make
    for server in servers:
        server.close()


def _recorded(code_part: str) -> dict:
    return next(r["response"] for r in REPLAY if code_part in r["request"]["code"] and r["status_code"] == 200)


def _load_script():
    spec = importlib.util.spec_from_file_location("check_sandbox_fusion", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_table_holds_on_the_recorded_answers(replay):
    """Every row of scripts/check_sandbox_fusion.py: correct 1, wrong 0, partial 2/3, errors, limits, compile error."""
    rows = _load_script().check(replay.url)
    assert [name for name, *_, ok in rows if not ok] == []
    assert len(rows) == 21


def test_scores_through_default_compute_score(replay):
    add = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
    tests = json.dumps({"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "10\n"]})
    got = default_compute_score("codecontests", "Here is my solution.\n" + add + "\n", tests, None,
                                sandbox_fusion_url=replay.url)
    assert got == {"score": pytest.approx(2 / 3), "pass_rate": pytest.approx(2 / 3), "num_tests": 3.0,
                   "sandbox_errors": 0.0}
    # the payload is verl's: python, 10 s compile and run limits, memory_limit_MB (1024 when not given)
    assert replay.requests[-1] | {"code": None, "stdin": None} == {
        "compile_timeout": 10, "run_timeout": 10, "code": None, "stdin": None, "memory_limit_MB": 1024,
        "language": "python", "files": {}, "fetch_files": []}


def test_other_data_sources_ignore_the_url(replay):
    before = len(replay.requests)
    assert default_compute_score("openai/gsm8k", "#### 7", "7", None, sandbox_fusion_url=replay.url) == 1.0
    # livecodebench is not in verl's SandboxFusion table: it stays on tiller's local sandbox
    truth = {"inputs": ["2\n"], "outputs": ["4\n"]}
    local = default_compute_score("livecodebench", "```python\nprint(2 * int(input()))\n```", truth, None,
                                  sandbox_fusion_url=replay.url)
    assert local["score"] == 1.0 and len(replay.requests) == before


def test_classify_the_recorded_failures():
    # worked from the real answers: non-zero exit -> -2, TimeLimitExceeded -> -3, compile failure -> -4
    assert sandbox_fusion.classify(_recorded("raise ValueError"), "").outcome == sandbox_fusion.RUNTIME_ERROR
    assert sandbox_fusion.classify(_recorded("while True"), "").outcome == sandbox_fusion.TIMEOUT
    compile_error = sandbox_fusion.classify(_recorded("int main( {"), "")
    assert compile_error.outcome == sandbox_fusion.COMPILE_ERROR and "error" in compile_error.stderr
    ok = _recorded("scanf")
    assert sandbox_fusion.classify(ok, "42").outcome is True  # trailing newlines stripped on both sides
    assert sandbox_fusion.classify(ok, "42 ").outcome is False  # nothing else is normalised
    assert sandbox_fusion.classify(ok, None).outcome is True  # an assert_case test has no expected output
    assert sandbox_fusion.classify({"status": "SandboxError", "message": "x"}, "").status == "sandbox_error"


def test_unscorable_samples_score_0_without_a_request(scripted):
    import doctest

    assert doctest.testmod(sandbox_fusion).failed == 0  # extract_solution's worked cases
    server = scripted(lambda path, body: (500, "unexpected"))
    fenced = "```python\nprint(1)\n```"
    for completion, tests in [("print(1)", {"inputs": ["1"], "outputs": ["1"]}),  # no fence
                              (fenced, "{not json"), (fenced, {"inputs": ["1"]}),  # no outputs
                              (fenced, {"inputs": ["1", "2"], "outputs": ["1"]}),  # counts differ
                              (fenced, {"inputs": [], "outputs": []})]:
        got = sandbox_fusion.compute_score(server.url, None, None, completion, tests, continuous=True)
        assert got["score"] == 0.0 and got["sandbox_errors"] == 0.0, (completion, tests)
    assert server.requests == []


def test_a_compile_error_marks_every_later_case(scripted):
    good, bad = _recorded("scanf"), _recorded("int main( {")
    server = scripted(lambda path, body: (200, json.dumps(bad if body["stdin"] == "bad" else good)))
    results = sandbox_fusion.run_cases(server.url, "code", {"inputs": ["ok", "bad", "ok"], "outputs": ["42"] * 3},
                                       language="cpp")
    assert [r.status for r in results] == ["success", "compile_error", "compile_error_skipped"]


def test_504_is_retried_with_verl_delays(scripted, monkeypatch):
    delays = []
    monkeypatch.setattr(sandbox_fusion.time, "sleep", delays.append)
    answers = iter([(504, "busy"), (504, "busy"), (200, json.dumps(_recorded("scanf")))])
    server = scripted(lambda path, body: next(answers))
    response, error = sandbox_fusion.run_code(server.url, "x", "21\n")
    assert error is None and response["status"] == "Success" and len(server.requests) == 3
    assert delays == [1.0, 2.0]
    server = scripted(lambda path, body: (504, "busy"))
    assert sandbox_fusion.run_code(server.url, "x", "")[0] is None and len(server.requests) == 3


def test_other_failures_are_not_retried_and_score_0(scripted):
    server = scripted(lambda path, body: (500, "oops"))
    result = sandbox_fusion.compute_score(server.url, None, None, "```python\nprint(1)\n```",
                                          {"inputs": ["", ""], "outputs": ["1", "1"]}, continuous=True)
    assert result == {"score": 0.0, "pass_rate": 0.0, "num_tests": 2.0, "sandbox_errors": 2.0}
    assert len(server.requests) == 2  # one request per case, none retried


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/run_code"


def test_unreachable_server_scores_0_counted_and_is_refused_at_start(tmp_path):
    url = _closed_port_url()
    got = sandbox_fusion.compute_score(url, None, None, "```python\nprint(1)\n```", {"inputs": [""], "outputs": ["1"]})
    assert got["score"] == 0.0 and got["sandbox_errors"] == 1.0
    cfg = load_config([f"reward.sandbox_fusion.url={url}"])
    with pytest.raises(UserError, match=r"reward.sandbox_fusion.url=http://127.0.0.1:\d+/run_code: SandboxFusion did "
                                        "not run a test program: ConnectError"):
        build_reward_manager(cfg)


@pytest.mark.parametrize("manager", ["naive", pytest.param("parallel", marks=pytest.mark.slow)])
def test_reward_manager_scores_code_on_the_server(replay, manager):
    cfg = load_config([f"reward.sandbox_fusion.url={replay.url}", "reward.sandbox_fusion.max_concurrent=2",
                       f"reward_model.reward_manager={manager}", "reward_model.num_workers=2"])
    fn = build_reward_manager(cfg)
    tests = json.dumps({"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "10\n"]})
    right = "Here is my solution.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
    wrong = "Here is my solution.\n```python\na, b = map(int, input().split())\nprint(a - b)\n```\n"
    try:
        result = fn([RewardRequest("codecontests", "p", right, tests), RewardRequest("taco", "p", wrong, tests),
                     RewardRequest("openai/gsm8k", "p", "#### 7", "7")])
    finally:
        fn.close()
    assert result.scores.tolist() == [1.0, 0.0, 1.0]
    assert result.extras["num_tests"][:2].tolist() == [3.0, 3.0] and result.metrics["reward/num_errors"] == 0.0


def test_reward_timeout_ends_a_sample_whose_server_hangs(scripted):
    release, waited_out = threading.Event(), []

    def hang(path, body):
        if body["code"] == "print('tiller')":  # the start-up check runs
            return 200, json.dumps(_recorded("scanf") | {"run_result": {"status": "Finished", "return_code": 0,
                                                                         "stdout": "tiller\n", "stderr": ""}})
        if not release.wait(20):  # the client waited for this request instead of ending the sample
            waited_out.append(body["stdin"])
        return 500, "late"

    server = scripted(hang)
    cfg = load_config([f"reward.sandbox_fusion.url={server.url}", "reward_model.timeout=1"])
    fn = build_reward_manager(cfg)
    tests = json.dumps({"inputs": [f"{i}\n" for i in range(40)], "outputs": ["0\n"] * 40})
    try:
        result = fn([RewardRequest("apps", "p", "```python\nprint(0)\n```", tests)])
    finally:
        release.set()
    # the sample scored 0 as a timeout while its requests still hung (40 cases queued; the hung ones end alone)
    assert result.scores.tolist() == [0.0] and result.metrics["reward/num_timeouts"] == 1.0
    assert waited_out == []


def test_slots_are_shared_across_processes_and_freed_when_a_holder_dies(tmp_path):
    sem = sandbox_fusion.SlotSemaphore(str(tmp_path), 1)
    copy = pickle.loads(pickle.dumps(sem))  # what a reward worker process receives
    assert sem.acquire(timeout=0) and not copy.acquire(timeout=0)
    sem.release()
    holder = subprocess.Popen(  # another process takes the one slot file (what SlotSemaphore.acquire does)
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)",
         str(tmp_path / "slot-0")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not sem.acquire(timeout=0)
    finally:
        holder.kill()
        holder.wait()
    assert sem.acquire(timeout=0)  # the kernel dropped the dead holder's lock
    sem.release()


def test_slots_bound_the_threads_of_one_process(tmp_path):
    sem, lock, state = sandbox_fusion.SlotSemaphore(str(tmp_path), 2), threading.Lock(), {"in": 0, "most": 0}

    def work():
        for _ in range(5):
            with sem:
                with lock:
                    state["in"] += 1
                    state["most"] = max(state["most"], state["in"])
                threading.Event().wait(0.002)
                with lock:
                    state["in"] -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 1 <= state["most"] <= 2 and state["in"] == 0


# ------------------------------------------------------------------------------- verl's SandboxFusionTool
VERL_TOOL_YAML = """tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config: {{sandbox_fusion_url: "{url}", num_workers: 128, enable_global_rate_limit: true, rate_limit: 128,
             default_timeout: 30, default_language: python, memory_limit_mb: 1024, type: native{extra}}}
    tool_schema:
      type: function
      function:
        name: code_interpreter
        description: A tool for executing code.
        parameters: {{type: object, properties: {{code: {{type: string, description: The code to execute.}}}},
                     required: [code]}}
"""


def test_verl_retool_tool_config_loads_and_runs(replay, tmp_path):
    path = tmp_path / "sandbox_fusion_tool_config.yaml"  # verl's retool recipe's file, as written there
    path.write_text(VERL_TOOL_YAML.format(url=replay.url, extra=""))
    tool = load_tools(path)["code_interpreter"]
    assert tool({"code": "print(6 * 7)"}) == "42\n"  # a recorded run of the real server
    assert tool({"code": "while True:\n    pass", "timeout": 1}) == "no stdout here"


@pytest.mark.parametrize("url, extra, message", [
    ("", "", r"tools\[0\]: SandboxFusionTool: config.sandbox_fusion_url is not set"),
    ("http://127.0.0.1:8080/run_code", ", retries: 3", r"tools\[0\]: SandboxFusionTool: unknown config keys \['retries'\]"),
    (None, "", r"tools\[0\]: SandboxFusionTool: config.sandbox_fusion_url=http://127.0.0.1:\d+/run_code: "
               "SandboxFusion did not run a test program"),
])
def test_verl_tool_config_errors_name_the_entry(tmp_path, url, extra, message):
    path = tmp_path / "tools.yaml"
    path.write_text(VERL_TOOL_YAML.format(url=_closed_port_url() if url is None else url, extra=extra))
    with pytest.raises(ConfigError, match=message):
        load_tools(path)


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("key", ["reward.sandbox_fusion", "reward_model.sandbox_fusion", "sandbox_fusion"])
def test_each_verl_place_resolves_onto_one_setting(key):
    cfg = load_config([f"{key}.url=http://h:8080/run_code", f"{key}.max_concurrent=3"])
    # the top-level section's nulls are verl's defaults (64 / 1024)
    assert cfg.reward_model.sandbox_fusion == {"url": "http://h:8080/run_code", "max_concurrent": 3,
                                               "memory_limit_mb": 1024}


def test_two_places_set_is_an_error_naming_both():
    with pytest.raises(ConfigError, match="sandbox_fusion and reward.sandbox_fusion are the same setting"):
        load_config(["sandbox_fusion.url=http://a:1/run_code", "reward.sandbox_fusion.url=http://b:1/run_code"])


@pytest.mark.parametrize("item, message", [
    ("reward.sandbox_fusion.max_concurrent=0", "reward.sandbox_fusion.max_concurrent must be a whole number > 0"),
    ("reward_model.sandbox_fusion.memory_limit_mb=-1", "reward_model.sandbox_fusion.memory_limit_mb must be"),
    ("+reward.sandbox_fusion.timeout=5", r"reward.sandbox_fusion: unknown keys \['timeout'\]"),
    ("custom_reward_function.path=x.py", "which custom_reward_function.path replaces"),
    ("reward_model.remote_url=http://rm:1/score", "which reward_model.remote_url replaces"),
])
def test_bad_settings_name_the_key(item, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["reward.sandbox_fusion.url=http://h:8080/run_code", item])


def test_bad_url_exits_2_naming_the_key(capsys):
    assert cli(["config", "show", "sandbox_fusion.url=localhost:8080"]) == 2
    err = capsys.readouterr().err
    assert "sandbox_fusion.url must be a SandboxFusion endpoint http(s)://HOST:PORT/run_code" in err
    assert "Traceback" not in err


@pytest.mark.skipif(not os.environ.get("TILLER_SANDBOX_FUSION_URL"), reason="set TILLER_SANDBOX_FUSION_URL to a "
                    "running SandboxFusion /run_code endpoint")
def test_the_check_script_against_a_real_server():
    res = subprocess.run([sys.executable, str(SCRIPT), "--url", os.environ["TILLER_SANDBOX_FUSION_URL"]],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "21/21 as expected" in res.stdout
