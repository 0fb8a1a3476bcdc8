"""`tiller rl` with verl's `actor_rollout_ref.rollout.multi_turn.enable=True`: each sample is a multi-turn tool
conversation (tiller.rollout.agent, the loop tiller eval runs); its tool-response tokens are context (response_mask
0, no logprob, no advantage), its assistant tokens carry the rollout's logprobs, and it is scored on the full
response with extra_info["tool_rewards"], exactly as `tiller eval` scores the same sample."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.evaluation.test_eval_cli import _scripted_eval, REWARD_PY, TOOLS_PY
from tiller.cli import main
from tiller.config import load_config
from tiller.rollout import RolloutOutput
from tiller.rollout.agent import truncate_tool_response
from tiller.trainer.rl_metrics import data_metrics

LOGPROB = -0.5  # every scripted token's sampling logprob


class ScriptedEngine:
    """Answers row k of a call with `script(context, k)`, every token at logprob LOGPROB."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script

    def generate(self, prompt_ids, sampling):
        out = RolloutOutput()
        for k, p in enumerate(prompt_ids):
            for _ in range(sampling.n):
                ids = self.tokenizer(self.script(self.tokenizer.decode(p), k), add_special_tokens=False)["input_ids"]
                out.prompt_ids.append(p)
                out.response_ids.append(ids)
                out.logprobs.append([LOGPROB] * len(ids))
                out.finish_reason.append("stop")
        return out


def script(context: str, k: int) -> str:
    """Ask the `add` tool, then repeat its result; the odd rows of the first turn (a prompt's second sample: rows
    are prompt-major, in eval and rl alike) answer 0 at once (no tool call: 1 turn, scored 0)."""
    if "<|im_start|>tool\n" in context:
        return "so " + context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0] + "<|im_end|>"
    a, b = re.findall(r"(\d+)\+(\d+)=", context)[-1]
    if k % 2:
        return "so 0<|im_end|>"
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call><|im_end|>'


@pytest.fixture()
def files(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as fh:
        for a, b in [(1, 2), (3, 4), (5, 5)]:
            fh.write(json.dumps({"data_source": "tiller/arithmetic",
                                 "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                                 "reward_model": {"style": "rule", "ground_truth": str(a + b)}}) + "\n")
    (tmp_path / "tools.py").write_text(TOOLS_PY)  # verl @function_tool `add`: its result and a 0.25 tool reward
    (tmp_path / "reward.py").write_text(REWARD_PY)  # 1 for the right number after "so ", + sum(tool_rewards)
    return tmp_path, prompts


def test_tool_rollouts_train_masked_and_score_as_eval(tiny_model_dir, files, monkeypatch):
    from tiller.trainer.rl import RLTrainer

    root, prompts = files
    keys = ["actor_rollout_ref.rollout.multi_turn.enable=True", f"data.function_tool_path={root / 'tools.py'}",
            f"custom_reward_function.path={root / 'reward.py'}", "data.max_prompt_length=1024",
            "data.max_response_length=300", "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=1",
            "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=right"]  # 10 -> "1...(truncated)"
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{prompts}]",
                       "data.train_batch_size=3", "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6",
                       "trainer.total_training_steps=1",
                       "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
                       f"trainer.default_local_dir={root / 'run'}", *keys])
    trainer = RLTrainer(cfg)
    try:
        tok = trainer.tokenizer
        trainer.actor.worker.rollout = ScriptedEngine(tok, script)
        trainer.global_step = 1
        m: dict = {}
        batch = trainer._collect_batch(m, 1)
        assert '"name": "add"' in tok.decode(batch["prompts"][0])  # the tools' schemas are in the prompts
        mask, resp, lps = batch["response_mask"], batch["responses"], batch["rollout_log_probs"]
        width = batch["prompts"].shape[1]
        scores = {}
        for i in range(len(batch)):
            a, b = re.findall(r"(\d+)\+(\d+)=", batch["prompt_text"][i])[-1]
            n = int(batch["attention_mask"][i, width:].sum())
            if i % 2:  # one turn, no tool: every response token trained
                turns = ["so 0<|im_end|>"]
            else:
                result = truncate_tool_response(str(int(a) + int(b)), 1, "right")
                turns = [script(f"{a}+{b}=", 0), f"so {result}<|im_end|>"]
            # the assistant tokens are exactly the scripted turns, id for id, at the rollout's logprobs
            sampled = [t for x in turns for t in tok(x, add_special_tokens=False)["input_ids"]]
            assert resp[i][mask[i].bool()].tolist() == sampled
            assert torch.all(lps[i][mask[i].bool()] == LOGPROB)
            # the rest of the response is the tool message (context): mask 0, logprob 0
            tool = resp[i, :n][mask[i, :n] == 0]
            assert torch.all(lps[i, :n][mask[i, :n] == 0] == 0.0)
            if len(turns) == 2:
                assert f"<|im_start|>tool\n{result}<|im_end|>" in tok.decode(tool)
                assert batch["tool_rewards"][i] == [0.25] and batch["num_turns"][i] == 2
            else:
                assert len(tool) == 0 and batch["tool_rewards"][i] == [] and batch["num_turns"][i] == 1
            # the reward sits on the last trained token (the final answer's end)
            last = int(mask[i].nonzero().max())
            assert batch["token_level_scores"][i].nonzero().flatten().tolist() in ([last], [])
            scores[batch["prompt_text"][i], i % 2] = float(batch["score"][i])
            assert batch["response_text"][i] == tok.decode(resp[i, :n], skip_special_tokens=True)
        assert [scores[p, j] for p, j in sorted(scores)] == [1.25, 0.0, 1.25, 0.0, 0.25, 0.0]  # 1+2, 3+4, 5+5
        assert m["agent/turns/mean"] == 1.5 and m["agent/tool_calls/mean"] == 0.5
        assert m["agent/tool_reward/mean"] == 0.125
        # tool-response tokens get no advantage (nothing of them reaches the policy loss)
        trainer._compute_advantage(batch, m, None)
        assert torch.all(batch["advantages"][mask == 0] == 0) and batch["advantages"][mask == 1].abs().sum() > 0
        # verl's response_length: the whole response, tool results included
        full = batch["attention_mask"][:, width:].sum(-1).double()
        assert data_metrics(batch, 300)["response_length/mean"] == pytest.approx(float(full.mean()))
        assert float(full.mean()) > float(mask.sum(-1).double().mean())
    finally:
        trainer.shutdown()
    # tiller eval, same tools, scorer and prompts: the same response text and score for every sample
    texts = {(batch["prompt_text"][i], i % 2): batch["response_text"][i] for i in range(len(batch))}
    monkeypatch.setattr("tests.evaluation.test_eval_cli.ScriptedEngine", ScriptedEngine)
    report, records = _scripted_eval(monkeypatch, tok, script, tiny_model_dir, prompts, *keys,
                                     "actor_rollout_ref.rollout.val_kwargs.n=2",
                                     "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
                                     "actor_rollout_ref.rollout.val_kwargs.temperature=1.0")
    assert len(records) == 6 and report["agent"]["tool_reward/mean"] == 0.125
    for r in records:
        key = (r["prompt"], r["sample_index"])
        assert (r["score"], r["response"]) == (scores[key], texts[key])


def test_tiller_rl_trains_on_verl_multi_turn_tools(tiny_model_dir, tmp_path, capsys):
    """verl's multi-turn keys through the CLI: 1 step on the tiny model, exit 0, tiller eval's agent metrics logged
    for training and validation."""
    from tiller.tasks import arithmetic

    arithmetic.write_task(tmp_path / "arith", n_train=4, n_test=2, seed=0)
    (tmp_path / "tools.yaml").write_text("tools:\n  - name: calculator\n")
    code = main(["rl", f"actor_rollout_ref.model.path={tiny_model_dir}",
                 f"data.train_files=[{tmp_path}/arith/train.parquet]",
                 f"data.val_files=[{tmp_path}/arith/test.parquet]",
                 "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                 "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "data.max_prompt_length=640", "data.max_response_length=8", "trainer.total_training_steps=1",
                 "trainer.logger=[jsonl]", f"trainer.default_local_dir={tmp_path}/run",
                 "actor_rollout_ref.rollout.multi_turn.enable=True",
                 "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path}/tools.yaml",
                 "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"])
    assert code == 0, capsys.readouterr().err
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-1]
    for key in ("agent/turns/mean", "agent/tool_calls/mean", "agent/tool_errors/mean", "agent/tool_reward/mean"):
        assert key in last, sorted(last)
    assert 1 <= last["agent/turns/mean"] <= 2 and "actor/pg_loss" in last
    val = [m for m in metrics if "val-agent/turns/mean" in m]  # validation runs the same loop (val_kwargs sampling)
    assert val and 1 <= val[-1]["val-agent/turns/mean"] <= 2 and "val-agent/tool_reward/mean" in val[-1]


def test_verls_gsm8k_multi_turn_example_trains_with_each_rows_ground_truth(tiny_model_dir, tmp_path):
    """verl's gsm8k multi-turn example as `tiller data gsm8k --tool` writes it (its parquet with per-row
    tools_kwargs, its tool config naming verl.tools.gsm8k_tool.Gsm8kTool): every sample's tool instance is created
    with its own row's ground truth, through the actor's chunked, seeded generation; verl's tool rewards reach
    extra_info and the gsm8k rule scores the final answer."""
    from tiller.data_cli import main as data_main
    from tiller.trainer.rl import RLTrainer

    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "test"):
        with open(src / f"{split}.jsonl", "w") as fh:
            for a, b in [(1, 2), (30, 4), (5, 50), (7, 7)]:
                fh.write(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"{a}+{b}\n#### {a + b}"}) + "\n")
    assert data_main(["gsm8k", "--src", str(src), "--out", str(tmp_path / "gsm8k_tool"), "--tool"]) == 0

    def gsm8k_script(context: str, k: int) -> str:
        a, b = map(int, re.findall(r"What is (\d+) plus (\d+)\?", context)[-1])
        if "<|im_start|>tool\n" in context:
            return f"#### {a + b}<|im_end|>"
        answer = a + b + (k % 2)  # a prompt's second sample submits a wrong answer first
        return f'<tool_call>{{"name": "calc_gsm8k_reward", "arguments": {{"answer": "{answer}"}}}}</tool_call><|im_end|>'

    data = tmp_path / "gsm8k_tool"
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{data}/train.parquet]",
                       "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_prompt_length=2048",
                       "data.max_response_length=300", "trainer.total_training_steps=1", "data.shuffle=False",
                       "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
                       f"trainer.default_local_dir={tmp_path / 'run'}",
                       "actor_rollout_ref.rollout.multi_turn.enable=True",
                       f"actor_rollout_ref.rollout.multi_turn.tool_config_path={data}/tool_config.yaml"])
    trainer = RLTrainer(cfg)
    try:
        tok = trainer.tokenizer
        trainer.actor.worker.rollout = ScriptedEngine(tok, gsm8k_script)
        trainer.rollout_seed_chunks = 2  # two seeded chunks of 2 prompts: each chunk gets its own rows' tools_kwargs
        trainer.global_step = 1
        batch = trainer._collect_batch({}, 1)
        assert '"name": "calc_gsm8k_reward"' in tok.decode(batch["prompts"][0])
        for i in range(len(batch)):
            a, b = map(int, re.findall(r"What is (\d+) plus (\d+)\?", batch["prompt_text"][i])[-1])
            text = batch["response_text"][i]
            if i % 2 == 0:  # right first: scored 1.0 against this row's ground truth, no penalty
                assert f"Current parsed answer='{a + b}' reward=1.0" in text and batch["tool_rewards"][i] == [0.0]
            else:
                assert f"Current parsed answer='{a + b + 1}' reward=0.0" in text
                assert batch["tool_rewards"][i] == [-0.05]
            assert text.endswith(f"#### {a + b}") and float(batch["score"][i]) == 1.0
    finally:
        trainer.shutdown()


class HookedScriptedEngine(ScriptedEngine):
    """ScriptedEngine that calls the weights hook once per sampled token (as the native engine does between decode
    steps) and records each token's version."""

    def generate(self, prompt_ids, sampling, weights_hook=None):
        out = super().generate(prompt_ids, sampling)
        out.token_versions = [[weights_hook() for _ in ids] for ids in out.response_ids]
        return out


def test_tool_loop_records_each_tokens_policy_version(tiny_model_dir):
    """Asynchronous RL's producer: every turn's engine call gets the weights hook; model tokens carry the version
    they were sampled with, a tool message's tokens the version of the turn before it."""
    from tiller.models.loading import load_tokenizer
    from tiller.rollout import SamplingParams
    from tiller.rollout.agent import run_agent_loop
    from tiller.rollout.function_tools import FunctionTool, infer_schema

    tok = load_tokenizer(tiny_model_dir, padding_side="left")

    def add(a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: first
            b: second
        """
        return str(a + b)

    calls = {"n": 0}

    def hook():  # version 0 for the first 5 tokens, then 1
        calls["n"] += 1
        return int(calls["n"] > 5)

    tools = {"add": FunctionTool(add, "add", infer_schema(add, "add"))}
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    out = run_agent_loop(HookedScriptedEngine(tok, script), tok, [prompt], SamplingParams(max_new_tokens=100),
                         tools, max_response_length=400, weights_hook=hook)
    versions, mask = out.token_versions[0], out.response_mask[0]
    assert len(versions) == len(mask) == len(out.response_ids[0]) and out.num_turns == [2]
    first = mask.index(0)  # the tool message: between the two turns
    second = first + mask[first:].index(1)
    assert versions[:5] == [0] * 5 and set(versions[5:first]) == {1}  # the switch inside the first turn
    assert versions[first:second] == [versions[first - 1]] * (second - first)  # tool tokens: the turn before
    assert set(versions[second:]) == {1}
    plain = run_agent_loop(ScriptedEngine(tok, script), tok, [prompt], SamplingParams(max_new_tokens=100), tools,
                           max_response_length=400)
    assert plain.token_versions == [] and plain.response_ids == out.response_ids


def test_async_multi_turn_run_trains_within_the_staleness_bound(tiny_model_dir, tmp_path):
    """verl's multi-turn tool rollouts under async_training (its fully-async retool recipe's combination): the
    producer thread runs the conversations on its own engine with the newest weights, partial rollouts record each
    token's version, every step trains within the staleness bound and logs the tool metrics."""
    from tiller.tasks import arithmetic

    arithmetic.write_task(tmp_path / "arith", n_train=8, n_test=2, seed=0)
    (tmp_path / "tools.yaml").write_text("tools:\n  - name: calculator\n")
    code = main(["rl", f"actor_rollout_ref.model.path={tiny_model_dir}",
                 f"data.train_files=[{tmp_path}/arith/train.parquet]", "data.val_files=[]",
                 "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=640",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "data.max_response_length=8", "trainer.total_training_steps=3", "trainer.logger=[jsonl]",
                 f"trainer.default_local_dir={tmp_path}/run", "actor_rollout_ref.rollout.multi_turn.enable=True",
                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path}/tools.yaml",
                 "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
                 "async_training.staleness_threshold=1", "async_training.partial_rollout=true"])
    assert code == 0
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/pg_loss" in m]
    assert len(steps) == 3
    for m in steps:
        assert "async/policy_version" in m and m["async/staleness_max"] <= 1 and 1 <= m["agent/turns/mean"] <= 2


class TeacherForcedEngine:
    """Scripted turns (`script(context, k)`) whose logprobs are the real model's, teacher-forced on the context (a
    vision-language model's with the image inputs each turn receives); `turns`: the rows of each call."""

    def __init__(self, model, tokenizer, script):
        self.model, self.tokenizer, self.script, self.turns = model, tokenizer, script, []

    def update_weights(self, *args):  # (the module is the actor's own)
        pass

    def generate(self, prompt_ids, sampling, multi_modal=None):
        from tiller.models.vision import image_token_id

        self.turns.append(len(prompt_ids))
        out = RolloutOutput()
        for k, ids in enumerate(prompt_ids):
            new = self.tokenizer(self.script(self.tokenizer.decode(ids), k), add_special_tokens=False)["input_ids"]
            full = torch.tensor([list(ids) + new])
            pixels = {}
            if multi_modal is not None:
                mm = multi_modal[k]
                pixels = {"pixel_values": mm["pixel_values"], "image_grid_thw": mm["image_grid_thw"],
                          "mm_token_type_ids": (full == image_token_id(self.model)).int()}
            with torch.no_grad():
                logits = self.model(input_ids=full, **pixels).logits[0].float()
            logp = torch.log_softmax(logits / sampling.temperature, -1)
            out.prompt_ids.append(list(ids))
            out.response_ids.append(new)
            out.logprobs.append([float(logp[len(ids) + j - 1, t]) for j, t in enumerate(new)])
            out.finish_reason.append("stop")
        return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_actor_scores_every_turn_of_a_conversation(tiny_model_dir, files, packed):
    """The actor's forward covers the whole conversation, the turns after a tool message included: its probabilities
    equal a teacher-forced forward of the real model on every model token (training/rollout_probs_diff_max at float32
    rounding). (The forward used to be trimmed to the number of trained tokens, which a tool message in the middle
    makes shorter than the columns: the last turn's tokens got log-probability 0 and no gradient.)"""
    from tiller.trainer.rl import RLTrainer

    root, prompts = files
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{prompts}]",
                       "data.train_batch_size=3", "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=3", "data.max_prompt_length=1024",
                       "data.max_response_length=300", "trainer.total_training_steps=1", "trainer.logger=[jsonl]",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6",
                       "trainer.val_before_train=false", "trainer.resume_mode=disable",
                       f"trainer.default_local_dir={root / 'run'}", "actor_rollout_ref.rollout.multi_turn.enable=True",
                       f"data.function_tool_path={root / 'tools.py'}", f"custom_reward_function.path={root / 'reward.py'}",
                       "actor_rollout_ref.rollout.dtype=float32",
                       f"actor_rollout_ref.model.use_remove_padding={packed}"])  # (packed: rows in one sequence)
    trainer = RLTrainer(cfg)
    try:
        worker = trainer.actor.worker
        worker.rollout = TeacherForcedEngine(worker.module, trainer.tokenizer, script)
        trainer.global_step = 1
        metrics = trainer.train_step()
    finally:
        trainer.shutdown()
    assert metrics["agent/turns/mean"] == 1.5  # half the samples: tool call, tool message, answer
    assert metrics["training/rollout_probs_diff_max"] < 1e-4


def test_the_critic_values_every_turn_of_a_conversation(tiny_model_dir, files):
    """PPO's critic on multi-turn rows: a value for every trained token, the turn after the tool message included,
    equal to a plain forward of the critic over the whole conversation."""
    from tiller.trainer.rl import RLTrainer

    root, prompts = files
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{prompts}]",
                       f"critic.model.path={tiny_model_dir}", "algorithm.adv_estimator=gae",
                       "data.train_batch_size=3", "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=1024",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=3", "data.max_response_length=300",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6", "critic.ppo_micro_batch_size_per_gpu=6",
                       "trainer.total_training_steps=1", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
                       "trainer.resume_mode=disable", f"trainer.default_local_dir={root / 'run'}",
                       "actor_rollout_ref.rollout.multi_turn.enable=True", f"data.function_tool_path={root / 'tools.py'}",
                       f"custom_reward_function.path={root / 'reward.py'}"])
    trainer = RLTrainer(cfg)
    try:
        trainer.actor.worker.rollout = ScriptedEngine(trainer.tokenizer, script)
        trainer.global_step = 1
        batch = trainer._collect_batch({}, 1)
        values = trainer.critic.execute("compute_values", batch)["values"]
        critic = trainer.critic.worker.model
        mask = batch["response_mask"].bool()
        width = batch["prompts"].shape[1]
        for i in range(len(batch)):
            keep = batch["attention_mask"][i].bool()
            ids = batch["input_ids"][i][keep][None]
            with torch.no_grad():
                head = critic(input_ids=ids).logits[0, :, 0].float()
            start = int(batch["attention_mask"][i, :width].sum())  # the first response column of the unpadded row
            want = head[start - 1:start - 1 + mask.shape[1]]
            n = int(mask[i].nonzero().max()) + 1
            torch.testing.assert_close(values[i, :n][mask[i, :n]], want[:n][mask[i, :n]], atol=1e-4, rtol=0)
        assert 2 in list(batch["num_turns"])  # (conversations with a tool message in the middle)
    finally:
        trainer.shutdown()


def test_verls_agent_name_column_picks_each_rows_loop(tiny_model_dir, tmp_path):
    """verl's per-row `agent_name`: tool_agent rows run the tool loop (their prompt carries the tools), a
    single_turn_agent row one turn without tools (no schema in its prompt, its calls not run); an unknown loop
    name, or tool_agent without multi_turn.enable, is an error naming the row."""
    from tiller.errors import DataError
    from tiller.trainer.rl import RLTrainer

    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as fh:
        for k, (a, b) in enumerate([(1, 2), (3, 4)]):
            fh.write(json.dumps({"data_source": "tiller/arithmetic", "agent_name": ["tool_agent",
                                                                                    "single_turn_agent"][k],
                                 "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                                 "reward_model": {"style": "rule", "ground_truth": str(a + b)}}) + "\n")
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    keys = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{prompts}]",
            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "data.max_prompt_length=1024", "data.max_response_length=300", "trainer.total_training_steps=1",
            "trainer.logger=[jsonl]", "trainer.val_before_train=false", "trainer.resume_mode=disable",
            f"trainer.default_local_dir={tmp_path / 'run'}", "data.shuffle=False"]
    trainer = RLTrainer(load_config([*keys, "actor_rollout_ref.rollout.multi_turn.enable=True",
                                     f"data.function_tool_path={tmp_path / 'tools.py'}"]))
    try:
        trainer.actor.worker.rollout = ScriptedEngine(trainer.tokenizer, lambda context, k: script(context, 0))
        trainer.global_step = 1
        batch = trainer._collect_batch({}, 1)
    finally:
        trainer.shutdown()
    for i in range(len(batch)):
        tool_row = "1+2=" in batch["prompt_text"][i]
        assert ('"name": "add"' in batch["prompt_text"][i]) == tool_row
        assert batch["num_turns"][i] == (2 if tool_row else 1)
        assert batch["num_tool_calls"][i] == (1 if tool_row else 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(prompts.read_text().replace("single_turn_agent", "my_agent"))
    with pytest.raises(DataError, match=r"bad.jsonl row 1: agent_name='my_agent': not one of the run's agent loops"):
        RLTrainer(load_config([*keys[:1], f"data.train_files=[{bad}]", *keys[2:],
                               "actor_rollout_ref.rollout.multi_turn.enable=True",
                               f"data.function_tool_path={tmp_path / 'tools.py'}"]))
    with pytest.raises(DataError, match=r"prompts.jsonl row 0: agent_name='tool_agent' needs the multi-turn tool"):
        RLTrainer(load_config(keys))
