"""TR-DPO's reference updates (Gorbatovski et al. 2024, arXiv 2404.09656; TRL's `sync_ref_model`): every
`sync_steps` optimizer steps the frozen reference moves toward the policy,

    ref <- alpha * policy + (1 - alpha) * ref        (parameters only; TRL's SyncRefModelCallback)

so the KL anchor (RL) or the DPO / KTO reference trails the policy instead of staying at the start. A sharded policy
(FSDP2: DTensor parameters) gives each parameter's full tensor, a collective every rank makes in the same order.
"""

from __future__ import annotations

import torch

from tiller.errors import ConfigError


class RefSync:
    """Counts optimizer steps and mixes the policy into `ref` every `sync_steps` of them."""

    def __init__(self, sync_steps: int, alpha: float, key: str):
        if int(sync_steps) < 1:
            raise ConfigError(f"{key}: ref_model_sync_steps must be >= 1, got {sync_steps}")
        if not 0.0 < float(alpha) <= 1.0:
            raise ConfigError(f"{key}: ref_model_mixup_alpha must be in (0, 1], got {alpha}")
        self.sync_steps, self.alpha, self.key = int(sync_steps), float(alpha), key
        self.optimizer_steps = 0

    def after_optimizer_step(self, ref: torch.nn.Module, policy: torch.nn.Module) -> bool:
        """Count one optimizer step; on every sync_steps-th, mix `policy` into `ref` (True when it did)."""
        self.optimizer_steps += 1
        if self.optimizer_steps % self.sync_steps:
            return False
        mix_into(ref, policy, self.alpha, self.key)
        return True


@torch.no_grad()
def mix_into(ref: torch.nn.Module, policy: torch.nn.Module, alpha: float, key: str = "ref_model_sync_steps") -> None:
    """ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter (matched by name)."""
    source = dict(policy.named_parameters())
    for name, target in ref.named_parameters():
        p = source.get(name)
        if p is None:
            raise ConfigError(f"{key}: the reference has parameter {name!r}, which the policy lacks (a reference of "
                              "another architecture cannot follow the policy)")
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if full.shape != target.shape:
            raise ConfigError(f"{key}: the reference's {name!r} is {tuple(target.shape)}, the policy's "
                              f"{tuple(full.shape)}")
        target.mul_(1.0 - alpha).add_(full.to(target.device, target.dtype), alpha=alpha)
