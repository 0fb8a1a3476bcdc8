"""optim.weight_decay_exempt: which parameters weight decay spares. null: none (verl); transformers: transformers'
Trainer's choice (TRL), checked against its own `get_decay_parameter_names`; openrlhf: OpenRLHF's name list. The TRL
and OpenRLHF front ends set theirs when weight decay is on."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.sft.conftest import job_overrides, write_jsonl
from tiller.config import load_config
from tiller.config.jobs import SFTConfig, validate_job
from tiller.errors import ConfigError
from tiller.models.optimizer import exempt_from_decay, param_groups


def _gpt2():
    """A tiny GPT-2: nn.LayerNorm modules named ln_1 / ln_2 / ln_f (spared by their type in transformers' rule)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2))


def test_the_transformers_rule_is_transformers_own(tiny_model_dir):
    from transformers import AutoModelForCausalLM, Trainer

    for model in (AutoModelForCausalLM.from_pretrained(tiny_model_dir), _gpt2()):
        names = {n for n, _ in model.named_parameters()}
        decayed = set(Trainer.get_decay_parameter_names(None, model))
        assert exempt_from_decay(model, "transformers") == names - decayed
        assert exempt_from_decay(model, None) == set()
    qwen = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    spared = exempt_from_decay(qwen, "transformers")
    assert "model.norm.weight" in spared and "model.layers.0.self_attn.q_proj.bias" in spared
    assert "model.layers.0.input_layernorm.weight" in spared and "model.layers.0.self_attn.q_proj.weight" not in spared
    # OpenRLHF's names: the same ones on this model; GPT-2's ln_1 is not in its list (its name has no "norm")
    assert exempt_from_decay(qwen, "openrlhf") == spared
    assert "transformer.h.0.ln_1.weight" not in exempt_from_decay(_gpt2(), "openrlhf")


def test_groups_leave_frozen_parameters_out(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.model.embed_tokens.requires_grad_(False)
    decay, spared = param_groups(model, "transformers")
    assert spared["weight_decay"] == 0.0 and "weight_decay" not in decay
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert len(decay["params"]) + len(spared["params"]) == n_trainable
    assert all(p.requires_grad for p in decay["params"] + spared["params"])
    assert len(param_groups(model, None)) == n_trainable  # one flat list: every one decays


def _sft_weights(model_dir, train, run, **extra) -> dict[str, torch.Tensor]:
    from tiller.trainer.sft import train_sft

    train_sft(load_config(job_overrides(model_dir, train, run, **{
        "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 8, "trainer.total_training_steps": 1,
        "optim.lr": 0.05, **extra}), schema=SFTConfig, validate=validate_job))
    return load_file(str(run / "hf_model" / "model.safetensors"))


def test_a_job_step_decays_only_what_the_rule_leaves(tiny_model_dir, tmp_path):
    """One SFT step with weight decay 0.5 against one without, from the same weights on the same batch: the
    parameters the rule spares come out bit-equal, the others differ; with no rule every nonzero one differs."""
    from transformers import AutoModelForCausalLM

    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"What is {i}?", "response": str(i)} for i in range(8)])
    plain = _sft_weights(tiny_model_dir, train, tmp_path / "plain")
    spared = exempt_from_decay(AutoModelForCausalLM.from_pretrained(tiny_model_dir), "transformers")
    rule = _sft_weights(tiny_model_dir, train, tmp_path / "rule", **{"optim.weight_decay": 0.5,
                                                                     "optim.weight_decay_exempt": "transformers"})
    every = _sft_weights(tiny_model_dir, train, tmp_path / "every", **{"optim.weight_decay": 0.5})
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, value in plain.items():
        if name in spared:
            assert torch.equal(rule[name], value), name
        else:
            assert not torch.equal(rule[name], value), name
        if start[name].any():  # (decay moves nothing that starts at 0: the biases here)
            assert not torch.equal(every[name], value), name
    with pytest.raises(ConfigError, match="optim.weight_decay_exempt='hf': one of transformers, openrlhf"):
        load_config(job_overrides(tiny_model_dir, train, tmp_path / "x", **{"optim.weight_decay_exempt": "hf"}),
                    schema=SFTConfig, validate=validate_job)


def test_rl_optimizers_and_front_ends(tiny_model_dir, tmp_path):
    from tiller.openrlhf.parse import parse_command
    from tiller.openrlhf.translate import translate
    from tiller.trl import GRPOConfig, GRPOTrainer
    from tiller.trl.common import job_keys
    from tiller.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.name=hf",
                       "actor_rollout_ref.actor.optim.weight_decay_exempt=openrlhf"])
    worker = ActorRolloutRefWorker(cfg, total_training_steps=1)
    groups = worker.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    spared = exempt_from_decay(worker.module, "openrlhf")
    by_id = {id(p): n for n, p in worker.module.named_parameters()}
    assert {by_id[id(p)] for p in groups[1]["params"]} == spared
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.optim.weight_decay_exempt='all'"):
        load_config([f"actor_rollout_ref.model.path={tiny_model_dir}",
                     "actor_rollout_ref.actor.optim.weight_decay_exempt=all"])
    # TRL: transformers' rule with weight decay on; off (TRL's 0.0 default) leaves the key out
    key = "actor_rollout_ref.actor.optim.weight_decay_exempt"
    for wd, want in ((0.1, "transformers"), (0.0, None)):
        args = GRPOConfig(output_dir=str(tmp_path / f"g{wd}"), bf16=False, weight_decay=wd)
        keys = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                           args=args, train_dataset=[{"prompt": f"q{i}"} for i in range(8)]).translate()[0]
        assert keys.get(key) == want
    assert job_keys({"weight_decay": 0.1, "total_training_steps": 4})["optim.weight_decay_exempt"] == "transformers"
    values = translate(parse_command(["train_sft", "--pretrain", "m", "--dataset", "d.jsonl", "--output_key", "a",
                                      "--l2", "0.1"])).values
    assert values["optim.weight_decay_exempt"] == "openrlhf"
    values = translate(parse_command(["train_ppo_ray", "--pretrain", "m", "--remote_rm_url", "http://x/r",
                                      "--prompt_data", "p.jsonl", "--l2", "0.1"])).values
    assert values["actor_rollout_ref.actor.optim.weight_decay_exempt"] == "openrlhf"
    assert values["critic.optim.weight_decay_exempt"] == "openrlhf"


def test_a_resume_with_another_grouping_names_the_key(tiny_model_dir, tmp_path):
    from tiller.errors import UserError

    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"What is {i}?", "response": str(i)} for i in range(8)])
    _sft_weights(tiny_model_dir, train, tmp_path / "run", **{"optim.weight_decay": 0.1, "trainer.save_freq": 1})
    with pytest.raises(UserError, match="other parameter groups .* optim.weight_decay_exempt"):
        _sft_weights(tiny_model_dir, train, tmp_path / "run", **{
            "optim.weight_decay": 0.1, "optim.weight_decay_exempt": "transformers", "trainer.total_training_steps": 2})
