"""Metrics of an RL step and of validation, with verl's names (`verl/trainer/ppo/metric_utils.py`).

Step: `critic/score/*` (sequence score), `critic/rewards/*` (after KL in reward), `critic/advantages/*`,
`critic/returns/*` (over response tokens), `response_length/{mean,max,min,clip_ratio}` (clip_ratio against
the step's limit; the driver adds `response_length/limit`, the multi-stage length of the step),
`prompt_length/{mean,max,min}`, `response/finish_stop_ratio`.
Validation, per data source and N = val_kwargs.n: `val-core/<source>/acc/mean@N`, for N > 1 also
`val-core/<source>/acc/best@N` (the best of N) and `val-core/<source>/acc/maj@N` (the accuracy of the
most frequent prediction, ties broken by first appearance), and `val-aux/<source>/reward/mean@N`.
Mixture-of-experts rollouts (`rollout.moe_load_balance_metrics_interval`): `rollout/moe/{max,min,avg}_vio/...`, each
layer's expert load against the uniform one (`moe_expert_counts`, `moe_load_balance_metrics`).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import torch

from tiller.protocol import Batch
from tiller.rollout.agent import tool_means


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {f"{name}/mean": 0.0, f"{name}/max": 0.0, f"{name}/min": 0.0}
    v = values.double()
    return {f"{name}/mean": float(v.mean()), f"{name}/max": float(v.max()), f"{name}/min": float(v.min())}


def data_metrics(batch: Batch, max_response_length: int) -> dict[str, float]:
    """verl's data metrics of one step's batch (all samples, before group filtering)."""
    mask = batch["response_mask"].bool()
    out: dict[str, float] = {}
    out.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    out.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    out.update(_stats("critic/advantages", batch["advantages"][mask]))
    out.update(_stats("critic/returns", batch["returns"][mask]))
    resp_len = mask.sum(-1).float()
    if "tool_rewards" in batch:  # multi-turn tool rollouts: the whole response, tool results included (as verl)
        resp_len = batch["attention_mask"][:, batch["prompts"].shape[1]:].sum(-1).float()
    out.update(_stats("response_length", resp_len))
    out["response_length/clip_ratio"] = float((resp_len >= max_response_length).float().mean())
    prompt_len = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1).float()
    out.update(_stats("prompt_length", prompt_len))
    if "finish_reason" in batch:
        out["response/finish_stop_ratio"] = float(np.mean([r == "stop" for r in batch["finish_reason"]]))
    return out


def moe_expert_counts(routed_experts: torch.Tensor, response_mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[layers, experts] counts of the experts each response token was routed to (every top-k choice counts once).

    `routed_experts` is the batch's [B, P + T, layers, top-k] routing (the rollout engine's, or R2's old-logprob
    pass's), `response_mask` its [B, T] response tokens. As verl counts: each row's last response token is left out
    (sampled, never fed back through the model: the engine recorded no routing for it), and so is any slot without a
    recorded routing (-1)."""
    T = response_mask.shape[1]
    routes = routed_experts[:, routed_experts.shape[1] - T:].long()
    mask = response_mask.bool()
    positions = torch.arange(T)
    last = torch.where(mask, positions, -1).amax(-1, keepdim=True)
    mask = mask & (positions != last)
    chosen = routes[mask]  # [tokens, layers, top-k]
    layers = routes.shape[2]
    if chosen.numel() and int(chosen.max()) >= num_experts:
        raise ValueError(f"routed expert id {int(chosen.max())} >= the model's {num_experts} experts")
    chosen = chosen[(chosen >= 0).all(-1).all(-1)]
    offsets = torch.arange(layers).view(1, layers, 1) * num_experts
    flat = (chosen + offsets).reshape(-1)
    return torch.bincount(flat, minlength=layers * num_experts).view(layers, num_experts)


def moe_load_balance_metrics(counts: torch.Tensor, prefix: str = "rollout/moe") -> dict[str, float]:
    """verl's rollout MoE load-balance metrics of [layers, experts] counts: per layer, each expert's share of the
    layer's assignments times the number of experts, minus 1 (0 everywhere = a uniform load); `max_vio` the most
    loaded expert's excess, `min_vio` the least loaded one's (-1: an expert never chosen), `avg_vio` the mean
    absolute deviation; each `/layer_i`, and `/max` and `/avg` over the layers. Plus the assignments counted."""
    share = counts.double() / counts.sum(-1, keepdim=True).clamp_min(1)
    deviation = share * counts.shape[1] - 1.0
    stats = {"max_vio": deviation.amax(-1), "min_vio": deviation.amin(-1), "avg_vio": deviation.abs().mean(-1)}
    out: dict[str, float] = {}
    for name, per_layer in stats.items():
        for i, v in enumerate(per_layer.tolist()):
            out[f"{prefix}/{name}/layer_{i}"] = v
        out[f"{prefix}/{name}/max"] = float(per_layer.max())
        out[f"{prefix}/{name}/avg"] = float(per_layer.mean())
    total = int(counts.sum())
    out[f"{prefix}/routed_expert_assignments"] = float(total)
    out[f"{prefix}/routed_experts_found"] = float(total > 0)
    return out


def validation_metrics(rows: list[tuple], n: int) -> dict[str, float]:
    """rows: (data_source, uid, score, acc, pred, prompt, response) per sample -> val metrics."""
    groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for ds, uid, score, acc, pred, *_ in rows:
        groups[ds][uid].append((score, acc, pred))
    out: dict[str, float] = {}
    for ds, by_prompt in sorted(groups.items()):
        mean_acc = [np.mean([a for _, a, _ in s]) for s in by_prompt.values()]
        mean_score = [np.mean([sc for sc, _, _ in s]) for s in by_prompt.values()]
        out[f"val-core/{ds}/acc/mean@{n}"] = float(np.mean(mean_acc))
        out[f"val-aux/{ds}/reward/mean@{n}"] = float(np.mean(mean_score))
        if n > 1:
            out[f"val-core/{ds}/acc/best@{n}"] = float(np.mean([max(a for _, a, _ in s) for s in by_prompt.values()]))
            maj = []
            for samples in by_prompt.values():
                top = Counter(p for _, _, p in samples).most_common(1)[0][0]
                maj.append(next(a for _, a, p in samples if p == top))
            out[f"val-core/{ds}/acc/maj@{n}"] = float(np.mean(maj))
    return out


TOOL_FIELDS = ("num_turns", "num_tool_calls", "tool_errors", "tool_rewards")
"""The per-sample fields of multi-turn tool rollouts (actor_rollout_ref.rollout.multi_turn.enable)."""


def tool_metrics(num_turns, num_tool_calls, tool_errors, tool_rewards, prefix: str = "agent") -> dict[str, float]:
    """tiller eval's `agent` means over samples (`tiller.rollout.agent.tool_means`), under `prefix`."""
    means = tool_means(num_turns, num_tool_calls, tool_errors, tool_rewards)
    return {f"{prefix}/{name}": value for name, value in means.items()}
