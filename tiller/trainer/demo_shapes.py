"""`tiller demo --task shapes`: a tiny vision-language model learns to count red squares with GRPO on a CPU.

1. Starter model (cached under `~/.cache/tiller/demo/`): a ~1.1M-parameter Qwen2-VL (`--model-type qwen3_vl`: a
   ~1.3M-parameter Qwen3-VL; `qwen3_5`: a ~1.2M-parameter Qwen3.5, Gated DeltaNet and attention layers; `glm4v`: a
   ~1.2M-parameter GLM-4.1V; `glm4v_moe`: a ~1.5M-parameter GLM-4.5V) from the tiny-VLM kit
   (`tiller.models.tiny_vlm`: random vision tower and language model), given a short supervised warm-up on
   freshly drawn images (`tiller.tasks.shapes.draw` from its own seed stream, never an RL or held-out image;
   cross-entropy on the answer tokens, constant lr 3e-3; 1e-3 for GLM-4.1V / GLM-4.5V, `WARMUP_LR`) that stops once greedy accuracy on 256 dev images
   (checked every 10 steps) first reaches `--warmup-target` (0.45; answering one fixed count scores about 0.25).
2. GRPO on `tiller/shapes` (verl's multimodal schema, `data.image_key=images`): the hf rollout engine with
   the images, n = 8 samples per prompt, DAPO's dynamic sampling (groups all right or all wrong dropped), no
   KL, AdamW lr 3e-4 after a 10-step warmup, cosine decay to 3e-5; `--steps` (250) steps of 32 prompts. (At
   lr 1e-4, or for 60 steps, GRPO only re-thresholds the starter's coarse count: +0.03 to +0.07; at a constant
   3e-4 the last steps are noisy; see docs/vlm.md.)
3. Greedy accuracy on 256 held-out images before and after RL, `plots/demo_curves.png` and `summary.json`.

Any RL config key can be overridden after the options, as in `tiller demo`.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

import torch

from tiller.config import load_config
from tiller.models.checkpoint import save_pretrained_atomic
from tiller.models.tiny_vlm import FAMILIES, PATCH_SIZE, PATCH_SIZES, build_vlm, image_processor, vl_tokenizer
from tiller.models.vision import ImageTextProcessor, encode_image_prompt, split_placeholders, to_pil
from tiller.rewards import default_compute_score
from tiller.rollout import SamplingParams, build_rollout_engine
from tiller.tasks import shapes
from tiller.trainer.demo_report import train_and_report

SHAPES_VERSION = 3
DEV_SIZE = 256
"""Dev images the warm-up checks (its own seed stream): at 128 the 0.03-0.05 noise of one check picked
noise peaks, and starters spread 0.39-0.54 held-out."""
VAL_KEY = f"val-core/{shapes.DATA_SOURCE}/acc/mean@1"
WARMUP_LR = {"glm4v": 1e-3, "glm4v_moe": 1e-3}
"""Warm-up lr per model type (default 3e-3). The tiny GLM-4.1V at 3e-3 learned to answer one count and never read
the image (870 steps, dev accuracy 0.23-0.29, the gradient into its vision tower ~1e-3); at 1e-3 its loss fell from
0.9 to 0.11 between steps 50 and 150 (seed 0, batch 32)."""


def _encode(processor, row: dict):
    """A shapes row's prompt as the RL run encodes it (chat template, one image)."""
    msgs = split_placeholders(row["prompt"], 1, "shapes")
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return encode_image_prompt(processor, text, [to_pil(row["images"][0])])


def greedy_accuracy(model, processor, rows: list[dict], max_new_tokens: int = 3) -> float:
    """Fraction of `rows` whose greedy answer is right (the task's scorer)."""
    engine = build_rollout_engine("hf", model, processor.tokenizer, dtype=None)
    prompts = [_encode(processor, r) for r in rows]
    out = engine.generate([p.prompt_ids for p in prompts], SamplingParams(do_sample=False, max_new_tokens=max_new_tokens),
                          multi_modal=[{"pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw}
                                       for p in prompts])
    texts = processor.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    scores = [float(default_compute_score(shapes.DATA_SOURCE, t, r["reward_model"]["ground_truth"], {}))
              for t, r in zip(texts, rows)]
    return sum(scores) / len(scores)


def _sft_batch(model, processor, rows: list[dict]) -> dict:
    """Right-padded prompt + answer + eos with labels on the answer, and the rows' pixels."""
    tok = processor.tokenizer
    seqs, starts, pixels, grids = [], [], [], []
    for r in rows:
        p = _encode(processor, r)
        answer = tok(r["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p.prompt_ids + answer)
        starts.append(len(p.prompt_ids))
        pixels.append(p.pixel_values)
        grids.append(p.image_grid_thw)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (s, p_len) in enumerate(zip(seqs, starts)):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
        labels[i, p_len:len(s)] = torch.tensor(s[p_len:])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": torch.cat(pixels),
            "image_grid_thw": torch.cat(grids), "mm_token_type_ids": (ids == model.config.image_token_id).int()}


def warm_up(model, processor, dev_rows: list[dict], *, target: float, seed: int, lr: float = 3e-3,
            batch_size: int = 32, eval_every: int = 10, max_steps: int = 1500, log=print) -> tuple[float, int]:
    """Supervised steps on fresh images until greedy dev accuracy, checked every `eval_every` steps, first
    reaches `target`; returns (acc, steps)."""
    rng = random.Random(f"shapes-warmup-{seed}")
    dev_images = {r["images"][0]["bytes"] for r in dev_rows}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    acc, step = 0.0, 0
    model.train()
    while step < max_steps:
        rows = []
        while len(rows) < batch_size:
            png, count = shapes.draw(rng)
            if png not in dev_images:
                rows.append(shapes.make_row(png, count, "warmup", step))
        loss = model(**_sft_batch(model, processor, rows)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % eval_every == 0 or step == max_steps:
            acc = greedy_accuracy(model, processor, dev_rows)
            model.train()
            log(f"  warm-up step {step}: loss {loss.item():.3f}, dev greedy accuracy {acc:.3f}")
            if acc >= target:
                break
    model.eval()
    return acc, step


def starter_model(args, cache: Path, log=print) -> Path:
    """The cached warmed-up tiny VLM dir; built on first use."""
    model_type = getattr(args, "model_type", "qwen2_vl")
    fields = [SHAPES_VERSION, args.seed, args.warmup_target, args.warmup_max_steps]
    key = hashlib.sha1(json.dumps(fields + ([model_type] if model_type != "qwen2_vl" else [])).encode())
    out = cache / f"shapes-starter-{key.hexdigest()[:10]}"
    if (out / "config.json").exists() and not args.rebuild:
        log(f"starter model: {out} (cached)")
        return out
    family = FAMILIES[model_type]
    log(f"building the starter model (tiny {family}, supervised warm-up to {args.warmup_target:.2f} greedy accuracy)")
    t0 = time.time()
    tok = vl_tokenizer(model_type=model_type)
    model = build_vlm(tok, seed=args.seed, model_type=model_type)
    patch = PATCH_SIZES[model_type]  # 64-px images resized so that each 16-px cell is one image token
    proc = image_processor(64 * patch // PATCH_SIZE, patch_size=patch, model_type=model_type)
    processor = ImageTextProcessor(proc, tok, tok.convert_ids_to_tokens(model.config.image_token_id))
    dev = shapes.make_splits(0, DEV_SIZE, seed=10_000 + args.seed)["test"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        acc, steps = warm_up(model, processor, dev, target=args.warmup_target, seed=args.seed,
                             lr=WARMUP_LR.get(model_type, 3e-3), max_steps=args.warmup_max_steps,
                             eval_every=min(10, args.warmup_max_steps), log=log)
    save_pretrained_atomic(out, model, tok, {"preprocessor_config.json": proc.to_json_string(),
                                             "warmup.json": json.dumps({"dev_acc": acc, "steps": steps,
                                                                        "seconds": time.time() - t0})})
    log(f"starter model ready in {time.time() - t0:.0f} s (dev accuracy {acc:.3f} after {steps} steps): {out}")
    return out


def rl_overrides(model_dir: Path, data_dir: Path, run_dir: Path, args) -> list[str]:
    """The shapes demo's RL config (verl keys); user overrides are appended after these."""
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files=[{data_dir / 'train.parquet'}]", f"data.val_files=[{data_dir / 'test.parquet'}]",
        "data.image_key=images", "data.max_prompt_length=64", "data.max_response_length=3",
        "data.train_batch_size=32", f"data.seed={args.seed}",
        "algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=1",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
        "actor_rollout_ref.actor.optim.warmup_style=cosine", "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0.0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.overwrite=true", f"trainer.seed={args.seed}",
        f"trainer.num_threads={args.threads}", f"trainer.default_local_dir={run_dir}",
        "trainer.project_name=tiller", "trainer.experiment_name=demo-shapes",
    ]


def run_shapes_demo(args, cache: Path) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.time()
    torch.set_num_threads(args.threads)
    run_dir = Path(args.out).expanduser().resolve()
    model_dir = starter_model(args, cache)
    t_warm = time.time() - t0
    data_dir = run_dir / "data"
    shapes.write_task(data_dir, n_train=args.train_size, n_test=args.val_size, seed=args.seed)
    cfg = load_config(rl_overrides(model_dir, data_dir, run_dir, args) + list(args.overrides))
    print(f"GRPO on shapes: {args.steps} steps x {cfg.data.train_batch_size} prompts x "
          f"n={cfg.actor_rollout_ref.rollout.n}; run dir {run_dir}")
    summary = train_and_report(cfg, run_dir, VAL_KEY, t0=t0, warmup_s=t_warm,
                               fields={"task": "shapes", "val_prompts": args.val_size, "starter_model": str(model_dir),
                                       "seed": args.seed, "threads": args.threads})
    acc_before, acc_after, wall = summary["val_acc_before"], summary["val_acc_after"], summary["wall_s"]
    print(f"held-out accuracy ({args.val_size} images, greedy): before RL {acc_before:.3f} -> after RL {acc_after:.3f} "
          f"({acc_after - acc_before:+.3f}) in {wall:.0f} s")
    print(f"run dir: {run_dir} (summary.json, metrics.jsonl, tensorboard/, plots/demo_curves.png)")
    return 0
