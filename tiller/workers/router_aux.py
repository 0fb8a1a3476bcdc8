"""The router load-balancing loss of a mixture-of-experts policy in the RL update (TRL's `router_aux_loss_coef`,
OpenRLHF's `--actor.aux_loss_coef`; `actor_rollout_ref.actor.router_aux_loss_coef`).

transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) return `aux_loss` (Switch Transformer's
num_experts x sum_e f_e P_e over the tokens they route, `load_balancing_loss_func`) when a forward is called with
`output_router_logits=True`. The actor reaches its model through several forwards (padded and trimmed, split long
responses, packed rows), so the loss is not threaded through them: `RouterAux` hooks the HF model itself, and
inside `collect()` (one micro-batch of the update, on the calling thread only: the rollout engine's forwards in
another thread are not touched) every forward is asked for its router logits and its `aux_loss` is recorded with
the number of tokens it routed. `micro_batch_aux` is their token-weighted mean.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from tiller.errors import ConfigError

_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("tiller_router_aux", default=None)


def is_moe(config) -> bool:
    """The HF config (or its text config, for a VLM) declares `output_router_logits`: a router loss exists."""
    text = getattr(config, "text_config", None)
    return hasattr(config, "output_router_logits") or (text is not None and hasattr(text, "output_router_logits"))


class RouterAux:
    """Forward hooks on the HF model under `module` (a PeftModel: its base model) that record `aux_loss` inside
    `collect()`. `key` names the config key in errors."""

    def __init__(self, module, key: str):
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        if not is_moe(base.config):
            raise ConfigError(f"{key}: {type(base).__name__} is not a mixture-of-experts model (its config has no "
                              "output_router_logits), so it has no router loss; set it to 0")
        self.key = key
        self._handles = [base.register_forward_pre_hook(self._ask, with_kwargs=True),
                         base.register_forward_hook(self._record, with_kwargs=True)]

    @staticmethod
    def _ask(_module, args, kwargs):
        if _SINK.get() is None:
            return None
        return args, {**kwargs, "output_router_logits": True}

    def _record(self, module, args, kwargs, output) -> None:
        sink = _SINK.get()
        if sink is None:
            return
        aux = getattr(output, "aux_loss", None)
        if aux is None:
            raise ConfigError(f"{self.key}: {type(module).__name__} returned no router loss (aux_loss) for "
                              "output_router_logits=True")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            tokens = mask.sum()  # (a device tensor: no host sync, no graph break under torch.compile)
        else:  # the packed forward (no padding) or a 4-D mask: every input token is routed
            ids = kwargs.get("input_ids", args[0] if args else None)
            tokens = ids.numel() if ids is not None else kwargs["inputs_embeds"].shape[:-1].numel()
        sink.append((aux, tokens))

    @staticmethod
    @contextlib.contextmanager
    def collect():
        """Inside: this thread's forwards of the hooked model return and record their router loss; yields the list
        of (aux_loss, tokens routed) they append."""
        sink: list = []
        token = _SINK.set(sink)
        try:
            yield sink
        finally:
            _SINK.reset(token)

    @staticmethod
    def collecting() -> bool:
        return _SINK.get() is not None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def micro_batch_aux(records: list) -> torch.Tensor:
    """The token-weighted mean of the recorded forwards' router losses (one forward: its own)."""
    if not records:
        raise RuntimeError("no forward of the MoE model ran inside RouterAux.collect()")
    if len(records) == 1:
        return records[0][0].float()
    auxes = torch.stack([aux.float() for aux, _ in records])
    tokens = torch.stack([torch.as_tensor(n, dtype=torch.float32, device=auxes.device) for _, n in records])
    return (auxes * tokens).sum() / tokens.sum()
