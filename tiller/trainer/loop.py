"""The training loop shared by `tiller sft`, `tiller rm`, `tiller dpo` and `tiller kto`.

A job (`Job` below) knows its data and its loss; this loop owns everything else, identically for
the four: seeded shuffling (a permutation per epoch from `numpy.random.default_rng(seed + epoch)`,
so the data order is a pure function of the step and a resumed run sees the same batches),
gradient accumulation, bf16 autocast, AdamW with linear warmup + cosine / constant schedule,
gradient clipping, validation, the run records (config.yaml, metrics.jsonl, TensorBoard through
`tiller.tracking.Tracker`), atomic checkpoints and resume (`tiller.models.checkpoint`) and the final
export of a `from_pretrained`-ready model (LoRA merged) to `<run dir>/hf_model`.

Global-batch invariance: the job's loss for a micro-batch is its SHARE of the step loss, i.e. a sum
over its items divided by a normaliser computed once over the whole step (`Job.normalizer`: e.g.
the step's response-token count for SFT, its pair count for DPO). Summing `.backward()` over the
micro-batches then gives exactly the gradient of the step loss, whatever the micro-batch size.
Metrics follow the same rule (each is a share; the loop sums them over micro-batches).

Steps: `data.train_batch_size` examples per optimizer step; an epoch is ceil(N / batch) steps (the
last batch of an epoch may be smaller; no example is dropped). `trainer.total_training_steps`
overrides `trainer.total_epochs`.

Under `torchrun --nproc_per_node N` the step's micro-batches are dealt to the ranks and gradients summed
(DDP or FSDP2, `trainer.strategy`): `tiller.trainer.data_parallel`; N ranks give the one-process update.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from tiller.config import to_dict
from tiller.errors import ConfigError, UserError
from tiller.models.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_pretrained_atomic
from tiller.models.lora import merge_lora
from tiller.models.neftune import neftune
from tiller.models.optimizer import make_optimizer, param_groups
from tiller.tracking import Tracker
from tiller.trainer import hooks as step_hooks
from tiller.trainer.data_parallel import DataParallel
from tiller.protocol import to_device as tensor_to_device
from tiller.workers.common import autocast, lr_lambda, read_metrics, read_update_metrics


class Job(Protocol):
    """What a trainer plugs into `run_training`."""

    def micro_batches(self, examples: Sequence[Any]) -> list[Any]:
        """Collate one step's examples into micro-batches (tensors on CPU)."""

    def normalizer(self, examples: Sequence[Any]) -> float:
        """The step loss is sum(item losses) / normalizer(examples)."""

    def prepare_step(self, model: torch.nn.Module, micro_batches: list[Any]) -> None:
        """Called before the micro-batch losses of a step (e.g. KTO's KL baseline); may do nothing."""

    def loss(self, model: torch.nn.Module, micro: Any, normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(this micro-batch's share of the step loss, metric shares summed over micro-batches)."""

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Turn summed metric shares into the logged values (e.g. perplexity); may return `sums`."""


# ------------------------------------------------------------------------------------------- helpers


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def to_device(obj: Any, device: torch.device) -> Any:
    """Move tensors inside dicts / lists / tuples to `device` (`tiller.protocol.to_device`: no stream sync)."""
    if isinstance(obj, torch.Tensor):
        return tensor_to_device(obj, device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={name!r} but CUDA is not available; use trainer.device=cpu")
    return torch.device(name)


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    return max(1, math.ceil(num_examples / batch_size))


def batch_indices(step: int, num_examples: int, batch_size: int, seed: int, shuffle: bool) -> list[int]:
    """Example indices of optimizer step `step` (0-based): a pure function of its arguments."""
    spe = steps_per_epoch(num_examples, batch_size)
    epoch, k = divmod(step, spe)
    order = np.random.default_rng(seed + epoch).permutation(num_examples) if shuffle else np.arange(num_examples)
    return [int(i) for i in order[k * batch_size:(k + 1) * batch_size]]


# ---------------------------------------------------------------------------------------------- eval


@torch.no_grad()
def evaluate(job: Job, model: torch.nn.Module, examples: Sequence[Any], batch_size: int, device: torch.device,
             dtype_name: str = "float32", par: Any = None) -> dict[str, float]:
    """Job metrics over the whole of `examples` (normalised over all of them), model left in train mode.
    `par` (a `DataParallel`): this rank's share of the micro-batches, sums added over ranks."""
    was_training = model.training
    model.eval()
    norm = job.normalizer(examples)
    sums: dict[str, float] = {}
    try:
        for start in range(0, len(examples), batch_size):
            micros, weights = _shard(par, job.micro_batches(examples[start:start + batch_size]))
            micros = [to_device(m, device) for m in micros]
            with autocast(dtype_name, device, key="optim.dtype"):
                job.prepare_step(model, micros)
                for micro, weight in zip(micros, weights):
                    loss, metrics = job.loss(model, micro, norm)
                    _accumulate(sums, {"loss": loss, **metrics}, weight)
    finally:
        model.train(was_training)
    sums = read_metrics(sums)  # (one host read)
    return job.summarize(par.sum_metrics(sums) if par is not None else sums)


def _shard(par: Any, micros: list) -> tuple[list, list[float]]:
    """This rank's micro-batches and weights; a padding copy (weight 0) is marked `pad` for prepare_step."""
    if par is None:
        return micros, [1.0] * len(micros)
    mine, weights = par.shard(micros)
    return [dict(m, pad=True) if w == 0 and isinstance(m, dict) else m for m, w in zip(mine, weights)], weights


def _accumulate(sums: dict, metrics: dict[str, torch.Tensor], weight: float = 1.0) -> None:
    """Add a micro-batch's metrics to `sums`, device scalars kept on the device in float64 (a `.item()` each would
    make the host wait for the micro-batch's backward: `read_metrics` reads them all once)."""
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + weight * (v.detach().double() if torch.is_tensor(v) else v)


# ----------------------------------------------------------------------------------------- export


def export_model(model: torch.nn.Module, tokenizer, out_dir: Path) -> Path:
    """Save `model` (LoRA merged into a copy-free unload) + tokenizer to `out_dir` atomically."""
    return save_pretrained_atomic(Path(out_dir), merge_lora(model), tokenizer)


# ------------------------------------------------------------------------------------------- loop


def _loader(models: dict | None):
    """`load_checkpoint`, restoring the job's extra models (e.g. a moving reference) too when it has any."""
    return functools.partial(load_checkpoint, extra_models=models) if models else load_checkpoint


def _resume(cfg, ckpt_root: Path, par, optimizer, scheduler, models: dict | None = None) -> int:
    mode = cfg.trainer.resume_mode
    if mode == "disable":
        return 0, {}
    path = cfg.trainer.resume_from_path if mode == "resume_path" else latest_checkpoint(ckpt_root)
    if path is None:
        return 0, {}
    state = par.load(_loader(models), path, optimizer=optimizer, scheduler=scheduler)
    print(f"resumed from {path} at step {state['step']}")
    return int(state["step"]), dict(state.get("extra") or {})


def run_training(cfg, job: Job, model: torch.nn.Module, tokenizer, train_examples: Sequence[Any],
                 val_examples: Sequence[Any] = (), device: torch.device | None = None) -> dict[str, float]:
    """Train `model` with `job` as configured by `cfg` (any of the job configs); returns the last metrics."""
    tr, optim_cfg, data = cfg.trainer, cfg.optim, cfg.data
    device = device or resolve_device(tr.device)
    noise = neftune(model, getattr(cfg.model, "neftune_noise_alpha", None))  # on the unwrapped model's embeddings
    par = DataParallel.setup(cfg, model, device)  # one process: identities; torchrun: DDP / FSDP2
    model = par.model
    if par.sp is not None:  # sequence parallelism (tiller sft / dpo): the job runs this rank's share of the tokens
        job.sp = par.sp
    run_dir = Path(tr.default_local_dir)
    ckpt_root = run_dir / "checkpoints"
    batch_size = data.train_batch_size
    total = tr.total_training_steps or tr.total_epochs * steps_per_epoch(len(train_examples), batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UserError("the model has no trainable parameters")
    optimizer = make_optimizer(param_groups(model, optim_cfg.weight_decay_exempt), optim_cfg, "optim")
    warmup = int(optim_cfg.warmup_steps_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_lambda, warmup=warmup, total=total, style=optim_cfg.lr_scheduler, min_lr_ratio=optim_cfg.min_lr_ratio,
        lr=optim_cfg.lr, kwargs=dict(optim_cfg.lr_scheduler_kwargs or {}),
        from_zero=True))  # (verl's SFT engine and transformers: the first warmup step at lr 0)
    models = job.checkpoint_models() if hasattr(job, "checkpoint_models") else {}  # e.g. a moving reference
    if models and par.world > 1:
        raise ConfigError("algorithm.ref_model_sync_steps: the reference's updates run in one process (not under "
                          "torchrun with several ranks)")
    start, extra = _resume(cfg, ckpt_root, par, optimizer, scheduler, models)
    best = _Best(tr, extra.get("best"))
    tracker = (Tracker(run_dir, loggers=tuple(tr.logger), project=tr.project_name, experiment=tr.experiment_name,
                       config=to_dict(cfg), total_steps=total, resume_from_step=start or None)
               if par.rank == 0 else _NoTracker())
    last: dict[str, float] = {}
    hooks = step_hooks.current()  # a front end's callbacks (tiller.trl), on rank 0 of one process

    def save(done: int) -> None:
        par.save(functools.partial(save_checkpoint, ckpt_root, done, extra_models=models or None),
                 optimizer=optimizer, scheduler=scheduler,
                 extra_state={"total_steps": total, **({"best": best.state} if best.state else {})},
                 tokenizer=tokenizer, keep=tr.max_ckpt_to_keep, keep_step=best.step)
        if hooks is not None:
            hooks.saved(done, ckpt_root / f"global_step_{done}")

    def serve(asked: step_hooks.Requests, done: int, metrics: dict, regular: bool, saved: bool = False) -> bool:
        """A validation / checkpoint of step `done` that is due (`regular`) or asked for and not made yet; whether
        the step is checkpointed now."""
        if asked.evaluate and val_examples and not any(k.startswith("val/") for k in metrics):
            val = {f"val/{k}": v for k, v in evaluate(job, model, val_examples, batch_size, device,
                                                        optim_cfg.dtype, par).items()}
            tracker.log(val, step=done)
            metrics.update(val)
            hooks.evaluated(done, val)
        if not saved and (regular or asked.save or asked.stop):
            if regular or any(k.startswith("val/") for k in metrics):
                best.see(done, metrics)  # (every scheduled checkpoint was validated: best_metric's rule)
            save(done)
            return True
        return saved

    per_epoch = steps_per_epoch(len(train_examples), batch_size)
    if hooks is not None:
        hooks.begin({"total": total, "start": start, "model": model, "optimizer": optimizer,
                     "lr_scheduler": scheduler, "tokenizer": tokenizer})
    model.train()
    done = start
    try:
        with noise:  # NEFTune while training (off again for the export below)
            for step in range(start, total):
                if hooks is not None:
                    if step == start or step % per_epoch == 0:
                        hooks.epoch_begin(step // per_epoch)
                    hooks.step_begin(step)
                t0 = time.perf_counter()
                idx = batch_indices(step, len(train_examples), batch_size, tr.seed, data.shuffle)
                metrics = _train_step(job, model, [train_examples[i] for i in idx], optimizer, params,
                                      optim_cfg, device, par)
                scheduler.step()
                if hasattr(job, "after_optimizer_step"):  # (TR-DPO: the reference follows the policy)
                    job.after_optimizer_step(model, step + 1)
                metrics["train/lr"] = scheduler.get_last_lr()[0]
                metrics["train/epoch"] = step // per_epoch
                metrics["timing_s/step"] = time.perf_counter() - t0
                done = step + 1
                if val_examples and ((tr.test_freq > 0 and done % tr.test_freq == 0) or done == total):
                    val = evaluate(job, model, val_examples, batch_size, device, optim_cfg.dtype, par)
                    metrics.update({f"val/{k}": v for k, v in val.items()})
                tracker.log(metrics, step=done)
                last = metrics
                asked = hooks.step(done, metrics) if hooks is not None else step_hooks.Requests()
                regular = (tr.save_freq > 0 and done % tr.save_freq == 0) or done == total
                saved = serve(asked, done, metrics, regular)
                if hooks is not None and (done % per_epoch == 0 or done == total or asked.stop):
                    more = hooks.epoch_end(done)  # (transformers: after the step's log / evaluate / save)
                    serve(more, done, metrics, False, saved)
                    asked.stop = asked.stop or more.stop
                if asked.stop:
                    if par.rank == 0:
                        print(f"training stopped at step {done} of {total} (a callback asked)")
                    break
        if hooks is not None:
            hooks.end(done, last)
    finally:
        tracker.close()
    if best.step is not None and best.step != done:  # the best checkpoint's weights are the result
        par.load(_loader(models), ckpt_root / f"global_step_{best.step}", optimizer=optimizer, scheduler=scheduler)
        if par.rank == 0:
            print(f"the best {tr.best_metric} ({best.value:.6g}) was at step {best.step}: its model is the result")
    if tr.export_hf:
        if hasattr(job, "before_export"):  # e.g. the reward model's score mean / std into its config
            job.before_export(model, device)
        plain = par.plain_model()  # collective under FSDP2
        if par.rank == 0:
            out = export_model(plain, tokenizer, run_dir / "hf_model")
            print(f"exported the trained model to {out}")
    par.close()
    return last


class _Best:
    """trainer.best_metric's best validated checkpoint so far: `step`, `value` (None before the first), kept in the
    checkpoints' extra state so a resumed run knows it."""

    def __init__(self, tr, state: dict | None):
        self.metric = tr.best_metric
        greater = tr.best_metric_greater
        self.greater = (not str(self.metric).endswith("loss")) if greater is None else bool(greater)
        self.step = state["step"] if state else None
        self.value = state["value"] if state else None

    @property
    def state(self) -> dict | None:
        return None if self.step is None else {"step": self.step, "value": self.value}

    def see(self, step: int, metrics: dict[str, float]) -> None:
        if self.metric is None:
            return
        if self.metric not in metrics:
            logged = sorted(k for k in metrics if k.startswith("val/"))
            raise ConfigError(f"trainer.best_metric={self.metric}: not a validation metric this job logs "
                              f"({', '.join(logged)})")
        value = float(metrics[self.metric])
        if self.value is None or (value > self.value if self.greater else value < self.value):
            self.step, self.value = step, value


class _NoTracker:
    """Ranks other than 0 log nothing."""

    def log(self, metrics, step) -> None:
        return None

    def close(self) -> None:
        return None


def _train_step(job: Job, model, examples: list, optimizer, params, optim_cfg, device,
                par: Any = None) -> dict[str, float]:
    micros, weights = _shard(par, job.micro_batches(examples))
    micros = [to_device(m, device) for m in micros]
    norm = job.normalizer(examples)  # over the whole step, on every rank
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    with autocast(optim_cfg.dtype, device, key="optim.dtype"):
        with torch.no_grad():
            job.prepare_step(model, micros)
        for i, (micro, weight) in enumerate(zip(micros, weights)):
            if par is not None:
                par.set_grad_sync(i == len(micros) - 1)
            loss, metrics = job.loss(model, micro, norm)
            (loss * weight if weight != 1.0 else loss).backward()
            _accumulate(sums, {"loss": loss, **metrics}, weight)
    clip = optim_cfg.clip_grad if optim_cfg.clip_grad > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
    # the step's one host read: its metrics and the gradient norm (whether to step on it)
    sums, grad_norm = read_update_metrics([sums], grad_norm)
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)  # skip a step with inf / NaN gradients
    else:
        optimizer.step()
    sums = par.sum_metrics(sums) if par is not None else sums
    out = {f"train/{k}": v for k, v in job.summarize(sums).items()}
    out["train/grad_norm"] = grad_norm
    return out
