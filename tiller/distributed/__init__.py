"""Worker groups: ``world_size`` copies of one plain worker class, in-process or as Ray actors.

The driver never talks to a worker object directly; it calls ``group.execute(method, ...)`` with a
dispatch mode (`tiller.distributed.dispatch`). With ``backend="local"`` the worker is an ordinary
object in the driver process (one rank, breakpoints work); with ``backend="ray"`` each rank is a
Ray actor placed in a placement group, and the ranks form a torch.distributed process group
(gloo on CPU, NCCL on GPU) before the worker is constructed, so the worker code is the same in
both cases (verl's "single controller" design, HybridFlow, Sheng et al. 2024, arXiv:2409.19256).

``import tiller.distributed`` does not import Ray; the Ray backend is loaded when first used.
"""

from __future__ import annotations

from typing import Any, Protocol

from tiller.distributed.dispatch import DISPATCH_MODES, check_mode, merge_dp, split_dp, WorkerError
from tiller.errors import ConfigError, UserError

BACKENDS = ("local", "ray")


class WorkerGroup(Protocol):
    name: str
    world_size: int

    def execute(self, method: str, *args, dispatch: str = "broadcast", replicas: int = 1, **kwargs) -> Any: ...

    def shutdown(self) -> None: ...


class LocalWorkerGroup:
    """One in-process worker: `execute` calls the method directly (no copies, no pickling)."""

    def __init__(self, worker_cls: type, init_kwargs: dict, *, name: str = "actor"):
        self.name, self.world_size = name, 1
        self.worker = worker_cls(**init_kwargs)

    def execute(self, method: str, *args, dispatch: str = "broadcast", replicas: int = 1, **kwargs) -> Any:
        check_mode(dispatch)
        fn = getattr(self.worker, method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"worker group {self.name!r}: {type(self.worker).__name__} has no method {method!r}")
        if dispatch in ("dp", "dp_parts"):
            per_rank, pad, padded_len = split_dp(args, 1, replicas)
            result = fn(*per_rank[0], **kwargs)
            return [result] if dispatch == "dp_parts" else merge_dp([result], pad, padded_len)
        result = fn(*args, **kwargs)
        return [result] if dispatch == "all" else result

    def shutdown(self) -> None:
        self.worker = None


def create_worker_group(worker_cls: type, init_kwargs: dict | None = None, *, backend: str = "local",
                        world_size: int = 1, cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                        name: str = "actor", ray_address: str | None = None,
                        colocate_with: WorkerGroup | None = None, **ray_options) -> WorkerGroup:
    """`world_size` ranks of `worker_cls(**init_kwargs)` (see docs/internals.md, tiller.distributed).

    backend "local" runs one rank in this process (world_size must be 1). backend "ray" starts
    (or joins, with `ray_address`) a Ray cluster, reserves a placement group of `world_size` bundles
    of `cpus_per_worker` CPUs and `gpus_per_worker` GPUs (or shares `colocate_with`'s bundles) and
    starts one actor per bundle; torch inside each actor uses `cpus_per_worker` threads.
    """
    init_kwargs = dict(init_kwargs or {})
    if backend not in BACKENDS:
        raise ConfigError(f"trainer.backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"worker group {name!r}: world_size must be a positive integer, got {world_size!r}")
    if backend == "local":
        if world_size != 1:
            raise ConfigError(f"worker group {name!r}: trainer.backend=local runs one process, got world size "
                              f"{world_size} (trainer.nnodes x trainer.n_gpus_per_node); use trainer.backend=ray")
        return LocalWorkerGroup(worker_cls, init_kwargs, name=name)
    try:
        # optional dependency: tiller.distributed.ray_group imports ray at its top
        from tiller.distributed.ray_group import RayWorkerGroup
    except ImportError as err:
        raise UserError("trainer.backend=ray needs Ray: pip install 'tiller[ray]' "
                        f"(import failed: {err})") from err
    return RayWorkerGroup(worker_cls, init_kwargs, world_size=world_size, cpus_per_worker=cpus_per_worker,
                          gpus_per_worker=gpus_per_worker, name=name, ray_address=ray_address,
                          colocate_with=colocate_with, **ray_options)


__all__ = ["BACKENDS", "DISPATCH_MODES", "LocalWorkerGroup", "WorkerError", "WorkerGroup", "create_worker_group"]
