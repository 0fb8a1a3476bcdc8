"""TRL's reward-function calling convention in tiller.trl (kwargs, formats, None -> NaN, weights, errors, async),
and TRL 1.16's GRPO advantage and loss formulas (quoted from trl/trainer/grpo_trainer.py) against the tiller
estimator / policy loss / aggregation each field maps to: values and gradients."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from tiller.algos.advantages import get_advantage_estimator
from tiller.algos.aggregate import aggregate_loss
from tiller.algos.kl import kl_penalty
from tiller.algos.policy_losses import get_policy_loss
from tiller.errors import DataError, UserError
from tiller.rewards.types import RewardRequest
from tiller.trl.grpo import LOSS_TYPES, TRL_ADV_EPSILON
from tiller.trl.rewards import TRLRewards

ROWS = [{"prompt": "a", "target": "1", "meta": {"k": [1, 2]}}, {"prompt": "b", "target": "2", "meta": None}]


def requests(texts, rows_idx, split="train"):
    return [RewardRequest(data_source="trl", prompt="p", response=t, ground_truth=None, group=f"g{r}",
                          extra_info={"trl_row": r, "trl_split": split}, response_ids=[7, len(t)])
            for t, r in zip(texts, rows_idx)]


def test_reward_functions_get_trls_keyword_arguments_and_none_is_nan():
    seen = {}

    def exact(prompts, completions, completion_ids, target, meta, trainer_state, log_extra, log_metric, **kw):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, target=target,
                    meta=meta, step=trainer_state.global_step, extra=sorted(kw))
        log_metric("custom/x", 2.0)
        return [1.0 if c == t else 0.0 for c, t in zip(completions, target)]

    def sometimes(completions, **kw):
        return [None, 3.0, 1.0, None]

    scorer = TRLRewards([exact, sometimes], ["exact", "sometimes"], [1.0, 0.5], {"train": ROWS}, False)
    scorer.global_step = 5
    batch = scorer.score(requests(["1", "x", "2", "2"], [0, 0, 1, 1]))
    assert seen == {"prompts": ["a", "a", "b", "b"], "completions": ["1", "x", "2", "2"],
                    "completion_ids": [[7, 1]] * 4, "target": ["1", "1", "2", "2"],
                    "meta": [{"k": [1, 2]}, {"k": [1, 2]}, None, None], "step": 5, "extra": []}
    # nansum(r x w): [1 + nan, 0 + 1.5, 1 + 0.5, 1 + nan]
    assert batch.scores.tolist() == [1.0, 1.5, 1.5, 1.0]
    assert batch.metrics["rewards/exact/mean"] == 0.75
    assert batch.metrics["rewards/sometimes/mean"] == 2.0  # nanmean of [3, 1]
    assert batch.metrics["rewards/sometimes/std"] == pytest.approx(math.sqrt(2.0))  # Bessel: ((1)^2 + 1^2) / 1
    assert batch.metrics["reward"] == 1.25 and batch.metrics["custom/x"] == 2.0
    assert batch.metrics["frac_reward_zero_std"] == 0.0  # groups [1, 1.5] and [1.5, 1] both vary
    assert np.isnan(batch.extras["sometimes"][0]) and batch.extras["exact"].tolist() == [1, 0, 1, 1]


def test_conversational_completions_and_async_functions():
    async def reward_async(completions, **kw):
        await asyncio.sleep(0)
        return [float(len(c[0]["content"])) for c in completions]

    conv = [{"prompt": [{"role": "user", "content": "q"}]}]
    scorer = TRLRewards([reward_async], ["reward_async"], [1.0], {"train": conv}, True)
    assert scorer.score(requests(["abc", "de"], [0, 0])).scores.tolist() == [3.0, 2.0]


def test_errors_name_the_function():
    def broken(completions, **kw):
        raise KeyError("target")

    def short(completions, **kw):
        return [1.0]

    def none(completions, **kw):
        return [None, None]

    for func, match in ((broken, "^reward function 'broken' raised KeyError: 'target'"),
                        (short, "^reward function 'short' returned 1 rewards, but 2 were expected")):
        with pytest.raises(UserError, match=match):
            TRLRewards([func], [func.__name__], [1.0], {"train": ROWS}, False).score(requests(["a", "b"], [0, 1]))
    with pytest.raises(DataError, match="every reward function returned None for completion 0"):
        TRLRewards([none], ["none"], [1.0], {"train": ROWS}, False).score(requests(["a", "b"], [0, 1]))
    with pytest.raises(UserError, match="reward_weights has 2 weights for 1 reward functions"):
        TRLRewards([none], ["none"], [1.0, 2.0], {"train": ROWS}, False)


def test_reward_model_scores_prompt_plus_completion_as_trl(tiny_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tiller.trl.rewards import RewardModelFunc

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    scorer = TRLRewards([RewardModelFunc(model, tok, None)], ["rm"], [1.0], {"train": ROWS}, False)
    got = scorer.score(requests([" x", " yz"], [0, 1])).scores
    with torch.no_grad():  # TRL: text = prompt + completion, right padded, logits[:, 0]
        want = [model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                for text in ("a x", "b yz")]
    assert got.tolist() == pytest.approx(want, abs=1e-5)


# ------------------------------------------------------------------------- TRL's math vs tiller's


def _trl_advantages(rewards: torch.Tensor, g: int, scale: str) -> torch.Tensor:
    # grpo_trainer.py, sum_then_normalize (no NaN): (r - group mean) / (group nanstd + 1e-4)
    mean = rewards.view(-1, g).mean(1).repeat_interleave(g)
    std = rewards.view(-1, g).std(1).repeat_interleave(g)  # nanstd: Bessel-corrected
    if scale == "batch":
        std = rewards.std().expand_as(rewards)  # nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    return adv if scale == "none" else adv / (std + 1e-4)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_equal_trls(scale):
    # worked: group [1, 0, 0, 1]: mean 0.5, std sqrt(1/3) = 0.57735 -> +-0.5 / 0.57745 = +-0.86588
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.4, 0.9, 0.9])
    mask = torch.ones(8, 3)
    tokens = torch.zeros(8, 3)
    tokens[:, -1] = rewards
    adv, _ = get_advantage_estimator("grpo")(tokens, mask, [0, 0, 0, 0, 1, 1, 1, 1], None, epsilon=TRL_ADV_EPSILON,
                                             norm_adv_by_std_in_grpo=scale != "none",
                                             std_scope="batch" if scale == "batch" else "group")
    assert adv[:, 0] == pytest.approx(_trl_advantages(rewards, 4, scale), abs=1e-6)
    if scale == "group":
        assert adv[0, 0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-4), abs=1e-6)


def _trl_normalize_then_sum(per_func: torch.Tensor, weights: torch.Tensor, g: int) -> torch.Tensor:
    """grpo_trainer.py, multi_objective_aggregation == "normalize_then_sum" (with TRL's own nanstd)."""
    from trl.trainer.utils import nanstd

    grouped = per_func.view(-1, g, per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, per_func.shape[1])
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    adv = (rewards - torch.nanmean(rewards)) / (nanstd(rewards) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def test_normalize_then_sum_is_gdpo_normalised_over_sequences_as_trl():
    # three functions, groups of 4; None (NaN) where a function does not apply: function c on all of group 1, one
    # completion of function b in group 0 (its stats over the other 3), three of function b in group 2 (one left:
    # no std, so it contributes 0 - TRL's nanstd is NaN there and nansum skips it)
    gen = torch.Generator().manual_seed(0)
    per_func = torch.rand(12, 3, generator=gen) * torch.tensor([1.0, 5.0, 0.2])
    per_func[4:8, 2] = float("nan")
    per_func[1, 1] = float("nan")
    per_func[8:11, 1] = float("nan")
    weights = torch.tensor([1.0, 0.5, 2.0])
    want = _trl_normalize_then_sum(per_func, weights, 4)
    mask = torch.ones(12, 3)
    mask[3, 1:] = 0
    adv, _ = get_advantage_estimator("gdpo")(torch.zeros(12, 3), mask, [i // 4 for i in range(12)], None,
                                             reward_components={k: per_func[:, i].numpy() for i, k in enumerate("abc")},
                                             gdpo_reward_keys=list("abc"), gdpo_reward_weights=weights.tolist(),
                                             gdpo_normalization="sequence", epsilon=TRL_ADV_EPSILON)
    assert adv[:, 0] == pytest.approx(want, abs=1e-6)
    assert adv[3, 1:].tolist() == [0.0, 0.0]  # the response's own mask
    # worked: no NaN, two functions where one is constant in its group - it adds nothing; the other one's z-scores
    # [+-0.86588] (group [1, 0, 0, 1]) then normalised over the 4 samples (std 1.0000 x 0.86588 / 0.57735 ...)
    comps = {"a": np.array([1.0, 0.0, 0.0, 1.0]), "b": np.array([3.0, 3.0, 3.0, 3.0])}
    adv, _ = get_advantage_estimator("gdpo")(torch.zeros(4, 1), torch.ones(4, 1), [0] * 4, None,
                                             reward_components=comps, gdpo_reward_keys=["a", "b"],
                                             gdpo_normalization="sequence", epsilon=TRL_ADV_EPSILON)
    z = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    s = z * 2 / math.sqrt(3)  # Bessel std of [z, -z, -z, z]
    assert adv[:, 0].tolist() == pytest.approx([z / (s + 1e-4), -z / (s + 1e-4)] * 1 + [-z / (s + 1e-4),
                                                                                          z / (s + 1e-4)], abs=1e-6)


def _trl_loss(loss_type, logp, old, adv, mask, eps_low, eps_high, max_len, tau=(1.0, 1.05), level="token"):
    """TRL 1.16 `_compute_loss` (one micro-batch, gradient_accumulation_steps = steps_per_generation = 1)."""
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    adv = adv.unsqueeze(1)
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * adv * logp
    elif loss_type == "sapo":
        temperatures = torch.where(adv > 0, tau[0], tau[1])
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * adv
    elif loss_type == "vespo":  # TRL's own Gamma weights (its defaults k 2 / 3, lambda 3 / 2)
        per_token_loss = -_trl_gamma_weights(adv, logp - old, mask, None) * adv * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if loss_type in ("grpo", "sapo"):
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):  # dapo / cispo: num_items_in_batch = the batch's tokens
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len)
    if loss_type == "luspo":
        return (per_token_loss * mask).sum(-1).mean()
    raise AssertionError(loss_type)


@pytest.mark.parametrize("loss_type,level", [(t, "token") for t in LOSS_TYPES] + [("dapo", "sequence"),
                                                                                  ("grpo", "sequence")])
def test_each_loss_type_equals_trls_value_and_gradient(loss_type, level):
    gen = torch.Generator().manual_seed(0)
    b, t, max_len = 6, 5, 7
    mask = torch.ones(b, t)
    for i, n in enumerate([5, 3, 1, 4, 2, 5]):
        mask[i, n:] = 0
    base = -torch.rand(b, t, generator=gen) * 3
    old = base + 0.3 * torch.randn(b, t, generator=gen)  # ratios well outside [0.8, 1.2]: clipping matters
    adv = torch.randn(b, generator=gen)
    eps_low, eps_high = 0.2, (5.0 if loss_type == "cispo" else 0.28)
    ours_logp, trl_logp = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    want = _trl_loss(loss_type, trl_logp, old, adv, mask, eps_low, eps_high, max_len, level=level)
    mode, agg = LOSS_TYPES[loss_type]
    hyper = {"vanilla": dict(clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=1e9),
             "cispo": dict(clip_ratio_low=1.0, clip_ratio_high=eps_high - 1.0),  # the translation's values
             "sapo": dict(tau_pos=1.0, tau_neg=1.05), "vespo": {}}[mode]
    if level == "sequence":
        mode, hyper = "gspo", dict(clip_ratio_low=eps_low, clip_ratio_high=eps_high)
    per_token, _ = get_policy_loss(mode)(ours_logp, old, adv[:, None].expand(b, t), mask, **hyper)
    got = aggregate_loss(per_token, mask, agg, max_len=max_len)
    assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    want.backward()
    got.backward()
    assert torch.allclose(ours_logp.grad, trl_logp.grad, rtol=1e-5, atol=1e-7), loss_type


def _trl_gamma_weights(*args, **kwargs):
    from trl.trainer.grpo_trainer import GRPOTrainer

    return GRPOTrainer.get_gamma_weights(*args, **kwargs)


def test_vespo_weights_and_rollout_is_ratio_equal_trls():
    # worked: phi(w) = exp(lam + k log w - lam w) is 1 at w = 1; a row whose log ratios sum to log 2 with A > 0
    # (k 2, lam 3): e^3 * 4 * e^-6 = 0.19915; with A < 0 (k 3, lam 2): e^2 * 8 * e^-4 = 1.08268
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    old = torch.full((3, 3), -1.0)
    logp = old + torch.tensor([[0.5 * math.log(2), 0.5 * math.log(2), 7.0], [math.log(2), 0.0, 0.0], [0.0, 0, 0]])
    adv = torch.tensor([1.0, -1.0, 0.5])
    per_token, metrics = get_policy_loss("vespo")(logp.clone().requires_grad_(True), old, adv[:, None].expand(3, 3),
                                                  mask)
    phi = [math.exp(3 - 3 * 2) * 4, math.exp(2 - 2 * 2) * 8, 1.0]
    assert (per_token / (-adv[:, None] * logp))[mask.bool()].tolist() == pytest.approx(
        [phi[0], phi[0], phi[1], phi[1], phi[1], phi[2]], rel=1e-5)
    assert float(metrics["vespo_phi_mean"]) == pytest.approx(sum(phi) / 3, rel=1e-5)
    assert per_token[0, 2] == 0  # outside the mask: no loss (its log ratio, 7, is not in the row's w either)
    # with rollout IS ratios (TRL: vLLM's token-level ratio, folded into the sequence weight; 0 = masked token)
    gen = torch.Generator().manual_seed(1)
    b, t = 5, 4
    mask = (torch.rand(b, t, generator=gen) > 0.2).float()
    mask[:, 0] = 1
    old = -torch.rand(b, t, generator=gen) * 2
    logp = old + 0.4 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, 1, generator=gen)
    ratio = torch.exp(0.3 * torch.randn(b, t, generator=gen)).clamp(max=2.0) * mask + (1 - mask)
    ratio[2, 0] = 0.0  # token_mask mode's rejected token
    want = _trl_gamma_weights(adv, logp - old, mask, ratio, 2.5, 1.5, 3.5, 2.5)
    hyper = dict(vespo_k_pos=2.5, vespo_lambda_pos=1.5, vespo_k_neg=3.5, vespo_lambda_neg=2.5)
    ours_logp, trl_logp = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    per_token, _ = get_policy_loss("vespo")(ours_logp, old, adv.expand(b, t), mask, rollout_is_weights=ratio, **hyper)
    got_phi = (per_token / (-adv * logp)).detach()
    assert torch.allclose(got_phi[mask.bool()], want.expand(b, t)[mask.bool()], rtol=1e-5, atol=1e-12)
    aggregate_loss(per_token, mask, "token-mean").backward()
    ((-want * adv * trl_logp * mask).sum() / mask.sum()).backward()
    assert torch.allclose(ours_logp.grad, trl_logp.grad, rtol=1e-5, atol=1e-9)


def test_k3_kl_equals_trls_within_verls_clamp():
    logp, ref = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.5, -1.0, -0.5]])
    trl = torch.exp(ref - logp) - (ref - logp) - 1  # grpo_trainer.py's per_token_kl
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), trl, atol=1e-7)
