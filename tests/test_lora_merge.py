"""LoRA weight sync: peft's own merge, on a copy, gives the merged model's logits and leaves training untouched."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_merged_state_dict_equals_peft_merge_and_leaves_the_model_alone(tiny_model_dir, use_dora):
    from peft import LoraConfig, get_peft_model

    from tiller.models.loading import load_causal_lm
    from tiller.models.lora import lora_template, merged_state_dict

    torch.manual_seed(0)
    peft_model = get_peft_model(load_causal_lm(tiny_model_dir), LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, use_dora=use_dora))
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    ids = torch.randint(5, 100, (2, 12))
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits

    merged = merged_state_dict(lora_template(peft_model), peft_model.state_dict())

    assert not any("lora_" in k or "base_layer" in k for k in merged)
    plain = load_causal_lm(tiny_model_dir)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    with torch.no_grad():
        got = plain(input_ids=ids).logits
    assert (got - want).abs().max().item() < 1e-5
    base = load_causal_lm(tiny_model_dir)  # the adapters really moved the weights (the test can fail)
    with torch.no_grad():
        assert (base(input_ids=ids).logits - want).abs().max().item() > 1e-3
    after = peft_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the training model is untouched
