"""A fused one-token decode step for Llama-family decoders (Llama, Qwen2, Qwen3, GLM-4, and the mixture-of-experts
Qwen2-MoE, Qwen3-MoE, Mixtral, GLM-4.5: `SUPPORTED`), used by the native engine.

Hugging Face's modules run q, k, v and gate, up as separate matmuls and go through generic attention
dispatch each step. At decode time (one new token per row, `M = rows`), those matmuls are small and the
k / v ones skinny (grouped-query attention), so fusing them is the cheapest way to a higher fraction of
the GEMM peak (vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear` do the same):

    qkv = x W_qkv^T (+ b_qkv)         W_qkv = [W_q; W_k; W_v]
    gate, up = split(x W_gu^T)         W_gu = [W_gate; W_up]

Everything else reuses the model's own modules (embedding, rotary embedding tables, act_fn) or computes the
same math in fewer ops: HF's `apply_rotary_pos_emb` on the q and k heads in one pass, fp32 RMSNorm through
`torch.nn.functional.rms_norm`; greedy output equals the HF forward's token for token (tests/rollout).
Grouped-query attention for one query token is computed by folding each kv head's query group into the
query-length axis (HF's `pack_gqa`), so keys / values are never repeated.

The fused matrices are copies; `sync()` rebuilds them whenever a source parameter changed in place
(tracked by tensor version counters), so the engine never decodes with stale weights.

On CPU every matmul of the step (qkv, o, gate-up, down, lm_head) runs on weights prepacked once per sync into
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing and vLLM's
CPU backend do). A decode step streams every weight from memory with few rows to amortise it: the plain
row-major GEMM reaches ~45% of the fp32 peak there, the packed one ~80% (`bench/rollout.py` prints the
achieved GFLOP/s). Results differ from the unpacked matmul only by summation order (~1e-6 relative).

Letters: `B` rows, `L` cache columns, `D` head dim, `Hq` / `Hk` query / kv heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiller.models import layer_masks, varlen
from tiller.rollout import packed_experts
from tiller.rollout.base import param_versions
from tiller.rollout.compiled_decode import CompiledStep
from tiller.rollout.decode_kernel import attention_kernel, DecodeAttention

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4", "glm4v", "qwen2_moe", "qwen3_moe",
             "qwen3_vl_moe", "mixtral", "glm4_moe", "glm4v_moe")
"""Model types whose decoder layers this step runs. Qwen2-VL's / Qwen2.5-VL's language model is Qwen2's layers with
M-RoPE: at decode time a response token's (t, h, w) positions are equal, where M-RoPE (Qwen3-VL's interleaved
M-RoPE too) is the 1D rotary embedding, and the model's own `rotary_emb` computes it from [B, T] positions; image
prompts' prefill runs the HF forward (`tiller.rollout.images`). Qwen3's layers (Qwen3-VL's language model too) add an
RMSNorm over each query / key head (`q_norm`, `k_norm`) before the rotary embedding, applied here too; Qwen3-VL's
deepstack features only touch image tokens, which are all in the prompt. GLM-4's layers (GLM-4-0414, GLM-Z1; GLM-4.1V's
language model, with M-RoPE as above) add an RMSNorm after attention and after the MLP, before each residual add,
keep gate and up in one matrix (`gate_up_proj`), and rotate only the first part of each head (`partial_rotary_factor`)
with adjacent pairs (dims 2i, 2i + 1) where Llama pairs halves (`ROPE`). The mixture-of-experts families (Qwen2-MoE,
Qwen3-MoE, Qwen3-VL-MoE, Mixtral; GLM-4.5 / 4.6, `glm4_moe`: Llama's halves rotated over the first half of each head,
q / k norms where `use_qk_norm`, sigmoid routing with a shared expert, dense first layers) are these attention layers
with an experts block in place of the MLP in some or all layers: the step fuses their attention and dense MLPs and
runs each experts block as the model's own module (`FusedDecoder.mlp`: its router, top-k and experts implementation,
e.g. transformers' `grouped_mm`, which keeps the routing on the device, so a CUDA graph can record it); on a CPU with
packing, the block's expert matmuls run on packed copies of the experts (`tiller.rollout.packed_experts`), its router
and shared experts as the model's."""
ROPE = {"glm4": "pairs_from_half", "glm4v": "pairs"}
"""How a model type's rotary embedding pairs dims (default "half": dim i with i + D / 2, over the whole head).
"pairs": dims 2i and 2i + 1 over the first `cos.shape[-1]` dims, the rest passed through (GLM-4.1V, whose
`rotary_emb` returns each frequency repeated for its pair); "pairs_from_half": the same after taking the first half of
the model's `cos` / `sin` and repeating each frequency twice (GLM-4's `apply_rotary_pos_emb`)."""


def decoder_stack(model):
    """The module holding `embed_tokens`, `layers`, `norm` and `rotary_emb`: `model.model`, or a vision-language
    model's `model.model.language_model`; None when there is none (e.g. a PeftModel, whose .model is the LM)."""
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)
    return inner if hasattr(inner, "layers") else None


def text_config(model):
    """The language model's config (a vision-language model's `text_config`)."""
    return layer_masks.text_config(model.config)


def supports(model) -> bool:
    """True for a plain (no adapters) model of a `SUPPORTED` type with full attention in every layer."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SUPPORTED or decoder_stack(model) is None:
        return False
    config = text_config(model)
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) \
            and not getattr(config, "layer_types", None):  # e.g. a Mixtral with a window: every layer slides
        return False
    if getattr(config, "pretraining_tp", 1) != 1:
        return False
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):  # e.g. peft's copy of a head trained in full
        return False
    linear_names = ("q_proj", "k_proj", "v_proj", "o_proj")
    for layer in decoder_stack(model).layers:
        mlp = layer.mlp
        mods = [getattr(layer.self_attn, n, None) for n in linear_names]
        if is_experts(mlp):
            if any(type(m) is not torch.nn.Linear for m in mods):
                return False
        else:
            mlp_names = ("gate_up_proj", "down_proj") if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj",
                                                                                             "down_proj")
            mods += [getattr(mlp, n, None) for n in mlp_names]
            if any(type(m) is not torch.nn.Linear for m in mods) or mlp_act(mlp) is None:
                return False
            if any(getattr(mlp, n).bias is not None for n in mlp_names[:-1]):
                return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm, *head_norms(layer), *post_norms(layer)]
        if not all(hasattr(n, "variance_epsilon") for n in norms):
            return False
    return True


def is_experts(mlp) -> bool:
    """A mixture-of-experts block (a router and `experts`, e.g. Qwen3-MoE's `Qwen3MoeSparseMoeBlock`), not a dense
    MLP: the step runs it as the model's own module."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and not hasattr(mlp, "up_proj")


def post_norms(layer) -> tuple:
    """(after attention, after the MLP) RMSNorms of a GLM-4 decoder layer, applied before each residual add; ()
    for a layer without (Llama, Qwen)."""
    attn, mlp = getattr(layer, "post_self_attn_layernorm", None), getattr(layer, "post_mlp_layernorm", None)
    return () if attn is None or mlp is None else (attn, mlp)


def mlp_act(mlp):
    """The MLP's activation: `act_fn` (Llama, Qwen), GLM-4's `activation_fn`; None if neither."""
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def gate_up_weight(mlp) -> torch.Tensor:
    """[W_gate; W_up]: a concatenation of `gate_proj` and `up_proj`, or GLM-4's `gate_up_proj` (already that)."""
    if hasattr(mlp, "gate_up_proj"):
        return mlp.gate_up_proj.weight
    return torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])


def head_norms(layer) -> tuple:
    """(q_norm, k_norm) of a decoder layer whose attention normalises each query / key head (Qwen3), else ()."""
    attn = layer.self_attn
    if getattr(attn, "q_norm", None) is None and getattr(attn, "k_norm", None) is None:
        return ()
    return attn.q_norm, attn.k_norm


PACK_ROWS = 64
"""Row count oneDNN picks the packed weight layout for (any row count runs on it)."""


def can_pack(model) -> bool:
    """oneDNN prepacking applies: CPU weights in float32 / bfloat16 and torch built with mkldnn."""
    p = next(model.parameters())
    return (p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _same_layout(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


class FusedDecoder:
    """Holds the fused weights of `model` and runs its one-token decode step."""

    def __init__(self, model, pack: bool | None = None, compile: bool = False, decode_kernel: bool = True):
        self.model = model
        self.pack = can_pack(model) if pack is None else pack
        self.decode_kernel = decode_kernel  # the C one-token attention on CPU (tiller.rollout.decode_kernel)
        self._kernels: dict[tuple, DecodeAttention | None] = {}
        self.inner = decoder_stack(model)  # embed_tokens, layers, norm, rotary_emb
        attn = self.inner.layers[0].self_attn
        self.head_dim = attn.head_dim
        config = text_config(model)
        self.n_q = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_q
        self.scaling = attn.scaling
        self.qk_norms = [head_norms(layer) for layer in self.inner.layers]  # () per layer without (Llama, Qwen2)
        self.post_norms = [post_norms(layer) for layer in self.inner.layers]  # () per layer without (not GLM-4)
        self.acts = [mlp_act(layer.mlp) for layer in self.inner.layers]
        self.rope = ROPE.get(config.model_type, ROPE.get(getattr(model.config, "model_type", None), "half"))
        self._seen = None
        self.sync()
        self.compiled = None  # the one-token step compiled by Inductor (tiller.rollout.compiled_decode), opt-in
        if compile:
            self.compiled = CompiledStep(self)

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
        """One query token per row, its group folded: q [B, Hk, group, D] over k / v [B, Hk, L, D] -> [B, Hk,
        group, D]; the C kernel where it applies (`decode_kernel`), else SDPA."""
        kernel = None
        if self.decode_kernel:
            key = (q.device.type, q.dtype)
            if key not in self._kernels:
                self._kernels[key] = attention_kernel(self.n_q, self.n_kv, self.head_dim, self.scaling, q.device,
                                                      q.dtype)
            kernel = self._kernels[key]
        if kernel is not None:
            return kernel(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)

    def sync(self) -> None:
        """Rebuild the fused copies if any parameter of the model changed since the last build."""
        seen = param_versions(self.model)
        if seen == self._seen:
            return
        old = None if self._seen is None else [*self.qkv, *self.o, *self.gate_up, *self.down, self.head]
        self.qkv, self.o, self.gate_up, self.down = [], [], [], []
        self.experts = []  # per layer: its experts' packed copies (`tiller.rollout.packed_experts`), or None
        with torch.no_grad():
            for layer in self.inner.layers:
                a, m = layer.self_attn, layer.mlp
                biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
                if any(b is not None for b in biases) and not all(b is not None for b in biases):
                    raise ValueError("fused decode: q/k/v must all have biases or none")
                qkv_b = torch.cat(biases) if biases[0] is not None else None
                self.qkv.append(self._linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), qkv_b))
                self.o.append(self._linear(a.o_proj.weight, a.o_proj.bias))
                experts = is_experts(m)  # no fused copies: the block runs as the model's module (`mlp`)
                self.gate_up.append(None if experts else self._linear(gate_up_weight(m), None))
                self.down.append(None if experts else self._linear(m.down_proj.weight, m.down_proj.bias))
                packed = experts and self.pack and packed_experts.packable(m.experts)
                self.experts.append(packed_experts.PackedExperts(m.experts) if packed else None)
            head = self.model.lm_head
            self.head = self._linear(head.weight, head.bias)
            if old is not None and not self.pack:
                self._keep_addresses(old)
        self._seen = param_versions(self.model)

    def _keep_addresses(self, old: list[tuple]) -> None:
        """Copy the rebuilt weights into the previous tensors and keep those: a CUDA graph captured on them
        (`tiller.rollout.graphed_decode`) then runs the synced weights without recapture."""
        new = [*self.qkv, *self.o, *self.gate_up, *self.down, self.head]
        pairs = [(o, n) for o, n in zip(old, new) if o is not None or n is not None]  # (None: an experts layer)
        if len(old) != len(new) or any(o is None or n is None for o, n in pairs) \
                or any(not _same_layout(a, b) for o, n in pairs for a, b in zip(o[:2], n[:2])):
            return
        for o, n in pairs:
            for a, b in zip(o[:2], n[:2]):
                if a is not None and a.data_ptr() != b.data_ptr():
                    a.copy_(b)
        layers = len(self.qkv)
        self.qkv, self.o, self.gate_up, self.down = (old[k * layers : (k + 1) * layers] for k in range(4))
        self.head = old[-1]

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """(weight, bias, packed): `packed` is the oneDNN-prepacked copy of `weight` when packing is on."""
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS) if self.pack else None
        return weight, bias, packed

    @staticmethod
    def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm; fp32 through torch's fused `rms_norm` (the same math as HF's module in one op)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
        return norm(x)

    def norm_heads(self, qk: torch.Tensor, layer: int) -> torch.Tensor:
        """qk [..., Hq + Hk, D] with layer `layer`'s q_norm over the query heads and k_norm over the key heads."""
        q_norm, k_norm = self.qk_norms[layer]
        q, k = qk.split([self.n_q, self.n_kv], dim=-2)
        return torch.cat([self._norm(q_norm, q), self._norm(k_norm, k)], dim=-2)

    def add_branch(self, x: torch.Tensor, out: torch.Tensor, layer: int, branch: int) -> torch.Tensor:
        """The residual add of layer `layer`'s attention (`branch` 0) or MLP (1) output: GLM-4 normalises the output
        first (its post norms), the others add it as it is."""
        post = self.post_norms[layer]
        return x + (self._norm(post[branch], out) if post else out)

    def mlp(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer `layer`'s MLP on its normalised input h [N, E]: the fused gate-up and down matmuls, or an experts
        block run as the model's own module (router, top-k, experts; each token on its own, as in HF's forward), its
        expert matmuls on packed weights where packing is on (`tiller.rollout.packed_experts`)."""
        if self.gate_up[layer] is None:
            block, packed = self.inner.layers[layer].mlp, self.experts[layer]
            out = block(h.unsqueeze(0)) if packed is None else packed_experts.run_block(block, packed, h.unsqueeze(0))
            return (out[0] if isinstance(out, tuple) else out).squeeze(0)  # (blocks that return router logits too)
        gate, up = self._apply(h, self.gate_up[layer]).chunk(2, dim=-1)
        return self._apply(self.acts[layer](gate) * up, self.down[layer])

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's `rotary_emb` output -> the tables `rotate` multiplies by (`ROPE`)."""
        if self.rope == "pairs_from_half":
            n = cos.shape[-1] // 2
            return cos[..., :n].repeat_interleave(2, dim=-1), sin[..., :n].repeat_interleave(2, dim=-1)
        return cos, sin

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding of q and k heads together, element for element as the model's
        `apply_rotary_pos_emb`: qk [..., D], cos / sin broadcastable to [..., cos.shape[-1]] (the first
        cos.shape[-1] dims of each head rotated, the rest passed through: a partial rotary embedding)."""
        d = cos.shape[-1]
        if self.rope == "half" and d == qk.shape[-1]:
            return qk * cos + torch.cat((-qk[..., d // 2 :], qk[..., : d // 2]), dim=-1) * sin
        rot, rest = qk[..., :d], qk[..., d:]
        if self.rope == "half":  # (GLM-4.5: halves of the first part)
            turned = torch.cat((-rot[..., d // 2 :], rot[..., : d // 2]), dim=-1)
        else:
            turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat([rot * cos + turned * sin, rest], dim=-1)

    @staticmethod
    def _apply(x: torch.Tensor, lin: tuple) -> torch.Tensor:
        weight, bias, packed = lin
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """One decode step. input_ids, position_ids [B, 1]; mask [B, 1, 1, L] bool (True = attend) or additive;
        `cache` a KVBuffer positioned at the write column. Returns logits [B, V]."""
        if self.compiled is not None:
            return self.compiled(input_ids, position_ids, mask, cache)
        return self.forward(input_ids, position_ids, mask, cache)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """T tokens per row (prefill, T >= 1): input_ids, position_ids [B, T]; mask [B, 1, T, L] over the keys
        `cache.update` returns. Returns the logits of each row's last position, [B, V]."""
        return self.forward_parts([(input_ids, position_ids, mask, cache)])[0]

    def forward_packed(self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], cu: torch.Tensor,
                       cache) -> torch.Tensor:
        """A prefill of new prompts packed end to end, without padding: ids, positions [N] (each prompt's from 0),
        `lengths` its prompts' lengths (host), `cu` their offsets [c + 1] int32 on the device. Each prompt attends
        causally to its own tokens (`tiller.models.varlen.causal_rows`: torch's varlen kernel on CUDA in bf16 / fp16);
        each layer's keys / values go to `cache.write_packed`. Returns each prompt's last-token logits [c, V]."""
        inner = self.inner
        d, n_q, n_kv = self.head_dim, self.n_q, self.n_kv
        n = ids.shape[0]
        x = inner.embed_tokens(ids)  # [N, E]
        cos, sin = self.rope_tables(*inner.rotary_emb(x[None, :1], positions[None]))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [N, 1, D]: broadcast over heads
        longest = max(lengths)
        for i, layer in enumerate(inner.layers):
            qkv = self._apply(self._norm(layer.input_layernorm, x), self.qkv[i])
            qk = qkv[:, : (n_q + n_kv) * d].view(n, n_q + n_kv, d)
            if self.qk_norms[i]:
                qk = self.norm_heads(qk, i)
            q, k = self.rotate(qk, cos, sin).split([n_q, n_kv], dim=1)
            v = qkv[:, (n_q + n_kv) * d :].view(n, n_kv, d)
            cache.write_packed(k, v, i)
            o = varlen.causal_rows(q, k, v, lengths, cu, longest, self.scaling)
            x = self.add_branch(x, self._apply(o.reshape(n, n_q * d), self.o[i]), i, 0)
            x = self.add_branch(x, self.mlp(self._norm(layer.post_attention_layernorm, x), i), i, 1)
        return self._apply(self._norm(inner.norm, x[cu[1:].long() - 1]), self.head)

    def forward_parts(self, parts: list[tuple]) -> list[torch.Tensor]:
        """Several batches in one pass, e.g. the decode rows and a new request's prefill: each part is
        (input_ids [B, T], position_ids [B, T], mask [B, 1, T, L], cache). Every matmul runs once over the tokens
        of all parts (the weights stream from memory once); attention runs per part over its own cache.
        Returns each part's last-position logits [B, V]."""
        inner = self.inner
        d, n_q, n_kv = self.head_dim, self.n_q, self.n_kv
        group = n_q // n_kv
        shapes = [p[0].shape for p in parts]
        counts = [b * t for b, t in shapes]
        flat_ids = torch.cat([p[0].reshape(-1) for p in parts]) if len(parts) > 1 else parts[0][0].reshape(-1)
        x = inner.embed_tokens(flat_ids)  # [N, E], N = all tokens of all parts
        rope = []
        for ids, pos, _, _ in parts:
            cos, sin = self.rope_tables(*inner.rotary_emb(x[:1], pos))
            rope.append((cos.unsqueeze(1), sin.unsqueeze(1)))  # [B, 1, T, D]: broadcast over heads
        for i, layer in enumerate(inner.layers):
            qkv = self._apply(self._norm(layer.input_layernorm, x), self.qkv[i])
            outs = []
            for (b, t), chunk, (cos, sin), (_, _, mask, cache) in zip(shapes, qkv.split(counts), rope, parts):
                chunk = chunk.view(b, t, -1)
                # rotary embedding on q and k heads together (HF's apply_rotary_pos_emb, element for element)
                qk = chunk[..., : (n_q + n_kv) * d].view(b, t, n_q + n_kv, d)
                if self.qk_norms[i]:  # Qwen3: RMSNorm over each query / key head before the rotary embedding
                    qk = self.norm_heads(qk, i)
                qk = self.rotate(qk.transpose(1, 2), cos, sin)
                q, k = qk.split([n_q, n_kv], dim=1)
                v = chunk[..., (n_q + n_kv) * d :].view(b, t, n_kv, d).transpose(1, 2)
                k, v = cache.update(k, v, i)
                if t == 1:
                    # fold the query group into the query axis: [B, Hq, 1, D] -> [B, Hk, group, D]; the mask
                    # [B, 1, 1, L] broadcasts over kv heads and the folded group
                    o = self.decode_attention(q.reshape(b, n_kv, group, d), k, v, mask)
                else:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                                       enable_gqa=group > 1).transpose(1, 2)
                outs.append(o.reshape(b * t, n_q * d))
            o = self._apply(torch.cat(outs) if len(outs) > 1 else outs[0], self.o[i])
            x = self.add_branch(x, o, i, 0)
            x = self.add_branch(x, self.mlp(self._norm(layer.post_attention_layernorm, x), i), i, 1)
        # each row's last token: offset of the part + (row + 1) * T - 1
        last, offset = [], 0
        for b, t in shapes:
            last.append(torch.arange(1, b + 1, device=x.device) * t - 1 + offset)
            offset += b * t
        logits = self._apply(self._norm(inner.norm, x[torch.cat(last)]), self.head)
        return list(logits.split([b for b, _ in shapes]))
