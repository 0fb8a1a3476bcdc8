"""The experts blocks' matmuls on packed weights (`tiller.rollout.packed_experts`) against the model's own block."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.layer_kinds import MOE
from tests.rollout.conftest import PROMPTS, assert_same_rows, load_family, prompt_ids
from tiller.models import routing
from tiller.rollout import SamplingParams, build_rollout_engine, fused_decode, packed_experts

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN packing needs mkldnn")


def _blocks(model):
    return [layer.mlp for layer in fused_decode.decoder_stack(model).layers if fused_decode.is_experts(layer.mlp)]


@pytest.mark.parametrize("model_type", MOE)
@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "onednn"])
def test_packed_block_equals_the_models_block(model_type, kernel, layer_kind_dir):
    """Every experts block of each family (Qwen2-MoE's shared expert and its gate, GLM-4.5's sigmoid routing and
    shared experts included) run with packed expert matmuls (the C kernel, and oneDNN) for a decode-sized batch (a
    few rows, some experts unused) and a prefill-sized one, the block left as it was: in fp32 the block's own output
    to summation order; in bf16 at least as close to the fp32 result of the same bf16 weights as transformers' bf16
    block is (the kernel keeps its intermediates in fp32)."""
    if kernel and packed_experts._library() is None:
        pytest.skip("no C compiler here")
    model, _ = load_family(layer_kind_dir, model_type)
    exact = model.to(torch.bfloat16).float()  # fp32 holding the bf16-rounded weights
    half = copy.deepcopy(exact).to(torch.bfloat16)
    torch.manual_seed(0)
    for block, block16 in zip(_blocks(exact), _blocks(half)):
        before = dict(block.named_children())
        calls = []
        block.experts.register_forward_hook(lambda *args: calls.append(1))
        packed = packed_experts.PackedExperts(block.experts, kernel=kernel)
        packed16 = packed_experts.PackedExperts(block16.experts, kernel=kernel)
        assert (packed.lib is not None) == kernel
        for rows in (3, 40):
            h = torch.randn(1, rows, model.config.hidden_size).to(torch.bfloat16)
            with torch.no_grad():
                want = _out(block(h.float()))
                got = _out(packed_experts.run_block(block, packed, h.float()))
                assert len(calls) == 1  # the block's own experts ran for `want` only
                calls.clear()
                hf16 = _out(block16(h))
                got16 = _out(packed_experts.run_block(block16, packed16, h))
            assert got.dtype == torch.float32 and got16.dtype == torch.bfloat16 and got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert want.abs().max() > 0.1  # (the comparison is not between zeros)
            assert (got16.float() - want).abs().max() <= 1.01 * (hf16.float() - want).abs().max()
        assert dict(block.named_children()) == before and block.experts is before["experts"]


def _out(out):
    return out[0] if isinstance(out, tuple) else out


def test_worked_numbers_and_a_bad_expert_id():
    """Two experts of hidden 16, intermediate 16 with identity-like weights: each token's output is the weighted sum
    of act(gate) * up through each expert's down matrix, by hand; an id beyond the experts is refused."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = AutoConfig.for_model("qwen3_moe", hidden_size=16, moe_intermediate_size=16, num_experts=2,
                                  num_experts_per_tok=2)
    experts = Qwen3MoeExperts(config)
    eye = torch.eye(16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.stack([torch.cat([eye, 2 * eye]), torch.cat([eye, -eye])]))
        experts.down_proj.copy_(torch.stack([eye, 3 * eye]))
    packed = packed_experts.PackedExperts(experts)
    x = torch.linspace(-1, 1, 32).view(2, 16)
    idx = torch.tensor([[0, 1], [1, 0]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    silu = torch.nn.functional.silu
    expert0, expert1 = silu(x) * 2 * x, 3 * (silu(x) * -x)
    want = torch.stack([0.25 * expert0[0] + 0.75 * expert1[0], 0.5 * expert1[1] + 0.5 * expert0[1]])
    torch.testing.assert_close(packed(x, idx, w), want, atol=1e-6, rtol=1e-6)
    assert packed(x[:0], idx[:0], w[:0]).shape == (0, 16)  # (no tokens: nothing to run)
    with pytest.raises(ValueError, match="expert id 2 beyond the block's 2 experts"):
        packed(x, torch.tensor([[0, 2], [1, 0]]), w)
    with pytest.raises(ValueError, match="expert id -1 beyond the block's 2 experts"):
        packed(x, torch.tensor([[0, -1], [1, 0]]), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_gates_stay_finite(dtype):
    """Gate pre-activations of several hundred (silu's exp overflows below -88): the packed experts give the module's
    output, finite (the C kernel once gave NaN there: an overflowed exp under -ffast-math)."""
    module = _random_experts(dtype=dtype)
    with torch.no_grad():
        module.gate_up_proj.mul_(100)
    torch.manual_seed(3)
    x = (torch.randn(16, 64) * 10).to(dtype)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(16)])
    w = torch.rand(16, 2).to(dtype)
    with torch.no_grad():
        want = module(x, idx, w).float()
        gates = torch.einsum("nh,eih->nei", x.float(), module.gate_up_proj.float()[:, :48])
    assert gates.min() < -200 and gates.max() > 200
    for kernel in ([True, False] if packed_experts._library() is not None else [False]):
        got = packed_experts.PackedExperts(module, kernel=kernel)(x, idx, w).float()
        assert torch.isfinite(got).all()
        rel = (got - want).abs().max() / want.abs().max()
        assert rel < (1e-5 if dtype == torch.float32 else 2e-2)


def test_engine_packs_experts_and_repacks_after_a_weight_change(layer_kind_dir):
    """The native engine on a CPU packs each experts layer (and only those) and decodes through them; routing hooks
    see the router calls; after an in-place change of the experts' weights the packed copies are rebuilt, and the
    rows equal HF `generate` of the changed model."""
    model, tok = load_family(layer_kind_dir, "qwen3_moe")
    prompts = prompt_ids(tok, PROMPTS + ["x", "Once upon a time there was a little"])
    greedy = SamplingParams(do_sample=False, max_new_tokens=12, ignore_eos=True)
    engine = build_rollout_engine("native", model, tok, prefill_tokens=16)
    calls = []
    hooks = [block.experts.register_forward_hook(lambda *args: calls.append(1)) for block in _blocks(model)]
    engine.generate(prompts, greedy)
    assert not calls  # prefill and decode: every experts block through the packed copies
    for hook in hooks:
        hook.remove()
    fused = engine._fused
    layers = fused_decode.decoder_stack(model).layers
    assert [e is not None for e in fused.experts] == [fused_decode.is_experts(layer.mlp) for layer in layers]
    first = [e for e in fused.experts if e is not None][0]
    with torch.no_grad():
        for block in _blocks(model):
            block.experts.down_proj.mul_(-1.5)
    changed = build_rollout_engine("hf", copy.deepcopy(model), tok).generate(prompts, greedy)
    out = engine.generate(prompts, greedy)
    assert [e for e in engine._fused.experts if e is not None][0] is not first  # rebuilt on the sync
    assert_same_rows(out, changed, atol=1e-4)
    recording = build_rollout_engine("native", model, tok, record_routing=True).generate(prompts, greedy)
    assert recording.response_ids == changed.response_ids
    table = recording.routed_experts[0]
    assert table.shape[1] == len(routing.routers(model, "test")) and (table[:-1] >= 0).all()


def _random_experts(experts: int = 8, hidden: int = 64, inter: int = 48, dtype=torch.float32):
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = AutoConfig.for_model("qwen3_moe", hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                                  num_experts_per_tok=2)
    module = Qwen3MoeExperts(config)
    torch.manual_seed(1)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.2)
        module.down_proj.normal_(0, 0.2)
    return module.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_are_batch_and_thread_independent(dtype):
    """A token's output from the C kernel is bit for bit the same alone, in a batch (its experts then see more rows,
    up to several row tiles), and with the experts split over two threads; fp32: the experts module's own to summation
    order; bf16: at least as close to the fp32 result as the module's bf16 one."""
    if packed_experts._library() is None:
        pytest.skip("no C compiler here")
    module = _random_experts(dtype=dtype)
    packed = packed_experts.PackedExperts(module)
    assert packed.lib is not None
    torch.manual_seed(2)
    x = torch.randn(40, 64).to(dtype)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(40)])
    idx[:20] = torch.tensor([3, 5])  # experts 3 and 5: 20+ rows each, three row tiles of 8
    w = torch.rand(40, 2).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch = packed(x, idx, w)
        alone = torch.cat([packed(x[i : i + 1], idx[i : i + 1], w[i : i + 1]) for i in range(40)])
        torch.set_num_threads(2)
        split = packed(x, idx, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, alone) and torch.equal(batch, split)
    with torch.no_grad():
        want = copy.deepcopy(module).float()(x.float(), idx, w.float())  # (bf16: fp32 on the bf16 weights)
        own = module(x, idx, w)
    if dtype == torch.float32:
        torch.testing.assert_close(batch, want, atol=1e-5, rtol=1e-5)
    else:  # the kernel's fp32 intermediates: at least as close as transformers' bf16 module
        assert (batch.float() - want).abs().max() <= (own.float() - want).abs().max()


def test_kernel_applies_where_it_can_and_onednn_elsewhere(monkeypatch):
    """Widths that are not multiples of 16, or gating other than SiLU, run on oneDNN; so does everything with
    `TILLER_EXPERTS_KERNEL=0`; asking for the kernel where it cannot run is refused."""
    if packed_experts._library() is None:
        pytest.skip("no C compiler here")
    assert packed_experts.PackedExperts(_random_experts()).lib is not None
    odd = _random_experts(inter=40)  # 2I = 80 is, I = 40 is not a multiple of 16
    assert packed_experts.PackedExperts(odd).lib is None
    gelu = _random_experts()
    gelu.act_fn = torch.nn.GELU()
    assert packed_experts.PackedExperts(gelu).lib is None
    with pytest.raises(ValueError, match="experts kernel: not available here"):
        packed_experts.PackedExperts(gelu, kernel=True)
    x, idx, w = torch.randn(5, 64), torch.tensor([[0, 1]] * 5), torch.full((5, 2), 0.5)
    with torch.no_grad():
        torch.testing.assert_close(packed_experts.PackedExperts(gelu)(x, idx, w), gelu(x, idx, w))
    monkeypatch.setattr(packed_experts, "_LIB", [])
    monkeypatch.setenv("TILLER_EXPERTS_KERNEL", "0")
    assert packed_experts.PackedExperts(_random_experts()).lib is None


def test_panel_layouts_worked():
    """The kernel's weight layouts: 16-column panels, K-major (P[e, n, k, j] = W[e, 16 n + j, k]), and for AVX512-BF16
    pairs of consecutive k (P[e, n, i, j, t] = W[e, 16 n + j, 2 i + t])."""
    w = torch.arange(2 * 32 * 4, dtype=torch.float32).view(2, 32, 4)  # 2 experts, N = 32, K = 4
    p = packed_experts.panels(w)
    assert p.shape == (2, 2, 4, 16)
    assert p[1, 1, 3, 5] == w[1, 21, 3] and p[0, 0, 2, 15] == w[0, 15, 2]
    q = packed_experts.panels(w, pairs=True)
    assert q.shape == (2, 2, 2, 16, 2)
    assert q[1, 1, 1, 5, 0] == w[1, 21, 2] and q[1, 1, 1, 5, 1] == w[1, 21, 3] and q[0, 0, 0, 15, 1] == w[0, 15, 1]
    # one panel row in memory: 16 columns of one k (or 16 columns x one pair of k)
    assert torch.equal(p[0, 0, 1], w[0, :16, 1]) and torch.equal(q[0, 0, 1].flatten(), w[0, :16, 2:4].flatten())
