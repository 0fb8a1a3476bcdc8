"""Agent rollouts on several workers: the workers' segment batches merged into the step's one batch.

With `trainer.backend=ray` the driver cuts a step's prompts into equal consecutive chunks, one per rank (dispatch
`dp_parts`: the prompt count padded to a multiple of the world size by repeating the first prompts, those copies
last), and each rank runs the `n` episodes of each of its prompts with its own engine (and agent endpoint). A rank
returns one row per recorded segment, its episodes numbered 0..k-1 within the rank, its widths the longest context
/ segment it saw. `merge_episode_parts` makes of them the batch one process would have produced:

- rank r's rows belong to the step's prompts r x c .. (r + 1) x c - 1 (c prompts a chunk): its episode e is the
  step's episode r x c x n + e (prompt-major, the samples of a prompt adjacent, as in one process);
- rows of the padding prompts (a step prompt index >= the prompt count) are dropped;
- every part is widened to the common widths: prompts (and the prompt half of input_ids / attention_mask) on the
  left with padding, responses and their masks / logprobs on the right; position_ids recomputed from the merged
  attention mask, as the worker computes them.

Everything after (rewards, advantages broadcast over an episode's segments, filter_groups, rollout correction) runs
on the merged batch in the driver. Letters: `B` rows (segments), `P` prompt width, `T` response width.
"""

from __future__ import annotations

import torch

from tiller.protocol import Batch
from tiller.workers.common import position_ids_from_mask

PROMPT_KEYS = {"prompts": "pad"}  # [B, P], left-padded
RESPONSE_KEYS = {"responses": "pad", "response_mask": 0, "rollout_log_probs": 0.0, "token_level_scores": 0.0,
                 "rollout_token_version": "last"}  # [B, T], right-padded (versions: the row's last, as the worker)
FULL_KEYS = {"input_ids": "pad", "attention_mask": 0}  # [B, P + T]: prompt half left, response half right
DERIVED_KEYS = ("position_ids",)  # recomputed from the merged attention_mask


def _pad_right(x: torch.Tensor, width: int, value) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra <= 0:
        return x
    if value == "last" and x.shape[1]:
        fill = x[:, -1:].expand(-1, extra)
    else:
        fill = torch.full((len(x), extra), -1 if value == "last" else value, dtype=x.dtype)
    return torch.cat([x, fill], dim=1)


def _pad_left(x: torch.Tensor, width: int, value) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra <= 0:
        return x
    return torch.cat([torch.full((len(x), extra), value, dtype=x.dtype), x], dim=1)


def widen(part: Batch, P: int, T: int, pad_token_id: int) -> Batch:
    """`part` (meta prompt_width p <= P, response_width t <= T) with every [B, *] tensor at widths P / T."""
    p, t = int(part.meta["prompt_width"]), int(part.meta["response_width"])
    out = Batch(tensors=dict(part.tensors), fields=dict(part.fields), meta={**part.meta, "prompt_width": P,
                                                                              "response_width": T})

    def value(v):
        return pad_token_id if v == "pad" else v

    for key, x in part.tensors.items():
        if x.dim() < 2 or key in DERIVED_KEYS:
            continue
        if key in PROMPT_KEYS and x.shape[1] == p:
            out[key] = _pad_left(x, P, value(PROMPT_KEYS[key]))
        elif key in RESPONSE_KEYS and x.shape[1] == t:
            out[key] = _pad_right(x, T, value(RESPONSE_KEYS[key]))
        elif key in FULL_KEYS and x.shape[1] == p + t:
            v = value(FULL_KEYS[key])
            out[key] = torch.cat([_pad_left(x[:, :p], P, v), _pad_right(x[:, p:], T, v)], dim=1)
        else:
            raise ValueError(f"merge_episode_parts: tensor {key!r} of shape {tuple(x.shape)} is not a known "
                             f"[B, P={p}] / [B, T={t}] / [B, P+T] key of an episode batch")
    if "position_ids" in part.tensors:
        out["position_ids"] = position_ids_from_mask(out["attention_mask"])
    return out


def merge_episode_parts(parts: list[Batch], n_prompts: int, n: int, pad_token_id: int) -> Batch:
    """The rank results of one dispatch `dp_parts` generate call (rank order) -> the step's batch (module docstring).

    parts: each with tensor `episode[B_r]` (0-based within the rank, `n` episodes a prompt, prompt-major) and meta
        prompt_width / response_width (its tensors' widths). n_prompts: the prompts given to the call (before the
        dispatch padded them to a multiple of len(parts)).
    """
    if not parts:
        raise ValueError("merge_episode_parts: no parts")
    per_part = -(-n_prompts // len(parts))  # prompts a rank (the padded count / world size)
    kept = []
    for r, part in enumerate(parts):
        part = part.index((r * per_part + part["episode"] // n < n_prompts).numpy())  # padding prompts' rows go
        part["episode"] = part["episode"] + r * per_part * n
        kept.append(part)
    return concat_episode_batches(kept, pad_token_id)


def concat_episode_batches(batches: list[Batch], pad_token_id: int) -> Batch:
    """Episode batches of different widths (ranks, or DAPO's generation rounds) -> one, each widened to the widest
    (`widen`); episode ids are left as they are (the caller makes them unique)."""
    P = max(int(b.meta["prompt_width"]) for b in batches)
    T = max(int(b.meta["response_width"]) for b in batches)
    return Batch.concat([widen(b, P, T, pad_token_id) for b in batches])
