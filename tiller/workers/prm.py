"""PRIME's implicit process reward model, held by the actor worker (`ActorRolloutRefWorker.prm`).

A causal LM pi_prm (initialised from `algorithm.prime.model_path`, default the policy's model) trained online,
and a frozen copy of its initial weights as pi_ref. Each step the driver calls `update` (the cross-entropy of
sigmoid(beta * sum_t log(pi_prm / pi_ref)) against the step's outcome labels, `tiller.algos.prime`), then
`log_ratio` (the token log-ratios the dense rewards are made of). Log-probs are of the raw logits (temperature 1),
as verl's recipe computes them. The model and its AdamW state travel with the actor's checkpoint (`prm/`,
`prm_optimizer.pt`). Letters: `B` samples, `T` response width.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import numpy as np
import torch

from tiller.algos.prime import implicit_log_ratio, prime_prm_loss
from tiller.distributed import context as dist_ctx
from tiller.models.loading import load_causal_lm
from tiller.protocol import Batch
from tiller.workers.common import autocast, build_optimizer, global_counts
from tiller.workers.micro_batches import split_micro_batches


class ImplicitPRM:
    """The trained PRM, its frozen reference and its optimizer (see the module docstring)."""

    def __init__(self, config, device: torch.device):
        self.cfg, self.device = config, device
        arr = config.actor_rollout_ref
        self.actor_cfg, self.prime_cfg = arr.actor, config.algorithm.prime
        path = self.prime_cfg.model_path or arr.model.path
        module = load_causal_lm(path, dtype="float32", trust_remote_code=arr.model.trust_remote_code, device=device)
        self.ref_module = copy.deepcopy(module).requires_grad_(False).eval()
        module.train()
        self.module = module
        self.model = dist_ctx.wrap_model(module, strategy=self.actor_cfg.strategy.replace("fsdp2", "fsdp"))
        # verl's recipe: constant lr, no weight decay; the actor's optimizer class, betas / eps and override kwargs
        optim = self.actor_cfg.optim
        override = {k: v for k, v in (optim.override_optimizer_config or {}).items() if k not in ("lr", "weight_decay")}
        self.optimizer = build_optimizer(self.model, dataclasses.replace(
            optim, lr=self.prime_cfg.lr, weight_decay=0.0, override_optimizer_config=override),
            "actor_rollout_ref.actor.optim")

    def update(self, batch: Batch, logp_fn: Callable) -> dict[str, float]:
        """One pass over `batch` (the actor's token tensors plus `acc[B]`) in mini-batches of meta
        `prm_mini_batch_size` samples, the loss averaged over each mini-batch's samples (all ranks). `logp_fn` is
        the worker's `_logp_entropy`. Returns `prime/*` metrics measured before each mini-batch's step (how well the
        PRM predicted outcomes it had not yet learned from)."""
        p, a = self.prime_cfg, self.actor_cfg
        mini = int(batch.meta.get("prm_mini_batch_size", len(batch)))
        stats: dict[str, list[float]] = {}
        self.model.train()
        for mb in batch.split(mini):
            n_seq = max(global_counts(mb)["global_seqs"], 1.0)
            sums = {"prm_loss": 0.0, "prm_acc": 0.0, "implicit_reward": 0.0}
            self.optimizer.zero_grad(set_to_none=True)
            micros = split_micro_batches(mb, rows=a.ppo_micro_batch_size_per_gpu).batches
            for i, micro in enumerate(micros):
                dist_ctx.set_grad_sync(self.model, i == len(micros) - 1)  # reduce once, after the last
                mask = micro["response_mask"].to(self.device)
                valid = (mask.sum(-1) > 0).float()  # padding rows (world-size padding) count for nothing
                with autocast(a.dtype, self.device):
                    prm_logp, _ = logp_fn(self.model, micro, 1.0, False)
                    with torch.no_grad():
                        ref_logp, _ = logp_fn(self.ref_module, micro, 1.0, False)
                per_sample, metrics = prime_prm_loss(prm_logp, ref_logp, mask, micro["acc"].to(self.device),
                                                     p.beta_train)
                loss = (per_sample * valid).sum() / n_seq
                loss.backward()
                share = float(valid.sum()) / n_seq
                sums["prm_loss"] += float(loss.detach())
                sums["prm_acc"] += share * float(metrics["prm_acc"])
                sums["implicit_reward"] += share * float(metrics["implicit_reward"])
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.grad_clip)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if np.isfinite(grad_norm):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if dist_ctx.is_distributed():  # each rank's sums are its share of the mini-batch means
                keys = sorted(sums)
                total = dist_ctx.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
                sums.update(zip(keys, total.tolist()))
            sums["prm_grad_norm"] = grad_norm
            for k, v in sums.items():
                stats.setdefault(k, []).append(v)
        return {f"prime/{k}": float(np.mean(v)) for k, v in stats.items()}

    @torch.no_grad()
    def log_ratio(self, batch: Batch, batch_logp_fn: Callable) -> Batch:
        """`prm_q[B, T]` = log pi_prm - log pi_ref of the response tokens (0 elsewhere); `batch_logp_fn` is the
        worker's `_batch_logp`."""
        plain = Batch(dict(batch.tensors), meta={**batch.meta, "temperature": 1.0})
        micros = split_micro_batches(plain, rows=self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu)
        prm = batch_logp_fn(self.model, plain, micros, self.actor_cfg.dtype)
        ref = batch_logp_fn(self.ref_module, plain, micros, self.actor_cfg.dtype)
        return Batch({"prm_q": implicit_log_ratio(prm, ref, batch["response_mask"])})

    def checkpoint_parts(self) -> dict:
        """`save_checkpoint` / `load_checkpoint` keyword arguments for the PRM and its optimizer."""
        return {"extra_models": {"prm": dist_ctx.unwrap_model(self.module)},
                "extra_states": {"prm_optimizer": self.optimizer}}
