"""A small regression worker for testing and benchmarking worker groups without a language model.

`MLPRegressionWorker` trains a two-layer MLP by SGD on a squared error normalised by the *global*
number of rows (``all_reduce_sum`` of the local count), which is exactly how tiller's RL workers
normalise their losses. So a group of N ranks fed a batch split N ways must reach the same weights
as one process fed the whole batch; the tests check this for DDP and FSDP2. It lives in the package
(not under tests/) so Ray actors can import it by name.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

from tiller import hostinfo
from tiller.distributed import context
from tiller.errors import UserError


class _Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class _MLP(nn.Module):
    _no_split_modules = ["_Block"]  # FSDP2 shards each block, as it does HF decoder layers

    def __init__(self, in_dim: int, hidden: int, out_dim: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(in_dim, hidden)
        self.blocks = nn.ModuleList(_Block(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class MLPRegressionWorker:
    """Rank-local SGD on ``sum((f(x) - y)^2) / global_rows``; identical init on every rank (seeded)."""

    def __init__(self, in_dim: int = 8, hidden: int = 16, out_dim: int = 2, layers: int = 2, lr: float = 0.1,
                 seed: int = 0, strategy: str = "fsdp", param_dtype: torch.dtype | None = None):
        torch.manual_seed(seed)
        self.model = context.wrap_model(_MLP(in_dim, hidden, out_dim, layers), strategy, param_dtype=param_dtype)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)

    def train_step(self, batch, micro: int | None = None, sleep_s: float = 0.0) -> dict[str, float]:
        """One SGD step on this rank's rows `x [b, in_dim]`, `y [b, out_dim]`, accumulated over
        micro-batches of `micro` rows (default: one); returns the global loss."""
        global_rows = context.all_reduce_sum(torch.tensor(float(len(batch))))
        micros = batch.split(micro or len(batch))
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i, mb in enumerate(micros):
            context.set_grad_sync(self.model, i == len(micros) - 1)
            loss = ((self.model(mb["x"]).float() - mb["y"]) ** 2).sum() / global_rows
            loss.backward()
            total += loss.detach()
        self.optimizer.step()
        if sleep_s:
            time.sleep(sleep_s)
        return {"loss": float(context.all_reduce_sum(total))}

    def predict(self, batch):
        """`batch` plus ``pred [b, out_dim]``."""
        with torch.no_grad():
            pred = self.model(batch["x"]).float()
        out = batch.select(batch.keys())
        out["pred"] = pred
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in context.full_state_dict(self.model).items()}

    def info(self) -> dict:
        return {"rank": context.rank(), "world_size": context.world_size(), "pid": os.getpid(),
                "threads": torch.get_num_threads(), "distributed": context.is_distributed(),
                "bf16": hostinfo.bf16_decision().reason}

    def fail(self, on_rank: int = 0, how: str = "raise", peers_wait: bool = True) -> None:
        """Test hook: rank `on_rank` raises ValueError ("raise"), UserError ("user") or kills its own
        process ("kill"); with `peers_wait` the other ranks wait in a barrier, as in a training step."""
        if context.rank() != on_rank:
            if peers_wait:
                context.barrier()
            return
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "user":
            raise UserError(f"bad input on rank {on_rank}")
        raise ValueError(f"requested failure on rank {on_rank}")
