"""Data parallelism for the offline jobs (`tiller sft|rm|dpo|kto`) under `torchrun --nproc_per_node N`.

    torchrun --nproc_per_node 2 -m tiller.cli sft model.partial_pretrain=... trainer.strategy=fsdp

Every rank reads the whole data set and computes the same step indices; the step's micro-batches (the ones one
process would build, so packing / KTO's mismatched pairs are unchanged) are dealt round-robin to the ranks, and a
rank with one fewer gets a copy of its first micro-batch with weight 0 (its forward / backward run, so FSDP2's
collectives stay paired, but it adds nothing). The step normaliser is computed over the whole step on every rank,
and `tiller.distributed.context.wrap_model` makes DDP / FSDP2 SUM gradients over ranks, so N ranks give the
one-process update (to float reduction order). Metric sums are all-reduced. Checkpoints and the exported model are
written by rank 0: under FSDP2 from an unsharded copy of the model filled by `full_state_dict` (collective),
with the optimizer state gathered by `checkpointable_optimizer`; a resume loads into the copy and scatters.

Outside torchrun (WORLD_SIZE unset or 1) `DataParallel.setup` returns a one-process object whose methods are
identities. LoRA with FSDP2 is refused (use trainer.strategy=ddp).

`ulysses_sequence_parallel_size` (`tiller sft`, verl's SFT key) > 1 under torchrun: groups of that many consecutive
ranks share each micro-batch, packed into one sequence and split over them (`tiller.workers.ulysses`); the
micro-batches are dealt to the groups, and the ranks' partial loss sums add up over the world as above.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
from typing import Any

import torch

from tiller.distributed import context as dist_ctx
from tiller.errors import ConfigError
from tiller.models.lora import is_lora
from tiller.workers.ulysses import check_heads, seq_parallel_groups

STRATEGIES = ("ddp", "fsdp")


class DataParallel:
    """The rank's view of a data-parallel offline job (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, strategy: str = "none", shadow: torch.nn.Module | None = None,
                 sp=None):
        self.model, self.strategy, self.shadow = model, strategy, shadow
        self.sp = sp  # Ulysses sequence parallelism (`tiller sft ulysses_sequence_parallel_size`): this rank's group

    @classmethod
    def setup(cls, cfg: Any, model: torch.nn.Module, device: torch.device) -> "DataParallel":
        """Join torchrun's process group (when WORLD_SIZE > 1) and wrap `model`; build the optimizer after."""
        sp_size = int(getattr(cfg, "ulysses_sequence_parallel_size", 1) or 1)
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            if sp_size > 1:
                print(f"tiller: ulysses_sequence_parallel_size={sp_size}: one process runs whole sequences (the same "
                      "update); under torchrun groups of that many ranks split each micro-batch", file=sys.stderr)
            return cls(model)
        strategy = cfg.trainer.strategy
        if strategy not in STRATEGIES:
            raise ConfigError(f"trainer.strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if strategy == "fsdp" and is_lora(model):
            raise ConfigError("LoRA with trainer.strategy=fsdp is not supported: use trainer.strategy=ddp")
        if not dist_ctx.is_distributed():
            backend = "nccl" if device.type == "cuda" else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
        dist_ctx.agree_bf16_decision()  # every rank computes in the dtype rank 0 chose
        shadow = copy.deepcopy(model) if strategy == "fsdp" else None  # unsharded copy for saving / export
        sp = None
        if sp_size > 1:
            check_heads(dist_ctx.unwrap_model(model).config, sp_size, key=f"ulysses_sequence_parallel_size={sp_size}")
            # the group's ranks run slices of the same micro-batches: their sums are partial, added over the world
            sp = seq_parallel_groups(sp_size, key="ulysses_sequence_parallel_size", data_group=False)
            if dist_ctx.rank() == 0:
                print(f"tiller: {dist_ctx.world_size()} ranks = {dist_ctx.world_size() // sp_size} data-parallel x "
                      f"{sp_size} sequence-parallel (ulysses_sequence_parallel_size)", file=sys.stderr)
        return cls(dist_ctx.wrap_model(model, strategy), strategy, shadow, sp)

    # ------------------------------------------------------------------------------------- data
    @property
    def rank(self) -> int:
        return dist_ctx.rank()

    @property
    def world(self) -> int:
        return dist_ctx.world_size()

    def shard(self, micros: list) -> tuple[list, list[float]]:
        """This rank's micro-batches (round-robin over the data-parallel replicas: the ranks, or their
        sequence-parallel groups, whose ranks share micro-batches) and their weights (0 for a padding copy)."""
        if self.world == 1:
            return micros, [1.0] * len(micros)
        size = self.sp.size if self.sp is not None else 1
        replica, replicas = self.rank // size, self.world // size
        mine = micros[replica::replicas]
        count = -(-len(micros) // replicas)
        weights = [1.0] * len(mine) + [0.0] * (count - len(mine))
        mine = mine + [micros[0]] * (count - len(mine))
        return mine, weights

    def sum_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric sums added over ranks (every rank holds the same keys)."""
        if self.world == 1:
            return sums
        keys = sorted(sums)
        total = dist_ctx.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        return dict(zip(keys, total.tolist()))

    def set_grad_sync(self, enabled: bool) -> None:
        dist_ctx.set_grad_sync(self.model, enabled)

    # ------------------------------------------------------------------------------------- saving
    def plain_model(self) -> torch.nn.Module:
        """An unsharded module holding the current weights (collective under FSDP2)."""
        if self.shadow is None:
            return dist_ctx.unwrap_model(self.model)
        self.shadow.load_state_dict(dist_ctx.full_state_dict(self.model))
        self.shadow.config = dist_ctx.unwrap_model(self.model).config
        return self.shadow

    def save(self, save_fn, *, optimizer, **kwargs) -> None:
        """Rank 0 calls `save_fn(model=..., optimizer=..., **kwargs)`; collectives first, a barrier after."""
        model = self.plain_model()
        optimizer = dist_ctx.checkpointable_optimizer(self.model, optimizer)
        if self.rank == 0:
            save_fn(model=model, optimizer=optimizer, **kwargs)
        dist_ctx.barrier()

    def load(self, load_fn, path, *, optimizer, scheduler) -> dict:
        """Every rank loads the checkpoint at `path` (into the unsharded copy under FSDP2, then scatters)."""
        if self.shadow is None:
            return load_fn(path, model=dist_ctx.unwrap_model(self.model), optimizer=optimizer, scheduler=scheduler)
        state = load_fn(path, model=self.shadow, scheduler=scheduler,
                        optimizer=dist_ctx.FullOptimizerState(self.model, optimizer))
        dist_ctx.load_full_state_dict(self.model, self.shadow.state_dict())
        return state

    def close(self) -> None:
        if self.world > 1:
            dist_ctx.barrier()
