"""Pieces the actor and critic workers share: optimizer + schedule, autocast, padded forward passes.

Sequence layout (verl's): `input_ids[B, P + T]` = left-padded prompt `[B, P]` then right-padded response
`[B, T]`; `attention_mask` marks real tokens; `position_ids = cumsum(attention_mask) - 1` (clamped at 0).
The logits at column `P + t - 1` predict response token `t`. Each micro-batch is trimmed to the columns
some row uses (leading all-pad prompt columns, trailing all-pad response columns) before the forward,
and the result is padded back to `T`, so a micro-batch of short answers costs what its tokens cost.

Letters: `B` samples, `P` prompt width, `T` response width, `V` vocabulary.
"""

from __future__ import annotations

import contextlib
import math

import torch

from tiller.errors import ConfigError

BF16 = ("bfloat16", "bf16")


def autocast(dtype: str, device: torch.device | str = "cpu"):
    """bf16 autocast when `dtype` is bfloat16, else a no-op context (fp32)."""
    if dtype in BF16:
        dev = torch.device(device).type
        return torch.autocast(device_type=dev, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_optimizer(model: torch.nn.Module, optim_cfg) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (`OptimConfig`: lr, betas, eps, weight_decay)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters")
    return torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                             weight_decay=optim_cfg.weight_decay)


def lr_lambda(step: int, *, warmup: int, total: int, style: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr after `step` scheduler steps: linear warmup, then constant or cosine.

    Worked numbers: warmup=2, total=10, cosine, min 0: step 0 -> 0.5 ((0+1)/2), step 1 -> 1.0,
    step 6 -> progress (6-2)/(10-2) = 0.5 -> 0.5 * (1 + cos(pi/2)) = 0.5.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    progress = min(max((step - warmup) / max(1, total - warmup), 0.0), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup (`lr_warmup_steps`, or `lr_warmup_steps_ratio` x total) then `warmup_style` constant | cosine."""
    warmup = optim_cfg.lr_warmup_steps
    if warmup < 0:
        warmup = int(optim_cfg.lr_warmup_steps_ratio * total_steps)
    import functools

    fn = functools.partial(lr_lambda, warmup=warmup, total=max(total_steps, 1), style=optim_cfg.warmup_style,
                           min_lr_ratio=optim_cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] 0/1 mask -> [B, L] positions: 0 for the first real token, pads clamped to 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def trim_bounds(attention_mask: torch.Tensor, prompt_width: int, response_mask: torch.Tensor) -> tuple[int, int]:
    """(first column any row uses, prompt_width + longest response) for one micro-batch."""
    used = attention_mask[:, :prompt_width].bool().any(0)
    first = int(used.nonzero()[0]) if used.any() else prompt_width - 1
    t_max = int(response_mask.sum(-1).max()) if response_mask.numel() else 0
    return min(first, prompt_width - 1), prompt_width + max(t_max, 1)


def response_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                     response_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run `model` on the trimmed micro-batch; returns (output tensor over the response slots, t_used).

    The output is `logits[B, t_used, V]` for a causal LM (column j predicts response token j), or the
    per-token head output `[B, t_used, 1]` for a token-classification (value) model: the value of the
    state before response token j, as verl's critic.
    """
    left, right = trim_bounds(attention_mask, prompt_width, response_mask)
    ids, mask = input_ids[:, left:right], attention_mask[:, left:right]
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False)
    t_used = right - prompt_width
    start = prompt_width - 1 - left
    return out.logits[:, start:start + t_used], t_used


def pad_right(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    """[B, t] -> [B, width] padded with `value`."""
    if x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def set_num_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)


def global_counts(mini_batch) -> dict[str, float]:
    """Aggregation counts of a mini-batch over all ranks: `aggregate_loss` keyword arguments
    (global_tokens = valid response tokens, global_seqs = sequences, max_len = T), so that the micro-batch
    losses of every rank sum to the loss of the whole mini-batch."""
    from tiller.distributed import context as dist_ctx

    mask = mini_batch["response_mask"].float()
    counts = dist_ctx.all_reduce_sum(torch.tensor([mask.sum(), float(len(mini_batch))], dtype=torch.float64))
    return dict(global_tokens=counts[0].item(), global_seqs=counts[1].item(), max_len=mask.shape[1])
