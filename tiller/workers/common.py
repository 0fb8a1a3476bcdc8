"""Pieces the actor and critic workers share: optimizer + schedule (verl's), autocast, padded forward passes.

Sequence layout (verl's): `input_ids[B, P + T]` = left-padded prompt `[B, P]` then right-padded response
`[B, T]`; `attention_mask` marks real tokens; `position_ids = cumsum(attention_mask) - 1` (clamped at 0).
The logits at column `P + t - 1` predict response token `t`. Each micro-batch is trimmed to the columns
some row uses (leading all-pad prompt columns, trailing all-pad response columns, and the last response
column, whose output predicts nothing) before the forward, and the result is padded back to `T`, so a
micro-batch of short answers costs what its tokens cost. Causal LMs compute logits only over the response
slots (`logits_to_keep`), and with `share_prompts` each distinct prompt of a micro-batch runs once: its KV
cache is expanded to every sample of the prompt and the responses run on top of it (the same math as one
forward per sample; the n samples of a GRPO group then cost one prompt, not n).

Letters: `B` samples, `P` prompt width, `T` response width, `V` vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from tiller.distributed import context as dist_ctx
from tiller.errors import ConfigError
from tiller.hostinfo import bf16_compute_allowed
from tiller.models import routing
from tiller.models.layer_masks import has_recurrent_layers
from tiller.models.loading import cache_keyword
from tiller.models.optimizer import HF_SCHEDULES, hf_schedule_factor, make_optimizer, param_groups
from tiller.models.vision import vision_inputs
from tiller.protocol import to_device

BF16 = ("bfloat16", "bf16")


def autocast(dtype: str, device: torch.device | str = "cpu", key: str = "actor_rollout_ref.actor.dtype"):
    """bf16 autocast when `dtype` is bfloat16, else a no-op context (fp32).

    On a CPU where `tiller.hostinfo.bf16_decision()` says no (no AVX-512 BF16 / AMX, or bf16 measured
    slower), bf16 falls back to fp32 like the rollout does, with one warning naming `key` (the config key
    that asked for bf16) and the reason.
    """
    if dtype in BF16:
        dev = torch.device(device).type
        if bf16_compute_allowed(dev, key):
            return torch.autocast(device_type=dev, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Float32Head(torch.nn.Linear):
    """An LM head whose matmul and logits run in float32 even under bf16 autocast (`fp32_lm_head`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(x.float(), self.weight.float(), bias)


def fp32_lm_head(model: torch.nn.Module, key: str) -> None:
    """Compute `model`'s LM head in float32 (TRL's cast_lm_head_to_fp32, the ScaleRL recipe: bf16 logits round the
    log-probs the policy ratio and the KL read). The head becomes a `Float32Head` in place: the same parameters and
    state-dict keys, copied with the model (the reference) and saved as before. A ConfigError naming `key` when the
    head is no plain Linear (LoRA-adapted, or trained through modules_to_save)."""
    head = model.get_output_embeddings()
    if type(head) not in (torch.nn.Linear, Float32Head):
        raise ConfigError(f"{key}=True: the model's LM head is a {type(head).__name__}, not a plain Linear (LoRA on "
                          "lm_head, or lm_head in modules_to_save?); leave the head out of them or the key off")
    head.__class__ = Float32Head


def build_optimizer(model: torch.nn.Module, optim_cfg, key: str) -> torch.optim.Optimizer:
    """The `optim` section's optimizer over the trainable parameters, built as verl builds it
    (`tiller.models.optimizer`: optimizer_impl.optimizer with lr, weight_decay, betas / eps for Adam-family
    classes, override_optimizer_config); `key` names the section in errors."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("the model has no trainable parameters")
    return make_optimizer(param_groups(model, optim_cfg.weight_decay_exempt), optim_cfg, key)


def lr_lambda(step: int, *, warmup: int, total: int, style: str, min_lr_ratio: float,
              from_zero: bool = False, lr: float = 1.0, kwargs: dict | None = None) -> float:
    """Multiplier of the peak lr after `step` scheduler steps (the SFT / RM / DPO / KTO job loop and the demos'
    warm-up): linear warmup, then constant, linear or cosine. The warmup starts from lr / warmup, or with `from_zero`
    (the job loop: verl's SFT engine and transformers' schedules) from 0 at step 0: step / warmup.

    Worked numbers: warmup=2, total=10, cosine, min 0: step 0 -> 0.5 ((0+1)/2; from_zero: 0), step 1 -> 1.0
    (from_zero: 0.5), step 6 -> progress (6-2)/(10-2) = 0.5 -> 0.5 * (1 + cos(pi/2)) = 0.5.
    transformers' cosine_with_restarts / polynomial / inverse_sqrt / warmup_stable_decay (`kwargs`: their keywords,
    `lr` the peak, which polynomial's lr_end is relative to): `hf_schedule_factor`, their own warmup included.
    """
    if style in HF_SCHEDULES:
        return hf_schedule_factor(step, style=style, warmup=warmup, total=total, lr=lr, kwargs=kwargs)
    if warmup > 0 and step < warmup:
        return (step if from_zero else step + 1) / warmup
    if style == "constant":
        return 1.0
    if style == "linear":  # transformers' linear decay to 0 at `total` (TRL's default schedule)
        return max(0.0, (total - step) / max(1, total - warmup))
    progress = min(max((step - warmup) / max(1, total - warmup), 0.0), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def verl_lr_lambda(step: int, *, warmup: int, total: int, style: str, min_lr_ratio: float, num_cycles: float = 0.5,
                   zero_indexed_step: bool = True, lr: float = 1.0, kwargs: dict | None = None) -> float:
    """Multiplier of the peak lr for RL step `step` (0, 1, ...): verl's `get_constant_schedule_with_warmup` and
    `get_cosine_schedule_with_warmup` (verl.utils.torch_functional, verl-project/verl 1dda039b) exactly.

    constant: step / max(1, warmup) while step < warmup, then 1 (num_cycles and zero_indexed_step unused, as in verl).
    cosine:   s = step if zero_indexed_step else step + 1;
              s < warmup: s / max(1, warmup);
              else p = (s - warmup) / max(1, total - warmup),
                   max(min_lr_ratio, cos(2 pi num_cycles p) (1 - min_lr_ratio) / 2 + (1 + min_lr_ratio) / 2).
    num_cycles 0.5 is a half cosine from 1 down to min_lr_ratio at p = 1; 1.0 goes down and back up.
    linear:   transformers' `get_linear_schedule_with_warmup` (TRL's default): step / max(1, warmup) while
              step < warmup, then max(0, (total - step) / max(1, total - warmup)) (zero_indexed_step, num_cycles
              and min_lr_ratio unused, as there).

    Worked numbers (warmup 2, total 10, min_lr_ratio 0): step 0 -> 0, step 1 -> 0.5, step 6 -> p = 0.5 ->
    (1 + cos(pi / 2)) / 2 = 0.5; zero_indexed_step False: step 0 -> 0.5, step 5 -> p = 0.5 -> 0.5;
    linear: step 1 -> 0.5, step 2 -> (10 - 2) / 8 = 1, step 6 -> 4 / 8 = 0.5, step 10 -> 0.
    transformers' cosine_with_restarts / polynomial / inverse_sqrt / warmup_stable_decay (tiller's; `kwargs` =
    optim.lr_scheduler_kwargs): `hf_schedule_factor`.
    """
    if style in HF_SCHEDULES:
        return hf_schedule_factor(step, style=style, warmup=warmup, total=total, lr=lr, kwargs=kwargs)
    if style == "linear":
        if step < warmup:
            return step / max(1.0, warmup)
        return max(0.0, (total - step) / max(1.0, total - warmup))
    if style == "constant":
        return step / max(1.0, warmup) if step < warmup else 1.0
    s = step if zero_indexed_step else step + 1
    if s < warmup:
        return float(s) / float(max(1, warmup))
    progress = float(s - warmup) / float(max(1, total - warmup))
    x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
    return max(min_lr_ratio, x * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)


def build_scheduler(optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """verl's schedule (`verl_lr_lambda`): warmup of `lr_warmup_steps` steps (<= 0: `lr_warmup_steps_ratio` x total,
    truncated, as verl), then `warmup_style` constant | cosine | linear (`num_cycles`, `min_lr_ratio`, `zero_indexed_step`)
    or one of transformers' (`lr_scheduler_kwargs`)."""
    warmup = optim_cfg.lr_warmup_steps
    if warmup <= 0:
        warmup = int(optim_cfg.lr_warmup_steps_ratio * total_steps)
    fn = functools.partial(verl_lr_lambda, warmup=warmup, total=max(total_steps, 1), style=optim_cfg.warmup_style,
                           min_lr_ratio=optim_cfg.min_lr_ratio, num_cycles=optim_cfg.num_cycles,
                           zero_indexed_step=optim_cfg.zero_indexed_step, lr=optim_cfg.lr,
                           kwargs=dict(optim_cfg.lr_scheduler_kwargs or {}))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def epoch_passes(batch, epochs: int, shuffle_seed: int | None):
    """The batch once per epoch (actor and critic updates): in its own order, or, with `shuffle_seed`, in a
    random order seeded by `shuffle_seed + epoch` (the same order on every rank and on resume)."""
    for epoch in range(epochs):
        if shuffle_seed is None:
            yield batch
        else:
            g = torch.Generator().manual_seed(shuffle_seed + epoch)
            yield batch.index(torch.randperm(len(batch), generator=g))


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] 0/1 mask -> [B, L] positions: 0 for the first real token, pads clamped to 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] each row's response columns up to its last trained token: the last index of `response_mask` that is set,
    plus 1 (0 for a row with none). A multi-turn row's mask has holes (tool messages are not trained), so its sum
    is shorter than the columns its last turn needs.

    >>> response_lengths(torch.tensor([[1, 1, 0, 0], [1, 0, 0, 1], [0, 0, 0, 0]])).tolist()
    [2, 4, 0]
    """
    if response_mask.numel() == 0:
        return torch.zeros(response_mask.shape[0], dtype=torch.long)
    columns = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    return ((response_mask != 0).long() * columns).max(-1).values


def trim_bounds(attention_mask: torch.Tensor, prompt_width: int, response_mask: torch.Tensor) -> tuple[int, int]:
    """(first column any row uses, prompt_width + longest response) for one micro-batch."""
    used = attention_mask[:, :prompt_width].bool().any(0)
    first = int(used.nonzero()[0]) if used.any() else prompt_width - 1
    t_max = int(response_lengths(response_mask).max()) if response_mask.numel() else 0
    return min(first, prompt_width - 1), prompt_width + max(t_max, 1)


def split_long_responses(response_mask: torch.Tensor, min_saving: float = 0.2):
    """(short rows, long rows) index tensors when a separate forward for a few long responses (at most 1/8 of
    the rows) spares the others at least `min_saving` of the micro-batch's response columns; else None.

    A trimmed forward pads every row to the longest response in its micro-batch, so one rare long answer
    widens them all; the split costs one more (small) forward. Per row the outputs are the same (a column
    never attends to later ones), up to float rounding."""
    b = response_mask.shape[0]
    if b < 8:
        return None
    lengths = response_lengths(response_mask)
    t_max = int(lengths.max())
    best, width = 0, None
    for s in lengths.unique().tolist():
        s = int(s)
        n_long = int((lengths > s).sum())
        if 1 <= s < t_max and n_long <= b // 8 and (b - n_long) * (t_max - s) > best:
            best, width = (b - n_long) * (t_max - s), s
    if width is None or best < min_saving * b * t_max:
        return None
    return (lengths <= width).nonzero().squeeze(-1), (lengths > width).nonzero().squeeze(-1)


def response_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                     response_mask: torch.Tensor, *, logits_to_keep: bool = False,
                     share_prompts: bool = False, multi_modal=None, device=None) -> tuple[torch.Tensor, int]:
    """Run `model` on the trimmed micro-batch; returns (output tensor over the response slots, t_used).
    The inputs are on `device` (default: theirs) or on the host: then the trimming, splitting and prompt sharing
    read them there and only the trimmed tensors move to `device` (reading those values from a GPU would be a host
    sync per micro-batch).
    When a few rows have much longer responses than the rest (`split_long_responses`), they run as a second
    trimmed forward and the others' outputs are zero-padded to t_used (not under torch.distributed, where
    every rank must run the same forwards).

    The output is `logits[B, t_used, V]` for a causal LM (column j predicts response token j), or the
    per-token head output `[B, t_used, 1]` for a token-classification (value) model: the value of the
    state before response token j, as verl's critic.

    logits_to_keep: the model takes HF's `logits_to_keep` (causal LMs): the LM head runs on the response
        slots only, not on the prompt.
    share_prompts: the model is an HF model that takes `past_key_values`: rows with the same prompt (tokens
        and padding, and images) share one prompt forward (see `shared_prompt_forward`).
    multi_modal: per row None or {"pixel_values", "image_grid_thw"} (image prompts of a vision-language model):
        the pixels go into the forward with the model's M-RoPE positions (`tiller.models.vision`).
    """
    share_prompts = share_prompts and not has_recurrent_layers(model)  # see forward_options
    device = input_ids.device if device is None else torch.device(device)
    split = None if dist_ctx.is_distributed() else split_long_responses(response_mask)
    if split is not None:
        outs = []
        for rows in split:
            with routing.view(lambda g: g[rows.to(g.device)]):  # (routing replay: these rows' slots)
                outs.append(_response_forward(model, input_ids[rows], attention_mask[rows], prompt_width,
                                              response_mask[rows], logits_to_keep, share_prompts,
                                              _rows(multi_modal, rows), device))
        t_used = outs[1][1]
        short = torch.nn.functional.pad(outs[0][0], (0, 0, 0, t_used - outs[0][1]))
        order = to_device(torch.argsort(torch.cat(split)), device)
        return torch.cat([short, outs[1][0]])[order], t_used
    return _response_forward(model, input_ids, attention_mask, prompt_width, response_mask, logits_to_keep,
                             share_prompts, multi_modal, device)


def _rows(multi_modal, rows: torch.Tensor):
    return None if multi_modal is None else [multi_modal[i] for i in rows.tolist()]


def image_keys(multi_modal, n: int, device) -> torch.Tensor:
    """[n, 1] an id per distinct image set (0 = none), so rows with equal prompt tokens but other images differ."""
    import hashlib

    ids, table = [], {}
    for m in multi_modal if multi_modal is not None else [None] * n:
        if m is None:
            ids.append(0)
            continue
        h = hashlib.blake2b(m["pixel_values"].float().numpy().tobytes(), digest_size=16)
        h.update(m["image_grid_thw"].numpy().tobytes())
        ids.append(table.setdefault(h.digest(), len(table) + 1))
    return torch.tensor(ids, device=device).unsqueeze(1)


def decided_mask(host_mask: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """The `attention_mask` of a forward without a cache over `mask` [B, L] (`host_mask`: the same on the host): None
    where no token is padded (causal, what transformers would choose; its SDPA path would first ask the device
    whether any is, `padding_mask.all()`: a host sync per forward), else `mask`. (With padding transformers still asks;
    a 4D mask made here would spare that but not models that read the 2D one for more, e.g. Mixtral's router loss.)"""
    return None if bool(host_mask.all()) else mask


def _response_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                      response_mask: torch.Tensor, logits_to_keep: bool, share_prompts: bool,
                      multi_modal=None, device=None) -> tuple[torch.Tensor, int]:
    device = input_ids.device if device is None else device
    left, right = trim_bounds(attention_mask, prompt_width, response_mask)  # (where the inputs are: the host)
    t_used = right - prompt_width
    # Under torch.distributed every rank must run the same number of forwards (FSDP2 all-gathers and DDP
    # broadcasts buffers in each one), so there ranks share prompts even when none repeats, and a
    # one-token micro-batch keeps a response column for the second forward.
    lockstep = share_prompts and dist_ctx.is_distributed()
    # the output at column P + t - 1 is the one for response token t: the last response column is not input
    cut = right if lockstep and t_used == 1 else right - 1
    host_ids, host_mask = input_ids[:, left:cut], attention_mask[:, left:cut]
    ids, mask = to_device(host_ids, device), to_device(host_mask, device)
    p = prompt_width - left
    vision, positions = vision_inputs(model, ids, mask, multi_modal)
    if share_prompts:
        prompt_key = torch.cat([host_ids[:, :p], host_mask[:, :p]], dim=1)
        if vision:
            prompt_key = torch.cat([prompt_key, image_keys(multi_modal, len(ids), prompt_key.device)], dim=1)
        unique, inverse = torch.unique(prompt_key, dim=0, return_inverse=True)
        if len(unique) < len(ids) or lockstep:
            host_prompt_mask = unique[:, p:2 * p]
            unique, inverse = to_device(unique, device), to_device(inverse, device)
            prompt_attention = unique[:, p:2 * p] if vision else decided_mask(host_prompt_mask, unique[:, p:2 * p])
            out = shared_prompt_forward(model, ids, mask, p, unique[:, :p], unique[:, p:2 * p], inverse,
                                        logits_to_keep=logits_to_keep, position_ids=positions if vision else None,
                                        multi_modal=multi_modal if vision else None,
                                        prompt_attention=prompt_attention)
            return out[:, :t_used], t_used
    kwargs = {"logits_to_keep": t_used} if logits_to_keep else {}
    with routing.view(lambda g: g[:, left:cut]):  # (routing replay: the slots of these columns)
        out = model(input_ids=ids, attention_mask=mask if vision else decided_mask(host_mask, mask),
                    position_ids=positions, use_cache=False, **vision, **kwargs)
    return out.logits[:, -t_used:], t_used  # the last t_used columns: P - 1 ... P + t_used - 2


def shared_prompt_forward(model, ids: torch.Tensor, mask: torch.Tensor, p: int, prompt_ids: torch.Tensor,
                          prompt_mask: torch.Tensor, inverse: torch.Tensor, logits_to_keep: bool = False,
                          position_ids: torch.Tensor | None = None, multi_modal=None,
                          prompt_attention=...) -> torch.Tensor:
    """Outputs over the response slots with each distinct prompt run once (exact, differentiable).

    ids, mask: `[B, p + t - 1]` trimmed input (p prompt columns, left-padded, then t - 1 response columns).
    prompt_ids, prompt_mask: `[U, p]` the distinct prompts; inverse: `[B]` row b's prompt in `[0, U)`.
    Returns `[B, t, V]` (V = 1 for a value head): column 0 from the prompt forward's last position (it
    predicts response token 0), columns 1.. from a second forward of the response columns over the prompt
    KV cache expanded by `inverse` (an index-select, so the gradients of every sample flow back into the
    one prompt forward). Position ids continue from each prompt's length. The cache is passed in and filled
    in place, so models whose output does not return it (token classification) share prompts too.
    Image prompts: `position_ids` `[3, B, p + t - 1]` (M-RoPE, of the whole rows) and `multi_modal` (per row);
    the prompt forward takes the pixels of each distinct prompt's first row, the response forward none.
    `prompt_attention`: the prompt forward's `attention_mask` when not `prompt_mask` itself (`decided_mask`).
    """
    from transformers import DynamicCache

    config = getattr(model, "config", None)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    keep = {"logits_to_keep": 1} if logits_to_keep else {}
    kw = cache_keyword(model) or "past_key_values"
    vision, prompt_pos, rest_pos = {}, position_ids_from_mask(prompt_mask), position_ids_from_mask(mask)[:, p:]
    if position_ids is not None:
        first_row = torch.full((len(prompt_ids),), len(inverse), dtype=torch.long, device=inverse.device)
        first_row = first_row.scatter_reduce(0, inverse, torch.arange(len(inverse), device=inverse.device), "amin")
        firsts = [multi_modal[i] for i in first_row.tolist()]
        with_images = [m for m in firsts if m is not None]
        if with_images:
            vision = {"pixel_values": torch.cat([m["pixel_values"] for m in with_images]).to(ids.device),
                      "image_grid_thw": torch.cat([m["image_grid_thw"] for m in with_images]).to(ids.device)}
        prompt_pos, rest_pos = position_ids[:, first_row, :p], position_ids[:, :, p:]
    attention = prompt_mask if prompt_attention is ... else prompt_attention
    out = model(input_ids=prompt_ids, attention_mask=attention, position_ids=prompt_pos,
                **{kw: cache}, use_cache=True, **keep, **vision)
    first = out.logits[:, -1:][inverse]  # [B, 1, V]
    if ids.shape[1] == p:  # one-token responses: nothing after the prompt
        return first
    cache.batch_select_indices(inverse)
    rest = model(input_ids=ids[:, p:], attention_mask=mask, position_ids=rest_pos,
                 **{kw: cache}, use_cache=True).logits
    return torch.cat([first, rest], dim=1)


def forward_options(module, share_prompts: bool) -> dict[str, bool]:
    """`response_forward` keyword options an HF `module` supports (a PeftModel: its base model).

    `logits_to_keep` when its forward takes it (causal LMs); `share_prompts` when asked for, the forward
    takes a KV cache (`cache`, or `past_key_values` before transformers 5.24), and gradient checkpointing is off
    (HF turns the cache off under it).
    """
    import inspect

    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    params = inspect.signature(base.forward).parameters
    # the property's new name first: reading the old one warns on transformers >= 5.24
    name = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    checkpointing = bool(getattr(base, name, False))
    # a recurrent layer's state (Qwen3.5's Gated DeltaNet, Mamba) is overwritten in place by the response forward,
    # which autograd cannot differentiate through: those models run each row's prompt itself
    share = share_prompts and cache_keyword(base) is not None and not checkpointing and not has_recurrent_layers(base)
    return {"logits_to_keep": "logits_to_keep" in params, "share_prompts": share}


def pad_right(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    """[B, t] -> [B, width] padded with `value`."""
    if x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def set_num_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)


_LANE_POOLS: dict[tuple[int, int], object] = {}


def lane_plan(configured: int, lent: int, lane_threads: int | None) -> tuple[int, int]:
    """(lanes, torch threads per lane) of an update: the configured update_lanes plus those lent by asynchronous
    RL, each on `lane_threads` (else the caller's threads shared out); one lane under torch.distributed."""
    lanes = 1 if dist_ctx.is_distributed() else configured + lent
    return lanes, lane_threads or max(1, torch.get_num_threads() // lanes)


def refuse_lanes_under_distributed(key: str, lanes: int) -> None:
    """`update_lanes` > 1 is for one process: under torch.distributed (torchrun) ranks run micro-batches in
    lockstep (DDP / FSDP2 collectives in every forward and backward)."""
    if lanes > 1 and dist_ctx.is_distributed():
        raise ConfigError(f"{key}={lanes} under torch.distributed (torchrun): ranks run their micro-batches in "
                          "lockstep; set update_lanes=1")


def run_in_lanes(fn, items: list, lanes: int, threads: int = 1) -> list:
    """`[fn(i, item) for i, item in enumerate(items)]`, the items run `lanes` at a time: the calling thread and
    `lanes - 1` helper threads each take the next item until none is left, each lane on `threads` torch
    threads (torch's counts are per thread; the caller's is restored afterwards). Results come back in
    item order whatever lane ran them. For CPU training micro-batches: autograd accumulates each backward's
    gradients into `.grad` under a lock, so two lanes give the sequential loop's sums exactly (two addends
    commute); with more the order of the additions, and so the last bits, depends on timing. If an item raises,
    the other lanes finish their current item, take no more, and the first error is raised."""
    if lanes <= 1 or len(items) <= 1:
        return [fn(i, item) for i, item in enumerate(items)]
    import itertools
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    lanes = min(lanes, len(items))
    caller_threads = torch.get_num_threads()
    per_lane = max(1, threads)
    key = (os.getpid(), lanes - 1)  # a forked child has none of its parent's threads: its own pools
    pool = _LANE_POOLS.get(key)
    if pool is None:
        pool = _LANE_POOLS[key] = ThreadPoolExecutor(lanes - 1, thread_name_prefix="tiller-lane")
    results: list = [None] * len(items)
    errors: list[BaseException] = []
    counter, lock = itertools.count(), threading.Lock()

    def lane() -> None:
        if torch.get_num_threads() != per_lane:
            torch.set_num_threads(per_lane)
        while not errors:
            with lock:
                i = next(counter)
            if i >= len(items):
                return
            try:
                results[i] = fn(i, items[i])
            except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread below
                errors.append(e)

    helpers = [pool.submit(lane) for _ in range(lanes - 1)]
    try:
        lane()
    finally:
        for h in helpers:
            h.result()
        torch.set_num_threads(caller_threads)
    if errors:
        raise errors[0]
    return results


def layer_hooks(model: torch.nn.Module, fn) -> list:
    """Call `fn()` before each decoder layer's forward and, in the backward, once that layer's input gradient
    is computed (a hook on the layer's input tensor: no wrapping of the layer's outputs). The decoder layers
    are the modules of the model's largest `nn.ModuleList` (HF models: `model.layers`). Returns the handles
    (`.remove()` each); none when the model has no ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    layers = max(lists, key=len)

    def on_grad(_grad):
        fn()

    def before(_module, args, kwargs):
        fn()
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            x.register_hook(on_grad)

    return [layer.register_forward_pre_hook(before, with_kwargs=True) for layer in layers]


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_cpu_malloc() -> bool:
    """Make glibc keep freed memory for reuse; True when applied (Linux with glibc), else False.

    PyTorch on the CPU has no caching allocator: every step allocates its activations and gradients afresh,
    and glibc hands large blocks back to the kernel (munmap, heap trimming) as soon as they are freed, so
    the next step page-faults and zero-fills them again. Raising the mmap threshold to glibc's maximum
    (32 MiB) puts blocks up to that size on the heap, and a 2 GiB trim threshold / 256 MiB top pad keep the
    heap's free pages mapped. The cost is RSS that does not shrink between steps, as with jemalloc or
    tcmalloc (PyTorch's CPU tuning guides recommend those; this needs no LD_PRELOAD). Process-wide.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    settings = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, (1 << 31) - 1), (_M_TOP_PAD, 256 << 20))
    return all(mallopt(param, value) == 1 for param, value in settings)


def prepare_process(trainer_cfg) -> None:
    """Per-process CPU settings of a worker or driver: torch threads and (CPU devices) malloc tuning."""
    set_num_threads(trainer_cfg.num_threads)
    if trainer_cfg.tune_cpu_malloc and torch.device(trainer_cfg.device).type == "cpu":
        tune_cpu_malloc()


def read_metrics(values: dict) -> dict[str, float]:
    """Metric values, some device scalars (0-dim tensors), as floats read back in one copy. A micro-batch's
    `float(loss)` on a GPU is a host sync: the host waits for its backward, and the device for the host's launches of
    the next micro-batch's forward, once per metric per micro-batch; the update keeps its metrics on the device and
    reads them here, once per mini-batch.

    >>> read_metrics({"a": torch.tensor(0.5), "b": 2, "c": torch.tensor([1.25])})
    {'a': 0.5, 'b': 2.0, 'c': 1.25}
    """
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    out = {k: float(v) for k, v in values.items() if k not in tensors}
    if tensors:  # gathered where most live: a device's (one copy back), not a host scalar's (a copy per tensor)
        device = next((v.device for v in tensors.values() if v.device.type != "cpu"), torch.device("cpu"))
        out.update(zip(tensors, torch.stack([v.detach().reshape(()).to(device, torch.float64)
                                             for v in tensors.values()]).tolist()))
    return {k: out[k] for k in values}


def read_update_metrics(parts, grad_norm: torch.Tensor) -> tuple[dict[str, float], float]:
    """The micro-batches' metric parts (dicts of device scalars or floats), summed in micro-batch order in float64,
    and the gradient norm (a DTensor's in full), read back in one copy (`read_metrics`): (sums, gradient norm)."""
    sums: dict = {}
    for part in parts:
        for k, v in part.items():
            sums[k] = sums.get(k, 0.0) + (v.double() if isinstance(v, torch.Tensor) else v)
    sums["grad_norm"] = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    sums = read_metrics(sums)
    return sums, sums.pop("grad_norm")


def counted_rows(batch) -> float:
    """The sequences of `batch` a seq-mean counts: those its `seq_counted` flags, else those with a valid token."""
    if "seq_counted" in batch:
        return float(batch["seq_counted"].float().sum())
    return float((batch["response_mask"].sum(-1) > 0).sum())


def global_counts(mini_batch, loss_scale_factor: float | None = None) -> dict[str, float]:
    """Aggregation counts of a mini-batch over all ranks: `aggregate_loss` keyword arguments
    (global_tokens = valid response tokens, global_seqs = sequences, max_len = the role's `loss_scale_factor` when
    set, else T), so that the micro-batch losses of every rank sum to the loss of the whole mini-batch.

    global_seqs: the rows flagged by the batch's `seq_counted[B]` when it has one (the driver sets it when rollout
    correction rejects tokens: every row with a response before rejection, so a row rejected whole still counts, as
    in verl 0.10, whose trainer passes agg_loss global_batch_size = ppo_mini_batch_size x n; world-size padding rows
    do not), else the rows with at least one valid token (padding rows have none)."""
    mask = mini_batch["response_mask"].float()
    counts = dist_ctx.all_reduce_sum(torch.tensor([mask.sum(), counted_rows(mini_batch)], dtype=torch.float64))
    max_len = max(mask.shape[1], 1) if loss_scale_factor is None else loss_scale_factor
    return dict(global_tokens=counts[0].item(), global_seqs=counts[1].item(), max_len=max_len)
