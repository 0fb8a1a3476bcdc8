"""Agent rollouts: `tiller rl` runs an agent written against the `openai` client through tiller's endpoint;
every completion is a trainable segment with its exact sampled ids and logprobs; bad agents are user errors."""

from __future__ import annotations

import json

import pytest
import torch

from tiller.config import load_config
from tiller.errors import ConfigError, UserError
from tiller.tasks import arithmetic

pytest.importorskip("openai")

# Two requests per episode: the second extends the transcript through the chat template (re-rendered text,
# so its context is *not* the first context + sampled ids: only the recorded ids can be trained exactly).
AGENT_SRC = '''
import json, os
import openai

LOG = os.environ.get("AGENT_LOG")

async def run(base_url, sample):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    messages = list(sample["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5, logprobs=True,
                                                 extra_body={"return_tokens_as_token_ids": True})
    text = first.choices[0].message.content
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    await client.close()
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"ids": [int(e.token.split(":")[1]) for e in first.choices[0].logprobs.content],
                                "lps": [e.logprob for e in first.choices[0].logprobs.content]}) + "\\n")
    answer = text + second.choices[0].message.content
    return sum(c.isdigit() for c in answer) / max(len(answer), 1)
'''

CLIENT_AGENT_SRC = '''
async def run(client, sample):
    r = await client.completions.create(model="policy", prompt=sample["prompt_text"], max_tokens=3)
    return {"reward": float(len(r.choices[0].text) % 2), "chars": len(r.choices[0].text)}
'''

BAD_AGENT_SRC = '''
async def run(base_url, sample):
    return "not a number"
'''

ENV_SRC = '''
class AgentInstance:
    def __init__(self, *args, **kwargs):
        self.t = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.t += 1
        reward = float(sum(c.isdigit() for c in states["action_text"]))
        return {"rewards": reward, "scores": reward, "environment_feedback": " more:", "done": self.t >= 2}
'''

TEMP_AGENT_SRC = '''
import openai

async def run(base_url, sample):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    await client.chat.completions.create(model="policy", messages=sample["prompt"], max_tokens=2, temperature=0.3)
    return 0.0
'''


@pytest.fixture(scope="module")
def agent_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_data")
    arithmetic.write_task(root, n_train=16, n_test=4, seed=0)
    for name, src in (("agent", AGENT_SRC), ("client_agent", CLIENT_AGENT_SRC), ("bad_agent", BAD_AGENT_SRC),
                      ("temp_agent", TEMP_AGENT_SRC), ("env", ENV_SRC)):
        (root / f"{name}.py").write_text(src)
    return root


def _cfg(run_dir, model_dir, data, *overrides):
    return load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data / 'train.parquet'}]",
        "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.dtype=float32", "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1",
        "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}", f"actor_rollout_ref.rollout.agent.path={data / 'agent.py'}",
        *overrides])


def test_agent_episodes_become_segments_with_the_sampled_ids(tmp_path, tiny_model_dir, agent_data, monkeypatch):
    from tiller.trainer.rl import RLTrainer

    log = tmp_path / "agent.log"
    monkeypatch.setenv("AGENT_LOG", str(log))
    trainer = RLTrainer(_cfg(tmp_path / "run", tiny_model_dir, agent_data))
    try:
        trainer.global_step = 1
        m: dict = {}
        batch = trainer._collect_batch(m, 1)
        # 2 prompts x n=3 episodes x 2 requests each = 12 segments, the episodes' rows adjacent
        assert len(batch) == 12 and batch["episode"].tolist() == [e for e in range(6) for _ in range(2)]
        assert batch["segment"].tolist() == [0, 1] * 6 and set(batch["policy_version"].tolist()) == {1}
        # the first segment of each episode holds exactly the ids and logprobs the agent's client received
        seen = [json.loads(line) for line in log.read_text().splitlines()]
        firsts = [i for i in range(12) if batch["segment"][i] == 0]
        got = sorted((batch["responses"][i][batch["response_mask"][i].bool()].tolist(),
                      batch["rollout_log_probs"][i][batch["response_mask"][i].bool()].tolist()) for i in firsts)
        want = sorted((s["ids"], s["lps"]) for s in seen)
        assert [g[0] for g in got] == [w[0] for w in want]
        for (_, g), (_, w) in zip(got, want):
            assert g == pytest.approx(w, abs=1e-6)
        # the second context is the re-rendered transcript: it holds the first answer's text, tokenized anew
        assert (batch["prompts"][1] != trainer.tokenizer.pad_token_id).sum() > (batch["prompts"][0] !=
                                                                                trainer.tokenizer.pad_token_id).sum()
        # every segment of an episode carries the episode's reward and the same advantage
        trainer._compute_advantage(batch, m, None)
        adv = batch["advantages"]
        for e in range(6):
            rows = (batch["episode"] == e).nonzero().squeeze(-1)
            vals = {round(float(adv[r][batch["response_mask"][r].bool()][0]), 6) for r in rows}
            assert len(vals) == 1
        # the actor's logprobs of the recorded segments equal the sampling logprobs (nothing re-tokenized)
        out = trainer.actor.execute("compute_log_prob", batch, dispatch="dp")
        mask = batch["response_mask"].bool()
        assert torch.allclose(out["old_log_probs"][mask], batch["rollout_log_probs"][mask], atol=1e-4)
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("engine", ["native", "hf"])  # hf: the endpoint micro-batches instead
def test_agent_rl_step_trains_and_takes_an_openai_client(tmp_path, tiny_model_dir, agent_data, engine):
    from tiller.trainer.rl import run

    cfg = _cfg(tmp_path / "run", tiny_model_dir, agent_data, f"actor_rollout_ref.rollout.name={engine}",
               f"actor_rollout_ref.rollout.agent.path={agent_data / 'client_agent.py'}",
               "actor_rollout_ref.rollout.agent.client=openai", "actor_rollout_ref.rollout.agent.max_concurrency=2",
               "trainer.total_training_steps=2")
    metrics = run(cfg)
    assert metrics["training/global_step"] == 2
    assert metrics["agent/segments_per_episode/mean"] == 1.0
    assert 0.0 <= metrics["agent/reward/mean"] <= 1.0
    assert abs(metrics["training/rollout_probs_diff_max"]) < 1e-3  # trained ids = sampled ids, same logprobs


def test_bad_agents_and_configs_are_user_errors(tmp_path, tiny_model_dir, agent_data):
    from tiller.trainer.rl import RLTrainer

    for name, match in (("bad_agent", "must return a number"), ("temp_agent", "temperature=0.3 differs")):
        trainer = RLTrainer(_cfg(tmp_path / name, tiny_model_dir, agent_data,
                                 f"actor_rollout_ref.rollout.agent.path={agent_data / (name + '.py')}"))
        try:
            trainer.global_step = 1
            with pytest.raises(UserError, match=match):
                trainer._collect_batch({}, 1)
        finally:
            trainer.shutdown()
    with pytest.raises(ConfigError, match="adv_estimator='gae'"):
        _cfg(tmp_path / "x", tiny_model_dir, agent_data, "algorithm.adv_estimator=gae")
    with pytest.raises(ConfigError, match="use_kl_in_reward is not supported with agent rollouts"):
        _cfg(tmp_path / "x", tiny_model_dir, agent_data, "algorithm.use_kl_in_reward=true")
    with pytest.raises(ConfigError, match="agent.client"):
        _cfg(tmp_path / "x", tiny_model_dir, agent_data, "actor_rollout_ref.rollout.agent.client=http")
    with pytest.raises(ConfigError, match="no such file"):
        RLTrainer(_cfg(tmp_path / "y", tiny_model_dir, agent_data,
                       f"actor_rollout_ref.rollout.agent.path={agent_data / 'missing.py'}"))._collect_batch({}, 1)


def test_environment_rollout_trains_through_tiller_rl(tmp_path, tiny_model_dir, agent_data):
    from tiller.trainer.rl import run

    cfg = _cfg(tmp_path / "run", tiny_model_dir, agent_data, "actor_rollout_ref.rollout.agent.path=null",
               f"actor_rollout_ref.rollout.agent.env_path={agent_data / 'env.py'}",
               "actor_rollout_ref.rollout.agent.max_turns=4", "trainer.total_training_steps=2")
    metrics = run(cfg)
    assert metrics["training/global_step"] == 2
    assert metrics["agent/segments_per_episode/mean"] == 2.0  # done after the second step
    assert abs(metrics["training/rollout_probs_diff_max"]) < 1e-3


def test_the_rollouts_regex_constrains_an_agents_requests(tmp_path, tiny_model_dir, agent_data):
    """rollout.structured_outputs_regex with an agent function: every segment the agent's requests sampled matches
    it (the endpoint fixes it for requests that leave it out)."""
    import re

    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(_cfg(tmp_path / "run", tiny_model_dir, agent_data,
                             "actor_rollout_ref.rollout.structured_outputs_regex='[0-9]{1,3}'"))
    try:
        batch = trainer._collect_batch({}, 1)
        texts = [trainer.tokenizer.decode(batch["responses"][i][batch["response_mask"][i].bool()].tolist(),
                                          skip_special_tokens=True) for i in range(len(batch))]
    finally:
        trainer.shutdown()
    assert len(texts) == 12 and all(re.fullmatch("[0-9]{1,3}", t) for t in texts), texts
