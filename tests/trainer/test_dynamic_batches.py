"""Token-budget micro-batches (verl's use_dynamic_bsz) and seqlen-balanced partitions.

The packing functions are checked on worked numbers and invariants (budget held, rows covered once,
groups kept together); the workers are checked for exactness: the gradient of an update, the old /
reference logprobs and the critic's values and gradient with token-budget micro-batches equal the
fixed-size ones (global-count normalisation makes the cut irrelevant).
"""

from __future__ import annotations

import random

import pytest
import torch

from tiller.config import load_config
from tiller.data.seqlen import balanced_partitions, token_budget_micro_batches
from tiller.protocol import Batch
from tiller.workers.micro_batches import split_micro_batches


def test_balanced_partitions_equal_size_and_near_equal_sums():
    rng = random.Random(0)
    weights = [rng.randint(1, 100) for _ in range(64)]
    parts = balanced_partitions(weights, 4, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert [len(p) for p in parts] == [16] * 4
    sums = [sum(weights[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(weights) // 10  # sums 831, 831, 831, 830 here
    # contiguous chunks of the unbalanced order differ by far more
    chunks = [sum(weights[i:i + 16]) for i in range(0, 64, 16)]
    assert max(chunks) - min(chunks) > 10 * (max(sums) - min(sums))
    with pytest.raises(ValueError):
        balanced_partitions([1, 2, 3], 2, equal_size=True)


def test_token_budget_worked_numbers():
    # rows: prompt lengths 2 2 3 3, responses 4 1 2 2, groups {0, 1} and {2, 3}
    # group 0 alone: 2 rows x (2 + 4) = 12 tokens; group 1: 2 x (3 + 2) = 10; together 4 x (3 + 4) = 28
    p, r, u = [2, 2, 3, 3], [4, 1, 2, 2], [0, 0, 1, 1]
    assert token_budget_micro_batches(p, r, u, budget=28) == [[0, 1, 2, 3]]
    assert token_budget_micro_batches(p, r, u, budget=12) == [[0, 1], [2, 3]]
    # budget 10: group 0 does not fit (12): split longest response first -> [0] (6) and [1] (3); group 1 fits
    # (10); first fit: [1] (3 tokens) goes in with [0]? 2 x (2 + 4) = 12 > 10, no; with [2, 3]? 3 x 5 = 15, no
    assert token_budget_micro_batches(p, r, u, budget=10) == [[0], [1], [2, 3]]
    with pytest.raises(ValueError, match="6 tokens"):
        token_budget_micro_batches(p, r, u, budget=5)


def test_token_budget_holds_budget_and_covers_rows():
    rng = random.Random(1)
    n_groups, n = 12, 4
    p = [l for l in (rng.randint(3, 20) for _ in range(n_groups)) for _ in range(n)]
    r = [rng.randint(1, 30) for _ in range(n_groups * n)]
    u = [g for g in range(n_groups) for _ in range(n)]
    budget = 160
    parts = token_budget_micro_batches(p, r, u, budget)
    assert sorted(i for part in parts for i in part) == list(range(n_groups * n))
    for part in parts:
        assert len(part) * (max(p[i] for i in part) + max(r[i] for i in part)) <= budget
    # groups that fit the budget on their own are never split
    for g in range(n_groups):
        rows = [i for i in range(len(u)) if u[i] == g]
        if n * (p[rows[0]] + max(r[i] for i in rows)) <= budget:
            assert any(set(rows) <= set(part) for part in parts)


def _batch(n_prompts: int = 4, n: int = 2, P: int = 6, T: int = 5, seed: int = 0) -> Batch:
    """n_prompts groups of n samples: left-padded prompts of different lengths, responses of different
    lengths, random advantages, old logprobs and GAE targets."""
    g = torch.Generator().manual_seed(seed)
    B = n_prompts * n
    plen = torch.randint(2, P + 1, (n_prompts,), generator=g).repeat_interleave(n)
    prompts = torch.randint(5, 300, (n_prompts, P), generator=g).repeat_interleave(n, 0)
    pmask = (torch.arange(P)[None] >= P - plen[:, None]).long()
    prompts = prompts * pmask
    rlen = torch.randint(1, T + 1, (B,), generator=g)
    rmask = (torch.arange(T)[None] < rlen[:, None]).long()
    responses = torch.randint(5, 300, (B, T), generator=g) * rmask
    attn = torch.cat([pmask, rmask], 1)
    return Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
                  "response_mask": rmask, "advantages": torch.randn(B, T, generator=g) * rmask,
                  "old_log_probs": -torch.rand(B, T, generator=g) - 5.0, "returns": torch.randn(B, T, generator=g),
                  "values": torch.randn(B, T, generator=g) * rmask},
                 meta={"mini_batch_size": B, "critic_mini_batch_size": B, "temperature": 1.0, "ppo_epochs": 1})


def test_split_micro_batches_restores_order():
    batch = _batch()
    micros = split_micro_batches(batch, rows=8, max_tokens=22)
    assert len(micros.batches) > 1 and not any(micros.padding)
    for mb in micros.batches:  # the budget: rows x (longest prompt + longest response)
        width = int(mb["attention_mask"][:, :6].sum(-1).max() + mb["response_mask"].sum(-1).max())
        assert len(mb) * width <= 22
    back = micros.restore([mb["advantages"] for mb in micros.batches])
    torch.testing.assert_close(back, batch["advantages"])


def _cfg(model_dir, *extra: str):
    return load_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=hf",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=4",
                        "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=6", "data.max_response_length=5",
                        "actor_rollout_ref.actor.grad_clip=1e9", "critic.grad_clip=1e9",
                        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.entropy_coeff=0.01",
                        *extra])


def _grads(worker, update, batch) -> dict[str, torch.Tensor]:
    """The accumulated gradient of one mini-batch, caught at the optimizer step."""
    caught = {}

    def step(*_, **__):
        caught.update({n: p.grad.detach().clone() for n, p in worker.model.named_parameters() if p.grad is not None})

    worker.optimizer.step = step
    getattr(worker, update)(batch)
    return caught


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_actor_gradient_dynamic_equals_fixed(tiny_model_dir, agg):
    from tiller.workers.actor import ActorRolloutRefWorker

    batch = _batch()
    grads, logps = [], []
    for extra in (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"],  # one micro-batch of 8
                  ["actor_rollout_ref.actor.use_dynamic_bsz=True",  # token budgets: several micro-batches
                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=22"]):
        cfg = _cfg(tiny_model_dir, f"actor_rollout_ref.actor.loss_agg_mode={agg}", *extra)
        w = ActorRolloutRefWorker(cfg, total_training_steps=1, need_ref=True)
        batch["ref_log_prob"] = w.compute_ref_log_prob(batch)["ref_log_prob"]
        logps.append(w.compute_log_prob(batch)["old_log_probs"])
        grads.append(_grads(w, "update_actor", batch))
    assert len(split_micro_batches(batch, rows=8, max_tokens=22).batches) >= 3
    mask = batch["response_mask"].bool()  # outside the mask a micro-batch's trimmed width decides (unused)
    torch.testing.assert_close(logps[0][mask], logps[1][mask], atol=1e-6, rtol=0)
    scale = max(float(g.abs().max()) for g in grads[0].values())
    assert scale > 1e-3
    worst = max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0])
    assert worst <= 1e-6, f"max |grad dynamic - grad fixed| = {worst:.2e} (max |grad| {scale:.2e})"


def test_critic_dynamic_equals_fixed(tiny_model_dir):
    from tiller.workers.critic import CriticWorker

    batch = _batch(seed=3)
    values, grads = [], []
    for extra in (["critic.ppo_micro_batch_size_per_gpu=8", "critic.forward_micro_batch_size_per_gpu=8"],
                  ["critic.use_dynamic_bsz=True", "critic.ppo_max_token_len_per_gpu=22",
                   "critic.forward_max_token_len_per_gpu=22"]):
        w = CriticWorker(_cfg(tiny_model_dir, *extra), total_training_steps=1)
        values.append(w.compute_values(batch)["values"])
        grads.append(_grads(w, "update_critic", batch))
    torch.testing.assert_close(values[0], values[1], atol=1e-6, rtol=0)  # 0 outside the mask in both
    scale = max(float(g.abs().max()) for g in grads[0].values())
    worst = max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0])
    assert worst <= 1e-6, f"max |grad dynamic - grad fixed| = {worst:.2e} (max |grad| {scale:.2e})"


def test_dynamic_defaults_follow_the_actor():
    cfg = load_config(["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=900"])
    arr = cfg.actor_rollout_ref
    assert arr.rollout.log_prob_use_dynamic_bsz and arr.ref.log_prob_use_dynamic_bsz and cfg.critic.use_dynamic_bsz
    assert arr.rollout.log_prob_max_token_len_per_gpu == arr.ref.log_prob_max_token_len_per_gpu == 900
    assert cfg.critic.forward_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu == 32768
    assert cfg.reward_model.use_dynamic_bsz and cfg.reward_model.forward_max_token_len_per_gpu == 32768
    off = load_config([])
    assert not off.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz and not off.critic.use_dynamic_bsz
    from tiller.errors import ConfigError

    with pytest.raises(ConfigError, match="below one sequence"):
        load_config(["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100"])


def test_ranks_agree_on_the_micro_batch_count(monkeypatch):
    """Under torch.distributed a rank with fewer token-budget micro-batches halves its largest ones, then adds
    padding micro-batches (all-zero response mask, outputs dropped) to match the largest count of any rank."""
    from tiller.distributed import context as dist_ctx

    batch = _batch()
    mine = len(split_micro_batches(batch, rows=8, max_tokens=40).batches)
    monkeypatch.setattr(dist_ctx, "is_distributed", lambda: True)
    for target in (mine + 2, len(batch) + 2):  # by splitting only; by splitting down to one row, then padding
        monkeypatch.setattr(dist_ctx, "all_gather_object", lambda n, t=target: [n, t])
        micros = split_micro_batches(batch, rows=8, max_tokens=40)
        assert len(micros.batches) == target
        assert sum(micros.padding) == max(0, target - len(batch))
        for mb, pad in zip(micros.batches, micros.padding):
            assert (mb["response_mask"].sum() == 0) == pad
        back = micros.restore([mb["advantages"] for mb in micros.batches])
        torch.testing.assert_close(back, batch["advantages"])


def test_critic_shuffle_is_read_and_seeded(tiny_model_dir):
    """critic.shuffle reorders samples before mini-batching (seeded by trainer.seed and the step): with two
    mini-batches the update changes, and the same seed gives the same update."""
    from tiller.workers.critic import CriticWorker

    batch = _batch(seed=5)
    batch.meta["critic_mini_batch_size"] = 4  # two mini-batches of 4
    after = []
    for shuffle in (False, True, True):
        w = CriticWorker(_cfg(tiny_model_dir, f"critic.shuffle={shuffle}", "critic.optim.lr=1e-2"),
                         total_training_steps=1)
        w.update_critic(batch)
        after.append({k: v.detach().clone() for k, v in w.model.state_dict().items()})
    assert any(not torch.equal(after[0][k], after[1][k]) for k in after[0])
    assert all(torch.equal(after[1][k], after[2][k]) for k in after[1])
