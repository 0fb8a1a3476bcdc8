"""What a worker sees of its group: rank, world size, collectives, model wrapping (DDP / FSDP2).

Every function here is the identity (rank 0 of 1, no communication, model unchanged) when
torch.distributed is not initialised, so a worker written against this module runs unchanged in one
process (``backend=local``, breakpoints work) and as one rank of a Ray group (``backend=ray``).

Gradient convention (deviation from torch's defaults): tiller normalises losses by *global* token
or sequence counts (``all_reduce_sum`` of the local counts), so the per-rank loss is already this
rank's share of the global loss and the global gradient is the **sum** of the rank gradients.
``wrap_model`` therefore configures DDP and FSDP2 to sum gradients instead of averaging them
(torch's default divides by the world size). This is what makes "2 ranks x B/2 == 1 process x B"
hold exactly, as in verl's global-token normalisation.

FSDP2 is ``torch.distributed.fsdp.fully_shard`` (per-parameter DTensor sharding, PyTorch >= 2.6):
each decoder layer (found via the Hugging Face ``_no_split_modules`` class names) is sharded, then
the root, so only one layer's full parameters are materialised at a time. bf16 mixed precision
uses ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: parameters, optimizer state and
gradient reduction stay fp32.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

from tiller import hostinfo
from tiller.errors import ConfigError
from tiller.models.compile import layer_classes

STRATEGIES = ("none", "ddp", "fsdp")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


_position: tuple[int, int] | None = None  # (rank, size) in a worker group whose ranks share no process group


def set_group_position(rank: int, size: int) -> None:
    """This process is rank `rank` of a group of `size` workers that do not form a process group (a Ray
    rollout pool: each worker generates on its own): `group_rank` / `group_size` report it."""
    global _position
    _position = (int(rank), int(size))


def group_rank() -> int:
    """This worker's place in its worker group, with or without a process group (seeds and numbering)."""
    return dist.get_rank() if _initialized() else (_position[0] if _position else 0)


def group_size() -> int:
    """The size of this worker's group, with or without a process group."""
    return dist.get_world_size() if _initialized() else (_position[1] if _position else 1)


def rank() -> int:
    """This process's rank in its worker group (0 when not distributed)."""
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """Number of ranks in this worker group (1 when not distributed)."""
    return dist.get_world_size() if _initialized() else 1


def is_distributed() -> bool:
    """True when torch.distributed is initialised with more than one rank."""
    return _initialized() and dist.get_world_size() > 1


def _comm_device() -> torch.device:
    """Device tensors must be on for collectives: CUDA for NCCL, CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_DATA_GROUP = None  # set_data_group: the ranks whose rows differ (None: all of them)


def set_data_group(group) -> None:
    """Make `all_reduce_sum` sum over `group` only: the data-parallel ranks when groups of ranks hold copies of the
    same rows (sequence parallelism, `tiller.workers.ulysses`); None restores the whole world."""
    global _DATA_GROUP
    _DATA_GROUP = group


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over the data-parallel ranks: all ranks, or the data group (`set_data_group`), whose rows are
    all the rows once (a new tensor, on `t`'s device); `t` itself when not distributed.

    Use it for global counts: ``global_tokens = all_reduce_sum(response_mask.sum())``.
    Not differentiable (the result is detached).
    """
    if not is_distributed():
        return t
    out = t.detach().to(_comm_device(), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_DATA_GROUP)
    return out.to(t.device)


def all_gather_object(obj) -> list:
    """`[obj of rank 0, obj of rank 1, ...]` (picklable objects); `[obj]` when not distributed."""
    if not is_distributed():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (no-op when not distributed)."""
    if is_distributed():
        dist.barrier()


def init_distributed(rank_: int, world_size_: int, master_addr: str, master_port: int, *,
                     backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Join the group's process group (called by the worker host before the worker is built).

    `backend` defaults to NCCL when CUDA is available, else gloo. MASTER_ADDR / MASTER_PORT,
    RANK, WORLD_SIZE and LOCAL_RANK are also exported so libraries that read them agree.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank_),
                      WORLD_SIZE=str(world_size_), LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank_,
                            world_size=world_size_, timeout=datetime.timedelta(seconds=timeout_s))


def agree_bf16_decision() -> None:
    """Every rank of a gloo (CPU) group takes rank 0's CPU bf16 decision (`tiller.hostinfo.adopt_bf16_decision`:
    ranks that time bf16 alone can disagree). Collective: every rank calls it; a no-op off gloo or alone."""
    if not is_distributed() or dist.get_backend() != "gloo":
        return
    box = [hostinfo.bf16_decision() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    hostinfo.adopt_bf16_decision(box[0])


def destroy_distributed() -> None:
    set_data_group(None)
    if _initialized():
        dist.destroy_process_group()


def _sum_allreduce_hook(process_group, bucket):
    """DDP comm hook: all-reduce SUM (torch's default hook divides by the world size)."""
    group = process_group if process_group is not None else dist.group.WORLD
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap_model(model: nn.Module, strategy: str = "fsdp", param_dtype: torch.dtype | None = None) -> nn.Module:
    """Data-parallel wrapper for training: "fsdp" (FSDP2 `fully_shard`), "ddp", or "none".

    Gradients are summed over ranks (see the module docstring). `param_dtype` (e.g. torch.bfloat16)
    is FSDP2's compute dtype for parameters; reductions stay fp32. When not distributed, or with
    strategy "none", the model is returned unchanged. Build the optimizer *after* wrapping (FSDP2
    replaces parameters by sharded DTensors).
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"parallel strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if strategy == "none" or not is_distributed():
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.cuda.current_device()] if dist.get_backend() == "nccl" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        ddp.register_comm_hook(None, _sum_allreduce_hook)
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    blocks = layer_classes(model)  # the repeated blocks, sharded one by one
    if blocks:
        for module in model.modules():
            if isinstance(module, blocks):
                fully_shard(module, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):  # every fully_shard-ed module
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduces gradients over ranks; call it before each micro-batch's
    forward with ``enabled = is_last_micro_batch``. Needed for DDP, whose every backward all-reduces
    the accumulated gradient (earlier micro-batches would be counted again); for FSDP2 it only saves
    communication (it accumulates reduced shards correctly either way). No-op otherwise."""
    if type(model).__name__ == "DistributedDataParallel":
        model.require_backward_grad_sync = enabled  # what DDP.no_sync() toggles
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 shards in place, so its model is the module)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on the CPU, on every rank; keys as in the unwrapped model.

    Collective under FSDP2 (every rank must call it). When not distributed the tensors are the
    model's own (detached, moved to the CPU if needed), so copy them before the next update if
    you keep them.
    """
    model = unwrap_model(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):  # DTensor (FSDP2 shard): all-gather the full tensor
            value = value.full_tensor()
        out[key] = value.detach().cpu()
    return out


def is_sharded(model: nn.Module) -> bool:
    """True when some parameter is an FSDP2 shard (a DTensor)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (every rank holds it) into `model`, sharded (FSDP2) or not."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    else:
        unwrap_model(model).load_state_dict(state)


class FullOptimizerState:
    """An FSDP2 optimizer's state in unsharded form, behind `state_dict()` / `load_state_dict()`.

    ``gather()`` is collective (every rank calls it); afterwards ``state_dict()`` returns the gathered
    dict without communicating, so rank 0 alone can hand this object to a checkpoint writer that calls
    ``optimizer.state_dict()``. ``load_state_dict(full)`` is collective too. Keys are parameter names
    (torch.distributed.checkpoint's format), not the integer ids of ``torch.optim``'s own state dict.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self._gathered: dict | None = None

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True)

    def gather(self) -> FullOptimizerState:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        gathered = get_optimizer_state_dict(self.model, self.optimizer, options=self._options())
        # un-sharded entries (Adam's `step`) come back as the live tensors: copy them, or the snapshot
        # would move on with the optimizer (and a loader would share them with it)
        live = {id(v) for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)}
        for state in gathered.get("state", {}).values():
            for key, value in state.items():
                if torch.is_tensor(value) and id(value) in live:
                    state[key] = value.clone()
        self._gathered = gathered
        return self

    def state_dict(self) -> dict:
        if self._gathered is None:
            raise RuntimeError("FullOptimizerState.state_dict(): call gather() on every rank first")
        return self._gathered

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state, options=self._options())


def checkpointable_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer):
    """What to hand a checkpoint writer/reader as "the optimizer": the optimizer itself, or for an
    FSDP2 model a gathered `FullOptimizerState` (collective: call on every rank)."""
    return FullOptimizerState(model, optimizer).gather() if is_sharded(model) else optimizer
