"""Loss aggregation (`loss_agg_mode`): per-token loss [B, T] -> scalar, with GLOBAL normalisers.

Modes (verl's names; `m` = response mask, `l` = per-token loss, `n_i` = sum_t m_it):
- token-mean:              sum_it l m / N_tok              (DAPO's token-level mean)
- token-sum:               sum_it l m                      (no normaliser: the loss scales with the batch)
- seq-mean-token-sum:      sum_i (sum_t l m) / N_seq
- seq-mean-token-mean:     sum_i (sum_t l m / n_i) / N_seq (GRPO's original 1/|o_i| per sequence)
- seq-mean-token-sum-norm: sum_i (sum_t l m) / (N_seq * L_max)  (Dr.GRPO's constant normaliser; L_max = the role's
                           `loss_scale_factor` when set, as verl's agg_loss, else the padded response width T)

`N_tok` = `global_tokens`, `N_seq` = `global_seqs`, `L_max` = `max_len`: the caller passes the
counts of the whole mini-batch, so that for micro-batches b_1..b_k of a mini-batch
    sum_j aggregate_loss(l[b_j], m[b_j], mode, global counts) == aggregate_loss(l, m, mode, same counts)
exactly (every mode is a sum over rows divided by a constant), and gradient accumulation by plain
`.backward()` on each micro-batch yields the mini-batch gradient. Without the keywords the local
counts are used (N_tok = local valid tokens, N_seq = local rows with at least one valid token
(`count_sequences`), L_max = T).

The local N_seq (no `global_seqs`) counts only sequences with at least one valid token, as verl's agg_loss does
without global_batch_size ("exclude fully masked sequences"). The trainer's `global_seqs` also counts a row that
rollout correction rejected whole (it contributes 0), as verl 0.10's trainer passes global_batch_size =
ppo_mini_batch_size x n (`tiller.workers.common.global_counts`); world-size padding rows never count.

Deviations from verl:
- verl's legacy actor (gone in 0.10, whose engine passes global counts as tiller does) aggregated each micro-batch
  with its own counts and scaled by 1/#micro-batches, which biases token-mean when micro-batches hold different
  token counts, and divided seq-mean-token-sum-norm by L_max only (a constant factor larger).
- A row with no valid token contributes 0 to seq-mean-token-mean (verl: 0 / 1e-8 = 0, the same).
"""

from __future__ import annotations

import torch

from tiller.algos.utils import masked_sum
from tiller.errors import ConfigError

LOSS_AGG_MODES = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
)

Count = int | float | torch.Tensor


def _as_denominator(value: Count, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).clamp(min=1)


def count_sequences(response_mask: torch.Tensor) -> torch.Tensor:
    """N_seq of the seq-mean modes: rows of `response_mask[B, T]` with at least one valid token (0-dim)."""
    return (response_mask.sum(-1) > 0).sum()


def aggregate_loss(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    max_len: Count | None = None,
) -> torch.Tensor:
    """Aggregate `per_token_loss[B, T]` over `response_mask[B, T]` into a scalar (see module doc).

    Args:
        global_tokens: valid tokens in the whole mini-batch (token-mean).
        global_seqs: sequences of the whole mini-batch (the seq-mean-* modes; the trainer's count includes rows
            rejected whole, as verl's trainer; default: this call's rows with a valid token, `count_sequences`).
        max_len: Dr.GRPO's constant (seq-mean-token-sum-norm): verl's `loss_scale_factor` (any positive number,
            used as given) or the padded width; default T (at least 1).
    """
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"loss_agg_mode: unknown mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    if per_token_loss.shape != response_mask.shape or per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss {tuple(per_token_loss.shape)} and mask {tuple(response_mask.shape)} must be [B, T]")
    fmask = response_mask.to(per_token_loss.dtype)
    if mode == "token-mean":
        n_tok = fmask.sum() if global_tokens is None else global_tokens
        return masked_sum(per_token_loss, response_mask) / _as_denominator(n_tok, per_token_loss)
    if mode == "token-sum":
        return masked_sum(per_token_loss, response_mask)
    n_seq = count_sequences(response_mask) if global_seqs is None else global_seqs
    seq_sum = masked_sum(per_token_loss, response_mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / _as_denominator(n_seq, per_token_loss)
    if mode == "seq-mean-token-mean":
        return (seq_sum / fmask.sum(-1).clamp(min=1)).sum() / _as_denominator(n_seq, per_token_loss)
    if max_len is None:
        length = _as_denominator(per_token_loss.shape[1], per_token_loss)
    else:
        length = torch.as_tensor(max_len, dtype=per_token_loss.dtype, device=per_token_loss.device)
    return seq_sum.sum() / (_as_denominator(n_seq, per_token_loss) * length)
