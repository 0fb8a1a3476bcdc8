"""A training role's optimizer, built as verl builds it from an `optim` section.

verl (`verl.workers.config.optimizer.build_optimizer`, verl-project/verl 1dda039b) imports the module
`optim.optimizer_impl` (`torch.optim`, `torchao.optim`, `bitsandbytes.optim`, ...), takes the class named
`optim.optimizer` from it and constructs it over the trainable parameters with

    lr, weight_decay               always
    betas                          when the class name, lower-cased, contains "adam" or "ademamix"
    **override_optimizer_config    last: extra keyword arguments, which may also replace the ones above

so `optimizer=SGD` gets `SGD(params, lr=, weight_decay=)` and `optimizer=AdamW, override_optimizer_config=
{amsgrad: true}` gets `AdamW(params, lr=, weight_decay=, betas=, amsgrad=True)`.

Deviations from verl:
- tiller's `optim` section has `eps` (verl's FSDP section does not): it goes with `betas` (1e-8, torch's
  Adam / AdamW default, so the default AdamW is verl's). Override it for other classes with
  `override_optimizer_config.eps`.
- A `betas` / `eps` away from its default for a class that does not get it is an error naming the key
  (verl drops it silently).
- Megatron's names `adam` / `adamw` (verl's Megatron layout default, `optim.optimizer=adam`) with
  `optimizer_impl=torch.optim` are torch.optim.AdamW, the same decoupled AdamW; `torch.optim.adam` is a
  module, not a class.
- An unknown module or class, a class that is not a `torch.optim.Optimizer`, or keyword arguments the class
  refuses (a name it does not take, a value its constructor rejects) is a `ConfigError` naming the key, and so
  is a class whose `step()` needs a closure (LBFGS: tiller calls `step()` once per mini-batch).
  `check_optimizer` finds all of these at load time by building the optimizer over one dummy parameter.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from typing import Any, Iterable

import torch

from tiller.errors import ConfigError

DEFAULT_BETAS = (0.9, 0.999)
DEFAULT_EPS = 1e-8
MEGATRON_ADAM = ("adam", "adamw")


def takes_betas(name: str) -> bool:
    """verl's rule: betas go to a class whose lower-cased name contains "adam" or "ademamix"."""
    low = name.lower()
    return "adam" in low or "ademamix" in low


def optimizer_class(impl: str, name: str, key: str) -> type:
    """The class `name` of module `impl` (`key` = the `optim` section, for the error)."""
    if impl == "torch.optim" and name in MEGATRON_ADAM:
        name = "AdamW"
    try:
        module = importlib.import_module(impl)
    except ImportError as err:
        raise ConfigError(f"{key}.optimizer_impl={impl!r}: cannot import it ({err}); install the package, or use "
                          "torch.optim") from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        found = sorted(n for n, v in vars(module).items() if not n.startswith("_") and isinstance(v, type)
                       and issubclass(v, torch.optim.Optimizer) and v is not torch.optim.Optimizer)
        what = f"{impl} has no class of that name" if cls is None else f"{impl}.{name} is not an optimizer class"
        raise ConfigError(f"{key}.optimizer={name!r}: {what}; the optimizers of {impl}: {', '.join(found) or 'none'}")
    step = inspect.signature(cls.step).parameters.get("closure")
    if step is not None and step.default is inspect.Parameter.empty:
        raise ConfigError(f"{key}.optimizer={name!r}: {impl}.{name}.step() needs a closure (it re-evaluates the loss); "
                          "tiller steps an optimizer once per mini-batch with step()")
    return cls


def optimizer_kwargs(optim_cfg, key: str) -> dict[str, Any]:
    """verl's keyword arguments of `optim_cfg`'s class (see the module doc), override_optimizer_config last."""
    kwargs: dict[str, Any] = {"lr": optim_cfg.lr, "weight_decay": optim_cfg.weight_decay}
    betas, eps = tuple(optim_cfg.betas), optim_cfg.eps
    declared = getattr(type(optim_cfg), "__dataclass_fields__", {})
    default_betas = tuple(declared["betas"].default_factory()) if "betas" in declared else DEFAULT_BETAS
    if takes_betas(optim_cfg.optimizer):
        kwargs.update(betas=betas, eps=eps)
    else:
        for field, value, default in (("betas", betas, default_betas), ("eps", eps, DEFAULT_EPS)):
            if value != default:
                raise ConfigError(
                    f"{key}.{field}={list(value) if field == 'betas' else value} does not reach "
                    f"{key}.optimizer={optim_cfg.optimizer!r} (verl passes betas only to Adam-family classes); drop "
                    f"it, or pass the class's own argument in {key}.override_optimizer_config")
    kwargs.update(optim_cfg.override_optimizer_config or {})
    return kwargs


# Which trainable parameters weight decay spares (`optim.weight_decay_exempt`). verl decays every one (None);
# transformers' Trainer (TRL's trainers) spares biases, norm weights and nn.LayerNorm parameters
# (`Trainer.get_decay_parameter_names`, transformers 5.x); OpenRLHF spares the names containing one of its list
# (`get_optimizer_grouped_parameters`, openrlhf/utils/deepspeed/deepspeed_utils.py).
WEIGHT_DECAY_EXEMPT = ("transformers", "openrlhf")
_TRANSFORMERS_NO_DECAY = tuple(re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                                        r"_norm(?:$|\.)"))
_OPENRLHF_NO_DECAY = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")


def check_decay_exempt(value, key: str) -> None:
    if value is not None and value not in WEIGHT_DECAY_EXEMPT:
        raise ConfigError(f"{key}={value!r}: one of {', '.join(WEIGHT_DECAY_EXEMPT)}, or null (every parameter decays, "
                          "as verl)")


def exempt_from_decay(model: torch.nn.Module, rule: str | None) -> set[str]:
    """The names of `model`'s parameters that `rule` (see WEIGHT_DECAY_EXEMPT) spares from weight decay."""
    if rule is None:
        return set()
    names = set()
    if rule == "transformers":
        layer_norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)
                       for p in m.parameters(recurse=False)}
        for name, p in model.named_parameters():
            if id(p) in layer_norms or any(pat.search(name.lower()) for pat in _TRANSFORMERS_NO_DECAY):
                names.add(name)
    else:
        names = {name for name, _ in model.named_parameters() if any(s in name for s in _OPENRLHF_NO_DECAY)}
    return names


def param_groups(model: torch.nn.Module, rule: str | None) -> list:
    """`model`'s trainable parameters for the optimizer: one list (every one decays), or, with an exemption rule,
    a decaying group and a group at weight_decay 0 (empty groups left out)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    exempt = exempt_from_decay(model, rule)
    if not exempt:
        return [p for _, p in named]
    decay = [p for n, p in named if n not in exempt]
    spared = [p for n, p in named if n in exempt]
    return [g for g in ({"params": decay}, {"params": spared, "weight_decay": 0.0}) if g["params"]]


def make_optimizer(params: Iterable[torch.nn.Parameter], optim_cfg, key: str) -> torch.optim.Optimizer:
    """`optim_cfg`'s optimizer over `params` (parameters or `param_groups`); a class or keyword arguments that do not
    fit is a `ConfigError`."""
    cls = optimizer_class(optim_cfg.optimizer_impl, optim_cfg.optimizer, key)
    kwargs = optimizer_kwargs(optim_cfg, key)
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as err:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        where = f"{key}.override_optimizer_config" if optim_cfg.override_optimizer_config else key
        raise ConfigError(f"{where}: {cls.__module__}.{cls.__qualname__}(params, {given}) is refused: {err}") from None


def check_optimizer(optim_cfg, key: str) -> None:
    """Load-time check: build `optim_cfg`'s optimizer over one dummy parameter (raises what `make_optimizer` raises),
    and its weight_decay_exempt rule is a known one."""
    check_decay_exempt(getattr(optim_cfg, "weight_decay_exempt", None), f"{key}.weight_decay_exempt")
    make_optimizer([torch.nn.Parameter(torch.zeros(1, 1))], optim_cfg, key)  # 2-D: Muon takes matrices only


def state_bytes_per_param(optim_cfg, key: str) -> float:
    """Bytes of optimizer state the configured class keeps per trainable parameter (AdamW 8: two fp32 moments; SGD 0;
    SGD with momentum 4), measured by one step of that class on a dummy fp32 matrix; per-tensor scalars (Adam's step
    count) are left out."""
    param = torch.nn.Parameter(torch.zeros(8, 8))
    optimizer = make_optimizer([param], optim_cfg, key)
    param.grad = torch.full_like(param, 0.5)
    optimizer.step()
    state = optimizer.state.get(param, {})
    held = sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.numel() > 1)
    return held / param.numel()


def optimizer_class_name(optimizer) -> str | None:
    """`module.Class` of an optimizer (or of the one inside a wrapper with `.optimizer`, e.g. FSDP2's gathered
    state); None for anything else. Checkpoints record it, so a resume with another class is refused."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return None
    return f"{type(inner).__module__}.{type(inner).__qualname__}"


# ---- transformers' other learning-rate schedules -----------------------------------------------------------------
# name -> its keyword arguments and their defaults (transformers.optimization, get_scheduler's
# scheduler_specific_kwargs); warmup_stable_decay's num_decay_steps has none (required)
HF_SCHEDULES: dict[str, dict[str, Any]] = {
    "cosine_with_restarts": {"num_cycles": 1},
    "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "inverse_sqrt": {"timescale": None},
    "warmup_stable_decay": {"num_decay_steps": None, "num_stable_steps": None, "warmup_type": "linear",
                            "decay_type": "cosine", "min_lr_ratio": 0.0, "num_cycles": 0.5},
}
_WSD_SHAPES = ("linear", "cosine", "1-sqrt")


def check_schedule_kwargs(style: str, kwargs: Any, lr: float, key: str) -> None:
    """`<key>` (lr_scheduler_kwargs) fits schedule `style`: only transformers' keyword names of it (none for tiller's
    own schedules), polynomial's lr_end below lr, warmup_stable_decay's num_decay_steps given and its shapes known."""
    given = dict(kwargs or {})
    allowed = HF_SCHEDULES.get(style, {})
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) if allowed else "none"
        raise ConfigError(f"{key}.{unknown[0]}: not a keyword of the {style!r} schedule (it takes: {takes})")
    if style == "polynomial" and not float(given.get("lr_end", 1e-7)) < lr:
        raise ConfigError(f"{key}.lr_end={given['lr_end']} must be below the peak lr ({lr}), as transformers requires")
    if style == "warmup_stable_decay":
        if given.get("num_decay_steps") is None or int(given["num_decay_steps"]) < 0:
            raise ConfigError(f"{key}.num_decay_steps: warmup_stable_decay needs its decay steps (an integer >= 0)")
        for name in ("warmup_type", "decay_type"):
            if given.get(name, "linear") not in _WSD_SHAPES:
                raise ConfigError(f"{key}.{name}={given[name]!r}: one of {', '.join(_WSD_SHAPES)}")


def hf_schedule_factor(step: int, *, style: str, warmup: int, total: int, lr: float, kwargs: Any) -> float:
    """Multiplier of the peak lr at scheduler step `step` for transformers' cosine_with_restarts, polynomial,
    inverse_sqrt and warmup_stable_decay schedules, their formulas exactly (transformers.optimization 5.x; the warmup
    of the first three: step / max(1, warmup)).

    Worked numbers (warmup 2, total 10, lr 1e-3): cosine_with_restarts num_cycles 2, step 6 -> progress 0.5 ->
    (2 x 0.5) % 1 = 0 -> 1.0; polynomial power 2, lr_end 1e-4, step 6 -> (0.9e-3 x 0.5^2 + 1e-4) / 1e-3 = 0.325;
    inverse_sqrt (timescale = warmup), step 8 -> 1 / sqrt(8 / 2) = 0.5; warmup_stable_decay num_decay_steps 4 (stable
    10 - 2 - 4 = 4), linear decay, step 8 -> 1 - 2 / 4 = 0.5, step 10 -> min_lr_ratio."""
    k = {**HF_SCHEDULES[style], **dict(kwargs or {})}
    if style == "warmup_stable_decay":
        decay = int(k["num_decay_steps"])
        stable = total - warmup - decay if k["num_stable_steps"] is None else int(k["num_stable_steps"])
        floor = float(k["min_lr_ratio"])
        if step < warmup:
            p = step / max(1, warmup)
            f = {"linear": p, "cosine": 0.5 * (1.0 - math.cos(math.pi * p)), "1-sqrt": 1.0 - math.sqrt(1.0 - p)}
            return max(0.0, f[k["warmup_type"]] * (1.0 - floor) + floor)
        if step < warmup + stable:
            return 1.0
        if step < warmup + stable + decay:
            p = (step - warmup - stable) / max(1, decay)
            f = {"linear": 1.0 - p, "cosine": 0.5 * (1.0 + math.cos(math.pi * float(k["num_cycles"]) * 2.0 * p)),
                 "1-sqrt": 1.0 - math.sqrt(p)}
            return max(0.0, f[k["decay_type"]] * (1.0 - floor) + floor)
        return floor
    if step < warmup:
        return step / max(1, warmup)
    if style == "inverse_sqrt":
        timescale = k["timescale"] if k["timescale"] is not None else (warmup or 10_000)
        return 1.0 / math.sqrt((step + timescale - warmup) / timescale)
    if style == "polynomial":
        lr_end, power = float(k["lr_end"]), float(k["power"])
        if step > total:
            return lr_end / lr
        remaining = 1 - (step - warmup) / (total - warmup)
        return ((lr - lr_end) * remaining ** power + lr_end) / lr
    progress = (step - warmup) / max(1, total - warmup)  # cosine_with_restarts (hard restarts)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(k["num_cycles"]) * progress) % 1.0))))
