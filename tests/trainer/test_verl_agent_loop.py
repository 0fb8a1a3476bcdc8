"""verl's custom agent loops (`actor_rollout_ref.rollout.agent.agent_loop_config_path`): an `AgentLoopBase` subclass
written against verl's API (`verl.experimental.agent_loop`, `server_manager.generate`, the Continuous Token helpers)
runs per sample on tiller's engine; its trajectory (ids, mask, log-probs) is what trains, its `reward_score` replaces
the reward function's, and per-row `agent_name` mixes it with tiller's own loops."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch

from tests.trainer.test_tool_rl import LOGPROB, ScriptedEngine
from tiller.cli import main
from tiller.config import load_config
from tiller.errors import ConfigError, DataError

AGENT_PY = textwrap.dedent('''
    from typing import Any
    from uuid import uuid4

    from verl.experimental.agent_loop import AgentLoopBase, AgentLoopOutput, register
    from verl.utils.profiler import simple_timer
    from verl.workers.rollout.replica import TokenOutput


    class TwoTurnAgentLoop(AgentLoopBase):
        """Answers, is asked `nudge` as a user turn, answers again: both answers are trained."""

        def __init__(self, *args, nudge: str = "Are you sure?", **kwargs):
            super().__init__(*args, **kwargs)
            self.nudge = nudge
            self.response_length = self.rollout_config.response_length

        async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
            messages = list(kwargs["raw_prompt"])
            prompt_ids = await self.ct_build_initial_tokens(messages)
            metrics = {}
            with simple_timer("generate_sequences", metrics):
                first: TokenOutput = await self.server_manager.generate(
                    request_id=uuid4().hex, prompt_ids=prompt_ids, sampling_params=sampling_params)
            merged, mask, logprobs = await self.ct_merge_assistant_token(
                prompt_ids, first.token_ids, [], [], assistant_logprobs=first.log_probs)
            previous = messages + [{"role": "assistant",
                                    "content": self.tokenizer.decode(first.token_ids, skip_special_tokens=True)}]
            updated = previous + [{"role": "user", "content": self.nudge}]
            merged, mask, logprobs = await self.ct_merge_non_assistant_msg(previous, updated, merged.token_ids, mask,
                                                                           logprobs)
            second = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=merged.token_ids,
                                                        sampling_params=sampling_params)
            merged, mask, logprobs = await self.ct_merge_assistant_token(
                merged.token_ids, second.token_ids, mask, logprobs, assistant_logprobs=second.log_probs)
            response = merged.token_ids[len(prompt_ids):]
            return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response[: self.response_length],
                                   response_mask=mask[: self.response_length],
                                   response_logprobs=logprobs[: self.response_length], num_turns=4,
                                   metrics=metrics, extra_fields={"tool_rewards": [0.5]})


    @register("self_scoring")
    class SelfScoringLoop(TwoTurnAgentLoop):
        """Scores its own trajectory (verl: reward_score set by the loop replaces the reward function's)."""

        async def run(self, sampling_params, **kwargs):
            out = await super().run(sampling_params, **kwargs)
            out.reward_score = 10.0 + kwargs["index"]
            return out


    class NoLogprobs(TwoTurnAgentLoop):
        async def run(self, sampling_params, **kwargs):
            out = await super().run(sampling_params, **kwargs)
            out.response_logprobs = None
            return out
''')

LOOPS_YAML = '''- name: two_turn
  _target_: my_loops.TwoTurnAgentLoop
  nudge: "Sure?"
- name: no_logprobs
  _target_: my_loops.NoLogprobs
'''

REWARD_PY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last answer is the ground truth, plus the loop's tool rewards."""
    return float(solution_str.strip().split()[-1] == ground_truth) + sum(extra_info.get("tool_rewards", []))
'''


def script(context: str, k: int) -> str:
    """First answer: the sum; asked "Sure?": "yes" and the sum again."""
    a, b = re.findall(r"(\d+)\+(\d+)=", context)[0]
    if "ure?<|im_end|>" in context:  # (two_turn asks "Sure?", self_scoring its default "Are you sure?")
        return f"yes {int(a) + int(b)}<|im_end|>"
    return f"{int(a) + int(b)}<|im_end|>"


@pytest.fixture()
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # verl imports _target_ from the working directory
    (tmp_path / "my_loops.py").write_text(AGENT_PY)
    (tmp_path / "loops.yaml").write_text(LOOPS_YAML)
    (tmp_path / "reward.py").write_text(REWARD_PY)
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as fh:
        for i, (a, b, agent) in enumerate([(1, 2, "two_turn"), (3, 4, "self_scoring"), (5, 5, "single_turn_agent")]):
            fh.write(json.dumps({"data_source": "tiller/arithmetic", "agent_name": agent,
                                 "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                                 "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                                 "extra_info": {"index": i}}) + "\n")
    return tmp_path, prompts


def _keys(root, prompts, model):
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files=[{prompts}]", "data.train_batch_size=3",
            "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6",
            "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
            "trainer.resume_mode=disable", f"trainer.default_local_dir={root / 'run'}", "data.max_prompt_length=64",
            "data.max_response_length=48", f"custom_reward_function.path={root / 'reward.py'}",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={root / 'loops.yaml'}"]


def test_custom_loops_trajectories_masks_and_rewards(tiny_model_dir, files):
    from tiller.trainer.rl import RLTrainer

    root, prompts = files
    trainer = RLTrainer(load_config(_keys(root, prompts, tiny_model_dir)))
    try:
        tok = trainer.tokenizer
        trainer.actor.worker.rollout = ScriptedEngine(tok, script)
        m: dict = {}
        batch = trainer._collect_batch(m, 1)
        width = batch["prompts"].shape[1]
        scores = {}
        for i in range(len(batch)):
            a, b = re.findall(r"(\d+)\+(\d+)=", batch["prompt_text"][i])[0]
            total = str(int(a) + int(b))
            n = int(batch["attention_mask"][i, width:].sum())
            resp, mask, lps = batch["responses"][i, :n], batch["response_mask"][i, :n], batch["rollout_log_probs"][i]
            if a == "5":  # single_turn_agent: tiller's one-turn loop
                assert tok.decode(resp) == f"{total}<|im_end|>" and bool(mask.all())
            else:  # the custom loop's trajectory: answer, the user turn (context), answer again
                nudge = "Sure?" if a == "1" else "Are you sure?"
                user = f"\n<|im_start|>user\n{nudge}<|im_end|>\n<|im_start|>assistant\n"
                assert tok.decode(resp) == f"{total}<|im_end|>{user}yes {total}<|im_end|>"
                trained = tok.decode(resp[mask.bool()])
                assert trained == f"{total}<|im_end|>yes {total}<|im_end|>"
                assert tok.decode(resp[~mask.bool()]) == user
                assert torch.all(lps[:n][mask.bool()] == LOGPROB) and torch.all(lps[:n][~mask.bool()] == 0.0)
            scores.setdefault(a, set()).add(float(batch["score"][i]))
        assert scores == {"1": {1.5}, "3": {11.0}, "5": {1.0}}  # self_scoring: its reward_score (10 + index)
        assert m["agent/reward_score_given"] == 2.0
        assert m["agent/turns/mean"] == pytest.approx((4 * 4 + 1 * 2) / 6)
    finally:
        trainer.shutdown()


def test_custom_loops_train_on_the_native_engine(tiny_model_dir, files, capsys):
    """Through `tiller rl`: the custom loop's requests share decode steps on the native engine; the actor's
    log-probabilities of the loop's trained tokens equal the engine's (the user turn in between is context)."""
    root, prompts = files
    keys = _keys(root, prompts, tiny_model_dir) + ["actor_rollout_ref.rollout.agent.default_agent_loop=two_turn",
                                                    "data.max_response_length=24"]
    code = main(["rl", *keys])
    assert code == 0, capsys.readouterr().err
    last = json.loads((root / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["training/rollout_probs_diff_max"] < 1e-4, last["training/rollout_probs_diff_max"]
    assert 1 <= last["agent/turns/mean"] <= 4 and "actor/pg_loss" in last


def test_bad_loops_are_named(tiny_model_dir, files, capsys):
    from tiller.trainer.rl import RLTrainer

    root, prompts = files
    (root / "bad.yaml").write_text("- name: x\n  _target_: my_loops.Missing\n")
    code = main(["rl", *_keys(root, prompts, tiny_model_dir),
                 f"actor_rollout_ref.rollout.agent.agent_loop_config_path={root / 'bad.yaml'}"])
    assert code == 2 and "my_loops has no 'Missing'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="default_agent_loop='mine': a custom loop needs"):
        load_config(_keys(root, prompts, tiny_model_dir)[:-1] + ["actor_rollout_ref.rollout.agent.default_agent_loop"
                                                                  "=mine"])
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    rows[0]["agent_name"] = "nobody"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="agent_name='nobody': not one of the run's agent loops"):
        RLTrainer(load_config(_keys(root, prompts, tiny_model_dir)))
    rows[0]["agent_name"] = "no_logprobs"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = RLTrainer(load_config(_keys(root, prompts, tiny_model_dir)))
    try:
        trainer.actor.worker.rollout = ScriptedEngine(trainer.tokenizer, script)
        with pytest.raises(Exception, match="no response_logprobs"):
            trainer._collect_batch({}, 1)
    finally:
        trainer.shutdown()


def test_tiller_eval_runs_the_custom_loops(tiny_model_dir, files, monkeypatch):
    """`tiller eval` with agent_loop_config_path: the same loops, the same scores as the training step's."""
    from tests.evaluation.test_eval_cli import _scripted_eval
    from tiller.models.loading import load_tokenizer

    root, prompts = files
    monkeypatch.setattr("tests.evaluation.test_eval_cli.ScriptedEngine", ScriptedEngine)
    tok = load_tokenizer(tiny_model_dir, padding_side="left")
    report, records = _scripted_eval(monkeypatch, tok, script, tiny_model_dir, prompts,
                                     f"custom_reward_function.path={root / 'reward.py'}",
                                     f"actor_rollout_ref.rollout.agent.agent_loop_config_path={root / 'loops.yaml'}",
                                     "data.max_response_length=48")
    assert [r["score"] for r in records] == [1.5, 11.0, 1.0]
    assert records[0]["response"].endswith("yes 3") and report["agent"]["turns/mean"] == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="tiller eval runs single-turn prompts"):
        _scripted_eval(monkeypatch, tok, script, tiny_model_dir, prompts,
                       f"actor_rollout_ref.rollout.agent.env_path={root / 'my_loops.py'}",
                       "algorithm.adv_estimator=grpo",
                       "actor_rollout_ref.rollout.n=2")


def test_custom_loops_run_asynchronously(tiny_model_dir, files, capsys):
    """async_training.staleness_threshold=1: the producer runs the loops on its own engine copy, one step ahead."""
    root, prompts = files
    keys = _keys(root, prompts, tiny_model_dir) + ["actor_rollout_ref.rollout.agent.default_agent_loop=two_turn",
                                                    "data.max_response_length=24", "trainer.total_training_steps=3",
                                                    "async_training.staleness_threshold=1"]
    code = main(["rl", *keys])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "actor/pg_loss" in r]
    assert len(trained) == 3 and max(r["async/staleness_max"] for r in trained) == 1, trained[-1]
    assert all(1 <= r["agent/turns/mean"] <= 4 for r in trained)
    with pytest.raises(ConfigError, match="partial_rollout=true: a verl agent loop's trajectory"):
        load_config(keys + ["async_training.partial_rollout=true"])


def test_server_generate_takes_the_rollouts_penalties_and_the_loops_own():
    """verl hands `run` the rollout's repetition_penalty; a loop's sampling parameters (vLLM's names) override the
    rollout's penalties per call."""
    import asyncio

    from tiller.rollout import SamplingParams
    from tiller.rollout.verl_agent_loop import _Server, verl_sampling_params

    sampling = SamplingParams(repetition_penalty=1.3, presence_penalty=0.2)
    params = verl_sampling_params(sampling)
    assert params["repetition_penalty"] == 1.3
    calls = []

    class Out:
        response_ids, logprobs = [[5]], [[-0.5]]

    async def generate(ids, call):
        calls.append(call)
        return Out()

    server = _Server(generate, sampling, seed=1, prompt_length=8, response_length=4, max_model_len=32)
    asyncio.run(server.generate(prompt_ids=[1, 2], sampling_params=params))
    asyncio.run(server.generate(prompt_ids=[1, 2], sampling_params={**params, "frequency_penalty": 0.5,
                                                                      "repetition_penalty": 1.0}))
    assert [(c.repetition_penalty, c.presence_penalty, c.frequency_penalty) for c in calls] == [
        (1.3, 0.2, 0.0), (1.0, 0.2, 0.5)]
