"""What `tiller generate`, `tiller eval` and `tiller serve` share: load a policy for inference, load prompt
files, and generate for many prompts in batches with a progress bar.

The model is loaded directly in the rollout dtype (`bfloat16` by default: the fast path on CPUs with
AVX-512 bf16 or AMX and on GPUs; on a CPU without fast bf16 matmuls it falls back to float32 with a warning,
as the engines do) and handed to the engine with `dtype=None`, so no second copy of the weights is kept (the
trainer's engines keep an fp32 actor plus a bf16 copy; inference needs only one).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

from tiller.data.rl_dataset import encode_image_row, read_rows, render_prompt, row_images
from tiller.errors import ConfigError, DataError
from tiller.models.chat_template import set_chat_template
from tiller.models.checkpoint import model_dir_for
from tiller.models.loading import is_vision_checkpoint, load_causal_lm, load_tokenizer, resolve_dtype
from tiller.models.vision import load_processor
from tiller.rollout import build_rollout_engine, RolloutOutput, SamplingParams
from tiller.rollout.base import effective_dtype, shaping_of
from tiller.rollout.graphed_decode import native_decode_options


@dataclass
class Policy:
    """An engine ready to generate, with its tokenizer and the model dir it came from."""

    engine: Any
    tokenizer: Any
    model_path: str
    model: Any = None
    processor: Any = None
    """A vision-language model's processor (its image prompts go through it); None for a text model."""


def load_policy(model_path: str, *, engine: str = "native", dtype: str = "bfloat16", seed: int = 0,
                tokenizer_path: str | None = None, device: str = "cpu", trust_remote_code: bool = False,
                engine_kwargs: dict | None = None, chat_template: str | None = None) -> Policy:
    """Load a causal LM + tokenizer from `model_path` and build the rollout engine `engine` around it.
    `chat_template`: replaces the tokenizer's (verl's actor_rollout_ref.model.custom_chat_template)."""
    import torch

    if not model_path:
        raise ConfigError("actor_rollout_ref.model.path is required (a Hugging Face model dir)")
    model_path = model_dir_for(model_path, log=lambda line: print(f"tiller: {line}", file=sys.stderr))
    tokenizer = load_tokenizer(tokenizer_path or model_path, padding_side="left", trust_remote_code=trust_remote_code)
    set_chat_template(tokenizer, chat_template)
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but torch sees no CUDA device")
    opts = dict(engine_kwargs or {})
    if engine == "vllm":
        return Policy(build_rollout_engine("vllm", model_path, tokenizer, dtype=dtype, seed=seed, **opts),
                      tokenizer, model_path)
    # bf16 on a CPU without fast bf16 matmuls falls back to fp32 (with a warning), as the engines do
    load_dtype = resolve_dtype(dtype)
    if isinstance(load_dtype, torch.dtype):
        load_dtype = effective_dtype(load_dtype, torch.device(device))
    model = load_causal_lm(model_path, dtype=load_dtype, trust_remote_code=trust_remote_code, device=device)
    model.eval()
    model.requires_grad_(False)
    processor = None
    if is_vision_checkpoint(model_path):
        processor = load_processor(model_path, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
        set_chat_template(tokenizer, chat_template, processor)
    return Policy(build_rollout_engine(engine, model, tokenizer, dtype=None, seed=seed, **opts),
                  tokenizer, model_path, model, processor)


def show_progress(wanted: bool) -> bool:
    """Whether to draw a progress bar: asked for, and stderr (where tqdm draws) is a terminal. In a log file a bar
    is a stream of carriage returns that runs into the results printed after it."""
    return wanted and sys.stderr.isatty()


def tokenize_prompt(text: str, tokenizer, max_len: int, truncation: str, where: str) -> list[int]:
    """Token ids of a rendered prompt, fitted to `max_len` by `truncation` (error | left | right | middle)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise DataError(f"{where}: prompt tokenizes to 0 tokens")
    if len(ids) <= max_len:
        return list(ids)
    if truncation == "left":
        return list(ids[-max_len:])
    if truncation == "right":
        return list(ids[:max_len])
    if truncation == "middle":
        head = max_len // 2
        return list(ids[:head]) + list(ids[len(ids) - (max_len - head):])
    raise DataError(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={max_len}; "
                    "set data.truncation=left|right|middle")


def load_prompt_rows(files: Sequence[str], tokenizer, *, prompt_key: str = "prompt", max_prompt_length: int = 1024,
                     truncation: str = "error", apply_chat_template: bool = True,
                     max_samples: int = -1, chat_template_kwargs: dict | None = None, processor=None,
                     image_key: str = "images") -> tuple[list[dict], list[list[int]], list[dict | None]]:
    """Rows of prompt files (verl schema, or any file with a `prompt_key` column of text or chat messages),
    the token ids of each rendered prompt and each row's image inputs (None for a text row). Each row gets
    `prompt_text` (the rendered prompt). `chat_template_kwargs`: extra template variables
    (data.apply_chat_template_kwargs). Rows with images (`image_key`) need a vision-language model's `processor`
    (as `tiller.data.rl_dataset.RLDataset` reads them; an image prompt is never truncated)."""
    if not files:
        raise ConfigError("no prompt files: pass --data FILE (or data.val_files=[...])")
    rows_out: list[dict] = []
    ids_out: list[list[int]] = []
    images_out: list[dict | None] = []
    for path in files:
        rows = read_rows(path)
        if not rows:
            raise DataError(f"{path}: the file has no rows")
        if prompt_key not in rows[0]:
            raise DataError(f"{path}: missing column {prompt_key!r} (columns: {', '.join(rows[0])}); "
                            "set data.prompt_key")
        for i, row in enumerate(rows):
            where = f"{path} row {i}"
            if row.get(prompt_key) is None:
                raise DataError(f"{where}: empty {prompt_key!r}")
            images = row_images(row, image_key, where)
            if images:
                if processor is None:
                    raise DataError(f"{where}: the row has images (column {image_key!r}) but the model is not a "
                                    "vision-language model tiller runs; drop the column or change data.image_key")
                vision = encode_image_row(row[prompt_key], images, processor, where, chat_template_kwargs)
                if len(vision.prompt_ids) > max_prompt_length:
                    raise DataError(f"{where}: image prompt has {len(vision.prompt_ids)} tokens > "
                                    f"data.max_prompt_length={max_prompt_length} (image prompts are not truncated)")
                text, ids = vision.text, list(vision.prompt_ids)
                images_out.append({"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw})
            else:
                text = render_prompt(row[prompt_key], tokenizer, apply_chat_template, where,
                                     chat_template_kwargs=chat_template_kwargs)
                ids = tokenize_prompt(text, tokenizer, max_prompt_length, truncation, where)
                images_out.append(None)
            ids_out.append(ids)
            rows_out.append({**row, "prompt_text": text})
            if 0 < max_samples <= len(rows_out):
                return rows_out, ids_out, images_out
    return rows_out, ids_out, images_out


def generate_batched(engine, prompt_ids: list[list[int]], sampling: SamplingParams, *, batch_size: int = 64,
                     progress: bool = True, desc: str = "generate",
                     multi_modal: Sequence[dict | None] | None = None) -> RolloutOutput:
    """`engine.generate` over `batch_size` prompts at a time, concatenated (n samples per prompt contiguous).

    With `sampling.seed` set, batch `j` uses seed `seed + j`, so a run is reproducible for a given batch size.
    `multi_modal`: per prompt a vision-language model's image inputs (`PromptItem.multi_modal_inputs`) or None.
    """
    from dataclasses import replace

    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    out = RolloutOutput()
    bar = tqdm(total=len(prompt_ids), desc=desc, unit="prompt", disable=not show_progress(progress), leave=False)
    try:
        for j, start in enumerate(range(0, len(prompt_ids), batch_size)):
            chunk = prompt_ids[start:start + batch_size]
            call = replace(sampling, seed=None if sampling.seed is None else sampling.seed + j)
            images = multi_modal[start:start + batch_size] if multi_modal is not None else None
            res = engine.generate(chunk, call, **({"multi_modal": list(images)} if images is not None and any(
                m is not None for m in images) else {}))
            out.prompt_ids += res.prompt_ids
            out.response_ids += res.response_ids
            out.logprobs += res.logprobs
            out.finish_reason += res.finish_reason
            bar.update(len(chunk))
            bar.set_postfix(tokens=out.num_tokens)
    finally:
        bar.close()
    return out


def sampling_from_rollout(rollout_cfg, max_new_tokens: int, seed: int, *, val: bool = False) -> SamplingParams:
    """SamplingParams from `actor_rollout_ref.rollout` (training keys) or its `val_kwargs` (val=True)."""
    r = rollout_cfg
    shaping = shaping_of(r)
    if val:
        vk = r.val_kwargs
        return SamplingParams(n=vk.n, temperature=vk.temperature if vk.do_sample else 1.0, top_p=vk.top_p,
                              top_k=vk.top_k, max_new_tokens=max_new_tokens, do_sample=vk.do_sample,
                              stop=tuple(r.stop), seed=seed, **shaping)
    return SamplingParams(n=r.n, temperature=r.temperature if r.do_sample else 1.0, top_p=r.top_p, top_k=r.top_k,
                          min_p=r.min_p, max_new_tokens=max_new_tokens, do_sample=r.do_sample, stop=tuple(r.stop),
                          ignore_eos=r.ignore_eos, seed=seed, **shaping)


def policy_from_config(cfg) -> Policy:
    """`load_policy` with an RLConfig's model / rollout / trainer keys."""
    arr = cfg.actor_rollout_ref
    opts = dict(arr.rollout.engine_kwargs)
    if arr.rollout.name == "native":  # rollout.enforce_eager as the trainer's engine reads it: graphs on a GPU
        for key, value in native_decode_options(arr.rollout.enforce_eager, cfg.trainer.device,
                                                arr.rollout.cudagraph_capture_sizes).items():
            opts.setdefault(key, value)
    return load_policy(arr.model.path, engine=arr.rollout.name, dtype=arr.rollout.dtype, seed=cfg.trainer.seed,
                       tokenizer_path=arr.model.tokenizer_path or cfg.data.tokenizer, device=cfg.trainer.device,
                       trust_remote_code=arr.model.trust_remote_code, engine_kwargs=opts,
                       chat_template=arr.model.custom_chat_template)


def decode(tokenizer, ids: Sequence[int]) -> str:
    """Response text without special tokens (what scorers and users see)."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)
