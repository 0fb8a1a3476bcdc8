"""`tiller generate` and `tiller eval` end to end on the tiny model, plus eval's bookkeeping with a scripted engine."""

from __future__ import annotations

import json

import pytest

from tiller.cli import main as cli
from tiller.rollout import RolloutOutput

FAST = ["actor_rollout_ref.rollout.dtype=float32", "data.max_response_length=6"]


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as fh:
        for a, b in [(1, 2), (3, 4), (5, 5)]:
            fh.write(json.dumps({"data_source": "tiller/arithmetic",
                                 "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                                 "reward_model": {"style": "rule", "ground_truth": str(a + b)}}) + "\n")
    return path


def test_generate_writes_n_responses_per_prompt_reproducibly(tiny_model_dir, prompt_file, tmp_path):
    outs = []
    for name in ("a.jsonl", "b.jsonl"):
        code = cli(["generate", "--data", str(prompt_file), "--out", str(tmp_path / name), "--model",
                    str(tiny_model_dir), "--no-progress", "actor_rollout_ref.rollout.n=3", "trainer.seed=5", *FAST])
        assert code == 0
        outs.append([json.loads(line) for line in open(tmp_path / name)])
    rows = outs[0]
    assert len(rows) == 3
    for row in rows:
        assert len(row["responses"]) == 3 and len(row["finish_reasons"]) == 3
        assert all(1 <= n <= 6 for n in row["response_lengths"])
        assert row["prompt_text"].startswith("<|im_start|>user\n")
        assert row["data_source"] == "tiller/arithmetic"  # input columns kept
    assert outs[0] == outs[1]  # same seed, same samples
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "prompts.jsonl"]  # no temp files


def test_generate_plain_text_prompts_to_parquet(tiny_model_dir, tmp_path):
    import pyarrow.parquet as pq

    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "hello"}\n{"prompt": "2+2="}\n')
    out = tmp_path / "g.parquet"
    assert cli(["generate", "--data", str(src), "--out", str(out), "--model", str(tiny_model_dir), "--no-progress",
                "actor_rollout_ref.rollout.do_sample=False", *FAST]) == 0
    table = pq.read_table(out).to_pylist()
    assert [len(r["responses"]) for r in table] == [1, 1]


def test_generate_takes_the_rollouts_penalties_and_regex(tiny_model_dir, prompt_file, tmp_path):
    """`tiller generate` samples with rollout.repetition_penalty / frequency_penalty and structured_outputs_regex (the
    same keys as `tiller rl`): greedy answers of the fresh tiny model repeat one token without them."""
    import re

    rows = {}
    for name, extra in (("plain", []), ("penalised", ["actor_rollout_ref.rollout.repetition_penalty=3.0",
                                                      "actor_rollout_ref.rollout.frequency_penalty=1.0"]),
                        ("regex", ["actor_rollout_ref.rollout.structured_outputs_regex='[0-9]{1,2}'"])):
        out = tmp_path / f"{name}.jsonl"
        assert cli(["generate", "--data", str(prompt_file), "--out", str(out), "--model", str(tiny_model_dir),
                    "--no-progress", "actor_rollout_ref.rollout.do_sample=False", *FAST, *extra]) == 0
        rows[name] = [json.loads(line)["responses"][0] for line in open(out)]
    assert rows["penalised"] != rows["plain"]
    assert all(re.fullmatch("[0-9]{1,2}", r) for r in rows["regex"]), rows["regex"]


def test_generate_and_eval_bad_input_exit_2(tiny_model_dir, tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text('{"question": "hello"}\n')
    assert cli(["generate", "--data", str(src), "--out", str(tmp_path / "o.jsonl"), "--model", str(tiny_model_dir),
                *FAST]) == 2
    assert "missing column 'prompt'" in capsys.readouterr().err
    assert cli(["generate", "--data", str(src), "--out", str(tmp_path / "o.txt"), "--model", str(tiny_model_dir)]) == 2
    assert cli(["eval", "--model", str(tiny_model_dir), *FAST]) == 2
    assert "data.val_files" in capsys.readouterr().err
    assert cli(["eval", "--model", str(tmp_path / "nope"), "--data", str(src)]) == 2


def test_eval_cli_writes_metrics_json(tiny_model_dir, prompt_file, tmp_path, capsys):
    out, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    code = cli(["eval", "--model", str(tiny_model_dir), "--data", str(prompt_file), "--out", str(out), "--samples",
                str(samples), "--no-progress", "actor_rollout_ref.rollout.val_kwargs.n=4",
                "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
                "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", *FAST])
    assert code == 0
    report = json.loads(out.read_text())
    m = report["metrics"]["tiller/arithmetic"]
    assert m["num_prompts"] == 3 and m["n"] == 4
    assert set(m) >= {"mean@4", "pass@1", "pass@2", "pass@4", "maj@1", "maj@2", "maj@4", "reward/mean@4"}
    assert m["pass@1"] == pytest.approx(m["mean@4"])  # pass@1 is the mean accuracy
    assert m["pass@1"] <= m["pass@2"] <= m["pass@4"]
    assert len(samples.read_text().splitlines()) == 12
    assert "pass@4" in capsys.readouterr().out  # the table


class ScriptedEngine:
    """Answers prompt i's sample j with a fixed text; checks eval's row bookkeeping."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script

    def generate(self, prompt_ids, sampling):
        out = RolloutOutput()
        for p in prompt_ids:
            question = self.tokenizer.decode(p)
            for j in range(sampling.n):
                ids = self.tokenizer(self.script(question, j), add_special_tokens=False)["input_ids"]
                out.prompt_ids.append(p)
                out.response_ids.append(ids)
                out.logprobs.append([0.0] * len(ids))
                out.finish_reason.append("stop")
        return out


def test_eval_metrics_with_scripted_answers(tiny_model_dir, prompt_file, monkeypatch):
    """Prompts 1+2, 3+4, 5+5 with n=4 scripted samples:
    1+2: "3","3","0","0"  -> c=2, maj "3" (tie 2-2, first)      correct
    3+4: "7","1","1","2"  -> c=1, maj "1"                      wrong
    5+5: "0","0","0","0"  -> c=0                                wrong
    mean@4 = (2/4 + 1/4 + 0)/3 = 0.25
    pass@2 = (1 - C(2,2)/C(4,2)) + (1 - C(3,2)/C(4,2)) + 0 = (5/6 + 1/2)/3 = 4/9
    pass@4 = (1 + 1 + 0)/3 = 2/3;  maj@4 = (1 + 0 + 0)/3 = 1/3
    """
    from tiller.models.loading import load_tokenizer

    answers = {"1+2": ["3", "3", "0", "0"], "3+4": ["7", "1", "1", "2"], "5+5": ["0"] * 4}
    tok = load_tokenizer(tiny_model_dir, padding_side="left")

    def script(question, j):
        key = next(k for k in answers if k in question)
        return f"{key}={answers[key][j]}"

    report, records = _scripted_eval(monkeypatch, tok, script, tiny_model_dir, prompt_file,
                                     "actor_rollout_ref.rollout.val_kwargs.n=4",
                                     "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
                                     "actor_rollout_ref.rollout.val_kwargs.temperature=1.0")
    m = report["metrics"]["tiller/arithmetic"]
    assert m["mean@4"] == pytest.approx(0.25)
    assert m["pass@2"] == pytest.approx(4 / 9)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["maj@4"] == pytest.approx(1 / 3)
    assert [r["pred"] for r in records[:4]] == ["3", "3", "0", "0"]
    assert [r["prompt_index"] for r in records] == [0] * 4 + [1] * 4 + [2] * 4


def test_eval_multi_turn_with_the_calculator(tiny_model_dir, prompt_file, monkeypatch):
    """A scripted policy that asks the calculator, then repeats its result: every answer is right, each sample
    takes 2 turns and 1 tool call, and the prompts carry the tool schema."""
    import re

    from tiller.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_model_dir, padding_side="left")
    seen = []

    def script(context, j):
        seen.append(context)
        if "<|im_start|>tool\n" in context:
            return "so " + context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0] + "<|im_end|>"
        a, b = re.findall(r"(\d+)\+(\d+)=", context)[-1]
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}+{b}"}}}}</tool_call><|im_end|>'

    report, records = _scripted_eval(monkeypatch, tok, script, tiny_model_dir, prompt_file,
                                     "actor_rollout_ref.rollout.multi_turn.enable=True",
                                     "data.max_prompt_length=512", "data.max_response_length=300")
    assert report["metrics"]["tiller/arithmetic"]["mean@1"] == 1.0
    assert report["agent"] == {"turns/mean": 2.0, "tool_calls/mean": 1.0, "tool_errors/mean": 0.0,
                               "tool_reward/mean": 0.0}
    assert [r["pred"] for r in records] == ["3", "7", "10"]
    assert '"name": "calculator"' in seen[0]


def test_generate_and_eval_accept_keys_after_options(tiny_model_dir, prompt_file, tmp_path):
    """`tiller eval key=v --out F key2=v` (keys on both sides of an option) parses, as users type it."""
    gens = tmp_path / "g.jsonl"
    code = cli(["generate", "actor_rollout_ref.rollout.n=2", "--data", str(prompt_file), "--out", str(gens),
                "--no-progress", "--model", str(tiny_model_dir), "trainer.seed=5", *FAST])
    assert code == 0
    assert all(len(json.loads(line)["responses"]) == 2 for line in open(gens))
    out = tmp_path / "eval.json"
    code = cli(["eval", f"actor_rollout_ref.model.path={tiny_model_dir}", "--out", str(out), "--no-progress",
                f"data.val_files=[{prompt_file}]", "actor_rollout_ref.rollout.val_kwargs.n=2",
                "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
                *FAST])
    assert code == 0
    assert json.loads(out.read_text())["metrics"]["tiller/arithmetic"]["n"] == 2.0


def _scripted_eval(monkeypatch, tok, script, tiny_model_dir, prompt_file, *overrides):
    """run_eval with the policy replaced by a scripted engine answering `script(context, j)`."""
    import tiller.evaluation.evaluate as evaluate
    import tiller.evaluation.runner as runner
    from tiller.config import load_config
    from tiller.evaluation.evaluate import run_eval

    monkeypatch.setattr(evaluate, "policy_from_config",
                        lambda cfg: runner.Policy(ScriptedEngine(tok, script), tok, str(tiny_model_dir)))
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.val_files=[{prompt_file}]",
                       *overrides])
    return run_eval(cfg, progress=False)


TOOLS_PY = '''
from verl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> tuple:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return str(a + b), 0.25
'''

REWARD_PY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the right number after 'so ', plus the tool rewards verl's reward managers hand over."""
    answer = solution_str.rsplit("so ", 1)[-1].strip()
    return float(answer == ground_truth) + sum(extra_info["tool_rewards"])
'''


def test_eval_multi_turn_with_verl_function_tools(tiny_model_dir, prompt_file, monkeypatch, tmp_path):
    """verl's data.function_tool_path: a scripted policy calls the file's `add` tool (verl import, no verl installed),
    then repeats its result; the tool's reward (0.25 a call) reaches the reward function in
    extra_info["tool_rewards"], so every sample scores 1 + 0.25, and the prompts carry `add`'s inferred schema."""
    import re

    from tiller.models.loading import load_tokenizer

    (tmp_path / "tools.py").write_text(TOOLS_PY)
    (tmp_path / "reward.py").write_text(REWARD_PY)
    tok = load_tokenizer(tiny_model_dir, padding_side="left")
    seen = []

    def script(context, j):
        seen.append(context)
        if "<|im_start|>tool\n" in context:
            return "so " + context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0] + "<|im_end|>"
        a, b = re.findall(r"(\d+)\+(\d+)=", context)[-1]
        return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call><|im_end|>'

    report, records = _scripted_eval(monkeypatch, tok, script, tiny_model_dir, prompt_file,
                                     "actor_rollout_ref.rollout.multi_turn.enable=True",
                                     f"data.function_tool_path={tmp_path / 'tools.py'}",
                                     f"custom_reward_function.path={tmp_path / 'reward.py'}",
                                     "data.max_prompt_length=1024", "data.max_response_length=300")
    assert [r["score"] for r in records] == [1.25, 1.25, 1.25]
    assert report["agent"] == {"turns/mean": 2.0, "tool_calls/mean": 1.0, "tool_errors/mean": 0.0,
                               "tool_reward/mean": 0.25}
    assert '"name": "add"' in seen[0] and '"description": "the first number."' in seen[0]
    assert '"name": "calculator"' not in seen[0]  # a function tool file alone: its tools only


@pytest.mark.parametrize("command, extra, phrase", [
    ("eval", ["actor_rollout_ref.rollout.multi_turn.tool_config_path={d}/calc.yaml",
              "actor_rollout_ref.rollout.multi_turn.function_tool_path={d}/calc.py"],
     "multi_turn.function_tool_path={d}/calc.py: tool name(s) ['calculator'] are also declared in "
     "actor_rollout_ref.rollout.multi_turn.tool_config_path={d}/calc.yaml"),
    ("eval", ["actor_rollout_ref.rollout.multi_turn.function_tool_path={d}/plain.py"],
     "multi_turn.function_tool_path={d}/plain.py: no @function_tool function in the file"),
    ("eval", ["data.function_tool_path={d}/tools.yaml"], "function_tool_path={d}/tools.yaml: not a Python file"),
    ("rl", ["actor_rollout_ref.rollout.multi_turn.function_tool_path={d}/calc.py"],
     "actor_rollout_ref.rollout.multi_turn.function_tool_path={d}/calc.py: its tools run in the multi-turn tool "
     "loop; set actor_rollout_ref.rollout.multi_turn.enable=true"),
])
def test_function_tool_file_problems_exit_2_naming_key_and_file(tiny_model_dir, prompt_file, tmp_path, capsys,
                                                              command, extra, phrase):
    (tmp_path / "calc.yaml").write_text("tools:\n  - name: calculator\n")
    (tmp_path / "tools.yaml").write_text("tools:\n  - name: calculator\n")
    (tmp_path / "plain.py").write_text("def calculator(expression: str) -> str:\n    return expression\n")
    (tmp_path / "calc.py").write_text(TOOLS_PY.replace("def add(a: int, b: int)", "def calculator(a: int, b: int)"))
    data = f"data.val_files=[{prompt_file}]" if command == "eval" else f"data.train_files=[{prompt_file}]"
    argv = [command, f"actor_rollout_ref.model.path={tiny_model_dir}", data,
            "actor_rollout_ref.rollout.multi_turn.enable=True" if command == "eval" else "data.val_files=[]",
            f"trainer.default_local_dir={tmp_path / 'run'}", *[e.replace("{d}", str(tmp_path)) for e in extra]]
    if command == "eval":
        argv += ["--out", str(tmp_path / "eval.json"), "--no-progress"]
    code = cli(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert phrase.replace("{d}", str(tmp_path)) in err.strip().splitlines()[-1], err
    assert not (tmp_path / "eval.json").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_generation_honours_rollout_enforce_eager(monkeypatch):
    """`tiller generate` / `eval` read rollout.enforce_eager as the trainer does: CUDA graphs by default on a GPU,
    eager when True; the compiled step on a CPU when False; engine_kwargs given by the user win."""
    from tiller.config import load_config
    from tiller.evaluation import runner

    seen = {}
    monkeypatch.setattr(runner, "load_policy", lambda *a, **kw: seen.update(kw) or "policy")

    def opts(*overrides):
        seen.clear()
        assert runner.policy_from_config(load_config(["actor_rollout_ref.model.path=m", *overrides])) == "policy"
        return seen["engine_kwargs"]

    assert opts() == {}
    assert opts("actor_rollout_ref.rollout.enforce_eager=False") == {"compile_decode": True}
    gpu = opts("trainer.device=cuda", "actor_rollout_ref.rollout.cudagraph_capture_sizes=[1,8]")
    assert gpu["static_decode"] and gpu["cuda_graphs"] and gpu["capture_sizes"] == [1, 8]
    assert opts("trainer.device=cuda", "actor_rollout_ref.rollout.enforce_eager=True") == {}
    assert opts("trainer.device=cuda", "+actor_rollout_ref.rollout.engine_kwargs.cuda_graphs=false")["cuda_graphs"] is False
    assert opts("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.enforce_eager=False") == {}
