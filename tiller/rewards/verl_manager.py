"""verl's custom reward managers (`reward.reward_manager.source=importlib`, `reward.reward_manager.module.path` =
a .py file, `reward.reward_manager.name` = the class) on tiller's reward path.

verl 0.10's reward loop: a `RewardManagerBase` subclass, constructed as `cls(config=..., tokenizer=...,
compute_score=...)`, scores one sample per `await run_single(data)` (a one-row `DataProto`) and returns
`{"reward_score": float, "reward_extra_info": {...}}`; every sample of the step runs concurrently on one event loop,
as verl's reward-loop worker gathers them. The older API (verl <= 0.9's `AbstractRewardManager`, still in verl:
`cls(tokenizer=..., num_examine=0, compute_score=..., reward_fn_key=data.reward_fn_key, **reward_model.reward_kwargs)`
and `__call__(data, return_dict=True)` over the whole batch, returning a token-level `reward_tensor` and
`reward_extra_info`) runs too: a sample's reward is its row's sum over the response (tiller gives each sample one
reward at its last token, which is where verl's managers put it).

What a manager sees is what verl gives it: `data.batch` with `prompts` (left-padded to the batch's widest prompt),
`responses` (right-padded), `attention_mask`, `input_ids`, `position_ids`; `data.non_tensor_batch` with
`data_source`, `reward_model` ({"ground_truth", "style"}), `extra_info`, `uid` (numpy object arrays), `data[i]` a
`DataProtoItem`, `data[i:j]` a `DataProto`; `config` the run's config with verl's attribute access (`config.reward.
reward_kwargs`, `config.data.max_response_length`, ...); `compute_score` the custom reward function (with
`custom_reward_function.reward_kwargs` bound) or verl's default scorer. While its file imports, `verl`,
`verl.protocol`, `verl.experimental.reward_loop.reward_manager` (`register`, `RewardManagerBase`),
`verl.workers.reward_manager` (`register`, `AbstractRewardManager`) and `verl.utils.reward_score` are tiller's
stand-ins unless verl is installed. Numeric `reward_extra_info` values become per-sample extras (as a dict reward's
keys do); a manager that overrides `assemble_rm_scores` (token-level rewards from the reward loop) is refused.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import sys
import types
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tiller.errors import ConfigError, UserError
from tiller.rewards.managers import ScoreBatch, unpack
from tiller.rewards.registry import default_compute_score
from tiller.rewards.types import RewardRequest
from tiller.config.verl_view import verl_config
from tiller.stand_ins import installed, package, verl_installed


# ------------------------------------------------------------------------------------ DataProto stand-in
class TensorBatch(dict):
    """The part of `tensordict.TensorDict` managers use: tensors by key, `batch_size`, row indexing."""

    def __init__(self, tensors: dict[str, torch.Tensor], batch_size: int | tuple = ()):
        super().__init__(tensors)
        self.batch_size = torch.Size([batch_size] if isinstance(batch_size, int) else batch_size)

    def __getitem__(self, key):
        if isinstance(key, str):
            return dict.__getitem__(self, key)
        rows = {k: v[key] for k, v in self.items()}
        size = len(range(*key.indices(self.batch_size[0]))) if isinstance(key, slice) else ()
        return TensorBatch(rows, size)


class DataProtoItem:
    """One row of a `DataProto` (verl's `DataProtoItem`)."""

    def __init__(self, batch: TensorBatch, non_tensor_batch: dict, meta_info: dict):
        self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch, meta_info


class DataProto:
    """verl's `DataProto` as reward managers read it: `batch` (tensors [B, ...]), `non_tensor_batch` (numpy object
    arrays [B]), `meta_info`; `len`, `data[i]` (a `DataProtoItem`), `data[i:j]`."""

    def __init__(self, batch: TensorBatch | None = None, non_tensor_batch: dict | None = None,
                 meta_info: dict | None = None):
        self.batch = batch if batch is not None else TensorBatch({}, 0)
        self.non_tensor_batch = dict(non_tensor_batch or {})
        self.meta_info = dict(meta_info or {})

    def __len__(self) -> int:
        if self.batch.batch_size:
            return int(self.batch.batch_size[0])
        return len(next(iter(self.non_tensor_batch.values()))) if self.non_tensor_batch else 0

    def __getitem__(self, item):
        if isinstance(item, slice):
            return DataProto(self.batch[item], {k: v[item] for k, v in self.non_tensor_batch.items()},
                             self.meta_info)
        if isinstance(item, (int, np.integer)):
            return DataProtoItem(self.batch[int(item)], {k: v[int(item)] for k, v in self.non_tensor_batch.items()},
                                 self.meta_info)
        raise TypeError(f"DataProto indices are ints or slices, got {type(item).__name__}")

    @classmethod
    def from_dict(cls, tensors: dict | None = None, non_tensors: dict | None = None, meta_info: dict | None = None):
        tensors = dict(tensors or {})
        size = len(next(iter(tensors.values()))) if tensors else 0
        return cls(TensorBatch(tensors, size), {k: np.asarray(v, dtype=object) for k, v in (non_tensors or {}).items()},
                   meta_info)


# ------------------------------------------------------------------------------------ the two manager APIs
class RewardManagerBase(ABC):
    """verl 0.10's `verl.experimental.reward_loop.reward_manager.base.RewardManagerBase`."""

    _class_initialized = False

    def __init__(self, config: Any, tokenizer: Any, compute_score: Callable | None):
        self.config = config
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.loop = _event_loop()
        self.init_class(config, tokenizer)

    @classmethod
    def init_class(cls, config: Any, tokenizer: Any) -> None:
        if cls._class_initialized:
            return
        cls._class_initialized = True

    @abstractmethod
    async def run_single(self, data: DataProto):
        raise NotImplementedError

    @classmethod
    def assemble_rm_scores(cls, data: DataProto, scores: list[float]) -> torch.Tensor:
        prompt_length = data.batch["prompts"].size(1)
        valid = data.batch["attention_mask"][:, prompt_length:].sum(dim=1)
        rm_scores = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        rm_scores[torch.arange(rm_scores.size(0)), valid - 1] = rm_scores.new_tensor(scores)
        return rm_scores


class AbstractRewardManager(ABC):
    """verl's older `verl.workers.reward_manager.abstract.AbstractRewardManager` (`__call__` over the batch)."""

    @abstractmethod
    def __init__(self, tokenizer: Any, num_examine: int, compute_score: Callable | None,
                 reward_fn_key: str = "data_source", **kwargs: Any):
        pass

    @abstractmethod
    def __call__(self, data: DataProto, return_dict: bool = False):
        pass

    def _extract_reward_from_rm_scores(self, data: DataProto, return_dict: bool = False):
        if "rm_scores" not in data.batch:
            return None
        if return_dict:
            keys = data.meta_info.get("reward_extra_keys", [])
            return {"reward_tensor": data.batch["rm_scores"],
                    "reward_extra_info": {k: data.non_tensor_batch[k] for k in keys}}
        return data.batch["rm_scores"]


def _event_loop() -> asyncio.AbstractEventLoop:
    """verl's `get_event_loop()`: the running loop, else the thread's (a new one when it has none)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    try:
        return asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


def _registry() -> tuple[dict, Callable, Callable]:
    table: dict[str, type] = {}

    def register(name: str):
        def decorator(cls: type) -> type:
            table[name] = cls
            return cls
        return decorator

    def get_reward_manager_cls(name: str) -> type:
        if name not in table:
            raise ValueError(f"Unknown reward manager: {name}")
        return table[name]

    return table, register, get_reward_manager_cls


def stand_in_modules() -> dict[str, types.ModuleType]:
    """verl's modules a reward-manager file imports, as tiller's stand-ins (see the module docstring)."""
    names = ("verl.utils.reward_score", "verl.protocol", "verl.experimental", "verl.experimental.reward_loop",
             "verl.experimental.reward_loop.reward_manager", "verl.experimental.reward_loop.reward_manager.base",
             "verl.experimental.reward_loop.reward_manager.registry", "verl.workers", "verl.workers.reward_manager",
             "verl.workers.reward_manager.abstract", "verl.workers.reward_manager.registry", "verl.utils.ray_utils")
    modules = {n: types.ModuleType(n) for n in names}
    modules["verl"], modules["verl.utils"] = package("verl"), package("verl.utils")
    modules["verl"].DataProto, modules["verl"].DataProtoItem = DataProto, DataProtoItem
    modules["verl.utils.reward_score"].default_compute_score = default_compute_score
    for n in ("verl.experimental", "verl.experimental.reward_loop", "verl.experimental.reward_loop.reward_manager",
              "verl.workers", "verl.workers.reward_manager"):
        modules[n].__path__ = []
    modules["verl.protocol"].DataProto, modules["verl.protocol"].DataProtoItem = DataProto, DataProtoItem
    for pkg, base, abstract in (("verl.experimental.reward_loop.reward_manager", RewardManagerBase, "base"),
                                ("verl.workers.reward_manager", AbstractRewardManager, "abstract")):
        _, register, get_cls = _registry()
        for name in (pkg, f"{pkg}.registry"):
            modules[name].register, modules[name].get_reward_manager_cls = register, get_cls
        setattr(modules[f"{pkg}.{abstract}"], base.__name__, base)
        setattr(modules[pkg], base.__name__, base)
    modules["verl.utils.ray_utils"].get_event_loop = _event_loop
    return modules


# ------------------------------------------------------------------------------------ loading and scoring
def load_manager_class(path: str, name: str, key: str) -> type:
    """The class `name` of the reward-manager file at `path`; ConfigError naming `key` otherwise."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{key}={path}: no such file")
    module_name = "tiller_reward_manager_" + str(file.resolve()).replace("/", "_").replace(".", "_")
    with installed(stand_in_modules(), skip=verl_installed()):
        try:
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - the user's file: named
            raise ConfigError(f"{key}={path}: cannot import it: {type(err).__name__}: {err}") from err
    cls = getattr(module, name or "", None)
    if not isinstance(cls, type):
        raise ConfigError(f"{key}={path}: no class named {name!r} (reward.reward_manager.name)")
    if not (callable(getattr(cls, "run_single", None)) or callable(getattr(cls, "__call__", None))):
        raise ConfigError(f"{key}={path}: {name} is not a reward manager (run_single or __call__)")
    assemble = getattr(cls, "assemble_rm_scores", None)
    if assemble is not None and getattr(assemble, "__func__", None) is not RewardManagerBase.assemble_rm_scores.__func__:
        raise ConfigError(f"{key}={path}: {name} overrides assemble_rm_scores (token-level rewards); tiller gives each "
                          "sample one reward at its last token")
    return cls


class VerlRewardManager:
    """A verl reward-manager class as tiller's scorer: `score(requests) -> ScoreBatch`."""

    def __init__(self, cls: type, config: Any, tokenizer: Any, compute_score: Callable | None,
                 reward_fn_key: str = "data_source", reward_kwargs: dict | None = None):
        self.tokenizer, self.pad_id = tokenizer, int(tokenizer.pad_token_id or 0)
        self.per_sample = callable(getattr(cls, "run_single", None)) and not issubclass(cls, AbstractRewardManager)
        try:
            if self.per_sample:
                self.manager = cls(config=config, tokenizer=tokenizer, compute_score=compute_score)
            else:
                self.manager = cls(tokenizer=tokenizer, num_examine=0, compute_score=compute_score,
                                   reward_fn_key=reward_fn_key, **(reward_kwargs or {}))
        except Exception as err:  # noqa: BLE001 - the user's class: named
            raise UserError(f"reward manager {cls.__name__}: its constructor raised {type(err).__name__}: {err}") \
                from err
        self.name = cls.__name__

    def score(self, requests: list[RewardRequest]) -> ScoreBatch:
        data = self._data(requests)
        try:
            outputs = asyncio.run(self._per_sample(data)) if self.per_sample else self._batched(data)
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - the user's manager: named
            raise UserError(f"reward manager {self.name} raised {type(err).__name__}: {err}") from err
        return _collect(outputs, self.name)

    async def _per_sample(self, data: DataProto) -> list[dict]:
        self.manager.loop = asyncio.get_running_loop()  # (verl's worker loop: the one run_single awaits on)
        return list(await asyncio.gather(*(self.manager.run_single(data[i:i + 1]) for i in range(len(data)))))

    def _batched(self, data: DataProto) -> list[dict]:
        out = self.manager(data, return_dict=True)
        tensor, info = (out["reward_tensor"], out.get("reward_extra_info", {})) if isinstance(out, dict) else (out, {})
        totals = torch.as_tensor(tensor).float().sum(-1).tolist()
        return [{"reward_score": t, "reward_extra_info": {k: v[i] for k, v in info.items()
                                                           if hasattr(v, "__len__") and len(v) == len(totals)}}
                for i, t in enumerate(totals)]

    def _data(self, requests: list[RewardRequest]) -> DataProto:
        def ids(given: list[int] | None, text: str) -> list[int]:  # (tiller eval's samples carry text only)
            return list(given) if given is not None else self.tokenizer(text, add_special_tokens=False)["input_ids"]

        prompts = [ids(r.prompt_ids, r.prompt) for r in requests]
        responses = [ids(r.response_ids, r.response) for r in requests]
        p_width, r_width = max(map(len, prompts), default=0), max(map(len, responses), default=0)
        n = len(requests)
        prompt_t = torch.full((n, p_width), self.pad_id, dtype=torch.long)
        resp_t = torch.full((n, r_width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(n, p_width + r_width, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if p:
                prompt_t[i, p_width - len(p):] = torch.tensor(p)
            resp_t[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, p_width - len(p):p_width + len(r)] = 1
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        tensors = {"prompts": prompt_t, "responses": resp_t, "input_ids": torch.cat([prompt_t, resp_t], 1),
                   "attention_mask": mask, "position_ids": position}
        non_tensors = {"data_source": [r.data_source for r in requests],
                       "reward_model": [{"ground_truth": r.ground_truth, "style": "rule"} for r in requests],
                       "extra_info": [dict(r.extra_info or {}) for r in requests],
                       "uid": [r.group for r in requests]}
        return DataProto.from_dict(tensors, non_tensors)


def _scalar(value: Any) -> Any:
    """A one-element tensor as its Python number (verl's managers compute some values as tensors)."""
    return value.item() if torch.is_tensor(value) and value.numel() == 1 else value


def _collect(outputs: list[dict], name: str) -> ScoreBatch:
    scores, extras = np.zeros(len(outputs), dtype=np.float32), {}
    for i, out in enumerate(outputs):
        if not isinstance(out, dict) or "reward_score" not in out:
            raise UserError(f"reward manager {name}: run_single returned {type(out).__name__}, not a dict with "
                            "reward_score")
        score, _, bad = unpack(_scalar(out["reward_score"]))
        if bad:
            raise UserError(f"reward manager {name}: sample {i}'s reward_score {out['reward_score']!r} is not a "
                            "finite number")
        scores[i] = score
        for key, value in (out.get("reward_extra_info") or {}).items():
            value = _scalar(value)
            if isinstance(value, (bool, int, float, np.number)) and not isinstance(value, str):
                extras.setdefault(key, np.full(len(outputs), np.nan))[i] = float(value)
    return ScoreBatch(scores=scores, extras={k: v.astype(np.float32) for k, v in extras.items()})


def reward_manager_spec(cfg: Any) -> tuple[str, str, str] | None:
    """(file or module, class name, the key naming it) of a custom verl reward manager, or None for the built-in ones:
    verl 0.10's reward.reward_manager.source=importlib with module.path (the class: reward.reward_manager.name, which
    tiller keeps as reward_model.reward_manager), verl 0.7's top-level reward_manager.* alike, or verl 0.9's
    reward_model.reward_loop_source / reward_loop_module_path / reward_loop_class_name."""
    found = []
    sections = (("reward.reward_manager", cfg.reward.reward_manager.source, cfg.reward.reward_manager.module),
                ("reward_manager", cfg.reward_manager.source, cfg.reward_manager.module))
    for key, source, module in sections:
        path = (module or {}).get("path")
        if source not in ("register", "importlib"):
            raise ConfigError(f"{key}.source must be register or importlib, got {source!r}")
        if source == "importlib" or path:
            if source != "importlib" or not path:
                raise ConfigError(f"{key}: a custom reward manager needs source=importlib and module.path (the file "
                                  f"defining the class named by {key}.name), got source={source!r}, "
                                  f"module.path={path!r}")
            found.append((str(path), str(cfg.reward_model.reward_manager), f"{key}.module.path"))
    rm = cfg.reward_model
    if rm.reward_loop_source not in (None, "register", "importlib"):
        raise ConfigError(f"reward_model.reward_loop_source must be register or importlib, got {rm.reward_loop_source!r}")
    if rm.reward_loop_source == "importlib" or rm.reward_loop_module_path:
        if rm.reward_loop_source != "importlib" or not rm.reward_loop_module_path or not rm.reward_loop_class_name:
            raise ConfigError("reward_model.reward_loop_source=importlib needs reward_model.reward_loop_module_path and "
                              "reward_model.reward_loop_class_name")
        found.append((rm.reward_loop_module_path, rm.reward_loop_class_name, "reward_model.reward_loop_module_path"))
    if len(found) > 1:
        raise ConfigError(f"{found[0][2]} and {found[1][2]} both name a custom reward manager: set one")
    if found and (rm.enable or rm.remote_url):
        raise ConfigError(f"{found[0][2]}: a custom reward manager scores the samples; reward_model.enable / "
                          "remote_url name another scorer: keep one")
    return found[0] if found else None


def build_verl_manager(cfg: Any, spec: tuple[str, str, str], tokenizer: Any, compute_score: Callable | None):
    """The `VerlRewardManager` of a custom manager `spec` = (file, class name, config key naming the file)."""
    path, name, key = spec
    cls = load_manager_class(path, name, key)
    return VerlRewardManager(cls, verl_config(cfg), tokenizer, compute_score or default_compute_score,
                             reward_fn_key=cfg.data.reward_fn_key, reward_kwargs=dict(cfg.reward_model.reward_kwargs))


def bound_compute_score(fn: Callable, reward_kwargs: dict) -> Callable:
    """verl's custom reward function with custom_reward_function.reward_kwargs bound (sync or async)."""
    if not reward_kwargs:
        return fn
    if inspect.iscoroutinefunction(fn):
        async def call(*args, **kwargs):
            return await fn(*args, **{**kwargs, **reward_kwargs})
        return call
    return functools.partial(fn, **reward_kwargs)
