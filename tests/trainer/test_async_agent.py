"""Asynchronous RL with agent rollouts: the producer thread runs whole episodes (an environment's turns, or an
agent's requests through its own OpenAI endpoint) with the newest weights it has; staleness is counted per
episode (its oldest segment decides, all its segments kept or dropped together); an effectively synchronous
schedule trains exactly as the synchronous agent run; the rollout correction sees the segments' logprobs;
resume loses and repeats no step; what stays refused names its key."""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch

from tests.trainer.test_rl import _jsonl, _train
from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.protocol import Batch
from tiller.rollout.episodes import renumber_episodes
from tiller.tasks import arithmetic
from tiller.trainer.async_rollout import staleness_filter

# Two turns: the first action's digits are rewarded, the observation asks again; the episode ends after turn 2.
ENV_SRC = '''
class Env:
    def reset(self, sample):
        self.turn = 0
        return None

    def step(self, action):
        self.turn += 1
        reward = sum(c.isdigit() for c in action) / max(len(action), 1)
        return " again:", reward, self.turn >= 2, {}
'''

CLIENT_AGENT_SRC = '''
async def run(client, sample):
    r = await client.completions.create(model="policy", prompt=sample["prompt_text"], max_tokens=3)
    again = await client.completions.create(model="policy", prompt=sample["prompt_text"] + r.choices[0].text,
                                            max_tokens=3)
    text = r.choices[0].text + again.choices[0].text
    return sum(c.isdigit() for c in text) / max(len(text), 1)
'''


@pytest.fixture(scope="module")
def env_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_agent_data")
    arithmetic.write_task(root, n_train=32, n_test=4, seed=0)
    (root / "env.py").write_text(ENV_SRC)
    (root / "client_agent.py").write_text(CLIENT_AGENT_SRC)
    return root


def _cfg(run_dir, model_dir, data, *overrides):
    return load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data / 'train.parquet'}]",
        "data.train_batch_size=2", "data.max_prompt_length=32", "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.dtype=float32", "algorithm.adv_estimator=grpo", "trainer.total_training_steps=3",
        "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}", f"actor_rollout_ref.rollout.agent.env_path={data / 'env.py'}",
        "actor_rollout_ref.rollout.agent.env_name=Env", "actor_rollout_ref.rollout.agent.max_turns=4", *overrides])


# ------------------------------------------------------------------------------------ the staleness filter
def test_staleness_filter_keeps_or_drops_whole_episodes_by_their_oldest_segment():
    # 4 episodes over 6 rows (segments); trainer step 4 with trigger 1 holds version 3, staleness 1 -> max age 1.
    # episode 0: segments at v2, v3 -> oldest 2, age 1, kept (partial: two versions)
    # episode 1: v1, v3          -> oldest 1, age 2, dropped whole (its v3 segment too)
    # episode 2: one v3 segment  -> age 0, kept
    # episode 3: no segment (an empty row) -> the batch's start version 1, age 2, dropped
    episode = torch.tensor([0, 0, 1, 1, 2, 3])
    versions = torch.tensor([2, 3, 1, 3, 3, 1])[:, None].expand(6, 2).clone()
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [0, 0]])
    batch = Batch({"rollout_token_version": versions, "response_mask": mask, "episode": episode,
                   "x": torch.arange(6)})
    kept, m = staleness_filter(batch, start_version=1, step=4, staleness_threshold=1, trigger=1)
    assert kept["x"].tolist() == [0, 1, 4]  # episodes 0 and 2, all their rows
    assert kept["episode"].tolist() == [0, 0, 1]  # renumbered 0..k-1 in order (the advantage indexes by it)
    assert m["async/dropped_stale"] == 2  # episodes, not rows
    assert m["async/staleness_max"] == 1 and m["async/staleness_mean"] == 0.5  # ages 1 and 0
    assert m["async/partial_samples"] == 1  # episode 0 holds versions 2 and 3
    # staleness 2 keeps all four episodes: ages 1, 2, 0, 2 -> mean 5/4
    kept, m = staleness_filter(batch, 1, 4, 2, 1)
    assert len(kept) == 6 and m["async/dropped_stale"] == 0 and m["async/staleness_mean"] == 1.25


# ------------------------------------------------------------------------------- partial rollouts, agents
def _switching_hook(module, state_b, switch_at: int):
    """A weights hook that loads `state_b` into `module` at its call `switch_at` (version 0 -> 1)."""
    calls = {"n": 0, "v": 0}

    def hook():
        calls["n"] += 1
        if calls["n"] == switch_at and calls["v"] == 0:
            module.load_state_dict(state_b)
            calls["v"] = 1
        return calls["v"]

    return hook


def test_continuous_batcher_takes_new_weights_between_decode_steps(tiny_model_dir):
    from tiller.models.loading import load_causal_lm, load_tokenizer
    from tiller.rollout import SamplingParams, build_rollout_engine
    from tiller.rollout.continuous import ContinuousBatcher

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    model_a = load_causal_lm(str(tiny_model_dir), dtype="float32")
    state_b = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
               for k, v in model_a.state_dict().items()}
    prompts = [tok("12+34=", add_special_tokens=False)["input_ids"], tok("7+5=", add_special_tokens=False)["input_ids"]]
    sampling = SamplingParams(n=2, max_new_tokens=6, do_sample=False, ignore_eos=True)

    def run(switch_at):
        module = copy.deepcopy(model_a).requires_grad_(False).eval()
        engine = build_rollout_engine("native", module, tok, dtype="float32")
        # call 1: before the prefill and the first decode (tokens 0 and 1's logits); call k: before the decode
        # giving token k's logits
        batcher = ContinuousBatcher(engine, max_rows=8, weights_hook=_switching_hook(module, state_b, switch_at))
        try:
            return batcher.generate(prompts, sampling)
        finally:
            batcher.close()

    plain, switched = run(0), run(3)  # the switch before the forward giving token 3's logits
    assert plain.token_versions == [[0] * 6] * 4
    assert switched.token_versions == [[0, 0, 0, 1, 1, 1]] * 4
    for row in range(4):
        assert switched.response_ids[row][:3] == plain.response_ids[row][:3]
        assert switched.logprobs[row][:3] == plain.logprobs[row][:3]
    assert any(switched.logprobs[r][3:] != plain.logprobs[r][3:] for r in range(4))  # new weights from token 3 on


def test_partial_agent_rollout_records_each_tokens_version_and_filters_whole_episodes(tmp_path, tiny_model_dir,
                                                                                      env_data):
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(_cfg(tmp_path / "run", tiny_model_dir, env_data, "async_training.staleness_threshold=2",
                             "async_training.partial_rollout=true",
                             "actor_rollout_ref.rollout.agent.max_concurrency=1"))
    try:
        worker = trainer.actor.worker
        module = worker._producer_engine.weights.module
        state_b = {k: v + 0.01 for k, v in module.state_dict().items()}
        # one episode at a time, two turns of up to 4 tokens each, about one hook call a token (call 1: before the
        # episodes): version 1 arrives during the first episodes, the later ones sample with it alone
        hook = _switching_hook(module, state_b, switch_at=8)
        batch = trainer._collect_batch({}, 1, {"engine": "producer", "weights_hook": hook})
    finally:
        trainer.shutdown()
    versions, mask, episode = batch["rollout_token_version"], batch["response_mask"].bool(), batch["episode"]
    assert set(versions[mask].tolist()) == {0, 1}
    for row in range(len(batch)):  # a segment's version is its first token's
        assert batch["policy_version"][row] == versions[row][mask[row]][0]
    per_episode = [versions[episode == e][mask[episode == e]].tolist() for e in range(int(episode.max()) + 1)]
    assert all(v == sorted(v) for v in per_episode)  # in segment order, versions never go back
    assert sum(set(v) == {0, 1} for v in per_episode) <= 1  # one switch: at most the episode it came in holds both
    # at trainer step 3 (version 2) with staleness 1, an episode with a version-0 token is dropped whole
    kept, m = staleness_filter(batch, 0, 3, 1, 1)
    old = [e for e, v in enumerate(per_episode) if 0 in v]
    assert 0 < len(old) < len(per_episode) and m["async/dropped_stale"] == len(old)
    assert len(kept) == int((~torch.isin(episode, torch.tensor(old))).sum())
    assert kept["episode"].tolist() == renumber_episodes(episode[~torch.isin(episode, torch.tensor(old))]).tolist()


# ----------------------------------------------------------------------------------------------- runs
def test_async_environment_run_trains_episodes_within_the_staleness_bound(tmp_path, tiny_model_dir, env_data):
    from tiller.trainer.rl import RLTrainer

    cfg = _cfg(tmp_path / "run", tiny_model_dir, env_data, "trainer.total_training_steps=4",
               "async_training.staleness_threshold=1")
    trainer = RLTrainer(cfg)
    # forced staleness, whatever the timing: the trainer publishes step s's weights only once the producer has
    # started step s + 1's episodes (with older weights), so every step after the first trains on age 1
    publish, seen = trainer._publish_weights, []

    def late_publish():
        while (trainer.producer._started_step < min(trainer.global_step + 1, trainer.total_steps)
               and trainer.producer._thread.is_alive()):
            threading.Event().wait(0.01)
        publish()

    take = trainer._take_batch

    def spy(m):
        batch = take(m)
        seen.append((trainer.global_step, batch["episode"].clone(), batch["policy_version"].clone()))
        return batch

    trainer._publish_weights, trainer._take_batch = late_publish, spy
    before = trainer.actor.execute("state_dict")
    try:
        trainer.fit()
        after = trainer.actor.execute("state_dict")
    finally:
        trainer.shutdown()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert sorted(rows) == [1, 2, 3, 4]
    for step, episode, version in seen:
        # all 2 x 3 episodes trained, two segments each; every segment sampled by the producer's version
        # step - 2 (the weights before the previous update), step 1 by the start weights
        assert episode.tolist() == [e for e in range(6) for _ in range(2)]
        assert version.tolist() == [max(0, step - 2)] * 12
        m = rows[step]
        assert m["async/policy_version"] == step - 1 and m["async/dropped_stale"] == 0
        assert m["async/staleness_max"] == m["async/staleness_mean"] == (0 if step == 1 else 1)
        assert m["agent/segments_per_episode/mean"] == 2.0
        assert "training/rollout_probs_diff_mean" in m  # the update's own logprobs vs the segments' rollout ones
    assert trainer.producer.in_flight(4) == 0 and not trainer.producer._thread.is_alive()


def test_effectively_synchronous_async_agent_run_equals_the_synchronous_one(tmp_path, tiny_model_dir, env_data):
    # staleness 0.5 with trigger 1: the producer runs (in its thread, on its own engine) but F = 1 batch per sync,
    # so step s waits for the weights of step s - 1: the same samples, the same updates. The rollout correction
    # (TIS) recomputes old logprobs in both, so both updates see the same numbers; one torch thread each side.
    # One episode at a time: concurrent episodes share the continuous batcher's decode steps in an order set by
    # when their turns arrive, and a batch's shape changes the last bits of its logprobs.
    common = ("trainer.num_threads=1", "+actor_rollout_ref.rollout.engine_kwargs.num_threads=1",
              "actor_rollout_ref.rollout.agent.max_concurrency=1",
              "algorithm.rollout_correction.rollout_is=token", "async_training.share_idle_threads=false")
    common += ("trainer.total_training_steps=2",)
    _, changed, plain = _train(_cfg(tmp_path / "a", tiny_model_dir, env_data, *common))
    _, _, asynced = _train(_cfg(tmp_path / "b", tiny_model_dir, env_data, *common,
                                "async_training.staleness_threshold=0.5"))
    assert changed
    for k in plain:
        assert torch.equal(plain[k], asynced[k]), k
    a, b = _jsonl(tmp_path / "a" / "metrics.jsonl"), _jsonl(tmp_path / "b" / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2]
    for step in a:
        assert {k: v for k, v in b[step].items() if not k.startswith(("async/", "training/off_policy/"))} == a[step]
        assert b[step]["async/staleness_max"] == 0 and b[step]["async/policy_version"] == step - 1
        assert b[step]["training/off_policy/trajectory_staleness_worst/max"] == 0
        assert b[step]["training/off_policy/trajectory_spans/max"] == 1
        assert "rollout_corr/rollout_is_mean" in a[step] and "training/rollout_probs_diff_mean" in a[step]


def test_async_agent_function_runs_through_the_producers_own_endpoint(tmp_path, tiny_model_dir, env_data):
    pytest.importorskip("openai")
    from tiller.trainer.rl import RLTrainer

    cfg = _cfg(tmp_path / "run", tiny_model_dir, env_data, "actor_rollout_ref.rollout.agent.env_path=null",
               f"actor_rollout_ref.rollout.agent.path={env_data / 'client_agent.py'}",
               "actor_rollout_ref.rollout.agent.client=openai", "trainer.total_training_steps=2",
               "async_training.staleness_threshold=1", f"data.val_files=[{env_data / 'test.parquet'}]")
    trainer = RLTrainer(cfg)
    worker = trainer.actor.worker
    try:
        trainer.fit()
        endpoints = dict(worker._endpoints)
        # the producer's episodes on its own engine; validation (after the last step, in the trainer thread) on
        # the trainer's rollout engine
        assert sorted(endpoints) == ["producer", "rollout"]
        assert endpoints["producer"].served.batcher.engine is worker._producer_engine
        assert endpoints["rollout"].served.batcher.engine is worker.rollout
    finally:
        trainer.shutdown()
    assert not worker._endpoints  # closed at shutdown
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert sorted(rows) == [1, 2]
    for step, m in rows.items():
        assert m["agent/segments_per_episode/mean"] == 2.0 and m["async/staleness_max"] <= 1
        assert m["async/dropped_stale"] == 0 and m["async/policy_version"] == step - 1
    assert any(k.startswith("val-core/") for k in rows[2])


def test_resume_after_an_interrupted_async_agent_run_repeats_and_loses_no_step(tmp_path, tiny_model_dir, env_data):
    from tiller.models.checkpoint import load_checkpoint
    from tiller.trainer.rl import RLTrainer

    common = ("async_training.staleness_threshold=1", "trainer.save_freq=2", "trainer.total_training_steps=3")
    trainer = RLTrainer(_cfg(tmp_path / "run", tiny_model_dir, env_data, *common))
    start = trainer.sampler.state_dict()
    for _ in range(3):
        trainer.sampler.next_batch()
    straight = trainer.sampler.state_dict()  # where a straight run's prompt sampler is after its 3 steps
    trainer.sampler.load_state_dict(start)
    step_fn = trainer.train_step

    def interrupted():
        if trainer.global_step == 3:
            raise KeyboardInterrupt
        return step_fn()

    trainer.train_step = interrupted
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    trainer.shutdown()
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "global_step_2")
    _train(_cfg(tmp_path / "run", tiny_model_dir, env_data, *common, "trainer.resume_mode=auto"))
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    # (what was in flight at the checkpoint depends on timing; what the resumed run regenerated must match it)
    assert rows[3].get("async/regenerated_on_resume", 0.0) == state["async_in_flight"]
    assert rows[3]["async/staleness_max"] == 0  # regenerated with the resumed (step-2) weights
    done = load_checkpoint(tmp_path / "run" / "checkpoints" / "global_step_3")
    assert done["sampler"] == straight and done["step"] == 3  # no prompt batch lost or drawn twice


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("override,expect", [
    ("async_training.staleness_threshold=1 async_training.partial_rollout=true actor_rollout_ref.rollout.name=hf",
     "async_training.partial_rollout=True needs actor_rollout_ref.rollout.name=native"),
    # on Ray too (a rollout pool: tests/distributed/test_agent_ray.py)
    ("trainer.backend=ray async_training.staleness_threshold=1 async_training.partial_rollout=true "
     "actor_rollout_ref.rollout.name=hf",
     "async_training.partial_rollout=True needs actor_rollout_ref.rollout.name=native"),
])
def test_what_async_agents_still_refuse_names_the_key(tmp_path, tiny_model_dir, env_data, override, expect):
    with pytest.raises(ConfigError, match=expect.replace(".", r"\.")):
        _cfg(tmp_path / "run", tiny_model_dir, env_data, *override.split())
