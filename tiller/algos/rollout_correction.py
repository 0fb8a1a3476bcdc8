"""Rollout correction: the rollout engine's sampling policy is not exactly the actor's.

The rollout engine (vLLM, a bf16 copy, a stale copy in async RL) samples token y_t with probability
p_rollout(y_t); the actor's policy at the start of the update gives p_old(y_t) for the same token. Their
ratio r_t = p_old(y_t) / p_rollout(y_t) is 1 when both agree. Two corrections act on it (verl's
`algorithm.rollout_correction`, Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse
from the Training-Inference Mismatch"; Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"):

- importance sampling, `rollout_is`: multiply each token's policy-gradient loss by a constant weight
  built from the ratio, per token (w_t = r_t) or per sequence (w_t = prod_s r_s = exp(sum_s log r_s) on
  every token of the row; log ratios clamped to [-20, 20] before exp). `rollout_is_threshold` is verl's
  string-or-float form:
      a float C (or "C"): truncated IS (TIS): w = min(w, C);
      "lo_hi" (e.g. "0.5_2.0"): IcePop: w is set to 0 where it lies outside [lo, hi] (the token stays in
          the loss mask, so it still counts in the token-mean's denominator), kept unchanged inside.
  `rollout_is_batch_normalize` divides the weights by their mean over the batch (tokens, or sequences for
  `sequence`) so they average 1.
- rejection sampling (RS), `rollout_rs`: set the loss mask to 0 where a divergence statistic leaves its
  bounds. Options (comma-separated; all must pass), statistics of the log ratio clamped to [-20, 20]:
      token_k1 / seq_sum_k1 / seq_mean_k1: k1 = -log r = log(p_rollout / p_old), per token / summed /
          averaged over the row, must lie in [log lo, log hi]: verl's k1 bounds apply to the inverse ratio
          p_rollout / p_old (per token, its product over the row, or its geometric mean). Threshold "lo_hi"
          (e.g. "0.5_2.0", lo <= hi) or a float hi (then lo = 1 / hi, the same interval for both
          orientations). To bound p_old / p_rollout in [a, b] instead, write "1/b_1/a" (e.g. [0.6, 1.6] on
          p_old / p_rollout is "0.625_1.6667").
      token_k2 / seq_sum_k2 / seq_mean_k2 / seq_max_k2: k2 = 0.5 (log r)^2, per token / summed / averaged /
          max over the row, must be <= the threshold (a float).
      token_k3 / ... / seq_max_k3: k3 = r - 1 - log r, likewise.
  A sequence-level option rejects every token of a failing row. `rollout_rs_threshold` is one threshold
  for all options or one per option, comma-separated. This is verl's code (`rollout_corr_helper.py` at
  verl-project/verl 1dda039b, 0.10.0.dev) key for key: a verl key means here what it means there.

Interface (shared by the synchronous trainer, async RL and bypass mode):

    rollout_correction(old_logp[B, T], rollout_logp[B, T], response_mask[B, T], **hyper)
        -> (weights[B, T], new_mask[B, T], metrics: dict[str, 0-dim Tensor])

`weights` are constants (no gradient), 1 where TIS is off, 0 outside `new_mask`; `new_mask` is
`response_mask` with rejected tokens set to 0 (same dtype). The trainer multiplies the per-token policy
loss by `weights` and aggregates over `new_mask`.

Mismatch diagnostics (verl's `calculate_debug_metrics`, names without the `training/` prefix):
`rollout_probs_diff_mean / _max / _std` of |p_rollout - p_actor| over response tokens and
`rollout_actor_probs_pearson_corr` of the two probabilities (as in MiniMax-M1, arXiv 2506.13585). They are
built from additive sums (`mismatch_sums`, `merge_mismatch_sums`, `mismatch_metrics`) so micro-batches and
ranks combine exactly.

Deviations from verl: metrics are 0-dim tensors (no `.item()`), sequence fractions count only rows with
at least one response token, and only verl's headline metrics are computed (not its per-option std /
seq_* breakdowns).

Letters: `B` sequences, `T` response tokens.
"""

from __future__ import annotations

import math

import torch

from tiller.algos.utils import masked_mean, masked_sum
from tiller.errors import ConfigError

SAFETY_BOUND = 20.0
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
IS_KEY = "algorithm.rollout_correction.rollout_is"
RS_KEY = "algorithm.rollout_correction.rollout_rs"
RS_THRESHOLD_KEY = "algorithm.rollout_correction.rollout_rs_threshold"


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """verl's `rollout_is_threshold`: a float C (or its string) -> (C, None), TIS; "lo_hi" -> (hi, lo), IcePop.
    ConfigError naming the key unless 0 < C, or 0 < lo <= hi."""
    key = "algorithm.rollout_correction.rollout_is_threshold"
    try:
        if isinstance(spec, bool):
            raise ValueError
        text = str(spec).strip()
        lo_s, _, hi_s = text.partition("_") if "_" in text else ("", "", text)
        hi, lo = float(hi_s), (float(lo_s) if lo_s else None)
        ok = hi > 0 and (lo is None or 0 < lo <= hi)
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{key}={spec!r} must be a float cap C > 0 (truncated IS) or \"lo_hi\" with "
                          "0 < lo <= hi (IcePop: weights outside [lo, hi] set to 0), e.g. 2.0 or \"0.5_2.0\"")
    return hi, lo


def parse_rs_options(rollout_rs: str | None, rollout_rs_threshold: str | float | None
                     ) -> list[tuple[str, float | None, float]]:
    """`rollout_rs` + `rollout_rs_threshold` -> [(option, lo, hi)]: for k1 options lo / hi bound p_rollout /
    p_old (verl's orientation), for k2 / k3 options lo is None and hi bounds the divergence. ConfigError (naming
    the key) when invalid."""
    if rollout_rs is None or not str(rollout_rs).strip():
        return []
    options = []
    for opt in (o.strip() for o in str(rollout_rs).split(",")):
        if opt not in ROLLOUT_RS_OPTIONS:
            raise ConfigError(f"{RS_KEY}: unknown option {opt!r}; valid: {', '.join(ROLLOUT_RS_OPTIONS)}")
        if opt not in options:
            options.append(opt)
    if rollout_rs_threshold is None:
        raise ConfigError(f"{RS_KEY}={rollout_rs} needs {RS_THRESHOLD_KEY} (e.g. 2.0 or \"0.5_2.0\")")
    specs = [s.strip() for s in str(rollout_rs_threshold).split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ConfigError(f"{RS_THRESHOLD_KEY}: give one threshold for all of {RS_KEY} or one per option "
                          f"({len(options)}), got {len(specs)}")
    out = []
    for opt, spec in zip(options, specs):
        try:
            if opt.endswith("k1"):
                lo_s, _, hi_s = spec.partition("_") if "_" in spec else ("", "", spec)
                hi = float(hi_s)
                lo = float(lo_s) if lo_s else 1.0 / hi
                ok = 0 < lo <= hi
            else:
                if "_" in spec:
                    raise ValueError
                lo, hi = None, float(spec)
                ok = hi > 0
        except (ValueError, ZeroDivisionError):
            ok = False
        if not ok:
            form = '"lo_hi" with 0 < lo <= hi, or a float hi >= 1' if opt.endswith("k1") else "a float > 0"
            raise ConfigError(f"{RS_THRESHOLD_KEY}: {spec!r} for {opt} must be {form}")
        out.append((opt, lo, hi))
    return out


def _seq_valid(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(-1) > 0


def _frac_rows(flags: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
    """Fraction of valid rows where `flags` [B] is set."""
    v = valid_rows.to(torch.float32)
    return (flags.to(torch.float32) * v).sum() / v.sum().clamp(min=1)


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or min) of `x` over `mask`; 0 when the mask is empty (no host sync: no branch on the data)."""
    fill = torch.full_like(x, -math.inf if largest else math.inf)
    value = torch.where(mask, x, fill)
    value = value.amax() if largest else value.amin()
    return torch.where(torch.isfinite(value), value, torch.zeros_like(value))


def _rs_statistic(option: str, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The option's statistic per token [B, T] (sequence options: the row's value on every token); k1 is
    -log r = log(p_rollout / p_old), as verl."""
    kind = option[-2:]
    log_ratio = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if kind == "k1":
        per_token = -log_ratio
    elif kind == "k2":
        per_token = 0.5 * log_ratio**2
    else:
        per_token = torch.exp(log_ratio) - 1.0 - log_ratio
    if option.startswith("token_"):
        return per_token
    if option.startswith("seq_sum_"):
        row = masked_sum(per_token, mask, dim=-1)
    elif option.startswith("seq_mean_"):
        row = masked_mean(per_token, mask, dim=-1)
    else:  # seq_max_
        row = torch.where(mask.bool(), per_token, torch.full_like(per_token, -math.inf)).amax(dim=-1)
        row = torch.where(_seq_valid(mask), row, torch.zeros_like(row))
    return row.unsqueeze(-1).expand_as(per_token)


def _is_weights(log_ratio: torch.Tensor, fmask: torch.Tensor, valid_rows: torch.Tensor, level: str,
                threshold: str | float, batch_normalize: bool, metrics: dict[str, torch.Tensor]) -> torch.Tensor:
    """TIS / IcePop weights [B, T] (0 outside the mask) and verl's `rollout_is_*` metrics (into `metrics`)."""
    hi, lo = parse_is_threshold(threshold)
    lo_metric = 1.0 / hi if lo is None else lo
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * fmask
    else:
        log_row = masked_sum(log_ratio, fmask, dim=-1)
        raw = torch.exp(log_row.clamp(-SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1) * fmask
    if lo is None:  # TIS
        weights = raw.clamp(max=hi)
    else:  # IcePop: out-of-bounds weights are 0, the tokens stay in the mask
        outside = (raw < lo) | (raw > hi)
        weights = torch.where(outside, torch.zeros_like(raw), raw)
        metrics["rollout_is_oob_ratio"] = masked_mean(outside.float(), fmask)
    mask = fmask.bool()
    metrics["rollout_is_mean"] = masked_mean(weights, fmask)
    if level == "token":
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((raw > hi).float(), fmask)
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw < lo_metric).float(), fmask)
        metrics["rollout_is_max"] = _masked_extreme(weights, mask, largest=True)
        metrics["rollout_is_min"] = _masked_extreme(weights, mask, largest=False)
    else:  # the rows' unclamped products, in log space
        metrics["rollout_is_ratio_fraction_high"] = _frac_rows(log_row > math.log(hi), valid_rows)
        metrics["rollout_is_ratio_fraction_low"] = _frac_rows(log_row < math.log(lo_metric), valid_rows)
        top = _masked_extreme(log_row, valid_rows, largest=True)
        metrics["rollout_is_max"] = torch.exp(top.clamp(max=SAFETY_BOUND))
        metrics["rollout_is_min"] = torch.exp(_masked_extreme(log_row, valid_rows, largest=False))
    # spread and effective sample size (a fraction of the tokens, 1 / E[(w / E[w])^2]) of the applied weights
    w = weights.clamp(min=0.0, max=hi)
    w_mean = masked_mean(w, fmask)
    var = (masked_mean(w**2, fmask) - w_mean**2).clamp(min=0)
    metrics["rollout_is_std"] = torch.where(fmask.sum() > 1, var.sqrt(), torch.zeros_like(var))
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean((w / (w_mean + 1e-8)) ** 2, fmask).clamp(min=1e-8)
    if batch_normalize:
        if level == "token":
            norm = masked_mean(weights, fmask)
        else:
            row_w = masked_mean(weights, fmask, dim=-1)
            norm = (row_w * valid_rows).sum() / valid_rows.sum().clamp(min=1)
        norm = torch.where(norm > 1e-8, norm, torch.ones_like(norm))
        weights = weights / norm
        metrics["rollout_is_batch_norm_factor"] = norm
    return weights


def rollout_correction(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor, *,
                       rollout_is: str | None = None, rollout_is_threshold: str | float = 2.0,
                       rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
                       rollout_rs_threshold: str | float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """TIS weights and the rejection mask (see the module docstring).

    Args:
        old_logp: [B, T] the actor's logprobs of the sampled tokens before the update (p_old).
        rollout_logp: [B, T] the rollout engine's logprobs of the same tokens (p_rollout).
        response_mask: [B, T] 1 on response tokens.
        rollout_is: None (off) | "token" | "sequence".
        rollout_is_threshold: the cap C of the weights (TIS), or "lo_hi" (IcePop); see `parse_is_threshold`.
        rollout_is_batch_normalize: divide the weights by their batch mean.
        rollout_rs: None (off) or comma-separated options of `ROLLOUT_RS_OPTIONS`.
        rollout_rs_threshold: see `parse_rs_options`.
    Returns:
        (weights [B, T], new_mask [B, T], metrics): metrics are detached 0-dim tensors with verl's names
        (no `rollout_corr/` prefix): `rollout_is_*` when TIS is on, `rollout_rs_*` when RS is on, and the
        off-policy diagnostics `kl`, `k3_kl`, `chi2_token`, `chi2_seq`, `log_ppl_diff`, `training_ppl`,
        `rollout_ppl` always.
    """
    if old_logp.shape != rollout_logp.shape or old_logp.shape != response_mask.shape:
        raise ValueError(f"rollout_correction: shapes differ: old_logp {tuple(old_logp.shape)}, "
                         f"rollout_logp {tuple(rollout_logp.shape)}, response_mask {tuple(response_mask.shape)}")
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise ConfigError(f"{IS_KEY} = {rollout_is!r} is not one of: null, {', '.join(ROLLOUT_IS_LEVELS)}")
    rs_options = parse_rs_options(rollout_rs, rollout_rs_threshold)
    old_logp, rollout_logp = old_logp.detach().float(), rollout_logp.detach().float()
    mask = response_mask.bool()
    fmask = mask.to(old_logp.dtype)
    valid_rows = _seq_valid(fmask)
    log_ratio = torch.where(mask, old_logp - rollout_logp, torch.zeros_like(old_logp))
    metrics: dict[str, torch.Tensor] = {}

    weights = fmask.clone()
    if rollout_is is not None:
        weights = _is_weights(log_ratio, fmask, valid_rows, rollout_is, rollout_is_threshold,
                              rollout_is_batch_normalize, metrics)

    keep = mask.clone()
    for option, lo, hi in rs_options:
        stat = _rs_statistic(option, log_ratio, fmask)
        if lo is not None:  # k1: the (sequence) ratio within [lo, hi]
            passed = (stat >= math.log(lo)) & (stat <= math.log(hi))
        else:
            passed = stat <= hi
        rejected = mask & ~passed
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(rejected.float(), fmask)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = _frac_rows(rejected.any(-1), valid_rows)
        metrics[f"rollout_rs_{option}_mean"] = masked_mean(stat, fmask)
        metrics[f"rollout_rs_{option}_max"] = _masked_extreme(stat, mask, largest=True)
        keep &= passed
    if rs_options:
        rejected = mask & ~keep
        metrics["rollout_rs_masked_fraction"] = masked_mean(rejected.float(), fmask)
        metrics["rollout_rs_seq_masked_fraction"] = _frac_rows(rejected.any(-1), valid_rows)
    new_mask = (response_mask * keep.to(response_mask.dtype)) if response_mask.dtype != torch.bool else keep
    weights = weights * keep.to(weights.dtype)

    metrics.update(offpolicy_metrics(old_logp, rollout_logp, fmask))
    return weights.detach(), new_mask, {k: v.detach() for k, v in metrics.items()}


def offpolicy_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor
                      ) -> dict[str, torch.Tensor]:
    """verl's off-policy diagnostics of p_old vs p_rollout over `response_mask` [B, T] (0-dim tensors):
    kl = E[log p_rollout - log p_old] (KL(rollout || old), direct estimator), k3_kl = E[r - 1 - log r],
    chi2_token = E[r^2] - 1, chi2_seq = mean_rows[(prod r)^2] - 1, training_ppl / rollout_ppl = mean over rows
    of exp(-mean_t logp), log_ppl_diff = mean over rows of (mean_t log p_rollout - mean_t log p_old)."""
    mask = response_mask.to(old_logp.dtype)
    rows = _seq_valid(mask)
    nrows = rows.sum().clamp(min=1)
    log_ratio = torch.where(mask.bool(), old_logp - rollout_logp, torch.zeros_like(old_logp))
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    mean_old = masked_mean(old_logp, mask, dim=-1)
    mean_rollout = masked_mean(rollout_logp, mask, dim=-1)
    log_row = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "kl": masked_mean(-log_ratio, mask),
        "k3_kl": masked_mean(torch.exp(safe) - 1.0 - safe, mask),
        "chi2_token": masked_mean(torch.exp(2 * safe), mask) - 1.0,
        "chi2_seq": (torch.exp(2 * log_row) * rows).sum() / nrows - 1.0,
        "training_ppl": (torch.exp(-mean_old) * rows).sum() / nrows,
        "rollout_ppl": (torch.exp(-mean_rollout) * rows).sum() / nrows,
        "log_ppl_diff": ((mean_rollout - mean_old) * rows).sum() / nrows,
    }


# ------------------------------------------------------------------------------ mismatch diagnostics
#: additive sufficient statistics of |p_rollout - p_actor| and of the Pearson correlation; `diff_max` merges by max
MISMATCH_SUM_KEYS = ("n", "diff_sum", "diff_sq_sum", "x_sum", "y_sum", "xx_sum", "yy_sum", "xy_sum")


def mismatch_sums(actor_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """Float64 sums over the response tokens of x = p_actor, y = p_rollout (probabilities) [B, T] -> 0-dim
    tensors `MISMATCH_SUM_KEYS` + `diff_max`. Merge parts with `merge_mismatch_sums`."""
    mask = response_mask.bool()
    x = torch.where(mask, actor_logp.detach().double().exp(), torch.zeros((), dtype=torch.float64))
    y = torch.where(mask, rollout_logp.detach().double().exp(), torch.zeros((), dtype=torch.float64))
    d = (x - y).abs()
    return {"n": mask.sum().double(), "diff_sum": d.sum(), "diff_sq_sum": (d * d).sum(), "x_sum": x.sum(),
            "y_sum": y.sum(), "xx_sum": (x * x).sum(), "yy_sum": (y * y).sum(), "xy_sum": (x * y).sum(),
            "diff_max": d.amax() if d.numel() else torch.zeros((), dtype=torch.float64)}


def merge_mismatch_sums(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The sums of the union of the parts' tokens."""
    out = {k: torch.stack([p[k] for p in parts]).sum() for k in MISMATCH_SUM_KEYS}
    out["diff_max"] = torch.stack([p["diff_max"] for p in parts]).amax()
    return out


def mismatch_metrics(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """verl's rollout-vs-actor metrics from `mismatch_sums` (no `training/` prefix): diff mean / max / std
    (unbiased; 0 for < 2 tokens) of |p_rollout - p_actor| and the Pearson correlation of p_actor and
    p_rollout (NaN when either is constant, as torch.corrcoef)."""
    n = sums["n"]
    nz = n.clamp(min=1)
    mean = sums["diff_sum"] / nz
    var = ((sums["diff_sq_sum"] - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0)
    cov = sums["xy_sum"] - sums["x_sum"] * sums["y_sum"] / nz
    var_x = (sums["xx_sum"] - sums["x_sum"] ** 2 / nz).clamp(min=0)
    var_y = (sums["yy_sum"] - sums["y_sum"] ** 2 / nz).clamp(min=0)
    denom = torch.sqrt(var_x * var_y)
    corr = torch.where(denom > 0, cov / torch.where(denom > 0, denom, torch.ones_like(denom)),
                       torch.full_like(denom, math.nan))
    return {"rollout_probs_diff_mean": mean, "rollout_probs_diff_max": sums["diff_max"],
            "rollout_probs_diff_std": torch.where(n > 1, var.sqrt(), torch.zeros_like(var)),
            "rollout_actor_probs_pearson_corr": corr.clamp(-1.0, 1.0)}


def rollout_mismatch_metrics(actor_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor
                             ) -> dict[str, torch.Tensor]:
    """`mismatch_metrics(mismatch_sums(...))` for one batch [B, T]."""
    return mismatch_metrics(mismatch_sums(actor_logp, rollout_logp, response_mask))
