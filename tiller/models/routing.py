"""Mixture-of-experts routing, recorded and replayed (verl's router replay: `actor.router_replay.mode` R2 / R3 and
`rollout.enable_rollout_routing_replay`).

An MoE policy's logprob of a token depends on the experts each earlier token was routed to, a discrete top-k choice
that a tiny numeric difference flips: the rollout engine (another kernel order, bf16) and the trainer route some
tokens to other experts, and the PPO ratio then compares two different networks. Routing replay pins the experts:
R3 (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers") replays the
rollout engine's routing in the trainer's forwards; verl's R2 replays the old-logprob pass's routing in the update.

- record: each router's top-k experts of every token of a forward are written into a table [slots, layers, k]
  (int16; -1: not recorded) at the token's slot;
- replay: each router's top-k is the table's at the token's slot (a token without a recorded routing routes itself);
  the mixing weights are the router's own probabilities at those experts, normalised as the model does, so the
  router still learns through its weights (verl's Megatron patch gathers them the same way).

Where a forward's tokens sit in the table: the caller opens a `session` over a grid of slots aligned with its
input_ids ([rows, columns]), and each forward path narrows the grid as it narrows its input (`view(fn)`: the same
slicing / packing applied to the grid), right around its model call. A router firing in a session outside a view
raises: a forward path that does not say where its tokens come from would replay the wrong experts.

Routers: transformers' top-k routers that return (router_logits, weights, indices): softmax routing (Qwen2-MoE,
Qwen3-MoE, Qwen3-VL-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral: the probabilities at the chosen experts, renormalised
under `norm_topk_prob`; Mixtral always) and sigmoid routing with a score-correction bias (GLM-4.5, GLM-4.5V: the
sigmoid scores at the chosen experts, renormalised under `norm_topk_prob`, times `routed_scaling_factor`; the bias
only chooses).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from tiller.errors import ConfigError

SOFTMAX = frozenset({"Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Qwen3VLMoeTextTopKRouter", "MixtralTopKRouter",
                     "Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter"})
SIGMOID = frozenset({"Glm4MoeTopkRouter", "Glm4vMoeTextTopkRouter"})
MARK = "_tiller_routing_layer"
"""Attribute of a hooked router: its position among the model's routers (the table's layer axis)."""


class Session:
    """One recording or replaying pass: the table [S, M, k] (int16, -1 = none), the slot grid the caller's input
    is aligned with, the view the running forward uses, and (replay) how many routes agreed with the router's own."""

    def __init__(self, table: torch.Tensor, mode: str, grid: torch.Tensor):
        if mode not in ("record", "replay"):
            raise ValueError(f"routing session mode must be 'record' or 'replay', got {mode!r}")
        self.table, self.mode, self.grid = table, mode, grid
        self.current: torch.Tensor | None = None
        self.routed = torch.zeros((), dtype=torch.long, device=table.device)  # replayed routes (token x layer)
        self.agreed = torch.zeros((), dtype=torch.long, device=table.device)  # of which the router chose the same


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar("tiller_routing", default=None)


def num_experts(config) -> int:
    """Routed experts per MoE layer in an HF config (its text config for a VLM): `num_experts` (Qwen-MoE),
    `num_local_experts` (Mixtral) or `n_routed_experts` (GLM-4.5); 0 for a dense model."""
    config = getattr(config, "text_config", None) or config
    return next((int(n) for n in (getattr(config, k, None) for k in ("num_experts", "num_local_experts",
                                                                      "n_routed_experts")) if n), 0)


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` with `experts` (transformers' experts blocks), in model order."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)]


def routers(model: torch.nn.Module, key: str) -> list[torch.nn.Module]:
    """Each experts block's router, in model order; a ConfigError naming `key` where there is none or one this
    module does not know how to replay."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ConfigError(f"{key}: {type(model).__name__} is not a mixture-of-experts model (no experts blocks), so "
                          "it has no routing to replay; leave it disabled")
    out = []
    for block in blocks:
        gate = getattr(block, "gate", None)
        while isinstance(getattr(gate, "base_layer", None), torch.nn.Module):  # (a LoRA-wrapped router: peft's)
            gate = gate.base_layer
        name = type(gate).__name__
        if name not in SOFTMAX | SIGMOID:
            raise ConfigError(f"{key}: {type(block).__name__}'s router ({name}) is not one tiller replays; it replays "
                              f"{', '.join(sorted(SOFTMAX | SIGMOID))} (Qwen2-MoE, Qwen3-MoE, Qwen3-VL-MoE, "
                              "Qwen3-Next, Qwen3.5-MoE, Mixtral, GLM-4.5, GLM-4.5V)")
        out.append(gate)
    if len({g.top_k for g in out}) != 1:
        raise ConfigError(f"{key}: the routers of {type(model).__name__} choose different numbers of experts "
                          f"({sorted({g.top_k for g in out})}); routing replay keeps one top-k per table")
    return out


def install(model: torch.nn.Module, key: str) -> tuple[int, int]:
    """Hook every router of `model` (once; a deep copy keeps the hooks) and return the table's (layers M, top-k)."""
    gates = routers(model, key)
    for i, gate in enumerate(gates):
        if getattr(gate, MARK, None) is None:
            setattr(gate, MARK, i)
            gate.register_forward_hook(functools.partial(_route, i))
    return len(gates), gates[0].top_k


def empty_table(slots: int, layers: int, top_k: int, device) -> torch.Tensor:
    """A table with no routing recorded: [slots, layers, top_k] int16 of -1."""
    return torch.full((slots, layers, top_k), -1, dtype=torch.int16, device=device)


def mixing_weights(gate: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The weights `gate` gives experts `chosen` [n, k] from its logits [n, E], as its own forward computes them
    for the experts it picks (float32)."""
    if type(gate).__name__ in SIGMOID:
        w = logits.float().sigmoid().gather(1, chosen)
        if gate.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * gate.routed_scaling_factor
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
    if getattr(gate, "norm_topk_prob", True):  # (Mixtral's router always renormalises)
        w = w / w.sum(dim=-1, keepdim=True)
    return w


def _route(layer: int, gate: torch.nn.Module, args, output):
    s = _SESSION.get()
    if s is None:
        return None
    logits, weights, idx = output
    if s.current is None:
        raise RuntimeError("routing replay: a router fired in a forward that did not say where its tokens come from "
                           "(tiller.models.routing.view around the model call)")
    origin = s.current.reshape(-1)
    if origin.numel() != idx.shape[0]:
        raise RuntimeError(f"routing replay: router {layer} routed {idx.shape[0]} tokens but the forward's view holds "
                           f"{origin.numel()} slots")
    if layer >= s.table.shape[1] or idx.shape[1] != s.table.shape[2]:
        raise RuntimeError(f"routing replay: router {layer} chose {idx.shape[1]} experts; the table holds "
                           f"{s.table.shape[1]} layers x {s.table.shape[2]}")
    if s.mode == "record":  # (indexing only: no host sync inside the forward)
        s.table[origin, layer] = idx.to(s.table.dtype)
        return None
    target = s.table[origin, layer].long()
    known = (target >= 0).all(dim=-1)
    chosen = torch.where(known[:, None], target, idx)
    same = (idx.sort(dim=-1).values == chosen.sort(dim=-1).values).all(dim=-1)
    s.routed += known.sum()
    s.agreed += (same & known).sum()
    return logits, mixing_weights(gate, logits, chosen).to(weights.dtype), chosen


@contextlib.contextmanager
def session(table: torch.Tensor, mode: str, grid: torch.Tensor):
    """Inside: this thread's forwards of hooked models record into / replay from `table`; `grid` [rows, columns] the
    slots of the caller's input tokens (forward paths narrow it with `view`). Yields the `Session`."""
    s = Session(table, mode, grid)
    token = _SESSION.set(s)
    try:
        yield s
    finally:
        _SESSION.reset(token)


def active() -> bool:
    return _SESSION.get() is not None


@contextlib.contextmanager
def view(fn):
    """Around a model call: its tokens are `fn(slots)` of the enclosing view (the session's grid at the top), in the
    order the model flattens them; nothing outside a session (`fn` is not called)."""
    s = _SESSION.get()
    if s is None:
        yield
        return
    before = s.current
    s.current = fn(before if before is not None else s.grid)
    try:
        yield
    finally:
        s.current = before


def resume():
    """A context that re-enters this thread's session and view as they are now (gradient checkpointing reruns a
    layer's forward inside backward(), after the forward's session closed: `tiller.workers.packed.recompute_contexts`).
    """
    s = _SESSION.get()
    if s is None:
        return contextlib.nullcontext()
    current = s.current

    @contextlib.contextmanager
    def again():
        token = _SESSION.set(s)
        before, s.current = s.current, current
        try:
            yield
        finally:
            s.current = before
            _SESSION.reset(token)

    return again()


class Recorder:
    """A rollout's routing: a table over a [rows, columns] grid of slots (a row's prompt and response columns)."""

    def __init__(self, model: torch.nn.Module, rows: int, columns: int, key: str):
        layers, top_k = install(model, key)
        device = next(model.parameters()).device
        self.rows, self.columns = rows, columns
        self.table = empty_table(rows * columns, layers, top_k, device)
        self.grid = torch.arange(rows * columns, device=device).view(rows, columns)

    @contextlib.contextmanager
    def at(self, fn):
        """Around one forward whose tokens are the slots `fn(grid)`: their routing is recorded there."""
        with session(self.table, "record", self.grid), view(fn):
            yield

    def by_row(self) -> torch.Tensor:
        """The table as [rows, columns, layers, top_k]."""
        return self.table.view(self.rows, self.columns, *self.table.shape[1:])
