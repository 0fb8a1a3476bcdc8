"""Regional compilation of a model's decoder layers (`actor_rollout_ref.actor.use_torch_compile`).

Each repeated block (HF's `_no_split_modules` classes: `Qwen2DecoderLayer`, `LlamaDecoderLayer`, ...) is compiled on
its own with `torch.compile` (`nn.Module.compile`), as torchtune's `compile_model` and torchtitan's per-block compile
do, instead of the whole model at once: Dynamo lifts each layer's parameters to graph inputs, so one compiled graph
serves every layer (one compile, not one per layer), the state dict keeps its names (no `_orig_mod.` prefix), and a
deep copy (the rollout's dtype-cast copy, the reference) is an eager module again (`nn.Module.__getstate__` drops the
compiled call). Inductor fuses each layer's elementwise chains, forward and backward: the RMSNorms' fp32 statistics,
the rotary embedding, SiLU x up, the residual adds, which run as one kernel per op eagerly (each a pass over
[tokens, hidden] or [tokens, intermediate]); the matmuls stay cuBLAS / oneDNN calls. An attention implementation that
cannot be traced (the packed forward's, `tiller.workers.packed`) runs between two compiled graphs.

A compile that fails (an op Inductor cannot lower here, no C++ compiler or Triton) warns once and the layers run
eagerly from then on: the numbers are the same either way, up to summation order.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tiller.errors import ConfigError

BACKEND = "inductor"
"""torch.compile backend of `compile_layers` (the tests trace with "aot_eager": Dynamo and AOTAutograd, no codegen)."""


def layer_classes(model: nn.Module) -> tuple[type, ...]:
    """Classes of the model's repeated blocks (HF `_no_split_modules`), the units FSDP2 shards and this compiles."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def compile_failure(err: BaseException) -> str:
    """One line saying why a compile (or a compiled call) failed: the error's type and message, without torch's
    debugging hints (`TORCHDYNAMO_VERBOSE=...`), for the warning and the `*_error` fields that report it."""
    lines = [line.strip() for line in str(err).splitlines()]
    return f"{type(err).__name__}: " + " ".join(line for line in lines if line and "TORCHDYNAMO_VERBOSE" not in line)


class _Fallback:
    """The compiled call of one layer: the first failure of any layer's compile warns once (naming `key`) and turns
    every layer back to eager; the failed call is rerun eagerly."""

    def __init__(self, layers: list[nn.Module], key: str):
        self.layers, self.key, self.error = layers, key, None

    def wrap(self, layer: nn.Module, compiled):
        def call(*args, **kwargs):
            if self.error is not None:
                return layer._call_impl(*args, **kwargs)
            try:
                # the backward compiled with the forward (AOTAutograd otherwise compiles it at the first backward,
                # where a failure would escape this fallback)
                with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                    return compiled(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # noqa: BLE001 - Inductor / Dynamo could not compile (or run) the layer here
                self.error = compile_failure(err)
                for other in self.layers:
                    other._compiled_call_impl = None
                warnings.warn(f"tiller: {self.key}: compiling the decoder layers failed ({self.error}); they run "
                              "eagerly", stacklevel=2)
                return layer._call_impl(*args, **kwargs)

        return call


def compile_layers(model: nn.Module, key: str, backend: str | None = None) -> _Fallback:
    """Compile each decoder layer of `model` in place (see the module docstring); returns the layers' shared state
    (`.layers`, `.error`: the failed compile's message or None). Shapes are dynamic from the first call (micro-batches
    differ in length). A model without repeated blocks to compile is refused, naming `key`."""
    classes = layer_classes(model)
    layers = [m for m in model.modules() if isinstance(m, classes)] if classes else []
    if not layers:
        raise ConfigError(f"{key}=true: {type(model).__name__} names no repeated decoder layers to compile "
                          "(its _no_split_modules); set it to false")
    state = _Fallback(layers, key)
    for layer in layers:
        layer.compile(dynamic=True, backend=backend or BACKEND)
        layer._compiled_call_impl = state.wrap(layer, layer._compiled_call_impl)
    return state
