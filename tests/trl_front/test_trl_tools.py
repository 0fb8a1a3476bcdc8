"""TRL's `GRPOTrainer(tools=..., environment_factory=...)` on tiller (`tiller.trl.tool_loop`).

The loop is checked against TRL 1.16's own `_tool_call_loop` run on the same scripted completions (ids, tool
masks, logprobs and messages equal), then through `GRPOTrainer.train()`: the reward functions get the messages and
the environments, tool tokens stay out of the loss, and the metrics carry TRL's names."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tiller.errors import ConfigError, DataError
from tiller.rollout import RolloutOutput, SamplingParams
from tiller.trl import GRPOConfig, GRPOTrainer
from tiller.trl.tool_loop import TRLToolLoop, prepare_tokenizer, tool_of

trl = pytest.importorskip("trl")
LOGPROB = -0.5


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def shout(text: str) -> str:
    """Repeat a text loudly, many times.

    Args:
        text: What to repeat.
    """
    return (text.upper() + "! ") * 80


async def slow_square(x: int) -> dict:
    """Square a number (async).

    Args:
        x: The number.
    """
    return {"square": x * x}


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Qwen2 with Qwen2.5's chat template (tools rendered, a template TRL knows how to parse)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tools") / "qwen2_tools"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    tok.save_pretrained(out)
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


CALLER_TURNS = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>', "Done.<|im_end|>")


@pytest.fixture(scope="module")
def caller_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Qwen2 with the calculator example's compact tool template (and its response template), taught (~130
    supervised steps, a few seconds) to answer any question by calling add(2, 3), then "Done." after the tool's
    reply, laid out as the tool loop lays it out: a real policy that calls tools."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    example = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "agent_calculator.py"))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template, tok.response_template = example["CHAT_TEMPLATE"], example["RESPONSE_TEMPLATE"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loop = TRLToolLoop([tool_of(add, "tools")], None, {}, {}, None, None, {}, 4096, 4096, tokenizer=tok)
    suffix = loop.suffix_ids(tok, [{"role": "tool", "name": "add", "content": "5"}])
    first, second = (tok(t, add_special_tokens=False)["input_ids"] for t in CALLER_TURNS)
    seqs = []
    for i in range(4):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"What is {i}+{i}?"}], tools=[add],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        seqs.append((prompt + first + suffix + second, [0] * len(prompt) + [1] * len(first) + [0] * len(suffix)
                     + [1] * len(second)))
    width = max(len(x) for x, _ in seqs)
    ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in seqs])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in seqs], dtype=torch.float)[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(400):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.003:
            break
    assert loss.item() < 0.01, loss.item()
    out = tmp_path_factory.mktemp("caller") / "qwen2_caller"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def call(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def script(context: str, k: int) -> str:
    """Sample k's next turn given everything before it (the rows of a batch: k = 0..7)."""
    results = context.count("<tool_response>")
    if k % 4 == 0:
        return "The answer is 5.<|im_end|>"  # no call
    if k % 4 == 1:  # one call, then an answer from its result
        if results == 0:
            return "Let me add.\n" + call("add", a=2, b=3) + "<|im_end|>"
        return "So " + context.rsplit("<tool_response>\n", 1)[1].split("\n")[0] + ".<|im_end|>"
    if k % 4 == 2:  # a turn of three calls: async, unknown tool, a wrong argument; then one more call
        if results == 0:
            return (call("slow_square", x=4) + "\n" + call("nope", q=1) + "\n" + call("add", a=1, c=2)
                    + "<|im_end|>")
        if results == 3:
            return call("add", a=7, b=8) + "<|im_end|>"
        return "Done, " + "very " * 100 + "done.<|im_end|>"  # long: cut by the budget
    if results == 0:  # k % 4 == 3: a call whose long result does not fit: TRL drops it, the sample ends
        return call("shout", text="hey") + "<|im_end|>"
    return "unreachable<|im_end|>"


class ScriptedEngine:
    """Continues each context with `script` for its sample (found by its prompt), every token at LOGPROB."""

    def __init__(self, tok, prompt_ids):
        self.tok, self.prompt_ids = tok, [list(p) for p in prompt_ids]

    def sample_of(self, context) -> int:
        return next(k for k, p in enumerate(self.prompt_ids) if list(context[:len(p)]) == p)

    def generate(self, prompt_ids, sampling, **_):
        out = RolloutOutput()
        for p in prompt_ids:
            ids = self.tok(script(self.tok.decode(p), self.sample_of(p)), add_special_tokens=False)["input_ids"]
            ids = ids[:sampling.max_new_tokens]
            out.prompt_ids.append(list(p))
            out.response_ids.append(ids)
            out.logprobs.append([LOGPROB] * len(ids))
            out.finish_reason.append("stop")
        return out


def _tokenizer(path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert prepare_tokenizer(tok, str(path)) is None  # Qwen2.5's template: prefix-preserving, parsed by TRL's schema
    return tok


def _trl_loop(tok, prompts, prompt_ids, tools, max_completion_length, max_iterations, max_model_len):
    """TRL 1.16's `_tool_call_loop` (the real method) on the scripted completions."""
    from trl import GRPOTrainer as TRLGRPOTrainer
    from trl.chat_template_utils import parse_response
    from trl.trainer.utils import start_event_loop_in_daemon

    thread, loop, ready = start_event_loop_in_daemon(name="test-loop")
    ready.wait()
    engine = ScriptedEngine(tok, prompt_ids)

    def generate_single_turn(ids_list, images, fields, num_generations, has_tool_images=False):
        out = engine.generate(ids_list, SamplingParams(max_new_tokens=max_completion_length))
        return out.response_ids, out.logprobs

    fake = SimpleNamespace(
        _sync_tool_dicts=[{t.__name__: t for t in tools if t is not slow_square} for _ in prompts],
        _async_tool_dicts=[{"slow_square": slow_square} for _ in prompts], async_loop=loop,
        use_vllm=False, vllm_mode="colocate", model=SimpleNamespace(config=SimpleNamespace(
            max_position_embeddings=max_model_len)), _is_vlm=False, max_completion_length=max_completion_length,
        max_tool_calling_iterations=max_iterations if max_iterations is not None else sys.maxsize,
        _generate_single_turn=generate_single_turn,
        environment_factories=None, tools=tools, _tokenizer=tok, processing_class=tok, chat_template=None,
        chat_template_kwargs={})
    fake._get_tool_suffix_ids = lambda messages: TRLGRPOTrainer._get_tool_suffix_ids(fake, messages)
    first, first_lps = generate_single_turn(prompt_ids, None, {}, 1)
    completions = [[parse_response(tok, ids, prefix=prompt_ids[i], tools=tools)] for i, ids in enumerate(first)]
    try:
        mask, completions, ids, lps, calls, failures, _ = TRLGRPOTrainer._tool_call_loop(
            fake, [list(p) for p in prompts], [list(p) for p in prompt_ids], [list(x) for x in first], completions,
            first_lps, None, {})
    finally:
        loop.call_soon_threadsafe(loop.stop)
    return mask, completions, ids, lps, calls, failures


@pytest.mark.parametrize("max_iterations", [None, 1])
def test_the_loop_equals_trls_tool_call_loop(tool_model_dir, max_iterations):
    tok = _tokenizer(tool_model_dir)
    tools = [add, shout, slow_square]
    prompts = [[{"role": "user", "content": f"Question {k}: what is 2+3?"}] for k in range(8)]
    prompt_ids = [tok.apply_chat_template(p, tools=tools, add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for p in prompts]
    budget = 450
    want_mask, want_messages, want_ids, want_lps, calls, failures = _trl_loop(
        tok, prompts, prompt_ids, tools, budget, max_iterations, max_model_len=4096)

    loop = TRLToolLoop([tool_of(t, "tools") for t in tools], None, {"train": []}, {}, max_iterations, None, {},
                       4096, 4096, tokenizer=tok)
    out = loop.generate(ScriptedEngine(tok, prompt_ids), tok, [list(p) for p in prompt_ids],
                        SamplingParams(n=1, max_new_tokens=budget), max_response_length=budget)
    assert out.response_ids == want_ids
    assert out.response_mask == want_mask  # TRL's tool_mask: tool tokens 0
    assert out.logprobs == want_lps
    assert out.messages == want_messages
    assert sum(out.num_tool_calls) == calls and sum(out.tool_errors) == failures
    # what the script does, spelled out: sample 1 reads its result; sample 2's three calls (async first in its turn,
    # run after the sync ones as TRL appends them) fail twice; sample 3's long result was dropped (no tool message)
    assert [m["role"] for m in out.messages[1]] == ["assistant", "tool", "assistant"]
    assert out.messages[1][2]["content"] == "So 5."
    assert [m.get("name") for m in out.messages[2][1:4]] == ["nope", "add", "slow_square"]
    assert out.messages[2][1]["content"] == "{'error': 'Tool nope not found.'}"
    assert out.messages[2][3]["content"] == "{'square': 16}"
    assert [m["role"] for m in out.messages[3]] == ["assistant"] and out.finish_reason[3] == "stop"
    assert out.num_tool_calls[3] == 1 and 0 not in out.response_mask[3]
    if max_iterations is None:  # the second round's answer runs past the budget: cut, truncated
        assert len(out.response_ids[2]) == budget and out.finish_reason[2] == "length"
    else:  # one round: the call of the turn after it is not run
        assert out.messages[2][-1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 7, "b": 8}}


class Counter:
    """A TRL environment: a counter the model moves with `increment`; the reward is reaching 10."""

    made = 0

    def __init__(self):
        Counter.made += 1
        self.total = 0

    def reset(self, start: int, **row) -> str:
        self.total = start
        return f" Start at {start}."

    def increment(self, by: int) -> int:
        """Increase the counter.

        Args:
            by: How much to add.
        """
        self.total += by
        return self.total

    def get_reward(self) -> float:
        return float(self.total == 10)


class CounterPolicy:
    """A scripted policy for Counter: a prompt's even samples add what reaches 10, its odd samples add 1, then
    each says "Done."."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompt_ids, sampling, **_):
        out, seen = RolloutOutput(), {}
        for p in prompt_ids:
            text = self.tok.decode(p)
            j = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
            if "<tool_response>" in text:
                reply = "Done.<|im_end|>"
            else:
                start = int(re.findall(r"Start at (\d+)\.", text)[-1])
                reply = call("increment", by=10 - start if j % 2 == 0 else 1) + "<|im_end|>"
            ids = self.tok(reply, add_special_tokens=False)["input_ids"]
            out.prompt_ids.append(list(p))
            out.response_ids.append(ids)
            out.logprobs.append([LOGPROB] * len(ids))
            out.finish_reason.append("stop")
        return out


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_environments_train_through_grpo_trainer(tmp_path, tool_model_dir, monkeypatch):
    from tiller.trl.tool_loop import TRLToolLoop

    original = TRLToolLoop.generate
    monkeypatch.setattr(TRLToolLoop, "generate", lambda self, engine, tok, *a, **kw: original(
        self, CounterPolicy(tok), tok, *a, **kw))
    seen = []

    def used_tool(completions, prompts, environments, **kw):
        seen.append((completions, prompts, environments, [e.total for e in environments]))
        return [float(any(m["role"] == "tool" for m in c)) * 0.5 for c in completions]

    rows = [{"prompt": [{"role": "user", "content": "Reach ten."}], "start": s} for s in (3, 4, 6, 7)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=160, learning_rate=1e-3, max_steps=2, bf16=False, seed=1,
                      log_completions=True)
    Counter.made = 0
    trainer = GRPOTrainer(model=str(tool_model_dir), reward_funcs=used_tool, args=args, train_dataset=rows,
                          environment_factory=Counter)
    trainer.train()
    assert Counter.made == 8  # the probe + one per completion of a batch (2 prompts x 4), reused in step 2
    completions, prompts, environments, totals = seen[0]  # (the instances are reset again for step 2, as TRL's)
    assert len(completions) == 8 and all(type(e) is Counter for e in environments)
    for c, p, total in zip(completions, prompts, totals):
        start = int(re.findall(r"Start at (\d+)\.", p[-1]["content"])[-1])  # the reset observation, appended
        assert p[-1]["content"] == f"Reach ten. Start at {start}."
        assert [m["role"] for m in c] == ["assistant", "tool", "assistant"]
        assert c[1] == {"role": "tool", "name": "increment", "content": str(total)}
        assert c[2]["content"] == "Done."
    assert sorted(total == 10 for total in totals) == [False] * 4 + [True] * 4
    history = [row for row in trainer.state.log_history if "tools/call_frequency" in row]
    assert len(history) == 2
    for row in history:  # TRL's metric names; the environment's reward under its class name
        assert row["tools/call_frequency"] == 1.0 and row["tools/failure_frequency"] == 0.0
        assert row["rewards/Counter/mean"] == 0.5 and row["rewards/used_tool/mean"] == 0.5
        assert row["reward"] == 1.0
    dump = _jsonl(tmp_path / "run" / "completions" / "1.jsonl")
    assert sorted(d["score"] for d in dump) == [0.5] * 4 + [1.5] * 4
    keys = trainer.tiller_keys
    assert keys["actor_rollout_ref.rollout.prompt_length"] > keys["data.max_prompt_length"]  # room for observations


def test_tools_on_the_real_engine_render_the_schemas_and_train(tmp_path, tool_model_dir):
    """A real (untrained) policy rarely calls a tool; the run goes through with the tools in every prompt."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}]} for i in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=8, learning_rate=1e-3, max_steps=1, bf16=False, seed=1,
                      max_tool_calling_iterations=2)
    trainer = GRPOTrainer(model=str(tool_model_dir), reward_funcs=lambda completions, **kw: [
        float(len(c)) for c in completions], args=args, train_dataset=rows, tools=[add])
    trainer.train()
    data = _jsonl(tmp_path / "run" / "data" / "train.jsonl")
    assert data[0]["prompt"] == rows[0]["prompt"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    want = len(tok.apply_chat_template(rows[0]["prompt"], tools=[add], add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    assert trainer.tiller_keys["data.max_prompt_length"] == want  # the schemas were measured into the prompts
    row = trainer.state.log_history[-1]
    assert "tools/call_frequency" in row and torch.isfinite(torch.tensor(row["loss"]))


def test_refusals_name_the_argument(tmp_path, tiny_model_dir, tool_model_dir):
    rows = [{"prompt": [{"role": "user", "content": "hi"}]} for _ in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=8, max_steps=1, bf16=False)
    reward = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731

    def undocumented(x):
        return x

    with pytest.raises(ConfigError, match=r"tools\[0\]: cannot write the schema of 'undocumented'"):
        GRPOTrainer(model=str(tool_model_dir), reward_funcs=reward, args=args, train_dataset=rows,
                    tools=[undocumented])
    with pytest.raises(DataError, match="tools / environment_factory need conversational prompts"):
        GRPOTrainer(model=str(tool_model_dir), reward_funcs=reward, args=args, train_dataset=[
            {"prompt": "hi"}] * 4, tools=[add])

    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: a number.
            """
            return x

    with pytest.raises(ConfigError, match="NoReset has no `reset` method"):
        GRPOTrainer(model=str(tool_model_dir), reward_funcs=reward, args=args, train_dataset=rows,
                    environment_factory=NoReset)
    with pytest.raises(ConfigError, match="reward_funcs: give at least one"):
        GRPOTrainer(model=str(tool_model_dir), reward_funcs=None, args=args, train_dataset=rows, tools=[add])
    # the tiny model's own template renders no tool calls: refused at construction (as TRL's), naming the model
    with pytest.raises(ConfigError, match="its chat template does not support tool calling"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward, args=args, train_dataset=rows, tools=[add])


def test_tokenizer_set_up_as_trl(tool_model_dir, monkeypatch):
    """A template TRL knows gets its response template; Qwen3's (not prefix-preserving) TRL's training template;
    without trl (and no response template of its own) a ConfigError says what to do."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import get_training_chat_template

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    assert getattr(tok, "response_template", None) is None
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    template = prepare_tokenizer(tok, "qwen3-like")
    assert template == get_training_chat_template(tok) and tok.response_template is not None
    loop = TRLToolLoop([tool_of(add, "tools")], None, {}, {}, None, template, {}, 4096, 4096, tokenizer=tok)
    suffix = tok.decode(loop.suffix_ids(tok, [{"role": "tool", "name": "add", "content": "5"}]))
    assert suffix == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # trl not installed
    with pytest.raises(ConfigError, match="no response_template .* install trl"):
        prepare_tokenizer(AutoTokenizer.from_pretrained(tool_model_dir), "m")


def train_caller(out_dir, model_dir, **args) -> tuple:
    """Two GRPO steps of the taught caller with tools=[add] (`args`: more GRPOConfig fields); (trainer, every
    completion the reward function saw)."""
    seen = []

    def done(completions, **kw):
        seen.extend(completions)
        return [float(c[-1]["content"] == "Done.") for c in completions]

    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}]} for i in range(4)]
    config = GRPOConfig(output_dir=str(out_dir), num_generations=4, per_device_train_batch_size=8,
                        max_completion_length=120, learning_rate=1e-4, max_steps=2, bf16=False, seed=2, **args)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=done, args=config, train_dataset=rows, tools=[add])
    trainer.train()
    return trainer, seen


def test_a_policy_that_calls_tools_trains_on_the_real_engine(tmp_path, caller_model_dir):
    """The native engine samples the calls, the tool runs, the engine continues after the tool tokens; the actor's
    log-probabilities of every model token equal the engine's (tool tokens in between, out of the loss)."""
    trainer, seen = train_caller(tmp_path / "run", caller_model_dir)
    called = [c for c in seen if len(c) == 3]
    others = [[(m["role"], m["content"][:40]) for m in c] for c in seen if len(c) != 3]
    assert len(seen) == 16 and len(called) >= 12, others
    for c in called:
        assert c[0]["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
        assert c[1] == {"role": "tool", "name": "add", "content": "5"}
    for row in trainer.state.log_history:
        assert row["tools/call_frequency"] >= 0.75 and row["tools/failure_frequency"] == 0.0, row
        assert row["training/rollout_probs_diff_max"] < 1e-4, row["training/rollout_probs_diff_max"]


class Echo:
    """A second environment: its tool echoes; it owns no reward."""

    def reset(self, **row) -> None:
        return None

    def echo(self, text: str) -> str:
        """Echo a text.

        Args:
            text: The text.
        """
        return text


def test_a_dict_of_environments_renders_each_rows_own_tools(tool_model_dir):
    """environment_factory={name: factory} with an `environment` column: each completion gets an instance of its
    row's environment, its prompt lists only that environment's tools (and the standalone ones), as TRL renders it."""
    from tiller.trl.tool_loop import EnvironmentPool, environment_rewards

    tok = _tokenizer(tool_model_dir)
    pool = EnvironmentPool({"counter": Counter, "echo": Echo}, [tool_of(add, "tools")])
    assert [name for name, _ in environment_rewards(pool)] == ["Counter"]  # only Counter owns a reward
    rows = [{"prompt": [{"role": "user", "content": "Go."}], "environment": "counter", "start": 3},
            {"prompt": [{"role": "user", "content": "Go."}], "environment": "echo", "start": 0}]
    loop = TRLToolLoop([tool_of(add, "tools")], pool, {"train": rows}, {}, None, None, {}, 4096, 4096, tokenizer=tok)
    assert sorted(loop.tools) == ["add", "echo", "increment"]  # the union: what the data's prompts are sized with

    class Answer:
        def generate(self, prompt_ids, sampling, **_):
            out = RolloutOutput()
            for p in prompt_ids:
                ids = tok("ok<|im_end|>", add_special_tokens=False)["input_ids"]
                out.prompt_ids.append(list(p))
                out.response_ids.append(ids)
                out.logprobs.append([LOGPROB] * len(ids))
                out.finish_reason.append("stop")
            return out

    info = [{"extra_info": {"trl_row": 0, "trl_split": "train"}}, {"extra_info": {"trl_row": 1, "trl_split": "train"}}]
    out = loop.generate(Answer(), tok, [[1], [1]], SamplingParams(n=2, max_new_tokens=16), rows=info)
    prompts = [tok.decode(p) for p in out.prompt_ids]
    for k, text in enumerate(prompts):
        counter = k < 2
        assert ('"name": "increment"' in text) == counter and ('"name": "echo"' in text) == (not counter)
        assert '"name": "add"' in text
        assert text.count("Go. Start at 3.") == (1 if counter else 0)  # Counter.reset's observation; Echo has none
    assert [type(s.environment).__name__ for s in out.states] == ["Counter", "Counter", "Echo", "Echo"]
    assert len({id(s.environment) for s in out.states}) == 4  # one instance per completion
    rows.append({"prompt": [{"role": "user", "content": "Go."}], "environment": "chess"})
    with pytest.raises(DataError, match="environment='chess', which is not among"):
        loop.generate(Answer(), tok, [[1]], SamplingParams(n=1, max_new_tokens=4),
                      rows=[{"extra_info": {"trl_row": 2}}])


def test_the_environment_owns_the_reward_and_eval_runs_the_loop(tmp_path, tool_model_dir, monkeypatch):
    """reward_funcs=None with an environment that defines get_reward (TRL: then the only reward source), and an
    eval_dataset validated through the same tool loop (its rows reset their own instances)."""
    from tiller.trl.tool_loop import TRLToolLoop

    original = TRLToolLoop.generate
    monkeypatch.setattr(TRLToolLoop, "generate", lambda self, engine, tok, *a, **kw: original(
        self, CounterPolicy(tok), tok, *a, **kw))
    rows = [{"prompt": [{"role": "user", "content": "Reach ten."}], "start": s} for s in (3, 4, 6, 7)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=160, learning_rate=1e-3, max_steps=1, bf16=False, seed=1,
                      eval_strategy="steps", eval_steps=1, num_generations_eval=2)
    trainer = GRPOTrainer(model=str(tool_model_dir), reward_funcs=None, args=args, train_dataset=rows,
                          eval_dataset=rows[:2], environment_factory=Counter)
    trainer.train()
    row = next(r for r in trainer.state.log_history if "reward" in r)
    assert row["rewards/Counter/mean"] == 0.5 and row["reward"] == 0.5  # even samples reach 10, odd ones do not
    evals = [r["eval_reward"] for r in trainer.state.log_history if "eval_reward" in r]
    assert evals and all(v == 0.5 for v in evals), evals  # validation ran the loop: one of each row's two reached 10
