"""Rollout-vs-actor mismatch metrics every step (every engine, on- and off-policy) and rollout correction in
the actor update: TIS weights scale the policy gradient; rejected tokens train nothing."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.test_rl import _train, make_cfg, rl_data  # noqa: F401  (rl_data is a fixture)
from tests.trainer.test_rl_units import _worker
from tiller.protocol import Batch

MISMATCH = ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "training/rollout_probs_diff_std",
            "training/rollout_actor_probs_pearson_corr")
FP32 = ("actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.actor.dtype=float32")


def _batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, 300, (8, 4), generator=g)
    responses = torch.randint(5, 300, (8, 5), generator=g)
    rmask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])[:, None]).long()
    return Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": torch.cat([torch.ones(8, 4, dtype=torch.long), rmask], 1), "response_mask": rmask,
                  "advantages": torch.randn(8, 5, generator=g) * rmask},
                 meta={"mini_batch_size": 8, "temperature": 1.0})


def _delta(model_dir, batch: Batch, *extra: str):
    # Adam with eps=1 and lr=1: the first step is ~ -g (see test_actor_update_is_micro_batch_invariant)
    w = _worker(model_dir, 4, "token-mean", "actor_rollout_ref.actor.optim.eps=1.0",
                "actor_rollout_ref.actor.optim.lr=1.0", "actor_rollout_ref.actor.optim.weight_decay=0.0", *extra)
    before = w.state_dict()
    metrics = w.update_actor(batch)
    return {k: v - before[k] for k, v in w.state_dict().items()}, metrics, w


def test_tis_weights_scale_the_policy_gradient(tiny_model_dir):
    # on-policy the PPO ratio is 1 (never clipped), so loss w_t * (-A_t r_t) has the gradient of advantages w_t A_t:
    # the update with weights equals the update with pre-scaled advantages and no weights
    batch = _batch()
    weights = 0.5 + 1.5 * torch.rand(8, 5, generator=torch.Generator().manual_seed(1))
    _assert_weights_act_as_scaled_advantages(tiny_model_dir, batch, weights, weights)


def _assert_weights_act_as_scaled_advantages(model_dir, batch, weights, factor, *overrides):
    """The update with `weights` as rollout IS weights equals the one with advantages x `factor` and no weights."""
    weighted = Batch(dict(batch.tensors), meta=dict(batch.meta))
    weighted["rollout_is_weights"] = weights
    scaled = Batch(dict(batch.tensors), meta=dict(batch.meta))
    scaled["advantages"] = batch["advantages"] * factor
    d_w, m_w, _ = _delta(model_dir, weighted, *overrides)
    d_s, m_s, _ = _delta(model_dir, scaled, *overrides)
    scale = max(float(d.abs().max()) for d in d_s.values())
    assert scale > 1e-4
    for k in d_s:
        torch.testing.assert_close(d_w[k], d_s[k], atol=1e-5 * scale, rtol=1e-4)
    assert m_w["actor/pg_loss"] == pytest.approx(m_s["actor/pg_loss"], rel=1e-5, abs=1e-7)


def test_geo_mean_weights_each_row_by_the_geometric_mean_of_its_is_weights(tiny_model_dir):
    # verl's geo_mean has one loss per row, -mean_t(A) * ratio, and weights it by exp(mean_t log(w_t + 1e-10)) over the
    # row's valid tokens: the same update as that row's advantages times that factor, without weights
    batch = _batch()
    mask = batch["response_mask"].float()
    weights = 0.5 + 1.5 * torch.rand(8, 5, generator=torch.Generator().manual_seed(1))
    geo = torch.exp((torch.log(weights + 1e-10) * mask).sum(-1) / (mask.sum(-1) + 1e-8))
    _assert_weights_act_as_scaled_advantages(tiny_model_dir, batch, weights, geo[:, None],
                                      "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean")


def test_vespo_takes_the_is_weights_into_its_sequence_weight(tiny_model_dir):
    # vespo (TRL's loss_type): on-policy its ratio is 1, so the rollout IS weights make the row's sequence weight
    # W = prod_t w_t and each token's loss -phi(W) A logp, phi(W) = exp(lam + k log W - lam W) with (k, lam) = (2, 3)
    # for A >= 0 and (3, 2) for A < 0 - not w_t x the loss, as the other losses take them
    batch = _batch()
    mask = batch["response_mask"].float()
    weights = 0.7 + 0.6 * torch.rand(8, 5, generator=torch.Generator().manual_seed(1))
    log_w = (torch.log(weights) * mask).sum(-1, keepdim=True)
    pos = batch["advantages"] >= 0
    k, lam = torch.where(pos, 2.0, 3.0), torch.where(pos, 3.0, 2.0)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    assert (phi - weights).abs().max() > 0.1  # the two readings differ
    _assert_weights_act_as_scaled_advantages(tiny_model_dir, batch, weights, phi,
                                             "actor_rollout_ref.actor.policy_loss.loss_mode=vespo")


def test_forced_aggregation_is_the_policy_terms_only(tiny_model_dir):
    # verl forces seq-mean-token-mean on gspo's policy loss, but aggregates the KL loss (and entropy, distillation)
    # with the config's loss_agg_mode. Zero advantages: gspo's and vanilla's policy terms have no gradient, so both
    # updates are the KL term's alone, token-mean in both (seq-mean-token-mean would weigh the rows of lengths
    # 5, 1, 3, 2, ... differently)
    batch = _batch()
    batch["advantages"] = torch.zeros(8, 5)
    batch["ref_log_prob"] = -1.0 - torch.rand(8, 5, generator=torch.Generator().manual_seed(3))
    kl = ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k2",
          "actor_rollout_ref.actor.kl_loss_coef=1.0")
    d_g, m_g, _ = _delta(tiny_model_dir, batch, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", *kl)
    d_v, m_v, _ = _delta(tiny_model_dir, batch, *kl)
    scale = max(float(d.abs().max()) for d in d_v.values())
    assert scale > 1e-4
    for k in d_v:
        torch.testing.assert_close(d_g[k], d_v[k], atol=1e-6 * scale, rtol=1e-5)
    assert m_g["actor/kl_loss"] == pytest.approx(m_v["actor/kl_loss"], rel=1e-6)


def test_importance_weighted_kl_loss_has_the_unbiased_kl_gradient(tiny_model_dir):
    """actor.kl_loss_importance_weight (TRL's use_bias_correction_kl): on-policy the ratio is 1 but its gradient
    makes k3's gradient ratio x d = d (d = logp - ref), which is k2's gradient: with zero advantages the weighted k3
    update equals the plain k2 update, and the plain k3 update (gradient 1 - e^-d) does not."""
    batch = _batch()
    batch["advantages"] = torch.zeros(8, 5)
    actor = _worker(tiny_model_dir, 4, "token-mean").compute_log_prob(batch)["old_log_probs"]
    noise = torch.rand(8, 5, generator=torch.Generator().manual_seed(3)) - 0.5
    batch["ref_log_prob"] = actor + noise  # |d| <= 0.5: inside k3's clamps
    kl = ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=1.0")
    d_w, m_w, _ = _delta(tiny_model_dir, batch, *kl, "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
                         "actor_rollout_ref.actor.kl_loss_importance_weight=true")
    d_2, _, _ = _delta(tiny_model_dir, batch, *kl, "actor_rollout_ref.actor.kl_loss_type=k2")
    d_3, m_3, _ = _delta(tiny_model_dir, batch, *kl, "actor_rollout_ref.actor.kl_loss_type=low_var_kl")
    scale = max(float(d.abs().max()) for d in d_2.values())
    assert scale > 1e-4
    for k in d_2:
        torch.testing.assert_close(d_w[k], d_2[k], atol=1e-5 * scale, rtol=1e-4)
    assert max(float((d_3[k] - d_2[k]).abs().max()) for k in d_2) > 0.02 * scale
    assert m_w["actor/kl_loss"] == pytest.approx(m_3["actor/kl_loss"], rel=1e-6)  # on-policy the value is k3's


def test_on_policy_update_measures_the_mismatch(tiny_model_dir):
    # no old_log_probs: the update's own logprobs are the actor's; rollout logprobs = actor's + known noise
    batch = _batch()
    w = _worker(tiny_model_dir, 4, "token-mean", "actor_rollout_ref.actor.dtype=float32")
    actor = w.compute_log_prob(batch)["old_log_probs"]
    noise = 0.05 * torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    batch["rollout_log_probs"] = (actor + noise) * batch["response_mask"]
    metrics = w.update_actor(batch)
    from tiller.algos.rollout_correction import rollout_mismatch_metrics

    expected = rollout_mismatch_metrics(actor, batch["rollout_log_probs"], batch["response_mask"])
    for key in MISMATCH:
        assert metrics[key] == pytest.approx(float(expected[key.removeprefix("training/")]), rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("engine,off_policy", [("native", False), ("native", True), ("hf", False)])
def test_every_step_logs_a_small_mismatch_in_fp32(tmp_path, tiny_model_dir, rl_data, engine, off_policy):  # noqa: F811
    extra = ("actor_rollout_ref.actor.ppo_epochs=2",) if off_policy else ()
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, f"actor_rollout_ref.rollout.name={engine}", *FP32, *extra)
    metrics, changed, _ = _train(cfg)
    assert changed
    assert metrics["training/rollout_probs_diff_mean"] < 1e-4 and metrics["training/rollout_probs_diff_max"] < 1e-3
    assert metrics["training/rollout_actor_probs_pearson_corr"] > 0.9999
    assert ("timing_s/old_log_prob" in metrics) == off_policy  # on-policy: the actor measured it in its update


def test_sampling_knobs_show_up_as_mismatch(tmp_path, tiny_model_dir, rl_data):  # noqa: F811
    # top-k=3 renormalises over 3 tokens: the rollout's logprobs are of another distribution than the actor's
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "actor_rollout_ref.rollout.top_k=3", *FP32,
                   "trainer.total_training_steps=1")
    metrics, _, _ = _train(cfg)
    assert metrics["training/rollout_probs_diff_mean"] > 0.05


def test_rollout_correction_runs_and_rejection_can_stop_training(tmp_path, tiny_model_dir, rl_data):  # noqa: F811
    rc = "algorithm.rollout_correction"
    cfg = make_cfg(tmp_path / "a", tiny_model_dir, rl_data, *FP32, "actor_rollout_ref.rollout.top_k=3",
                   f"{rc}.rollout_is=sequence", f"{rc}.rollout_is_threshold=2.0",
                   f"{rc}.rollout_rs=token_k1", f"{rc}.rollout_rs_threshold=0.5_2.0")
    metrics, changed, _ = _train(cfg)
    assert changed and "timing_s/old_log_prob" in metrics  # correction needs p_old: computed even on-policy
    for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_ratio_fraction_high",
                "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/kl", "rollout_corr/chi2_token"):
        assert math.isfinite(metrics[key]), key
    # top-k=3 makes every r = p_actor / p_rollout < 1; keeping only r in [1.5, 2] rejects every token: no update
    cfg = make_cfg(tmp_path / "b", tiny_model_dir, rl_data, *FP32, "actor_rollout_ref.rollout.top_k=3",
                   "actor_rollout_ref.actor.optim.weight_decay=0.0", f"{rc}.rollout_rs=token_k1",
                   f"{rc}.rollout_rs_threshold=1.5_2.0")
    metrics, changed, _ = _train(cfg)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert not changed
