"""The rollout contract shared by every engine, and the small helpers they have in common.

An engine turns prompts (token ids) into `n` sampled completions each, with the log-probability of every
sampled token under the *sampling* distribution (after temperature, top-k, top-p, min-p). The trainer
uses those logprobs for off-policy diagnostics and (when `use_kl_loss` / rollout correction is on) as
`rollout_log_probs`; the PPO ratio itself is always recomputed by the actor.

Conventions (see docs/internals.md, `tiller.rollout`):
- `RolloutOutput` has `len(prompts) * n` rows; the `n` samples of prompt `i` are rows `i*n .. i*n+n-1`.
- A response ends at the first stop token (kept in the response) or at the first point where its decoded
  text contains a stop string (the token that completed the string is kept, nothing after it), else it
  runs to `max_new_tokens` (`finish_reason="length"`).
- Greedy decoding (`do_sample=False`) reports `log_softmax(logits)` at temperature 1.
- Penalties (repetition, presence, frequency) change the logits before everything else, greedy rows included; the
  logprobs are then those of the penalised distribution (`tiller.rollout.sampling`).

Letters: `B` rows in the decode batch, `V` vocabulary size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch

from tiller.errors import ConfigError, UserError
from tiller.hostinfo import bf16_decision
from tiller.models.quant import dequantized_merge, is_quantized


@dataclass
class SamplingParams:
    """How to sample. Field names follow vLLM's `SamplingParams` where they exist."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature (> 0 when sampling)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = -1
    """Keep the k most likely tokens (-1 or 0 = off)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's (0 = off)."""
    max_new_tokens: int = 64
    """Most tokens generated per sample."""
    do_sample: bool = True
    """False = greedy (argmax); temperature, top-k, top-p and min-p are then ignored."""
    stop_token_ids: Sequence[int] = ()
    """Token ids that end a sample, besides the tokenizer's and model's eos ids."""
    stop: Sequence[str] = ()
    """Strings that end a sample once its decoded text contains one."""
    seed: int | None = None
    """Seed for this call (None = the engine's own generator, advanced call by call)."""
    ignore_eos: bool = False
    """Do not stop at eos ids (explicit `stop_token_ids` and `stop` strings still apply); for benchmarks."""
    repetition_penalty: float = 1.0
    """Divide a positive logit (multiply a negative one) of every token already in the prompt or the response by
    this (> 0; 1 = off; `tiller.rollout.sampling.apply_penalties`)."""
    presence_penalty: float = 0.0
    """Subtract this from the logit of every token already in the response ([-2, 2]; 0 = off)."""
    frequency_penalty: float = 0.0
    """Subtract this times its count in the response from every token's logit ([-2, 2]; 0 = off)."""
    regex: str | None = None
    """Constrain every response to text matching this regular expression in full (vLLM's `structured_outputs`
    regex; llguidance on the native engine): tokens that cannot continue a match are masked, eos is allowed once
    the text matches, and the logprobs are those of the masked distribution. None = unconstrained."""

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the logits depend on the tokens so far)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Raise ConfigError naming the field when a value cannot be used."""
        if self.n < 1:
            raise ConfigError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise ConfigError(f"SamplingParams.temperature must be > 0 when sampling, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise ConfigError(f"SamplingParams.top_k must be -1 (off) or >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ConfigError(f"SamplingParams.regex must be a non-empty string or None, got {self.regex!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"SamplingParams.stop must hold non-empty strings, got {list(self.stop)!r}")


def shaping_of(rollout_cfg) -> dict:
    """`SamplingParams` keywords of what `actor_rollout_ref.rollout` sets on the distribution besides temperature and
    the filters: the penalties and the regex constraint (training and validation alike: verl's rollout server applies
    `repetition_penalty` to every request, TRL's vLLM generation its structured-outputs regex)."""
    return dict(repetition_penalty=rollout_cfg.repetition_penalty, presence_penalty=rollout_cfg.presence_penalty,
                frequency_penalty=rollout_cfg.frequency_penalty, regex=rollout_cfg.structured_outputs_regex)


@dataclass
class RolloutOutput:
    """Completions for `len(prompts) * n` rows, the n samples of each prompt contiguous."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: list[str] = field(default_factory=list)
    """"stop" (stop token or stop string) or "length" (max_new_tokens reached)."""
    token_versions: list[list[int]] = field(default_factory=list)
    """Per row, the policy version that sampled each response token (only when the engine was given a
    weights hook: asynchronous RL); empty otherwise."""
    routed_experts: list = field(default_factory=list)
    """Per row (an engine recording routing: the native engine's `record_routing`), the experts each prompt and
    response token was routed to: int16 [len(prompt) + len(response), MoE layers, top-k], -1 where no forward routed
    it (the last response token); empty otherwise (`tiller.models.routing`)."""

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_tokens(self) -> int:
        """Total generated tokens."""
        return sum(len(r) for r in self.response_ids)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutOutput: ...
    # engines that take image prompts (hf, native) also accept `multi_modal=[{"pixel_values", "image_grid_thw"} | None]`

    def update_weights(self, state_dict: dict[str, torch.Tensor] | None = None) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


# ----------------------------------------------------------------------------------------- helpers


def check_prompts(prompt_ids: list[list[int]], vocab_size: int | None = None) -> None:
    """Raise DataError-style UserError for empty prompts or ids outside the vocabulary."""
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise UserError(f"rollout: prompt {i} is empty (0 tokens)")
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            raise UserError(f"rollout: prompt {i} has a token id outside [0, {vocab_size})")


def eos_token_ids(model, tokenizer) -> list[int]:
    """The eos ids a sample stops at: the tokenizer's eos plus the model's generation_config eos (list or int)."""
    ids: list[int] = []
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.append(int(tok_eos))
    gen_cfg = getattr(model, "generation_config", None)
    gen_eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    if isinstance(gen_eos, int):
        gen_eos = [gen_eos]
    for t in gen_eos or []:
        if int(t) not in ids:
            ids.append(int(t))
    return ids


def stop_ids_for(model, tokenizer, sampling: SamplingParams) -> list[int]:
    """Stop token ids for one call: explicit ids plus eos ids unless `ignore_eos`."""
    ids = [int(t) for t in sampling.stop_token_ids]
    if not sampling.ignore_eos:
        ids += [t for t in eos_token_ids(model, tokenizer) if t not in ids]
    return ids


def pad_token_id(model, tokenizer) -> int:
    """A pad id for left padding (tokenizer pad, else eos, else 0); it is always masked out."""
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if value is not None:
            return int(value)
    return 0


def left_pad(prompt_ids: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts to one length. Returns input_ids[G, P] and attention_mask[G, P] (1 = real token)."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


class StopStringWatcher:
    """Detects, token by token, when a sample's decoded text first contains one of the stop strings.

    Only a window of the last tokens is decoded each step (enough tokens to spell the longest stop string
    even when byte-level tokens carry partial characters), so a step costs O(window), not O(length).
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        if stop and tokenizer is None:
            raise UserError("rollout: stop strings need a tokenizer; pass tokenizer= to build_rollout_engine")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.window = 4 * max((len(s) for s in self.stop), default=0) + 4

    def __bool__(self) -> bool:
        return bool(self.stop)

    def hits(self, responses: Sequence[Sequence[int]]) -> list[bool]:
        """For each response (tokens so far) whether a stop string ends within its last token's reach."""
        if not self.stop:
            return [False] * len(responses)
        texts = self.tokenizer.batch_decode(
            [list(r[-self.window :]) for r in responses],
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
        return [any(s in text for s in self.stop) for text in texts]

    def cut(self, response: Sequence[int]) -> int | None:
        """Length of the shortest prefix of `response` whose text contains a stop string, or None."""
        if not self.stop or not any(s in _decode(self.tokenizer, response) for s in self.stop):
            return None
        lo, hi = 1, len(response)  # invariant: prefix of length hi contains a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in _decode(self.tokenizer, response[:mid]) for s in self.stop):
                hi = mid
            else:
                lo = mid + 1
        return hi


def finalize_row(
    tokens: list[int], logprobs: list[float], stop_ids: Sequence[int], watcher: StopStringWatcher
) -> tuple[list[int], list[float], str]:
    """Truncate one generated row at its first stop token or stop string; return (ids, logprobs, reason).

    Every engine passes its raw output through this so they all agree on where a response ends.
    """
    end, reason = len(tokens), "length"
    stop_set = set(stop_ids)
    for i, t in enumerate(tokens):
        if t in stop_set:
            end, reason = i + 1, "stop"
            break
    cut = watcher.cut(tokens[:end]) if watcher else None
    if cut is not None:
        end, reason = cut, "stop"
    return tokens[:end], logprobs[:end], reason


def resolve_dtype(dtype) -> torch.dtype | None:
    """'bfloat16' | 'bf16' | 'float32' | 'fp32' | torch.dtype | None -> torch.dtype | None (None = model's)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "fp16": torch.float16, "auto": None}
    if dtype not in table:
        raise ConfigError(f"actor_rollout_ref.rollout.dtype: unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


_BF16_FAST: dict[str, bool] = {}
"""Override of the bf16 decision for the rollout ("cpu" -> bool; tests set it); empty = follow
`tiller.hostinfo.bf16_decision()`."""


def cpu_bf16_is_fast() -> bool:
    """Whether bf16 compute on this CPU is used: `tiller.hostinfo.bf16_decision().use_bf16` (decided once
    per process from the CPU's features, confirmed by a GEMM timing), unless `_BF16_FAST` overrides it.

    CPUs with AVX-512 BF16 or AMX run bf16 GEMMs 2-4x faster than fp32; CPUs without them (AVX2 only)
    can be ~100x slower, which would turn a bf16 rollout into a stall.
    """
    if "cpu" in _BF16_FAST:
        return _BF16_FAST["cpu"]
    return bf16_decision().use_bf16


def _bf16_refusal_reason() -> str:
    """Why `cpu_bf16_is_fast()` said no: the decision's reason, or the override."""
    if "cpu" in _BF16_FAST:
        return "tiller.rollout.base._BF16_FAST overrides the decision"
    return bf16_decision().reason


def effective_dtype(dtype: torch.dtype | None, device: torch.device, fallback: bool = True) -> torch.dtype | None:
    """bf16 on a CPU where bf16 is not used (see `cpu_bf16_is_fast`) falls back to fp32, with a warning
    naming the reason, unless `fallback=False`."""
    if fallback and dtype == torch.bfloat16 and device.type == "cpu" and not cpu_bf16_is_fast():
        import warnings

        warnings.warn(f"rollout: no fast bf16 on this CPU: {_bf16_refusal_reason()}; rolling out in float32 "
                      "instead of bfloat16 (pass dtype_fallback=False to force bf16)", stacklevel=3)
        return torch.float32
    return dtype


class WeightView:
    """The module an in-process engine runs: the actor itself, or a copy cast to another dtype.

    With a copy, `refresh()` copies the actor's current parameters in (the trainer calls
    `update_weights()` after every optimizer step, which lands here).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None, dtype_fallback: bool = True):
        self.source = model
        dtype = effective_dtype(dtype, next(model.parameters()).device, dtype_fallback)
        model_dtype = next(model.parameters()).dtype
        self.is_copy = dtype is not None and dtype != model_dtype
        if self.is_copy:
            self.module = _cast_copy(model, dtype)
        else:
            self.module = model
        self.dtype = dtype if dtype is not None else model_dtype
        self._seen = param_versions(model)

    def sync_if_stale(self) -> None:
        """Refresh the copy if any actor parameter changed in place since the last copy (version counters),
        so a forgotten `update_weights()` can never make the engine sample from old weights."""
        if self.is_copy and param_versions(self.source) != self._seen:
            self.refresh()

    def refresh(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Copy weights in: from `state_dict` when given (into the actor module too), else from the actor."""
        with torch.no_grad():
            if state_dict is not None:
                missing, unexpected = self.source.load_state_dict(state_dict, strict=False)
                if unexpected:
                    raise UserError(f"rollout.update_weights: unexpected keys {unexpected[:5]}")
            if self.is_copy and is_quantized(self.source):  # QLoRA: the dequantized base, adapters merged
                merged = dequantized_merge(self.source, self.dtype).state_dict()
                for name, dst in self.module.state_dict().items():
                    dst.copy_(merged[name])
            elif self.is_copy:
                src = dict(self.source.named_parameters())
                src.update(dict(self.source.named_buffers()))
                for name, dst in list(self.module.named_parameters()) + list(self.module.named_buffers()):
                    if name in src and src[name].shape == dst.shape:
                        dst.copy_(src[name])
        self._seen = param_versions(self.source)

    def drop(self) -> None:
        """Free the copy (sleep); `restore()` rebuilds it."""
        if self.is_copy:
            self.module = None

    def restore(self) -> None:
        if self.is_copy and self.module is None:
            self.module = _cast_copy(self.source, self.dtype)
            self._seen = param_versions(self.source)


def param_versions(module: torch.nn.Module) -> tuple:
    """(version counter, storage pointer) of every parameter: changes when an optimizer steps in place."""
    return tuple((p._version, p.data_ptr()) for p in module.parameters())


def _cast_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen eval-mode copy with parameters cast to `dtype`; buffers (rotary inv_freq) keep their dtype. A 4-bit
    (QLoRA) model's copy is its dequantized base with the adapters merged, in `dtype`."""
    if is_quantized(model):
        return dequantized_merge(model, dtype)
    module = copy.deepcopy(model)
    for p in module.parameters():
        p.grad = None
        p.data = p.data.to(dtype)
    module.requires_grad_(False)
    module.eval()
    return module


class eval_mode:
    """Context: put a module in eval mode and restore its training flag after. A module already in eval mode
    is left alone: `train()` / `eval()` walk every submodule, ~1 ms on a 30M model, which per decode step adds up."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __enter__(self):
        self.was_training = self.module.training
        if self.was_training:
            self.module.eval()
        return self.module

    def __exit__(self, *exc):
        if self.was_training:
            self.module.train(True)
        return False


class InProcessEngine:
    """What the in-process engines (`hf`, `native`) share: the actor's module behind a `WeightView`
    (the module itself, or a dtype-cast copy refreshed on `update_weights`), a tokenizer and a seed."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, *, dtype=None, seed: int = 0,
                 dtype_fallback: bool = True):
        self.tokenizer = tokenizer
        self.weights = WeightView(model, resolve_dtype(dtype), dtype_fallback)
        self.generator_seed = seed
        self._calls = 0

    def update_weights(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """No-op for a shared module without `state_dict`; otherwise refresh the weights in use (cast copies)."""
        self.weights.refresh(state_dict)

    def sleep(self) -> None:
        self.weights.drop()

    def wake(self) -> None:
        self.weights.restore()
