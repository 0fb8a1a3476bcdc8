"""Atomic, resumable checkpoints and export to a plain Hugging Face model directory.

Layout (verl's directory and marker-file names):

    ckpt_root/
      latest_checkpointed_iteration.txt     # "N", rewritten atomically after each save
      global_step_N/
        model/                              # save_pretrained (safetensors) + tokenizer; a PEFT model
                                            # saves its adapter here (adapter_model.safetensors)
        <name>/                             # each of `extra_models` (e.g. critic/), same format
        optimizer.pt  scheduler.pt          # state_dicts (torch.save); <name>.pt for `extra_states`
        state.pt                            # {"step", "extra" (sampler position, ...), "rng",
                                            #  "optimizer_classes": {"optimizer": "torch.optim.adamw.AdamW", ...}}

A save writes everything into `global_step_N.tmp-<pid>`, fsyncs the files, then renames the directory
into place with `os.replace` (atomic on POSIX), and only then rewrites the marker file through a temp
file + rename. Pruning renames a dir to `global_step_N.del-<pid>` before deleting it. So a process
killed at any moment leaves only complete `global_step_N` dirs; the temp / trash dirs of dead
processes are removed by the next save.

RNG states saved: Python `random`, NumPy's global generator, torch CPU (and CUDA when present).
Generators owned by the caller (e.g. a sampler's `torch.Generator`) belong in `extra_state`.
`state.pt` is a pickle: load only checkpoints you trust (as with any PyTorch checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import shutil
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiller.errors import UserError
from tiller.models.loading import is_vision_checkpoint, resolve_dtype
from tiller.models.optimizer import optimizer_class_name
from tiller.models.quant import check_quantization, dequantized_merge, is_quantized, quantize_after_load

MARKER = "latest_checkpointed_iteration.txt"
PREFIX = "global_step_"


# ---- small filesystem helpers -----------------------------------------------------------------------
def current_umask() -> int:
    """The process's umask (read from /proc where it can be, so no other thread sees it changed)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root`, and give every file and dir the mode a plain `open` / `mkdir` would have
    (0o666 / 0o777 less the umask): temp dirs and files from `mkdtemp` / `mkstemp` (transformers writes
    safetensors through one) are owner-only, and a finished model dir must not stay so."""
    umask = current_umask()
    os.chmod(root, 0o777 & ~umask)
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~umask)
        for name in files:
            path = os.path.join(dirpath, name)
            os.chmod(path, (0o666 | (os.stat(path).st_mode & 0o111)) & ~umask)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same dir, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def save_pretrained_atomic(out: str | os.PathLike, model, tokenizer=None, files: dict[str, str] | None = None) -> Path:
    """`save_pretrained` of `model` (safetensors) and `tokenizer`, plus text `files` {name: text}, into `out` as one
    unit: written in a temp dir beside it, fsynced, then swapped in (an existing `out` is replaced), so a crash
    never leaves a half-written model dir. Returns `out`."""
    out = Path(out)
    with _atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
    return out


@contextlib.contextmanager
def _atomic_dir(out: Path):
    """Yield a fresh temp dir beside `out`; on success fsync it and swap it in for `out`, on error remove it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_dir(path: Path) -> None:
    """Delete a checkpoint dir so it is never seen half-deleted: rename it out of view, then rmtree."""
    trash = path.with_name(f"{path.name}.del-{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move directory `src` to `dst`, replacing an existing `dst` (old one removed after the swap)."""
    old = None
    if dst.exists():
        old = dst.with_name(f"{dst.name}.del-{os.getpid()}")
        os.replace(dst, old)
    os.replace(src, dst)
    _fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(PREFIX):
        return None
    rest = name[len(PREFIX):]
    return int(rest) if rest.isdigit() else None


def list_checkpoints(ckpt_root: str | os.PathLike) -> list[Path]:
    """Complete checkpoint dirs under `ckpt_root`, oldest step first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := _step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def _remove_stale_temps(root: Path) -> None:
    """Remove temp (being written) and trash (being deleted) dirs and temp marker files left by dead processes."""
    for p in [*root.glob(f"{PREFIX}*.tmp-*"), *root.glob(f"{PREFIX}*.del-*"), *root.glob(".*.tmp-*")]:
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not _pid_alive(int(pid))):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


# ---- RNG ---------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- model save / load --------------------------------------------------------------------------------
def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP (`.module`) and torch.compile (`._orig_mod`) wrappers, so keys have no prefix."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _save_module(model: torch.nn.Module, out: Path) -> None:
    """HF / PEFT models via save_pretrained (safetensors); any other module as model.safetensors."""
    model = _unwrap(model)
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(out, safe_serialization=True)
        if is_quantized(model):  # QLoRA: `tiller export` merges the adapter into the same 4-bit base, dequantized
            quant = model.get_base_model().config.quantization_config
            (out / QUANT_FILE).write_text(json.dumps(quant.to_dict(), indent=1, default=str))
    else:
        from safetensors.torch import save_model

        save_model(model, str(out / "model.safetensors"))


def _load_module(model: torch.nn.Module, src: Path) -> None:
    """Load weights saved by `_save_module` into `model` in place (strict, tied weights allowed)."""
    from safetensors.torch import load_file

    model = _unwrap(model)
    if _is_peft(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(src / "adapter_model.safetensors")))
        return
    index = src / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not (src / shard).exists():
            raise UserError(f"checkpoint is missing weights file: {src / shard}")
        state.update(load_file(str(src / shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ptrs = {params[k].data_ptr() for k in state if k in params}
    # save_pretrained / save_model drop one copy of tied weights (lm_head = embed_tokens): fine if shared.
    missing = [k for k in missing if not (k in params and params[k].data_ptr() in loaded_ptrs)]
    if missing or unexpected:
        raise UserError(f"weights in {src} do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _torch_save(obj: Any, path: Path) -> None:
    """`torch.save` through a Python file, so a write that fails (a full disk) raises the OSError with its errno
    (torch's own file writer turns it into a RuntimeError without one)."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)


def _disk_full(err: BaseException, root: Path) -> bool:
    """The save failed because the disk is full: ENOSPC / EDQUOT, or a library's own error while no space is left."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(err, Exception):
        return False
    try:
        return shutil.disk_usage(root).free == 0
    except OSError:
        return False


def _disk_full_error(final: Path, root: Path) -> OSError:
    """One line for the CLI: the disk is full at the checkpoint's path; nothing of it was kept."""
    newest = latest_checkpoint(root)
    kept = f"the newest checkpoint is still {newest.name}" if newest is not None else "no checkpoint was written"
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} while saving this checkpoint (its partial files were "
                                 f"removed; {kept})", str(final))


LEGACY_OPTIMIZER = "torch.optim.adamw.AdamW"


# ---- public API ---------------------------------------------------------------------------------------
def save_checkpoint(ckpt_root: str | os.PathLike, step: int, model: torch.nn.Module | None = None,
                    optimizer=None, scheduler=None, extra_state: dict | None = None, tokenizer=None,
                    keep: int | None = None, extra_models: dict[str, torch.nn.Module] | None = None,
                    extra_states: dict[str, Any] | None = None, keep_step: int | None = None) -> Path:
    """Save a checkpoint for `step` atomically; returns `ckpt_root/global_step_<step>`.

    extra_state: plain values restored by `load_checkpoint` (sampler position, KL coefficient, ...).
    extra_models: other modules by name (e.g. {"critic": critic}), saved to `<name>/`.
    extra_states: other objects with `state_dict()` by name (e.g. {"critic_optimizer": opt}) -> `<name>.pt`.
    keep: keep only the newest `keep` checkpoints (None keeps all), and `keep_step`'s (the best one) besides.
    """
    if keep is not None and keep < 1:
        raise UserError(f"checkpoint keep must be >= 1 or None, got {keep}")
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root)
    final = root / f"{PREFIX}{int(step)}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        if model is not None:
            _save_module(model, tmp / "model")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        for name, module in (extra_models or {}).items():
            _save_module(module, tmp / name)
        if optimizer is not None:
            _torch_save(optimizer.state_dict(), tmp / "optimizer.pt")
        if scheduler is not None:
            _torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
        for name, obj in (extra_states or {}).items():
            _torch_save(obj.state_dict(), tmp / f"{name}.pt")
        saved = [("optimizer", optimizer), *(extra_states or {}).items()]
        classes = {name: optimizer_class_name(obj) for name, obj in saved if optimizer_class_name(obj) is not None}
        _torch_save({"step": int(step), "extra": dict(extra_state or {}), "rng": rng_state(),
                     "optimizer_classes": classes}, tmp / "state.pt")
        _fsync_tree(tmp)
        _replace_dir(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err, root):
            raise _disk_full_error(final, root) from None
        raise
    try:
        write_text_atomic(root / MARKER, f"{int(step)}\n")
    except OSError as err:  # the step's dir is whole, the marker still names the one before: remove the new dir
        if not _disk_full(err, root):
            raise
        _remove_dir(final)
        raise _disk_full_error(final, root) from None
    if keep is not None:
        spared = {final, root / f"{PREFIX}{int(keep_step)}"} if keep_step is not None else {final}
        for old in list_checkpoints(root)[:-keep]:
            if old not in spared:
                _remove_dir(old)
    return final


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Path | None:
    """The checkpoint named by the marker file, else the highest complete `global_step_N`; None if none."""
    root = Path(ckpt_root)
    marker = root / MARKER
    if marker.exists():
        text = marker.read_text().strip()
        if text.isdigit() and (root / f"{PREFIX}{text}" / "state.pt").exists():
            return root / f"{PREFIX}{text}"
    complete = [p for p in list_checkpoints(root) if (p / "state.pt").exists()]
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A `global_step_N` dir, a checkpoint root (its latest) or a run dir (its checkpoints/ latest)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"checkpoint path not found: {p}")
    if (p / "state.pt").exists():
        return p
    for root in (p, p / "checkpoints"):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise UserError(f"no checkpoint in {p} (expected state.pt, or {PREFIX}N/ dirs, or checkpoints/)")


def model_dir_for(path: str | os.PathLike, log=None) -> str:
    """The Hugging Face model dir to load for `path`: `path` itself when it is one (or a hub id), else, for a run
    dir / checkpoint root / `global_step_N` dir, its newest checkpoint's `model/` (announced through `log`).
    A checkpoint holding a LoRA adapter, or a run dir with no checkpoint, is a `UserError` saying what to pass."""
    p = Path(path).expanduser()
    if not p.is_dir() or (p / "config.json").exists() or (p / "adapter_config.json").exists():
        return str(path)
    is_run = any((p / name).exists() for name in ("checkpoints", "metrics.jsonl", "config.yaml", "state.pt"))
    try:
        ckpt = resolve_checkpoint(p)
    except UserError:
        if is_run:
            raise UserError(f"{p} is a run dir with no checkpoint yet (nothing under {p / 'checkpoints'}): pass a "
                            "model dir, or let the run save one (trainer.save_freq)") from None
        return str(path)
    model = ckpt / "model"
    if (model / "adapter_config.json").exists() or not (model / "config.json").exists():
        raise UserError(f"{p} is a run dir whose newest checkpoint ({ckpt}) holds no full model (a LoRA adapter): "
                        f"`tiller export {path} --to DIR` merges it into one; then pass DIR")
    if log is not None:
        log(f"{path} is a run dir: using its newest checkpoint's model, {model}")
    return str(model)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None = None, optimizer=None, scheduler=None,
                    extra_models: dict[str, torch.nn.Module] | None = None,
                    extra_states: dict[str, Any] | None = None, restore_rng: bool = True) -> dict:
    """Restore what `save_checkpoint` wrote into the given objects; returns `{"step": N, **extra_state}`.

    `path` may be a `global_step_N` dir, a checkpoint root or a run dir (see `resolve_checkpoint`).
    """
    ckpt = resolve_checkpoint(path)
    state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)
    pairs = [("optimizer", optimizer), ("scheduler", scheduler), *(extra_states or {}).items()]
    _check_optimizer_classes(ckpt, state, pairs)  # before anything is loaded
    if model is not None:
        _load_module(model, ckpt / "model")
    for name, module in (extra_models or {}).items():
        _load_module(module, ckpt / name)
    for name, obj in pairs:
        if obj is None:
            continue
        file = ckpt / f"{name}.pt"
        if not file.exists():
            raise UserError(f"checkpoint {ckpt} has no {file.name}")
        try:
            obj.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
        except ValueError as err:  # torch: another number or size of parameter groups
            if "parameter group" not in str(err):
                raise
            raise UserError(f"{file.name} of checkpoint {ckpt} holds other parameter groups than this run's optimizer "
                            f"({err}): its optim.weight_decay_exempt (or the trainable parameters) differ from the "
                            "saved run's; resume with the same settings, or start afresh "
                            "(trainer.resume_mode=disable)") from None
    if restore_rng:
        set_rng_state(state["rng"])
    return {"step": state["step"], **state["extra"]}


def _check_optimizer_classes(ckpt: Path, state: dict, pairs: list) -> None:
    """A resume loads an optimizer's state only into an optimizer of the class that saved it (torch's
    `load_state_dict` would take another class's state and fail, or step wrongly, later). A checkpoint from before
    the classes were recorded holds AdamW state (tiller's only optimizer then)."""
    saved = state.get("optimizer_classes", {})
    for name, obj in pairs:
        now = optimizer_class_name(obj)
        if now is None:
            continue
        then = saved.get(name, LEGACY_OPTIMIZER if "optimizer_classes" not in state else None)
        if then is not None and then != now:
            raise UserError(f"{name}.pt holds {then} state but this run builds {now} (optim.optimizer / "
                            f"optim.optimizer_impl), in checkpoint {ckpt}: resume with the optimizer it was trained "
                            "with, or start afresh (trainer.resume_mode=disable)")


def export_hf(ckpt_path: str | os.PathLike, to_dir: str | os.PathLike, dtype: str | None = None,
              overwrite: bool = False) -> Path:
    """Write a Hugging Face model dir (weights + config + tokenizer) from a checkpoint, atomically.

    A PEFT adapter is merged into its base model (`base_model_name_or_path` in adapter_config.json).
    `dtype` ("bfloat16", "float32", ...) converts the weights; None keeps them as saved.
    """
    ckpt = resolve_checkpoint(ckpt_path)
    src = ckpt / "model"
    if not src.is_dir():
        raise UserError(f"checkpoint {ckpt} has no model/ directory")
    out = Path(to_dir).expanduser()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"export target {out} exists and is not empty (pass --force to replace it)")
    check_weights(src)  # before anything is written: a truncated or foreign weights file is refused
    with _atomic_dir(out) as tmp:
        if (src / "adapter_config.json").exists() or dtype is not None:
            _export_via_load(src, tmp, dtype)
        else:
            shutil.copytree(src, tmp, dirs_exist_ok=True)
    return out


def _weight_shapes(src: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in a saved model dir's safetensors files, each file's header checked against its
    size (safetensors' own reader refuses a file cut short); a `UserError` names the file and the problem."""
    from safetensors import SafetensorError, safe_open

    index = src / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"{index}: not a valid weights index ({err})") from None
    else:
        files = [name for name in ("model.safetensors", "adapter_model.safetensors") if (src / name).exists()]
        if not files:
            raise UserError(f"{src} has no weights file (model.safetensors)")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        path = src / name
        if not path.exists():
            raise UserError(f"checkpoint is missing weights file: {path}")
        try:
            with safe_open(str(path), framework="pt") as fh:
                for key in fh.keys():
                    shapes[key] = tuple(fh.get_slice(key).get_shape())
        except (SafetensorError, OSError) as err:
            raise UserError(f"{path}: the weights file is damaged or truncated ({err}); "
                            "export an older checkpoint") from None
    return shapes


def check_weights(src: str | os.PathLike) -> None:
    """Refuse a saved model dir whose weights do not read or do not fit its config.json: a truncated file, a tensor
    of another shape, a tensor the architecture lacks, or one it needs that is absent (tied embeddings aside). A
    LoRA adapter's files, and a model transformers cannot build from its config alone (remote code), are only read
    (their headers checked against the file sizes)."""
    import transformers

    src = Path(src)
    shapes = _weight_shapes(src)
    if (src / "adapter_config.json").exists() or not (src / "config.json").exists():
        return
    try:
        config = transformers.AutoConfig.from_pretrained(src)
        with torch.device("meta"):
            model = _auto_class(src).from_config(config)
    except Exception:  # noqa: BLE001 - remote code, an architecture this transformers lacks: the headers must do
        return
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = {k for k in expected if k not in shapes and getattr(config, "tie_word_embeddings", False)
            and k.endswith("lm_head.weight")}
    missing = sorted(set(expected) - set(shapes) - tied)
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(k for k in set(shapes) & set(expected) if shapes[k] != expected[k])
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:3]}" if missing else "", f"unexpected {unexpected[:3]}" if unexpected else "",
                 "; ".join(f"{k} is {list(shapes[k])}, the config wants {list(expected[k])}" for k in wrong[:3])]
        raise UserError(f"the weights in {src} do not fit its config.json ({json.dumps(config.architectures)}): "
                        + "; ".join(p for p in parts if p))


MODEL_SHAPE_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "intermediate_size")


def _model_config(path: Path) -> dict | None:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def describe_model(config: dict) -> str:
    """`Qwen2ForCausalLM (hidden 160, 2 layers, vocab 512)` from a config.json mapping."""
    arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
    return (f"{arch} (hidden {config.get('hidden_size', '?')}, {config.get('num_hidden_layers', '?')} layers, "
            f"vocab {config.get('vocab_size', '?')})")


def model_mismatch(ckpt: str | os.PathLike, model_path: str | os.PathLike) -> tuple[str, str] | None:
    """(checkpoint's model, configured model) described, when a checkpoint's `model/config.json` and the configured
    model dir's differ in architecture or size; None when they agree or either cannot be read (a hub id, a LoRA
    adapter): the weights' own load then decides."""
    saved, wanted = _model_config(Path(ckpt) / "model"), _model_config(Path(model_path).expanduser())
    if saved is None or wanted is None:
        return None
    if all(saved.get(k) == wanted.get(k) for k in MODEL_SHAPE_KEYS):
        return None
    return describe_model(saved), describe_model(wanted)


def _auto_class(src: Path):
    """The transformers Auto class a saved model (or LoRA adapter) belongs to: causal LM, RM or critic."""
    import transformers

    if (src / "adapter_config.json").exists():
        task = json.loads((src / "adapter_config.json").read_text()).get("task_type") or "CAUSAL_LM"
        return {"SEQ_CLS": transformers.AutoModelForSequenceClassification,
                "TOKEN_CLS": transformers.AutoModelForTokenClassification}.get(task, transformers.AutoModelForCausalLM)
    archs = json.loads((src / "config.json").read_text()).get("architectures") or [""] \
        if (src / "config.json").exists() else [""]
    if archs[0].endswith("ForSequenceClassification"):
        return transformers.AutoModelForSequenceClassification
    if archs[0].endswith("ForTokenClassification"):
        return transformers.AutoModelForTokenClassification
    return transformers.AutoModelForCausalLM


QUANT_FILE = "quantization_config.json"
"""Beside a QLoRA checkpoint's adapter: the bitsandbytes settings of the 4-bit base it was trained on."""


def _export_via_load(src: Path, out: Path, dtype: str | None) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    torch_dtype = resolve_dtype(dtype) if dtype is not None else "auto"
    auto_cls = _auto_class(src)
    if (src / "adapter_config.json").exists():
        from peft import PeftModel

        base = json.loads((src / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base or not (Path(base).exists() or base.count("/") == 1):
            raise UserError(f"cannot merge the adapter in {src}: its base model {base!r} is not available")
        if auto_cls.__name__ == "AutoModelForCausalLM" and is_vision_checkpoint(base):
            auto_cls = AutoModelForImageTextToText  # a vision-language policy's adapter (language model LoRA)
        extra = {} if auto_cls in (AutoModelForImageTextToText,) or auto_cls.__name__ == "AutoModelForCausalLM" \
            else {"num_labels": 1}
        if (src / QUANT_FILE).exists():  # trained on a 4-bit base (QLoRA): that base, dequantized, takes the adapter
            from transformers import BitsAndBytesConfig

            quant = BitsAndBytesConfig.from_dict(json.loads((src / QUANT_FILE).read_text()))
            check_quantization(types.SimpleNamespace(load_in_4bit=True, bnb_4bit_quant_type=quant.bnb_4bit_quant_type),
                               str(src / QUANT_FILE), lora=True)
            model = quantize_after_load(auto_cls.from_pretrained(base, quantization_config=quant,
                                                                 device_map={"": "cpu"}, dtype=torch.float32, **extra))
            model = dequantized_merge(PeftModel.from_pretrained(model, str(src)))
            if dtype is not None:
                model = model.to(torch_dtype)
        else:
            model = auto_cls.from_pretrained(base, dtype=torch_dtype, **extra)
            model = PeftModel.from_pretrained(model, str(src)).merge_and_unload()
    else:
        if auto_cls.__name__ == "AutoModelForCausalLM" and is_vision_checkpoint(src):
            auto_cls = AutoModelForImageTextToText
        model = auto_cls.from_pretrained(src, dtype=torch_dtype)
    model.save_pretrained(out, safe_serialization=True)
    if (src / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(src).save_pretrained(out)
    for name in ("preprocessor_config.json", "chat_template.jinja", "chat_template.json"):  # a VLM's processor
        if (src / name).exists() and not (out / name).exists():
            shutil.copy2(src / name, out / name)


def export_main(argv: list[str]) -> int:
    """`tiller export CKPT --to DIR [--dtype bfloat16] [--force]`."""
    parser = argparse.ArgumentParser(prog="tiller export", description=(
        "Export a checkpoint (global_step_N dir, checkpoints root or run dir) as a Hugging Face model dir "
        "that AutoModelForCausalLM.from_pretrained loads. LoRA adapters are merged into the base model."))
    parser.add_argument("ckpt", help="checkpoint dir, checkpoints root, or run dir")
    parser.add_argument("--to", required=True, dest="to_dir", help="output directory")
    parser.add_argument("--dtype", default=None, help="convert weights: float32 | bfloat16 | float16")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    args = parser.parse_args(argv)
    out = export_hf(args.ckpt, args.to_dir, dtype=args.dtype, overwrite=args.force)
    print(f"exported {resolve_checkpoint(args.ckpt)} -> {out}")
    return 0
