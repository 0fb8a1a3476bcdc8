"""Token entropy and log-probabilities from logits, chunked; Skywork-OR1's adaptive entropy control.

`entropy_from_logits(logits[..., V])` -> [...]: H = logsumexp(z) - sum_v softmax(z)_v z_v, computed
`chunk_size` rows at a time, by a custom autograd function whose backward uses the closed form
dH/dz = -p (z - E_p[z]) and fills the gradient buffer chunk by chunk: besides the logits and their
gradient, only one chunk's softmax (chunk_size x V) is ever alive.

`logprobs_from_logits(logits[..., V], labels[...])` -> [...]: log_softmax gathered at the labels,
= z_label - logsumexp(z), chunked the same way (gradient onehot(label) - p); no full log_softmax
tensor is materialised. Both are first-order differentiable only (no double backward).

`sum_pi_squared_from_logits(logits[..., V])` -> [...]: sum_v softmax(z)_v^2 per position, chunked, no
gradient (the optimal token baseline's variance proxy; verl computes it in the actor's forward).

AdaptiveEntropyController (Skywork-OR1, He et al. 2025, arXiv 2505.22312, "adaptive entropy
control"): a coefficient c_k, target entropy H*, step delta and cap c_max. After each step with
observed entropy H_k: c_{k+1} = clip(c_k + delta * sign(H* - H_k), 0, c_max). The entropy bonus
actually used is `c_k * 1[H_k < H*]` (`effective_coeff`): the term only applies while entropy is
below target, so it never pushes entropy up once it is high enough. At H_k == H* the coefficient
does not move (sign 0); the paper's text uses <= for the raise, which differs only at equality.
`inclusive=True` is TRL's controller: the bonus applies at H_k <= H*, and the coefficient rises there and falls
otherwise (never holds); `min_coeff` (TRL's entropy_coef_min) replaces the floor 0.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from tiller.errors import ConfigError


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _out_dtype(logits: torch.Tensor) -> torch.dtype:
    return _upcast(logits[:0]).dtype


def _check_chunk(chunk_size: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


class _ChunkedEntropy(torch.autograd.Function):
    """H(z) per row, computed and differentiated `chunk` rows at a time.

    dH/dz = -p * (z - sum_v p_v z_v): the backward rebuilds p for one chunk at a time and writes
    straight into the gradient buffer, so no [N, V] temporary beyond that buffer is ever alive.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk: int) -> torch.Tensor:  # logits [N, V]
        out = torch.empty(logits.shape[0], dtype=_out_dtype(logits), device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            z = _upcast(logits[s : s + chunk])
            out[s : s + chunk] = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
        ctx.save_for_backward(logits)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (logits,) = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            z = _upcast(logits[s : s + ctx.chunk])
            p = torch.softmax(z, -1)
            mean_z = (p * z).sum(-1, keepdim=True)
            grad[s : s + ctx.chunk] = (-p * (z - mean_z) * grad_out[s : s + ctx.chunk, None]).to(grad.dtype)
        return grad, None


class _ChunkedLogProb(torch.autograd.Function):
    """log softmax(z)[y] per row, chunked; d/dz = onehot(y) - p, written chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:  # [N, V], [N]
        out = torch.empty(logits.shape[0], dtype=_out_dtype(logits), device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            z = _upcast(logits[s : s + chunk])
            picked = z.gather(-1, labels[s : s + chunk, None]).squeeze(-1)
            out[s : s + chunk] = picked - torch.logsumexp(z, -1)
        ctx.save_for_backward(logits, labels)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            go = grad_out[s : s + ctx.chunk, None]
            g = -torch.softmax(_upcast(logits[s : s + ctx.chunk]), -1) * go
            g.scatter_add_(1, labels[s : s + ctx.chunk, None], go.to(g.dtype))
            grad[s : s + ctx.chunk] = g.to(grad.dtype)
        return grad, None, None


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 256) -> torch.Tensor:
    """Categorical entropy per position: logits [..., V] -> [...] (float32 for half inputs)."""
    _check_chunk(chunk_size)
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedEntropy.apply(flat, chunk_size).reshape(logits.shape[:-1])


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 256) -> torch.Tensor:
    """log softmax(logits)[labels]: logits [..., V], labels [...] (long) -> [...]."""
    _check_chunk(chunk_size)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedLogProb.apply(flat, labels.reshape(-1).long(), chunk_size).reshape(labels.shape)


def _lp_ent_forward(chunk: torch.Tensor, labels: torch.Tensor, temperature: float, want_entropy: bool):
    """One chunk's (log p[label], entropy) of `chunk / temperature` in fp32 (fp64 stays fp64)."""
    z = _upcast(chunk) / temperature
    lse = torch.logsumexp(z, -1)
    logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    if not want_entropy:
        return logp, None
    return logp, lse - (torch.softmax(z, -1) * z).sum(-1)


def _lp_ent_backward(chunk: torch.Tensor, labels: torch.Tensor, temperature: float, go_logp: torch.Tensor,
                     go_ent: torch.Tensor | None) -> torch.Tensor:
    """d(go_logp . logp + go_ent . entropy) / d chunk for one chunk, in the chunk's dtype."""
    z = _upcast(chunk) / temperature
    p = torch.softmax(z, -1)
    g = p * (-go_logp[:, None])
    if go_ent is not None:  # dH/dz = -p (z - E_p[z])
        g = g - p * (z - (p * z).sum(-1, keepdim=True)) * go_ent[:, None]
    g = g.scatter_add(1, labels[:, None], go_logp[:, None].to(g.dtype))
    return (g / temperature).to(chunk.dtype)


_COMPILED: dict = {}
COMPILE_BACKEND = "inductor"  # (the tests trace with "aot_eager": Dynamo and AOTAutograd without code generation)


def _run(fn, compiled: bool, *args):
    """`fn(*args)`, compiled by Inductor when `compiled` (one compile for every chunk length; on CUDA the chunk's
    softmax, gather and sums become a few reductions that read it once instead of ~10 fp32 [chunk, V] passes). A
    compile that fails warns once and runs `fn` eagerly from then on."""
    if not compiled:
        return fn(*args)
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, backend=COMPILE_BACKEND)
    try:
        return _COMPILED[fn](*args)
    except Exception as err:  # noqa: BLE001 - Inductor could not compile (or run) it here
        if _COMPILED[fn] is fn:
            raise
        import warnings

        from tiller.models.compile import compile_failure  # import cost: tiller.models loads transformers

        warnings.warn(f"tiller: compiling {fn.__name__} failed ({compile_failure(err)}); it runs eagerly",
                      stacklevel=3)
        _COMPILED[fn] = fn
        return fn(*args)


class _ChunkedLogProbEntropy(torch.autograd.Function):
    """(log softmax(z / T)[y], H(z / T)) per row of the model's logits z, `chunk` rows at a time: the fp32 copy of
    the logits (and of their gradient) is never made whole: each chunk is upcast, scaled and reduced, and the
    backward writes each chunk's gradient in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, want_entropy, chunk, compiled):  # [N, V], [N]
        dtype = _out_dtype(logits)
        logp = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        ent = torch.empty(logits.shape[0] if want_entropy else 0, dtype=dtype, device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            lp, h = _run(_lp_ent_forward, compiled, logits[s : s + chunk], labels[s : s + chunk], temperature,
                         want_entropy)
            logp[s : s + chunk] = lp
            if want_entropy:
                ent[s : s + chunk] = h
        ctx.save_for_backward(logits, labels)
        ctx.opts = (temperature, chunk, compiled)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, go_logp, go_ent):
        logits, labels = ctx.saved_tensors
        temperature, chunk, compiled = ctx.opts
        if go_logp is None:
            go_logp = torch.zeros(logits.shape[0], dtype=_out_dtype(logits), device=logits.device)
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            grad[s : s + chunk] = _run(_lp_ent_backward, compiled, logits[s : s + chunk], labels[s : s + chunk],
                                       temperature, go_logp[s : s + chunk],
                                       None if go_ent is None else go_ent[s : s + chunk])
        return grad, None, None, None, None, None


def head_dtype(hidden: torch.Tensor, weight: torch.Tensor, fp32: bool = False) -> torch.dtype:
    """The dtype `F.linear(hidden, weight)` computes in here: autocast's where it is on for the device (its lower
    precision for fp32 / half inputs), else the inputs' promoted dtype; float32 with `fp32` (a `Float32Head`)."""
    if fp32:
        return torch.float32
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def head_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              labels: torch.Tensor, temperature: float = 1.0, want_entropy: bool = False,
                              entropy_grad: bool = False, fp32: bool = False, chunk_size: int | None = None,
                              compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logprobs_and_entropy(F.linear(hidden, weight, bias), labels, ...)` without the [N, V] logits (verl's
    `use_fused_kernels`, its torch backend): each chunk of `chunk_size` rows runs the LM head's matmul, then the
    log-prob / entropy math of `logprobs_and_entropy`; the backward recomputes the chunk's logits and gives hidden's,
    weight's and bias's gradients chunk by chunk. hidden [N, E], weight [V, E], bias [V] or None, labels [N]. The
    matmul runs in `head_dtype` (autocast's dtype under autocast, as F.linear would; float32 with `fp32`), the
    weight's gradient summed over the chunks in float32. Neither the logits nor their gradient exists whole: at 32k
    response tokens of a 152k vocabulary that is 10 GB each in bf16, and the micro-batch can grow instead. The price is
    the head's matmul once more in the backward (a third more of the head's FLOPs)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden [N, E], weight [V, E] and labels [N] expected, got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(labels.shape)}")
    chunk, compiled = _chunking(hidden.device, temperature, chunk_size, compiled)
    dtype = head_dtype(hidden, weight, fp32)
    logp, ent = _FusedHeadLogProbEntropy.apply(hidden, weight, bias, labels.long(), float(temperature), want_entropy,
                                               chunk, compiled, dtype)
    return logp, (None if not want_entropy else ent if entropy_grad else ent.detach())


class _FusedHeadLogProbEntropy(torch.autograd.Function):
    """`_ChunkedLogProbEntropy` over the LM head's output, each chunk's logits made (and remade in the backward) from
    the hidden states: the [N, V] logits never exist whole."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, want_entropy, chunk, compiled, dtype):
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32 if dtype != torch.float64 else dtype, device=hidden.device)
        ent = torch.empty(n if want_entropy else 0, dtype=logp.dtype, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                z = torch.nn.functional.linear(hidden[s : s + chunk].to(dtype), w, b)
                lp, h = _run(_lp_ent_forward, compiled, z, labels[s : s + chunk], temperature, want_entropy)
                logp[s : s + chunk] = lp
                if want_entropy:
                    ent[s : s + chunk] = h
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.opts = (temperature, chunk, compiled, dtype)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, go_logp, go_ent):
        hidden, weight, bias, labels = ctx.saved_tensors
        temperature, chunk, compiled, dtype = ctx.opts
        n = hidden.shape[0]
        if go_logp is None:
            go_logp = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = torch.promote_types(dtype, torch.float32)  # the weight's and bias's gradient summed in (fp64 stays)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                h = hidden[s : s + chunk].to(dtype)
                z = torch.nn.functional.linear(h, w, b)
                g = _run(_lp_ent_backward, compiled, z, labels[s : s + chunk], temperature, go_logp[s : s + chunk],
                         None if go_ent is None else go_ent[s : s + chunk])  # d / d logits, [c, V] in `dtype`
                if grad_h is not None:
                    grad_h[s : s + chunk] = (g @ w).to(hidden.dtype)
                if grad_w is not None:
                    grad_w += (g.t() @ h).to(acc)
                if grad_b is not None:
                    grad_b += g.to(acc).sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None)


def compile_logprobs(device: torch.device) -> bool:
    """Whether `logprobs_and_entropy` compiles its chunks by default on `device`: on CUDA with Triton (on a CPU
    the eager chunks are as fast and a compile costs seconds)."""
    if device.type != "cuda":
        return False
    from torch.utils._triton import has_triton

    return has_triton()


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         want_entropy: bool = False, entropy_grad: bool = False, chunk_size: int | None = None,
                         compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[labels] and (with `want_entropy`) the entropy of softmax(logits /
    temperature), per row of logits [N, V] in the model's dtype, labels [N]: what `logprobs_from_logits` and
    `entropy_from_logits` give for `logits.float() / temperature`, in one chunked pass that never makes the fp32
    [N, V] copy (the update's largest tensors on a GPU: 128 x 256 tokens of a 152k vocabulary are 20 GB in fp32).
    The entropy has a gradient only with `entropy_grad`. `compiled` (default: on CUDA with Triton) runs each chunk's
    math compiled by Inductor (a compile that fails warns and runs eagerly). Chunks of `chunk_size` rows (default
    1024 compiled, 256 eager)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"logits [N, V] and labels [N] expected, got {tuple(logits.shape)} and {tuple(labels.shape)}")
    chunk, compiled = _chunking(logits.device, temperature, chunk_size, compiled)
    logp, ent = _ChunkedLogProbEntropy.apply(logits, labels.long(), float(temperature), want_entropy, chunk, compiled)
    return logp, (None if not want_entropy else ent if entropy_grad else ent.detach())


def _chunking(device: torch.device, temperature: float, chunk_size: int | None,
              compiled: bool | None) -> tuple[int, bool]:
    """(rows a chunk, compiled) of `logprobs_and_entropy` / `head_logprobs_and_entropy`: compiled by default where
    `compile_logprobs` says, chunks of 1,024 rows compiled and 256 eager; the temperature checked."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if compiled is None:
        compiled = compile_logprobs(device)
    chunk = chunk_size or (1024 if compiled else 256)
    _check_chunk(chunk)
    return chunk, compiled


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, chunk_size: int = 256) -> torch.Tensor:
    """sum_v softmax(logits)_v^2 per position: logits [..., V] -> [...] float32 (no gradient)."""
    _check_chunk(chunk_size)
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for s in range(0, flat.shape[0], chunk_size):
        out[s : s + chunk_size] = torch.softmax(flat[s : s + chunk_size].float(), dim=-1).pow(2).sum(-1)
    return out.reshape(logits.shape[:-1])


class AdaptiveEntropyController:
    """Skywork-OR1 adaptive entropy coefficient (see module doc). Holds Python floats."""

    def __init__(self, init_coeff: float, target_entropy: float, delta: float, max_coeff: float,
                 min_coeff: float = 0.0, inclusive: bool = False) -> None:
        if max_coeff < 0 or delta < 0:
            raise ConfigError(f"adaptive_entropy: delta ({delta}) and max_coeff ({max_coeff}) must be >= 0")
        if min_coeff > max_coeff:
            raise ConfigError(f"adaptive_entropy: min_coeff ({min_coeff}) must be <= max_coeff ({max_coeff})")
        self.min_coeff = float(min_coeff)
        self.value = min(max(float(init_coeff), self.min_coeff), float(max_coeff))
        self.target = float(target_entropy)
        self.delta = float(delta)
        self.max_coeff = float(max_coeff)
        self.inclusive = bool(inclusive)

    def _below(self, entropy: float) -> bool:
        return entropy <= self.target if self.inclusive else entropy < self.target

    def effective_coeff(self, current_entropy: float) -> float:
        """The coefficient to use this step: value while entropy < target (<= when inclusive), else 0."""
        return self.value if self._below(current_entropy) else 0.0

    def update(self, current_entropy: float) -> float:
        """c <- clip(c + delta * sign(target - entropy), min_coeff, max_coeff) (inclusive: +delta at entropy <=
        target, else -delta); returns the new c."""
        if self.inclusive:
            step = self.delta if current_entropy <= self.target else -self.delta
        else:
            step = self.delta * (0.0 if current_entropy == self.target
                                 else math.copysign(1.0, self.target - current_entropy))
        self.value = min(max(self.value + step, self.min_coeff), self.max_coeff)
        return self.value
