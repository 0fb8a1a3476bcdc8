"""Ray backend: a worker group is `world_size` Ray actors in a placement group, one torch process group.

Resource pool: a placement group of `world_size` bundles ``{"CPU": cpus_per_worker, "GPU":
gpus_per_worker}`` (strategy PACK: as few nodes as possible). Rank r's actor is pinned to bundle r.
Each actor asks for ``1 / MAX_COLOCATE`` of its bundle, so up to MAX_COLOCATE groups can share one
pool ("colocated" placement, e.g. actor and critic on the same GPUs, as verl's hybrid engine does);
a group created without `colocate_with` gets its own pool ("split" placement).

Start-up: rank 0 reports its node IP and a free port; every rank then joins
``torch.distributed`` (gloo on CPU, NCCL with GPUs) and constructs the worker, so
``worker_cls.__init__`` can already wrap its model with FSDP2. torch in each actor uses
`cpus_per_worker` threads, and the driver's CPU bf16 decision (`tiller.hostinfo`), not a timing of its own.

A group made with ``process_group=False`` (asynchronous RL's rollout pool) joins no process group: each rank
only knows its place (`context.group_rank`), for seeding. `execute_ref` returns rank 0's result as an object
reference rank 0 stored itself; passed to another group's `execute`, each of its ranks fetches it (the trainer's
weights to the rollout pool, never through the driver).

Calls: arguments travel through Ray's object store (a `Batch` pickles its tensors as numpy, which Ray
stores out of band, zero-copy on read). Results are collected with ``ray.wait`` so the first failing
rank is seen at once even while its peers block in a collective; a dead actor becomes a
`WorkerError` naming group, rank, pid and node. After a death, or a failure that leaves ranks
hanging in a collective, the group is shut down (its process group is broken) and later calls raise.

Deviation from verl: no per-method ``@register`` decorators; the dispatch mode is chosen by the caller.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tiller import hostinfo
from tiller.distributed import context
from tiller.distributed.dispatch import check_mode, merge_dp, split_dp, WorkerError
from tiller.errors import ConfigError, UserError

MAX_COLOCATE = 4
"""At most this many worker groups share one resource pool (each actor takes 1/MAX_COLOCATE of a bundle)."""

FAILURE_GRACE_S = 3.0
"""After one rank fails, how long to wait for the others before naming the culprit."""


def ensure_ray(address: str | None = None) -> None:
    """Start a local Ray (address None) or join a cluster (``"auto"``, ``"ray://host:10001"``, ...)."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=True, ignore_reinit_error=True)
    except ConnectionError as err:
        raise ConfigError(f"trainer.ray_address={address!r}: cannot connect to a Ray cluster ({err})") from err


def _free() -> dict[str, float]:
    return {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}


class ResourcePool:
    """A placement group of `world_size` bundles that one or more worker groups share."""

    def __init__(self, world_size: int, cpus_per_worker: float, gpus_per_worker: float, *,
                 strategy: str = "PACK", timeout_s: float = 300.0, name: str = "actor"):
        self.world_size, self.cpus, self.gpus = world_size, cpus_per_worker, gpus_per_worker
        self.users = 0
        bundle = {"CPU": float(cpus_per_worker)}
        if gpus_per_worker:
            bundle["GPU"] = float(gpus_per_worker)
        total = ray.cluster_resources()
        for key, per in bundle.items():
            if per * world_size > total.get(key, 0):
                raise ConfigError(
                    f"worker group {name!r} needs {per * world_size:g} {key} ({world_size} workers x {per:g}; "
                    f"trainer.nnodes x trainer.n_gpus_per_node, trainer.cpus_per_worker) but the Ray cluster "
                    f"has {total.get(key, 0):g}")
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise ConfigError(f"worker group {name!r}: no room for {world_size} x {bundle} within {timeout_s:g} s "
                              f"(free: {_free()}); other groups may hold the resources")

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0 and self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


class _WorkerHost:
    """The Ray actor around one rank: joins torch.distributed, builds the worker, runs its methods."""

    def __init__(self, threads: int, bf16: hostinfo.Bf16Decision):
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        hostinfo.adopt_bf16_decision(bf16)  # the driver's: every process of the run computes in one dtype
        self.worker = None

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, worker_cls: type, init_kwargs: dict, rank: int, world_size: int, master: tuple[str, int] | None,
              backend: str, timeout_s: float) -> tuple[int, str]:
        if master is None:  # independent workers (a rollout pool): a place in the group, no process group
            context.set_group_position(rank, world_size)
        elif world_size > 1:
            context.init_distributed(rank, world_size, master[0], master[1], backend=backend, timeout_s=timeout_s)
        self.worker = worker_cls(**init_kwargs)
        return os.getpid(), ray.util.get_node_ip_address()

    def peak_rss_mb(self) -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB

    def execute(self, method: str, args: tuple, kwargs: dict) -> Any:
        fn = getattr(self.worker, method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"{type(self.worker).__name__} has no method {method!r}")
        # an argument passed by reference (`execute_ref`'s result) is fetched here: workers never see Ray objects
        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        return fn(*args, **kwargs)

    def execute_put(self, method: str, args: tuple, kwargs: dict) -> Any:
        """`execute`, the result put in Ray's object store by this process (its reference returned)."""
        result = self.execute(method, args, kwargs)
        return ray.put(result) if result is not None else None


class _Board:
    """The Ray actor behind `WeightBoard`: the newest published (version, [weights reference]) and a stop flag."""

    def __init__(self):
        self.version, self.refs, self.stopped = -1, [], False

    def publish(self, version: int, refs: list) -> None:
        if version > self.version:
            self.version, self.refs = version, refs

    def stop(self) -> None:
        self.stopped = True

    def latest(self) -> tuple[int, list, bool]:
        return self.version, self.refs, self.stopped


class WeightBoard:
    """Where a rollout pool's workers find the trainer's newest weights while they generate (asynchronous RL's
    partial rollouts on Ray: a worker cannot take a call while it generates, so it asks between decode steps, at most
    every `poll_s` seconds). Picklable: it travels to the workers in the prompts' meta. The weights stay a reference
    into Ray's object store (`RayWorkerGroup.execute_ref`); a worker fetches them only when it has an older version."""

    poll_s = 0.05

    def __init__(self):
        self._actor = ray.remote(_Board).options(num_cpus=0).remote()

    def publish(self, version: int, ref) -> None:
        """Make `ref` (weights of `version`) the newest (in a list: Ray would fetch a reference passed bare)."""
        ray.get(self._actor.publish.remote(version, [ref]))

    def stop(self) -> None:
        """Workers asking from now on learn that the trainer stopped (they abandon their generation)."""
        ray.get(self._actor.stop.remote())

    def latest(self, step: int | None = None) -> tuple[int, Any, bool]:
        """(newest version, its weights reference or None, stopped); `step`: the step the asking generation is
        for (unused here; a test board may pace a given step's generation with it)."""
        version, refs, stopped = ray.get(self._actor.latest.remote())
        return version, (refs[0] if refs else None), stopped

    @staticmethod
    def fetch(ref) -> Any:
        return ray.get(ref)

    def close(self) -> None:
        ray.kill(self._actor, no_restart=True)


class RayWorkerGroup:
    """`world_size` ranks of one worker class as Ray actors (see the module docstring)."""

    def __init__(self, worker_cls: type, init_kwargs: dict, *, world_size: int, cpus_per_worker: float = 1,
                 gpus_per_worker: float = 0, name: str = "actor", ray_address: str | None = None,
                 colocate_with: RayWorkerGroup | None = None, collective_timeout_s: float = 600.0,
                 placement_timeout_s: float = 300.0, process_group: bool = True):
        self.name, self.world_size = name, world_size
        self._actors: list = []
        self._pool: ResourcePool | None = None
        ensure_ray(ray_address)
        if colocate_with is not None:
            pool = colocate_with._pool
            if not isinstance(colocate_with, RayWorkerGroup) or pool is None or pool.pg is None:
                raise ConfigError(f"worker group {name!r}: colocate_with must be a live Ray worker group")
            if pool.world_size != world_size:
                raise ConfigError(f"worker group {name!r}: cannot colocate {world_size} workers with group "
                                  f"{colocate_with.name!r} of {pool.world_size}")
            if pool.users >= MAX_COLOCATE:
                raise ConfigError(f"worker group {name!r}: at most {MAX_COLOCATE} groups share one resource pool")
        else:
            pool = ResourcePool(world_size, cpus_per_worker, gpus_per_worker, timeout_s=placement_timeout_s, name=name)
        pool.users += 1
        self._pool = pool
        threads = max(1, int(pool.cpus))
        host_cls = ray.remote(_WorkerHost)
        bf16 = hostinfo.bf16_decision()
        for rank in range(world_size):
            options = {"num_cpus": pool.cpus / MAX_COLOCATE, "max_restarts": 0, "max_concurrency": 1,
                       "scheduling_strategy": PlacementGroupSchedulingStrategy(pool.pg, placement_group_bundle_index=rank)}
            if pool.gpus:
                options["num_gpus"] = pool.gpus / MAX_COLOCATE
            self._actors.append(host_cls.options(**options).remote(threads, bf16))
        self._where = [f"rank {r}" for r in range(world_size)]
        try:
            master = ray.get(self._actors[0].address.remote()) if process_group else None
            backend = "nccl" if pool.gpus else "gloo"
            refs = [a.start.remote(worker_cls, init_kwargs, r, world_size, master, backend, collective_timeout_s)
                    for r, a in enumerate(self._actors)]
            started = self._gather(refs, list(range(world_size)), "__init__")
        except BaseException:
            self.shutdown()
            raise
        self.pids = [pid for pid, _ in started]
        self.nodes = [node for _, node in started]
        self._where = [f"pid {pid} on {node}" for pid, node in started]

    # ---- calls ----------------------------------------------------------------------------------
    def execute(self, method: str, *args, dispatch: str = "broadcast", replicas: int = 1, **kwargs) -> Any:
        """Run `method` on the ranks as `dispatch` says (`tiller.distributed.dispatch`); `replicas`: with "dp" /
        "dp_parts", groups of that many consecutive ranks get the same rows (sequence parallelism)."""
        check_mode(dispatch)
        if not self._actors:
            raise WorkerError(f"worker group {self.name!r} is shut down (after an earlier failure?); "
                              f"cannot call {method!r}", group=self.name, rank=-1, method=method)
        if dispatch in ("dp", "dp_parts"):
            per_rank, pad, padded_len = split_dp(args, self.world_size, replicas)
            kw = ray.put(kwargs)
            shared = [ray.put(per_rank[r]) for r in range(0, self.world_size, replicas)]
            refs = [a.execute.remote(method, shared[r // replicas], kw) for r, a in enumerate(self._actors)]
            results = self._gather(refs, list(range(self.world_size)), method)[::replicas]
            return results if dispatch == "dp_parts" else merge_dp(results, pad, padded_len)
        args_ref, kw = ray.put(args), ray.put(kwargs)
        if dispatch == "rank0":
            return self._gather([self._actors[0].execute.remote(method, args_ref, kw)], [0], method)[0]
        refs = [a.execute.remote(method, args_ref, kw) for a in self._actors]
        results = self._gather(refs, list(range(self.world_size)), method)
        return results if dispatch == "all" else results[0]

    def execute_ref(self, method: str, *args, **kwargs) -> Any:
        """Run `method` on every rank (a collective may be inside) and return rank 0's result as a Ray object
        reference, stored by rank 0 itself: it never passes through this process. Hand it to another group's
        `execute` and each of its ranks fetches it from the object store (a weight broadcast between pools)."""
        if not self._actors:
            raise WorkerError(f"worker group {self.name!r} is shut down (after an earlier failure?); "
                              f"cannot call {method!r}", group=self.name, rank=-1, method=method)
        args_ref, kw = ray.put(args), ray.put(kwargs)
        refs = [a.execute_put.remote(method, args_ref, kw) for a in self._actors]
        return self._gather(refs, list(range(self.world_size)), method)[0]

    def _gather(self, refs: list, ranks: list[int], method: str) -> list:
        """ray.get every ref; on the first failure, name the rank that caused it (a death first)."""
        results: list = [None] * len(refs)
        pending = {ref: i for i, ref in enumerate(refs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(ready[0])
            try:
                results[i] = ray.get(ready[0])
            except Exception as err:  # noqa: BLE001 - every Ray failure is reported with its rank
                self._raise_failure([(ranks[i], err)], pending, ranks, method)
        return results

    def _raise_failure(self, failures: list, pending: dict, ranks: list[int], method: str) -> None:
        deadline = time.monotonic() + FAILURE_GRACE_S
        while pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                i = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception as err:  # noqa: BLE001
                    failures.append((ranks[i], err))
        died = [(r, e) for r, e in failures if isinstance(e, ray.exceptions.RayActorError)]
        rank, err = min(died or failures, key=lambda f: f[0])
        if pending or died:  # a dead rank, or peers blocked in a collective with it: the group is unusable
            self.shutdown()
        cause = getattr(err, "cause", None)
        if isinstance(err, ray.exceptions.RayTaskError) and isinstance(cause, UserError):
            raise cause
        where = self._where[rank] if rank < len(self._where) else f"rank {rank}"
        if died:
            raise WorkerError(f"worker group {self.name!r} rank {rank} ({where}) died during {method!r}: "
                              f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                              group=self.name, rank=rank, method=method, died=True) from err
        raise WorkerError(f"worker group {self.name!r} rank {rank} ({where}) raised in {method!r}: "
                          f"{type(cause).__name__ if cause else type(err).__name__}: {cause or err}",
                          group=self.name, rank=rank, method=method) from err

    def peak_rss_mb(self) -> list[float]:
        """Peak resident memory of each rank's process, in MiB."""
        return ray.get([a.peak_rss_mb.remote() for a in self._actors])

    def shutdown(self) -> None:
        """Kill the actors and release the pool once no colocated group uses it."""
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._pool is not None:
            self._pool.release()
            self._pool = None
