"""Agent rollouts on 2 Ray workers == one process (environment loop and agent function through the endpoint).

Each rank runs the episodes of its chunk of the step's prompts with its own engine (and, for an agent function,
its own OpenAI endpoint); the driver merges the ranks' segment batches (`tiller.trainer.episode_merge`). The
episodes are deterministic: an environment episode is seeded by its index in the step (whatever rank runs it), and
the agent here seeds its requests by the sample's index in the step (`sample["index"]`, the step's, on every
rank), the native engine's seeded rows being batch-independent. So both runs see the same segments, and the
comparison is the one of tests/distributed/test_rl_ray.py (`assert_same`: losses, gradient norms, weights;
Adam with eps = 1 so reassociation noise is not amplified). 3 prompts over 2 ranks: the dispatch pads them to 4,
the copy's episodes are dropped, and the odd segment count is padded with masked rows for the update.
"""

from __future__ import annotations

import json

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("openai")

from tests.distributed.test_rl_ray import ASYNC_RAY, assert_same, RAY  # noqa: E402
from tiller.config import load_config  # noqa: E402
from tiller.tasks import arithmetic  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # Ray start-up plus two runs a test: ~1 min on 2 cores

# 1 to 3 turns an episode (done once an action has an even number of distinct characters): episodes have different
# segment counts, and the reward (distinct characters) differs within groups, so every step has a gradient; the
# questions of even data rows score 0 whatever the answer, so DAPO's filter drops their groups (another round)
ENV_SRC = '''
class Env:
    def reset(self, sample):
        self.turn, self.scale = 0, 0.0 if sample["extra_info"]["index"] % 2 == 0 else 1 / 8

    def step(self, action):
        self.turn += 1
        distinct = len(set(action))
        return " and:", self.scale * distinct, self.turn >= 3 or distinct % 2 == 0, {}
'''

# a second request when the first answer has an odd number of distinct characters; requests seeded by the
# sample's place in the step; each episode logs the process and endpoint port that ran it
AGENT_SRC = '''
import json, os
import openai

async def run(base_url, sample):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    seed = 1000 * sample["index"] + 10 * sample["sample"]
    r = await client.completions.create(model="policy", prompt=sample["prompt_text"], max_tokens=5, seed=seed)
    text = r.choices[0].text
    if len(set(text)) % 2:
        r = await client.completions.create(model="policy", prompt=sample["prompt_text"] + text + " and:",
                                            max_tokens=4, seed=seed + 1)
        text += r.choices[0].text
    await client.close()
    with open(LOG, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "port": base_url.split(":")[2].split("/")[0],
                            "index": sample["index"], "sample": sample["sample"]}) + "\\n")
    return len(set(text)) / 8
'''


@pytest.fixture(scope="module")
def agent_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_ray_data")
    arithmetic.write_task(root, n_train=12, n_test=4, seed=0)
    (root / "env.py").write_text(ENV_SRC)
    (root / "agent.py").write_text(f"LOG = {str(root / 'episodes.jsonl')!r}\n" + AGENT_SRC)
    return root


def make_cfg(run_dir, model_dir, data, kind, *overrides):
    rollout = "actor_rollout_ref.rollout.agent"
    # the environment run also filters groups (DAPO): a group of equal rewards is dropped and another round drawn,
    # each round merged over the ranks, the rounds widened, concatenated and their episodes renumbered
    agent = ([f"{rollout}.env_path={data / 'env.py'}", f"{rollout}.env_name=Env", f"{rollout}.max_turns=3",
              "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
              "algorithm.filter_groups.max_num_gen_batches=3"]
             if kind == "env" else [f"{rollout}.path={data / 'agent.py'}"])
    return load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'test.parquet'}]", "data.val_max_samples=3",  # validated after the last step
        "data.train_batch_size=3", "data.max_prompt_length=32", "data.max_response_length=5",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.optim.lr=1.0",
        "actor_rollout_ref.actor.optim.eps=1.0", "actor_rollout_ref.rollout.dtype=float32",
        f"{rollout}.max_concurrency=1",  # one episode at a time: even the sampling logprobs agree bit for bit
        "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}", *agent, *overrides])


def train(cfg):
    """Fit; returns ((per-step (pg_loss, grad_norm), final weights), the merged batches (training and validation),
    the rank parts' sizes, the last step's val-* metrics)."""
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    batches, parts, losses = [], [], []
    execute, generate = trainer.actor.execute, trainer._generate

    def spy(method, *args, **kwargs):
        out = execute(method, *args, **kwargs)
        if method == "update_actor":
            losses.append((out["actor/pg_loss"], out["actor/grad_norm"]))
        if kwargs.get("dispatch") == "dp_parts":
            parts.append([len(p) for p in out])
        return out

    def keep(prompts):
        batches.append(generate(prompts))
        return batches[-1]

    trainer.actor.execute, trainer._generate = spy, keep
    try:
        last = trainer.fit()
        return (losses, execute("state_dict")), batches, parts, {k: v for k, v in last.items() if k.startswith("val")}
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("kind", ["env", "agent"])
def test_agent_rollouts_on_two_ray_workers_equal_one_process(kind, ray_session, tmp_path, tiny_model_dir, agent_data):
    log = agent_data / "episodes.jsonl"
    log.unlink(missing_ok=True)
    local, local_batches, local_parts, local_val = train(make_cfg(tmp_path / "local", tiny_model_dir, agent_data, kind))
    local_log = log.read_text().splitlines() if kind == "agent" else []
    log.unlink(missing_ok=True)
    ray_run, ray_batches, ray_parts, ray_val = train(make_cfg(tmp_path / "ray", tiny_model_dir, agent_data, kind, *RAY))

    assert local_parts == [[len(b)] for b in local_batches]  # one process: one part, the whole batch
    assert all(len(p) == 2 and min(p) > 0 for p in ray_parts)  # both ranks ran episodes every step
    # 2 steps (the environment's: 1 or more rounds each) + validation (3 prompts x 1 episode)
    assert local_val and ray_val == local_val
    assert len(local_batches) > 3 if kind == "env" else len(local_batches) == 3  # env: a step drew a second round
    assert [len(set(b["episode"].tolist())) for b in local_batches] == [6] * (len(local_batches) - 1) + [3]
    for one, two in zip(local_batches, ray_batches, strict=True):
        # the same episodes (6 a training round, consecutive ids: the padding prompt's gone; a second round's are
        # offset by the driver after the merge), the same segments, token for token
        ids = sorted(set(two["episode"].tolist()))
        assert ids == list(range(ids[0], ids[0] + len(ids)))
        assert two["episode"].tolist() == one["episode"].tolist() and list(two["uid"]) == list(one["uid"])
        for key in ("input_ids", "attention_mask", "position_ids", "response_mask", "agent_reward"):
            assert torch.equal(two[key], one[key]), key
        # (after an update the two runs' weights differ by the order of the gradient's cross-rank sum: ~1e-6 here)
        torch.testing.assert_close(two["rollout_log_probs"], one["rollout_log_probs"], atol=1e-5, rtol=0)
    # episodes of different segment counts (the merge's offsets and widths have something to get wrong)
    assert any(len(set(torch.bincount(b["episode"]).tolist())) > 1 for b in local_batches[:2])
    assert_same(ray_run, local, steps=2)
    if kind == "agent":  # each rank's episodes through its own endpoint; sample indexes are the step's
        episodes = [json.loads(line) for line in log.read_text().splitlines()]
        by_pid = {}
        for e in episodes:
            by_pid.setdefault(e["pid"], set()).add((e["port"], e["index"]))
        assert len(by_pid) == 2 and len({port for s in by_pid.values() for port, _ in s}) == 2
        # the same episodes (index, sample) as one process, plus rank 1's of the padding prompt (index 3: the
        # dispatch's copy of prompt 0), run and dropped by the merge
        ran = sorted((e["index"], e["sample"]) for e in episodes)
        assert [x for x in ran if x[0] < 3] == sorted((json.loads(x)["index"], json.loads(x)["sample"])
                                                      for x in local_log)
        # 2 steps x n = 2, and validation's (index 3, sample 0) (its 3 prompts padded to 4 as well)
        assert [x for x in ran if x[0] >= 3] == [(3, 0), (3, 0), (3, 0), (3, 1), (3, 1)]


@pytest.mark.parametrize("kind,partial", [("env", False), ("agent", False), ("env", True)],
                         ids=["env", "agent", "env-partial"])
def test_async_agent_rollouts_on_a_ray_rollout_pool_equal_one_process(kind, partial, ray_session, tmp_path,
                                                                       tiny_model_dir, agent_data):
    """Asynchronous RL on Ray with agent rollouts: the two rollout workers run the episodes of their chunks (each
    agent through its own endpoint) and the driver merges them, as the trainer's ranks do synchronously. At
    staleness_threshold=0.5 (one batch ahead at most: the synchronous schedule) the episodes, segments and the run
    equal one synchronous process's; every training segment records the version it was sampled with. With
    partial_rollout the environment loop asks the pool's board between decode steps (no newer version comes
    during a generation on this schedule, so the run is the same)."""
    local, local_batches, _, local_val = train(make_cfg(tmp_path / "local", tiny_model_dir, agent_data, kind))
    pool, pool_batches, _, pool_val = train(make_cfg(tmp_path / "ray", tiny_model_dir, agent_data, kind, *ASYNC_RAY,
                                                     "async_training.staleness_threshold=0.5",
                                                     f"async_training.partial_rollout={partial}"))
    assert local_val and pool_val == local_val  # (validation: the trainer's own worker and engine)
    assert len(pool_batches) == len(local_batches) >= 3
    for one, two in zip(local_batches, pool_batches, strict=True):
        assert two["episode"].tolist() == one["episode"].tolist() and list(two["uid"]) == list(one["uid"])
        for key in ("input_ids", "attention_mask", "response_mask", "agent_reward"):
            assert torch.equal(two[key], one[key]), key
        torch.testing.assert_close(two["rollout_log_probs"], one["rollout_log_probs"], atol=1e-5, rtol=0)
    versions = [set(b["rollout_token_version"][b["response_mask"].bool()].tolist()) for b in pool_batches[:-1]]
    step_of = [int(str(b["uid"][0])[1:].split("r")[0].split("-")[0]) for b in pool_batches[:-1]]
    assert versions == [{step - 1} for step in step_of]  # step s's episodes: the weights after step s - 1
    assert_same(pool, local, steps=2)
