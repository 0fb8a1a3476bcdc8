"""Policy losses: per-token surrogate losses for the actor update (aggregation is a separate step).

One signature (registry `POLICY_LOSSES`, verl's names):

    fn(logp[B, T], old_logp[B, T], advantages[B, T], response_mask[B, T], **hyper)
        -> (per_token_loss[B, T], metrics: dict[str, 0-dim detached Tensor])

`logp` carries the gradient; `old_logp` (behaviour policy) and `advantages` are constants. The
loss is 0 outside `response_mask`. Metrics always hold `pg_clipfrac`, `pg_clipfrac_lower` and
`ppo_kl` (masked mean of old_logp - logp; for kl_cov the mean |log ratio|, as verl); the trainer
adds the `actor/` prefix. Every loss is row-local (a row's loss depends only on that row, apart from
clip_cov / kl_cov's token selection), so with `aggregate_loss` and global counts micro-batch
gradients sum exactly to the mini-batch gradient.

Losses (log-ratio rho = logp - old_logp, r = exp(rho), A = advantage, eps_lo / eps_hi = clip ratios):
- vanilla: PPO clip (Schulman et al. 2017, arXiv 1707.06347) max(-A r, -A clip(r, 1-eps_lo, 1+eps_hi)),
  DAPO clip-higher via separate eps_lo / eps_hi (Yu et al. 2025, arXiv 2503.14476), dual-clip for
  A < 0: min(that, -A c) with c = clip_ratio_c > 1 (Ye et al. 2019, arXiv 1912.09729). rho is
  clamped to [-20, 20] before exp, as verl.
- gspo: sequence-level ratio s_i = exp(mean_t rho_it) (Zheng et al. 2025, arXiv 2507.18071), applied
  per token as s_it = sg(s_i) * exp(logp_it - sg(logp_it)) (so grad s_it = s_i grad logp_it), log
  clamped at 10, then PPO clip. Intended with seq-mean-token-mean (verl forces it).
- gpg: -A logp (Chu et al. 2025, arXiv 2504.02546); no ratio, no clip.
- cispo: -sg(clip(r, 1-eps_lo, 1+eps_hi)) A logp (MiniMax-M1, arXiv 2506.13585): every token keeps
  its gradient, the clipped IS weight is a constant. The loss *value* contains logp (only its
  gradient is meaningful).
- sapo: soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau, loss -f(r) A, tau = tau_pos for A > 0
  else tau_neg (Gao et al. 2025, arXiv 2511.20347; verl's `actor.tau_pos` / `actor.tau_neg`; the older
  names sapo_tau_pos / sapo_tau_neg are accepted, both spellings at once is an error). Intended with
  seq-mean-token-mean.
- geo_mean: GMPO (Zhao et al. 2025, arXiv 2507.20673): per-sequence loss -mean_t(A) exp(mean_t
  clip_sgn(rho)), where rho is clipped to [-eps_lo, eps_hi] on the side that limits the update for
  the sign of A. tiller returns that sequence loss on every valid token of the row, so
  seq-mean-token-mean reproduces verl's torch.mean over sequences (verl takes it per micro-batch, over all its
  rows, ignoring the global counts, so its gradient grows with the number of micro-batches; tiller's is the
  mini-batch's mean). Rollout IS weights act on a row through their geometric mean (`rollout_is_weights_for`).
- clip_cov: PPO clip, plus: among tokens not already clipped whose centred covariance
  (A - mean A)(logp - mean logp) lies in (clip_cov_lb, clip_cov_ub), a random
  max(1, floor(clip_cov_ratio * N_valid)) of them get zero loss (no gradient) (Cui et al. 2025,
  arXiv 2505.22617). Pass `generator` for reproducible selection.
- kl_cov: unclipped -A r; the top max(1, floor(kl_cov_ratio * N_valid)) tokens by that covariance
  get an extra ppo_kl_coef |rho| penalty (same paper).
- dppo_tv / dppo_kl: Divergence PPO (arXiv 2602.04879): instead of clipping the ratio, a token whose
  update already moved the *probability* too far is masked out of the gradient. With p = exp(logp),
  p_old = exp(old_logp) and thresholds d_lo / d_hi (verl reuses clip_ratio_low / _high for them):
      dppo_tv: valid = (p - p_old <= d_hi) if A > 0 else (p - p_old >= -d_lo)
      dppo_kl: D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)) (binary KL);
               valid = (D <= d_hi or p <= p_old) if A > 0 else (D <= d_lo or p >= p_old)
  loss = -A sg(min(r, clip_ratio_c)) logp valid: grad = -A min(r, c) grad logp on valid tokens, 0 elsewhere
  (like cispo, the loss *value* contains logp). pg_clipfrac = fraction of invalid tokens,
  pg_clipfrac_lower = fraction of valid tokens whose ratio exceeds c.
- dro: Direct Reward Optimisation with a quadratic log-ratio penalty:
  loss = -(A logp - dro_beta / 2 (logp - old_logp)^2); grad = -(A - dro_beta rho) grad logp.
- vespo: VESPO (arXiv 2602.10693; TRL's loss_type="vespo"): no clip; a smooth Gamma weight of the *sequence*
  importance ratio w = exp(sum_t clamp(rho_t, -20, 20)) (a sum, not GSPO's mean; log w clamped to [log 1e-8, 20]),
  phi(w) = exp(lam + k log w - lam w) (= 1 at w = 1; k, lam = vespo_k_pos, vespo_lambda_pos for A >= 0, else the
  _neg pair), detached, on -A logp: grad = -phi A grad logp. Rollout-correction IS weights, when the batch has them,
  enter w (log w += sum_t clamp(log w_t, log 1e-8, 20)) instead of multiplying the loss, as TRL folds its vLLM
  ratio in. The loss value contains logp (like cispo, only its gradient is meaningful); metric vespo_phi_mean.
- bypass_mode: verl's loss for `algorithm.rollout_correction.bypass_mode=True`, where old_logp IS the rollout
  engine's logprobs (no recompute). The rollout correction of `tiller.algos.rollout_correction` is computed
  inside the loss from the *current* policy: weights w and rejection mask from sg(p) / p_rollout. Then
  `loss_type=ppo_clip`: vanilla PPO clip against p_rollout on the kept tokens (no w: the ratio already is
  the IS correction); `loss_type=reinforce`: -A w logp on the kept tokens. Metrics add the correction's
  (`rollout_is_*`, `rollout_rs_*`, off-policy diagnostics) under their verl names.

Deviations from verl: losses are returned per token; metrics are tensors (no `.item()`); clip_cov /
kl_cov choose tokens with a rank test instead of `.item()` + topk (same distribution / same tokens
up to ties); dppo_tv / dppo_kl default clip_ratio_c to 20 when called bare, but the trainer passes
actor.clip_ratio_c (3.0 by default) exactly as verl's config does; dro clamps nothing (as verl); clip_cov, kl_cov and geo_mean clamp rho to [-20, 20] like vanilla so extreme ratios
stay finite (verl leaves geo_mean's clamp commented out: exp(mean rho) overflows float32); geo_mean uses
max(n_i, 1) where verl uses n_i + 1e-8 (a 1e-8 relative difference). Covariance statistics of
clip_cov / kl_cov are per call (per micro-batch), as in verl and the paper's code.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from tiller.algos.rollout_correction import rollout_correction
from tiller.algos.utils import Registry, masked_mean, reject_unknown
from tiller.errors import ConfigError

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode")
register_policy_loss = POLICY_LOSSES.register

#: keyword names any policy loss accepts (each uses its own subset; `loss_mode` is ignored).
POLICY_HYPER = (
    "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "clip_cov_ratio", "clip_cov_lb",
    "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "tau_pos", "tau_neg", "sapo_tau_pos", "sapo_tau_neg",
    "dro_beta", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "rollout_is_weights",
    "loss_type", "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
    "rollout_rs_threshold", "loss_mode", "generator",
)

#: the aggregation verl forces on these losses' policy-gradient term (entropy / KL / distillation terms and the
#: other losses: the config's loss_agg_mode).
FORCED_LOSS_AGG_MODE = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}

LOG_RATIO_CLAMP = 20.0

#: losses that take the rollout-correction IS weights inside (keyword `rollout_is_weights`) instead of having their
#: per-token loss multiplied by them.
IS_WEIGHTS_INSIDE = frozenset({"vespo"})


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; ConfigError listing the valid names otherwise."""
    return POLICY_LOSSES.get(name)


def _zero_outside(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def _clip_range(clip_ratio: float, low: float | None, high: float | None) -> tuple[float, float]:
    return (clip_ratio if low is None else low), (clip_ratio if high is None else high)


def _metrics(mask: torch.Tensor, log_ratio: torch.Tensor, clipfrac=None, clipfrac_lower=None) -> dict[str, torch.Tensor]:
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    return {
        "pg_clipfrac": (zero if clipfrac is None else clipfrac).detach(),
        "pg_clipfrac_lower": (zero if clipfrac_lower is None else clipfrac_lower).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float):
    """(max(-A r, -A clip(r)), -A r, -A clip(r))."""
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    return torch.maximum(l1, l2), l1, l2


@register_policy_loss("vanilla")
def vanilla_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio: float = 0.2, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0, **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip with clip-higher and dual-clip (see module doc)."""
    reject_unknown("vanilla", extra, POLICY_HYPER)
    if not clip_ratio_c > 1.0:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1 (dual-clip), got {clip_ratio_c}")
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    clip1, l1, l2 = _clipped_surrogate(torch.exp(log_ratio), advantages, low, high)
    l3 = -advantages * clip_ratio_c
    clip2 = torch.minimum(l3, clip1)
    loss = torch.where(advantages < 0, clip2, clip1)
    clipfrac = masked_mean((l2 > l1).to(logp.dtype), response_mask)
    lower = masked_mean(((clip1 > l3) & (advantages < 0)).to(logp.dtype), response_mask)
    return _zero_outside(loss, response_mask), _metrics(response_mask, log_ratio, clipfrac, lower)


@register_policy_loss("gspo")
def gspo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio: float = 0.2, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: PPO clip on the length-normalised sequence ratio, spread over tokens (see module doc)."""
    reject_unknown("gspo", extra, POLICY_HYPER)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = logp - old_logp
    m = response_mask.to(logp.dtype)
    seq_log_ratio = (torch.where(response_mask.bool(), log_ratio, 0.0).sum(-1) / m.sum(-1).clamp(min=1)).detach()
    log_s = torch.clamp(logp - logp.detach() + seq_log_ratio.unsqueeze(-1), max=10.0)
    loss, l1, l2 = _clipped_surrogate(torch.exp(log_s), advantages, low, high)
    clipfrac = masked_mean((l2 > l1).to(logp.dtype), response_mask)
    return _zero_outside(loss, response_mask), _metrics(response_mask, log_ratio, clipfrac)


@register_policy_loss("gpg")
def gpg_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG / plain REINFORCE surrogate -A logp."""
    reject_unknown("gpg", extra, POLICY_HYPER)
    loss = -advantages * logp
    return _zero_outside(loss, response_mask), _metrics(response_mask, logp - old_logp)


@register_policy_loss("cispo")
def cispo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio: float = 0.2, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: clipped, stop-gradient IS weight times -A logp."""
    reject_unknown("cispo", extra, POLICY_HYPER)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    loss = -clipped.detach() * advantages * logp
    clipfrac = masked_mean((ratio != clipped).to(logp.dtype), response_mask)
    return _zero_outside(loss, response_mask), _metrics(response_mask, log_ratio, clipfrac)


@register_policy_loss("sapo")
def sapo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, tau_pos: float | None = None, tau_neg: float | None = None, sapo_tau_pos: float | None = None,
    sapo_tau_neg: float | None = None, **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: smooth sigmoid gate in place of the hard clip (tau_pos 1.0, tau_neg 1.05 by default)."""
    reject_unknown("sapo", extra, POLICY_HYPER)
    tau_pos = _one_of("tau_pos", tau_pos, "sapo_tau_pos", sapo_tau_pos, 1.0)
    tau_neg = _one_of("tau_neg", tau_neg, "sapo_tau_neg", sapo_tau_neg, 1.05)
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=logp.dtype), torch.as_tensor(tau_neg, dtype=logp.dtype))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return _zero_outside(-gate * advantages, response_mask), _metrics(response_mask, log_ratio)


def _one_of(name: str, value: float | None, alias: str, alias_value: float | None, default: float) -> float:
    """A hyper-parameter with an old alias: either spelling, never both."""
    if value is not None and alias_value is not None:
        raise TypeError(f"sapo: {name} and {alias} are the same setting; give one")
    return default if value is None and alias_value is None else (value if value is not None else alias_value)


@register_policy_loss("geo_mean")
def geo_mean_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio: float = 0.2, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: geometric mean of sign-aware clipped token ratios; sequence loss on each valid token."""
    reject_unknown("geo_mean", extra, POLICY_HYPER)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sgn = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -low, high)
    rho = sgn * torch.minimum(sgn * log_ratio, sgn * clamped)
    m = response_mask.to(logp.dtype)
    n = m.sum(-1).clamp(min=1)
    seq_ratio = torch.exp(torch.where(response_mask.bool(), rho, 0.0).sum(-1) / n)
    seq_adv = torch.where(response_mask.bool(), advantages, 0.0).sum(-1) / n
    loss = (-seq_adv * seq_ratio).unsqueeze(-1).expand_as(logp)
    clipped = log_ratio != clamped
    clipfrac = masked_mean((clipped & (advantages > 0)).to(logp.dtype), response_mask)
    lower = masked_mean((clipped & (advantages < 0)).to(logp.dtype), response_mask)
    return _zero_outside(loss, response_mask), _metrics(response_mask, log_ratio, clipfrac, lower)


def rollout_is_weights_for(loss_mode: str, weights: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The per-token factor [B, T] that rollout-correction IS `weights[B, T]` put on `loss_mode`'s per-token loss.

    Every loss multiplies each token's loss by its weight, as verl's losses do, except geo_mean, whose loss is one
    per sequence: verl weights it by the geometric mean of the row's token weights,
    exp(sum_t m log(w_t + 1e-10) / (n_i + 1e-8)), returned here on every token of the row (so the seq-mean-token-mean
    of geo_mean's loss times it is verl's). A zero weight (IcePop) thus shrinks the whole row to ~0.
    """
    if loss_mode != "geo_mean":
        return weights
    m = response_mask.to(weights.dtype)
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    log_w = torch.where(response_mask.bool(), torch.log(weights + 1e-10), zero)
    seq = torch.exp(log_w.sum(-1) / (m.sum(-1) + 1e-8))
    return seq.unsqueeze(-1).expand_as(weights)


def _centred_cov(advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A - mean A)(logp - mean logp) with means over valid tokens; detached. [B, T]."""
    a, lp = advantages.detach(), logp.detach()
    return (a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask))


def _top_k_mask(keys: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Boolean [B, T]: the eligible entries with the k largest keys (k a 0-dim tensor; no .item())."""
    flat = torch.where(eligible, keys, torch.full_like(keys, float("-inf"))).reshape(-1)
    order = torch.argsort(flat, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return eligible & (rank.reshape(keys.shape) < k)


@register_policy_loss("clip_cov")
def clip_cov_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio: float = 0.2, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None, **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO clip, and a random few high-covariance tokens are detached (zero loss)."""
    reject_unknown("clip_cov", extra, POLICY_HYPER)
    if not clip_cov_ratio > 0:
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    valid = response_mask.bool()
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss, l1, l2 = _clipped_surrogate(torch.exp(log_ratio), advantages, low, high)
    cov = _centred_cov(advantages, logp, response_mask)
    eligible = valid & ~(l2 > l1) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    k = torch.floor(clip_cov_ratio * valid.sum().to(torch.float64)).clamp(min=1)
    keys = torch.rand(logp.shape, generator=generator, dtype=torch.float64, device="cpu").to(logp.device)
    selected = _top_k_mask(keys, eligible, k)
    loss = torch.where(selected, torch.zeros_like(loss), loss)
    clipfrac = masked_mean(selected.to(logp.dtype), response_mask)
    return _zero_outside(loss, response_mask), _metrics(response_mask, log_ratio, clipfrac)


@register_policy_loss("kl_cov")
def kl_cov_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 1.0, **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: -A r, with a |log ratio| penalty on the highest-covariance tokens."""
    reject_unknown("kl_cov", extra, POLICY_HYPER)
    if not kl_cov_ratio > 0:
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    valid = response_mask.bool()
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    abs_kl = log_ratio.abs()
    base = -advantages * torch.exp(log_ratio)
    k = torch.floor(kl_cov_ratio * valid.sum().to(torch.float64)).clamp(min=1)
    selected = _top_k_mask(_centred_cov(advantages, logp, response_mask), valid, k)
    loss = torch.where(selected, base + ppo_kl_coef * abs_kl, base)
    metrics = _metrics(response_mask, log_ratio)
    metrics["ppo_kl"] = masked_mean(abs_kl, response_mask).detach()
    return _zero_outside(loss, response_mask), metrics


def _dppo_loss(logp, old_logp, advantages, response_mask, valid, clip_ratio_c):
    """-A sg(min(r, c)) logp on valid tokens; metrics of the masked tokens (shared by both DPPO variants)."""
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    valid = valid.detach().to(logp.dtype)
    loss = -advantages * torch.clamp(ratio, max=clip_ratio_c).detach() * logp * valid
    clipfrac = masked_mean(1.0 - valid, response_mask)
    lower = masked_mean((ratio > clip_ratio_c).to(logp.dtype) * valid, response_mask)
    return _zero_outside(loss, response_mask), _metrics(response_mask, log_ratio, clipfrac, lower)


@register_policy_loss("dppo_tv")
def dppo_tv_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio: float = 0.2, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
    clip_ratio_c: float = 20.0, **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV: mask tokens whose probability moved more than the TV threshold (see module doc)."""
    reject_unknown("dppo_tv", extra, POLICY_HYPER)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    diff = (torch.exp(logp) - torch.exp(old_logp)).detach()
    valid = torch.where(advantages > 0, diff <= high, diff >= -low)
    return _dppo_loss(logp, old_logp, advantages, response_mask, valid, clip_ratio_c)


@register_policy_loss("dppo_kl")
def dppo_kl_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio: float = 0.2, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
    clip_ratio_c: float = 20.0, **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL: mask tokens whose binary KL(p_old || p) passed the threshold in the direction of A."""
    reject_unknown("dppo_kl", extra, POLICY_HYPER)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    lp, olp = logp.detach(), old_logp
    p, p_old = torch.exp(lp), torch.exp(olp)
    binary_kl = p_old * (olp - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid = torch.where(advantages > 0, (binary_kl <= high) | (p <= p_old), (binary_kl <= low) | (p >= p_old))
    return _dppo_loss(logp, old_logp, advantages, response_mask, valid, clip_ratio_c)


@register_policy_loss("dro")
def dro_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, dro_beta: float = 0.1, **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO: -(A logp - beta / 2 (logp - old_logp)^2), no ratio, no clip."""
    reject_unknown("dro", extra, POLICY_HYPER)
    if not dro_beta > 0:
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.dro_beta must be > 0, got {dro_beta}")
    log_ratio = logp - old_logp
    loss = -(advantages * logp - 0.5 * dro_beta * log_ratio**2)
    return _zero_outside(loss, response_mask), _metrics(response_mask, log_ratio)


VESPO_LOG_FLOOR = math.log(1e-8)  # TRL's (the VESPO reference code's) floor of log w


@register_policy_loss("vespo")
def vespo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0, rollout_is_weights: torch.Tensor | None = None, **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO: a detached Gamma weight of the sequence ratio on -A logp (see module doc; defaults are TRL's)."""
    reject_unknown("vespo", extra, POLICY_HYPER)
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    with torch.no_grad():
        log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        seq = torch.where(valid, log_ratio, zero).sum(-1, keepdim=True)
        if rollout_is_weights is not None:
            log_is = torch.clamp(torch.log(rollout_is_weights.to(logp.dtype)), VESPO_LOG_FLOOR, LOG_RATIO_CLAMP)
            seq = seq + torch.where(valid, log_is, zero).sum(-1, keepdim=True)
        log_w = torch.clamp(seq, VESPO_LOG_FLOOR, LOG_RATIO_CLAMP)
        nonneg = advantages >= 0
        k = torch.where(nonneg, vespo_k_pos, vespo_k_neg).to(logp.dtype)
        lam = torch.where(nonneg, vespo_lambda_pos, vespo_lambda_neg).to(logp.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = -phi * advantages * logp
    metrics = _metrics(response_mask, log_ratio)
    rows = valid.any(-1)
    seq_phi = torch.where(valid, phi, zero).sum(-1) / response_mask.to(logp.dtype).sum(-1).clamp(min=1)
    metrics["vespo_phi_mean"] = (torch.where(rows, seq_phi, zero).sum() / rows.sum().clamp(min=1)).detach()
    return _zero_outside(loss, response_mask), metrics


BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
_RS_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")


def bypass_loss_mask(logp: torch.Tensor, old_logp: torch.Tensor, response_mask: torch.Tensor,
                     **hyper: Any) -> torch.Tensor:
    """The mask [B, T] verl aggregates bypass_mode's loss over: `response_mask` less the tokens its rejection
    sampling drops (computed from sg(logp) vs the rollout logprobs `old_logp`, as inside the loss).

    Only seq-mean-token-mean reads it beyond the loss itself (each row's token count); the other modes'
    normalisers are global counts. `hyper`: bypass_mode's keywords; the rollout_* ones are used, the rest ignored.
    """
    kw = {k: v for k, v in hyper.items() if k in _RS_KEYS}
    return rollout_correction(logp.detach(), old_logp, response_mask, **kw)[1]


@register_policy_loss("bypass_mode")
def bypass_mode_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, loss_type: str = "ppo_clip", rollout_is: str | None = None, rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None, **extra: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass mode: `old_logp` are the rollout engine's logprobs; correction from sg(logp) vs them (module doc).

    Other keywords (clip_ratio*, clip_ratio_c) go to vanilla for loss_type=ppo_clip.
    """
    reject_unknown("bypass_mode", extra, POLICY_HYPER)
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ConfigError(f"algorithm.rollout_correction.loss_type = {loss_type!r} is not one of: "
                          f"{', '.join(BYPASS_LOSS_TYPES)}")
    weights, kept, corr = rollout_correction(
        logp.detach(), old_logp, response_mask, rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold)
    if loss_type == "ppo_clip":
        vanilla_hyper = {k: v for k, v in extra.items() if k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high",
                                                                  "clip_ratio_c")}
        loss, metrics = vanilla_loss(logp, old_logp, advantages, kept, **vanilla_hyper)
    else:
        w = weights.to(logp.dtype) if rollout_is is not None else torch.ones_like(logp)
        loss = _zero_outside(-advantages * logp * w, kept)
        metrics = _metrics(kept, logp - old_logp)
    metrics.update(corr)
    return _zero_outside(loss, response_mask), metrics
