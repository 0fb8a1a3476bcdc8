"""Tiny models of the decoder families whose layers are not all full attention (`tiller.models.layer_masks`):
sliding windows (Mistral: one window for every layer; gpt-oss: sliding and full layers, attention sinks, experts;
Gemma 2: sliding and full layers, a logit soft-cap) and recurrent layers (Qwen3.5's and Qwen3-Next's Gated DeltaNet, LFM2's short
convolutions, Granite 4's, Bamba's and Nemotron-H's Mamba 2 (Nemotron-H with a token-mixing-free MLP block),
Jamba's Mamba with experts, Falcon-H1's attention and Mamba side by side). Each is built from its
transformers config with the kit's tokenizer, its weights redrawn with std 0.2 (seeded: the default init gives
near-flat logits that repeat one token), and saved, so tests load it through `from_pretrained` as a user's model.
The window is 6 tokens, so every prompt + response of a test crosses it."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 6

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=True)
FAMILIES = {
    "mistral": dict(head_dim=16, sliding_window=WINDOW),
    "gpt_oss": dict(head_dim=16, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma2": dict(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=16),
    "qwen3_5_text": dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2),
    "qwen3_next": dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "lfm2": dict(layer_types=["conv", "full_attention"] * 2, block_auto_adjust_ff_dim=False),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"] * 2, mamba_n_heads=4, mamba_d_head=32,
                             mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8, num_local_experts=0,
                             shared_intermediate_size=128),
    "falcon_h1": dict(head_dim=16, mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128, mamba_d_state=16,
                      mamba_n_groups=1, mamba_chunk_size=8),
    "nemotron_h": dict(head_dim=16, layers_block_type=["mamba", "attention", "mamba", "mlp"], mamba_num_heads=4,
                       mamba_head_dim=32, ssm_state_size=16, n_groups=1, chunk_size=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=2, mamba_d_state=8,
                  mamba_d_conv=4, mamba_expand=2),
    "bamba": dict(attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                  mamba_chunk_size=8),
}
FULL = {"qwen3": dict(head_dim=16), "glm4": dict(head_dim=16),
        "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          norm_topk_prob=True, mlp_only_layers=[0]),
        "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, mlp_only_layers=[1]),
        "mixtral": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2),
        "glm4_moe": dict(head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         first_k_dense_replace=1, n_shared_experts=1, use_qk_norm=True, attention_bias=True)}
"""Full-attention families the fused decode step runs (`tiller.rollout.fused_decode`): Qwen3's per-head q / k norms;
GLM-4's post-attention / post-MLP norms, fused gate-up and paired rotary on half of each head; experts blocks
(Qwen3-MoE with a dense first layer, Qwen2-MoE with a dense second layer, a shared expert and q / k / v biases, Mixtral
with experts in every layer; GLM-4.5 with a dense first layer, sigmoid routing, a shared expert, q / k norms and
biases, the rotary embedding on the first half of each head; 4 experts, top-2)."""
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
EAGER = ("gpt_oss", "gemma2")  # no sdpa in transformers for these (sinks, soft-cap)
SLIDING = ("mistral", "gpt_oss", "gemma2")
RECURRENT = ("qwen3_5_text", "qwen3_next", "lfm2", "granitemoehybrid", "falcon_h1", "nemotron_h", "jamba", "bamba")


def attn_of(model_type: str) -> str:
    return "eager" if model_type in EAGER else "sdpa"


def build(model_type: str, tokenizer_dir, out: Path, seed: int = 1) -> Path:
    """Save a tiny `model_type` model (~0.2-0.5M parameters) with the tokenizer at `tokenizer_dir` into `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                  **COMMON, **{**FAMILIES, **FULL}[model_type])
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" not in name and "norm" not in name:  # keep the state decays and norms as initialised
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif model_type in FULL and "norm" in name:  # norm gains of their own: a norm applied in the wrong
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.2)  # place changes the output
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_qwen3_5_vlm(tokenizer_dir, out: Path, model_type: str = "qwen3_5") -> Path:
    """A tiny Qwen3.5 checkpoint as the hub ships the family (`qwen3_5`: Qwen3_5ForConditionalGeneration, or
    `qwen3_5_moe` with 4 experts, top-2: a vision tower, the LM head tied to the embeddings at the top of config.json
    only), ~0.3M parameters."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                **{k: v for k, v in COMMON.items() if k != "tie_word_embeddings"}, **FAMILIES["qwen3_5_text"])
    if model_type == "qwen3_5_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
