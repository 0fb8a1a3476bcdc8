"""RL on models whose layers are not all full attention (`tiller.models.layer_masks`): a Qwen3.5 checkpoint as the
hub ships the family (a vision-language `qwen3_5` dir: Gated DeltaNet and attention layers, here on text rows) and a
sliding-window Mistral. The rollout's logprobs (native engine) equal the actor's recomputed ones, so the importance
ratios start at 1. Also: a composite checkpoint loaded as its text model keeps its tied LM head."""

from __future__ import annotations

import json

import pytest
import torch

from tests.layer_kinds import build_qwen3_5_vlm
from tests.trainer.test_rl import _train, make_cfg, rl_data  # noqa: F401 (rl_data: a fixture)
from tiller.errors import UserError
from tiller.models.loading import load_causal_lm


def test_a_composite_checkpoint_loaded_as_its_text_model_keeps_the_tied_head(tiny_model_dir, tmp_path, monkeypatch):
    """A vision-language checkpoint that tiller trains as text (transformers maps Llama 4, Emu3, Mllama, Qwen3.5-MoE,
    ... to a causal LM class built from `text_config`; Qwen3.5-MoE, which tiller trains as a vision-language model,
    stands in for them here): with tie_word_embeddings true at the top of config.json and false in `text_config`,
    transformers would draw the LM head at random (its load report: lm_head.weight MISSING); tiller ties it as the
    checkpoint's own model does, so the text model's logits are the vision-language model's."""
    from transformers import AutoModelForImageTextToText

    import tiller.models.loading as loading

    monkeypatch.setattr(loading, "VISION_MODEL_TYPES", tuple(t for t in loading.VISION_MODEL_TYPES
                                                             if t != "qwen3_5_moe"))
    path = build_qwen3_5_vlm(tiny_model_dir, tmp_path / "moe", model_type="qwen3_5_moe")
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"] and not config["text_config"].get("tie_word_embeddings")
    text = load_causal_lm(path).eval()
    assert type(text).__name__ == "Qwen3_5MoeForCausalLM"
    assert text.lm_head.weight.data_ptr() == text.get_input_embeddings().weight.data_ptr()
    full = AutoModelForImageTextToText.from_pretrained(path).eval()
    ids = torch.randint(5, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(text(input_ids=ids).logits, full(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_without_its_lm_head_is_refused(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    tensors.pop("lm_head.weight")
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="no lm_head.weight"):
        load_causal_lm(tmp_path / "m")


@pytest.mark.parametrize("which", ["qwen3_5", "mistral"])
def test_grpo_on_hybrid_and_sliding_window_models(which, tiny_qwen3_5_vlm_dir, layer_kind_dir, rl_data,  # noqa: F811
                                                  tmp_path, capsys):
    """Two GRPO steps with the native engine (fp32) and use_remove_padding (Qwen3.5: the padded update, said once):
    the actor's weights change and the rollout / actor probability gap stays at float noise, ~3e-7 on Mistral
    (before, the engine did not apply Mistral's 6-token window: a gap of 0.15 on these rows; Qwen3.5 did not run)."""
    model_dir = tiny_qwen3_5_vlm_dir if which == "qwen3_5" else layer_kind_dir("mistral")
    cfg = make_cfg(tmp_path / "run", model_dir, rl_data, "actor_rollout_ref.model.use_remove_padding=true",
                   "data.max_response_length=8", "actor_rollout_ref.actor.optim.lr=1e-4",
                   "actor_rollout_ref.rollout.dtype=float32")  # bf16 rounding alone is ~0.02 on Mistral's sharp logits
    metrics, changed, _ = _train(cfg)
    assert changed
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["training/rollout_probs_diff_max"] for r in rows if "training/rollout_probs_diff_max" in r]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps
    lengths = [r["prompt_length/max"] + r["response_length/max"] for r in rows if "response_length/max" in r]
    assert max(lengths) > 6  # the rows cross Mistral's window
    err = capsys.readouterr().err
    assert ("recurrent layers (linear_attention)" in err) == (which == "qwen3_5")
