"""`tiller spin`: Self-Play fIne-tuNing (Chen et al. 2024, arXiv 2401.01335).

SPIN turns an SFT dataset into preference pairs against the model itself. Iteration t = 0 .. T-1, starting from
p_theta_0 = model.partial_pretrain:

1. generate: for every prompt x of the SFT data, sample y' ~ p_theta_t(. | x) with the model as it is now
   (tiller's rollout engine; `algorithm.temperature`, `top_p`, `max_new_tokens`);
2. train p_theta_{t+1} from p_theta_t on the pairs (chosen = the SFT target y, rejected = y') with the SPIN loss

       L = E[ log(1 + exp(-( lambda log p_theta(y|x)/p_theta_t(y|x) - lambda log p_theta(y'|x)/p_theta_t(y'|x) ))) ]

   (paper Eq. 4.7 with the logistic loss), which is DPO's sigmoid loss with beta = lambda and the frozen
   reference = p_theta_t: `tiller.trainer.preference.DPOJob` with `tiller.algos.dpo_loss`, run by the shared
   loop (`tiller.trainer.loop.run_training`: batching, AdamW, checkpoints, resume) for trainer.total_epochs
   (or total_training_steps) per iteration.

Run dir: `iter_<t>/` per iteration (its metrics.jsonl, checkpoints/, pairs.jsonl with the generated
responses, hf_model/ = p_theta_{t+1}); `hf_model/` at the top = the last iteration's model; `summary.json` with,
per iteration, the mean log-likelihood margin log p(y|x) - log p(y'|x) over the iteration's pairs under
p_theta_t (before) and p_theta_{t+1} (after): SPIN raises it. A finished iteration (its hf_model exists) is
skipped when the command is run again, so an interrupted run continues where it stopped.

Deviations from the paper: the paper mixes the newly generated pairs with the previous iteration's (its
"iterations" reuse data); tiller trains each iteration on its own pairs only. Prompts of chat-message form go
through the chat template; `messages`-format SFT rows (whole conversations) are not read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tiller.config.jobs import SPINConfig
from tiller.data.packing import collate_padded
from tiller.data.preference import PairExample, make_sequence, refuse_images
from tiller.data.sft import encode_prompt_response
from tiller.data.sources import load_sources
from tiller.errors import DataError
from tiller.models.checkpoint import write_text_atomic
from tiller.models.lora import adapter_settings, merge_lora
from tiller.rollout import build_rollout_engine, SamplingParams
from tiller.trainer.loop import resolve_device, run_training, to_device
from tiller.trainer.preference import DPOJob, Reference, sequence_logps
from tiller.trainer.sft import build_model_and_tokenizer, parse_job_args, setup


def load_spin_rows(cfg: SPINConfig, tokenizer) -> list[tuple[list[int], list[int], str]]:
    """(prompt ids, ground-truth completion ids with eos, where) for each SFT row."""
    data = cfg.data
    if not data.train_files:
        raise DataError("no training rows (set data.train_files)")
    rows = []
    for where, row in load_sources([str(f) for f in data.train_files], data.train_split, None, cfg.trainer.seed,
                                   max_per_source=data.max_samples):
        refuse_images(row, where)  # text only: images would be dropped
        for key, name in ((data.prompt_key, "data.prompt_key"), (data.response_key, "data.response_key")):
            if key not in row or row[key] is None:
                raise DataError(f"{where}: no {key!r} column ({name}); columns: {sorted(row)}")
        if not isinstance(row[data.response_key], str):
            raise DataError(f"{where}: {data.response_key!r} must be a string (the ground-truth response)")
        p_ids, c_ids = encode_prompt_response(row[data.prompt_key], row[data.response_key], tokenizer,
                                              data.apply_chat_template, where, data.input_template)
        rows.append((p_ids, c_ids, where))
        if 0 < data.max_samples <= len(rows):
            break
    if not rows:
        raise DataError(f"no training rows in {', '.join(map(str, data.train_files))}")
    return rows


@torch.no_grad()
def generate_responses(model, tokenizer, prompts: list[list[int]], cfg: SPINConfig, seed: int) -> list[list[int]]:
    """One sampled response per prompt from `model` as it is (token ids, the stop token kept)."""
    algo = cfg.algorithm
    was_training = model.training
    model.eval()
    try:
        engine = build_rollout_engine("native", model, tokenizer, dtype=None)
        params = SamplingParams(temperature=algo.temperature, top_p=algo.top_p, max_new_tokens=algo.max_new_tokens,
                                do_sample=True, seed=seed)
        out = []
        size = max(1, cfg.data.micro_batch_size_per_gpu * 8)
        for i in range(0, len(prompts), size):
            out += list(engine.generate(prompts[i:i + size], params).response_ids)
    finally:
        model.train(was_training)
    return out


def spin_pairs(rows: list[tuple[list[int], list[int], str]], generated: list[list[int]], max_length: int,
               truncation: str) -> list[PairExample]:
    """chosen = (x, y) the SFT target, rejected = (x, y') the model's own generation."""
    if len(rows) != len(generated):
        raise ValueError(f"{len(rows)} prompts but {len(generated)} generations")
    return [PairExample(make_sequence(p, y, max_length, truncation, where),
                        make_sequence(p, g, max_length, truncation, f"{where} (generated)"))
            for (p, y, where), g in zip(rows, generated)]


@torch.no_grad()
def mean_margin(model, pairs: list[PairExample], pad_id: int, micro: int, device) -> float:
    """Mean over pairs of log p(y|x) - log p(y'|x) (sums over the completion tokens)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(pairs), micro):
        chunk = pairs[i:i + micro]
        batch = to_device(collate_padded([p.chosen for p in chunk] + [p.rejected for p in chunk], pad_id), device)
        logps, _ = sequence_logps(model, batch)
        chosen, rejected = logps.float().chunk(2)
        total += float((chosen - rejected).sum())
    model.train(was_training)
    return total / max(len(pairs), 1)


def _write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n")


def _write_pairs(path: Path, tokenizer, rows, generated) -> None:
    lines = [json.dumps({"prompt": tokenizer.decode(p), "real": tokenizer.decode(y, skip_special_tokens=True),
                         "generated": tokenizer.decode(g, skip_special_tokens=True)})
             for (p, y, _), g in zip(rows, generated)]
    write_text_atomic(path, "\n".join(lines) + "\n")


def _copy_dir_atomic(src: Path, dst: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def run_spin(cfg: SPINConfig) -> dict:
    """All iterations (see the module docstring); returns the summary (also written to summary.json)."""
    setup(cfg)
    device = resolve_device(cfg.trainer.device)
    run_dir = Path(cfg.trainer.default_local_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"iterations": []}
    current = cfg.model.partial_pretrain
    for t in range(cfg.algorithm.iterations):
        it_dir = run_dir / f"iter_{t}"
        if (it_dir / "hf_model" / "config.json").exists():  # finished earlier: continue from its model
            current = str(it_dir / "hf_model")
            continue
        model_cfg = dataclasses.replace(cfg.model, partial_pretrain=current)
        if current != cfg.model.partial_pretrain and model_cfg.lora_adapter_path:
            # p_theta_0 = base + model.lora_adapter_path; later iterations train fresh adapters of its shape on
            # the previous iteration's merged model (the saved adapter is in its weights already)
            model_cfg = dataclasses.replace(model_cfg, lora_adapter_path=None,
                                            **adapter_settings(model_cfg.lora_adapter_path, "model.lora_adapter_path"))
        it_cfg = dataclasses.replace(cfg, model=model_cfg,
                                     trainer=dataclasses.replace(cfg.trainer, default_local_dir=str(it_dir),
                                                                 export_hf=True))
        model, tokenizer = build_model_and_tokenizer(it_cfg)
        model.to(device)
        rows = load_spin_rows(it_cfg, tokenizer)
        generated = generate_responses(model, tokenizer, [p for p, _, _ in rows], cfg,
                                       seed=cfg.trainer.seed * 1_000_003 + t)
        it_dir.mkdir(parents=True, exist_ok=True)
        _write_pairs(it_dir / "pairs.jsonl", tokenizer, rows, generated)
        pairs = spin_pairs(rows, generated, cfg.data.max_length, cfg.data.truncation)
        # p_theta_t: the model as it is now (the base, or base + a saved adapter merged in), frozen
        ref_model = it_cfg.model if it_cfg.model.lora_adapter_path else dataclasses.replace(it_cfg.model, lora_rank=0)
        ref = merge_lora(build_model_and_tokenizer(dataclasses.replace(it_cfg, model=ref_model))[0])
        ref = ref.to(device).eval().requires_grad_(False)  # p_theta_t, frozen
        micro = cfg.data.micro_batch_size_per_gpu
        before = mean_margin(model, pairs, tokenizer.pad_token_id, micro, device)
        job = DPOJob(Reference(model=ref), tokenizer.pad_token_id, micro, "dpo", cfg.algorithm.beta)
        last = run_training(it_cfg, job, model, tokenizer, pairs, device=device)
        after = mean_margin(model, pairs, tokenizer.pad_token_id, micro, device)
        record = {"iteration": t, "model_in": current, "pairs": len(pairs), "margin_before": before,
                  "margin_after": after, "last_metrics": {k: float(v) for k, v in last.items()}}
        summary["iterations"] = [r for r in summary["iterations"] if r["iteration"] != t] + [record]
        _write_json_atomic(summary_path, summary)
        print(f"spin iteration {t}: log p(real) - log p(generated) {before:.3f} -> {after:.3f} over {len(pairs)} "
              "pairs")
        current = str(it_dir / "hf_model")
        del model, ref
    if cfg.trainer.export_hf:
        _copy_dir_atomic(Path(current), run_dir / "hf_model")
        print(f"the last iteration's model: {run_dir / 'hf_model'}")
    return summary


def main(argv: list[str]) -> int:
    run_spin(parse_job_args("tiller spin", __doc__, argv, SPINConfig))
    return 0
