"""The state dict tiller sends vLLM is in the checkpoint's layout (`tiller.rollout.vllm_engine.checkpoint_state_dict`):
transformers 5 fuses a mixture-of-experts layer's experts into 3-D parameters as it loads (Qwen3-MoE's
`mlp.experts.gate_up_proj`, Mixtral's `block_sparse_moe` renamed `mlp`), which vLLM's `load_weights` does not read
(it skipped them, or refused the names). This runs without vLLM; the vllm lane checks the engine itself."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tiller.rollout.vllm_engine import checkpoint_state_dict, is_moe


def _moe(tmp_path, tok_dir, model_type):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    extra = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
             "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}[model_type]
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), hidden_size=64, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / model_type)
    return AutoModelForCausalLM.from_pretrained(tmp_path / model_type), tmp_path / model_type


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_moe_state_dict_goes_out_in_the_checkpoints_layout(tmp_path, tiny_model_dir, model_type):
    model, path = _moe(tmp_path, tiny_model_dir, model_type)
    state = model.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # transformers' fused runtime layout
    out = checkpoint_state_dict(model, state)
    saved = load_file(path / "model.safetensors")
    assert set(out) == set(saved) and all(torch.equal(out[k], saved[k]) for k in saved)
    # from the meta-device skeleton an engine built from a directory uses: the same names
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    assert set(checkpoint_state_dict(skeleton, state)) == set(saved)
    assert is_moe(model) and is_moe(str(path))


def test_a_dense_state_dict_passes_unchanged(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    state = model.state_dict()
    out = checkpoint_state_dict(model, state)
    assert set(out) == set(state) and all(out[k] is state[k] for k in state)  # (sorted by name)
    assert not is_moe(model)
