"""`hf` rollout engine: Hugging Face `model.generate`, the reference every other engine is checked against.

Prompts are left-padded into one batch, each repeated n times (contiguous, as the contract wants).
Per-token logprobs come from `output_scores`, which holds the logits *after* HF's warpers
(temperature, top-k, top-p, min-p in that order), so `log_softmax(scores)[token]` is the log-probability under the distribution the token was drawn from.
Stop strings are watched by a `StoppingCriteria` built on `StopStringWatcher`, and every row is cut by
`finalize_row`, the same rule the native engine uses.

Image prompts (vision-language models): `multi_modal[i]` holds prompt i's `pixel_values` / `image_grid_thw`
(`tiller.models.vision.encode_image_prompt`). The vision tower runs once per prompt, before the n copies are
made, and its outputs go to `generate` as `mm_encoder_outputs` (repeated for the n samples of the prompt, as
`generate`'s own `num_return_sequences` expands them), so the n samples share the prompt's pixels; `generate`
computes the M-RoPE positions from `image_grid_thw` and `mm_token_type_ids` by the model's rule. A vision model
never samples its vision special tokens (`<|image_pad|>`, ...: suppressed, the logprobs are those of the
renormalised distribution): a response holding one would be read as an image slot by every later forward.

Penalties (repetition, presence, frequency) run as one logits processor with the native engine's math
(`tiller.rollout.sampling.apply_penalties`), so both engines sample from the same penalised distribution.

Deviations from plain `generate`: every sampling knob is set explicitly (so a checkpoint's
`generation_config`, e.g. `top_k=20`, never leaks in), and `ignore_eos` is implemented by giving
`generate` no eos id rather than suppressing eos logits (the distribution stays unchanged).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from tiller.models.vision import image_token_id
from tiller.errors import UserError
from tiller.rollout.base import (
    RolloutOutput,
    SamplingParams,
    StopStringWatcher,
    InProcessEngine,
    check_prompts,
    eval_mode,
    finalize_row,
    left_pad,
    pad_token_id,
    stop_ids_for,
)
from tiller.rollout.sampling import apply_penalties, token_counts
from tiller.rollout.images import encode_images, encoder_outputs, vision_token_ids  # noqa: F401 - vision_token_ids: re-exported


_NO_TOKEN = 2**31 - 1


class _StopStringCriteria(StoppingCriteria):
    """Marks rows done once their generated text contains a stop string."""

    def __init__(self, watcher: StopStringWatcher, prompt_width: int):
        self.watcher = watcher
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        responses = input_ids[:, self.prompt_width :].tolist()
        return torch.tensor(self.watcher.hits(responses), dtype=torch.bool, device=input_ids.device)


class _Penalties(LogitsProcessor):
    """`tiller.rollout.sampling.apply_penalties` as a `generate` logits processor: the prompt tokens counted from the
    unpadded prompts (HF's own repetition processor would count the left padding too), the response's from the
    columns past `prompt_width`. `generate` runs it after token suppression and before temperature and the filters,
    the native engine's order."""

    def __init__(self, prompts: list[list[int]], prompt_width: int, sampling: SamplingParams):
        self.prompts, self.prompt_width = prompts, prompt_width
        self.penalties = (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty)
        self.prompt_seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None  # response token counts [B, V] up to column `counted`
        self.counted = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab, device = scores.shape[-1], scores.device
        if self.prompt_seen is None:
            self.prompt_seen = token_counts(self.prompts, vocab, device) > 0
        if self.counts is None or input_ids.shape[1] < self.counted:
            self.counts, self.counted = torch.zeros((len(input_ids), vocab), device=device), self.prompt_width
        new = input_ids[:, self.counted:]  # the columns sampled since the last call (one a step): counted on device
        if new.numel():
            self.counts.scatter_add_(1, new, torch.ones(new.shape, device=device))
        self.counted = input_ids.shape[1]
        return apply_penalties(scores, self.prompt_seen, self.counts, *self.penalties)


class HFRolloutEngine(InProcessEngine):
    """Generation through `model.generate`; shares the actor module (or a dtype-cast copy of it)."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 multi_modal: list[dict | None] | None = None) -> RolloutOutput:
        """`multi_modal`: per prompt, None (text) or {"pixel_values", "image_grid_thw"} (see the module docstring)."""
        sampling.validate()
        if sampling.regex is not None:
            raise UserError("rollout.name=hf: a regex constraint (SamplingParams.regex) runs on the native or vllm "
                            "engine")
        self.weights.sync_if_stale()
        model = self.weights.module
        check_prompts(prompt_ids, model.get_input_embeddings().num_embeddings)
        device = next(model.parameters()).device
        pad_id = pad_token_id(model, self.tokenizer)
        stop_ids = stop_ids_for(model, self.tokenizer, sampling)
        watcher = StopStringWatcher(self.tokenizer, sampling.stop)
        # each prompt repeated n times (what num_return_sequences does, which greedy decoding refuses)
        expanded = [p for p in prompt_ids for _ in range(sampling.n)]
        input_ids, attention_mask = left_pad(expanded, pad_id, device)
        width = input_ids.shape[1]
        knobs = dict(temperature=float(sampling.temperature), top_k=max(int(sampling.top_k), 0),
                     top_p=float(sampling.top_p), min_p=float(sampling.min_p) if sampling.min_p > 0 else None,
                     typical_p=1.0) if sampling.do_sample else {}
        gen_cfg = GenerationConfig(
            do_sample=sampling.do_sample,
            **knobs,
            repetition_penalty=1.0,
            max_new_tokens=int(sampling.max_new_tokens),
            # an id no model emits stands for "no eos": None would be filled in from model.generation_config
            eos_token_id=stop_ids or [_NO_TOKEN],
            pad_token_id=pad_id,
            return_dict_in_generate=True,
            output_scores=True,
            use_cache=True,
            suppress_tokens=vision_token_ids(model) or None,
        )
        criteria = StoppingCriteriaList([_StopStringCriteria(watcher, width)]) if watcher else None
        processors = LogitsProcessorList([_Penalties(expanded, width, sampling)]) if sampling.penalized else None
        seed = sampling.seed if sampling.seed is not None else self.generator_seed + self._calls
        self._calls += 1
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), eval_mode(model):
            torch.manual_seed(seed)
            with torch.inference_mode():
                vision = image_inputs(model, input_ids, multi_modal, sampling.n) if multi_modal else {}
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    generation_config=gen_cfg,
                    stopping_criteria=criteria,
                    logits_processor=processors,
                    **vision,
                )
        sequences = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()  # [B, T, V] processed logits
        token_logp = torch.log_softmax(scores, dim=-1).gather(-1, sequences.unsqueeze(-1)).squeeze(-1)
        result = RolloutOutput()
        for row, (toks, lps) in enumerate(zip(sequences.tolist(), token_logp.tolist())):
            ids, lp, reason = finalize_row(toks, lps, stop_ids, watcher)
            result.prompt_ids.append(list(prompt_ids[row // sampling.n]))
            result.response_ids.append(ids)
            result.logprobs.append(lp)
            result.finish_reason.append(reason)
        return result


def image_inputs(model, input_ids: torch.Tensor, multi_modal: list[dict | None], n: int) -> dict:
    """`generate` keywords for a batch of image prompts, each repeated n times: the vision tower run once on
    the prompts' pixels, its per-image outputs repeated per sample (`mm_encoder_outputs`), plus
    `image_grid_thw` and `mm_token_type_ids` for the M-RoPE positions. {} when no prompt has images."""
    if all(m is None for m in multi_modal):
        return {}
    device = input_ids.device
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    per_prompt = encode_images(model, multi_modal)
    features = tuple(f for feats in per_prompt for _ in range(n) for f in feats)
    grid = torch.cat([m["image_grid_thw"] for m in multi_modal if m is not None for _ in range(n)]).to(device)
    return {"mm_encoder_outputs": encoder_outputs(list(features)),
            "image_grid_thw": grid, "mm_token_type_ids": (input_ids == image_token_id(base)).int()}
