"""actor_rollout_ref.actor.router_aux_loss_coef (TRL's router_aux_loss_coef, OpenRLHF's --actor.aux_loss_coef): a
mixture-of-experts policy's router load-balancing loss joins the RL update, transformers' own over each micro-batch's
forward, by the micro-batch's share of the sequences."""

from __future__ import annotations

import pytest
import torch

from tests.sft.test_router_aux import tiny_moe_dir  # noqa: F401  (a fixture)
from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.protocol import Batch


def _worker(model_dir, *extra):
    from tiller.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=hf",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.train_batch_size=2",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.actor.optim.lr=1e-2", *extra])
    return ActorRolloutRefWorker(cfg, total_training_steps=8)


def _batch(vocab: int, advantages: float | None = None) -> Batch:
    """8 rows: left-padded prompts of 3-6 tokens (two rows share each prompt), responses of 4-6 tokens (right
    padding); the widest prompt and the longest response are there, so the trimmed forward drops only the last
    column."""
    g = torch.Generator().manual_seed(0)
    P, T = 6, 6
    prompts, responses = torch.randint(5, vocab, (8, P), generator=g), torch.randint(5, vocab, (8, T), generator=g)
    pmask, rmask = torch.ones(8, P, dtype=torch.long), torch.ones(8, T, dtype=torch.long)
    for i, (p_len, r_len) in enumerate([(6, 6), (6, 5), (3, 4), (3, 6), (5, 5), (5, 4), (4, 6), (4, 6)]):
        pmask[i, : P - p_len] = 0
        rmask[i, r_len:] = 0
        if i % 2:
            prompts[i] = prompts[i - 1]
    prompts = prompts * pmask
    responses = responses * rmask
    adv = torch.zeros(8, T) if advantages == 0 else torch.randn(8, T, generator=g)
    return Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": torch.cat([pmask, rmask], 1), "response_mask": rmask, "advantages": adv * rmask},
                 meta={"mini_batch_size": 8, "temperature": 1.0})


def _transformers_aux(model_dir, batch: Batch, rows: slice) -> float:
    """transformers' router loss of the update's forward of `rows`: the rows without their last column (no
    response token follows it), padding masked."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return float(model(input_ids=batch["input_ids"][rows, :-1], attention_mask=batch["attention_mask"][rows, :-1],
                           output_router_logits=True).aux_loss)


@pytest.mark.parametrize("packed", [False, True])
def test_the_update_adds_transformers_router_loss_by_share_of_sequences(tiny_moe_dir, packed):  # noqa: F811
    extra = ["actor_rollout_ref.model.use_remove_padding=true"] if packed else []
    plain = _worker(tiny_moe_dir, *extra)
    w = _worker(tiny_moe_dir, "actor_rollout_ref.actor.router_aux_loss_coef=0.5", *extra)
    assert w._forward_opts["share_prompts"]  # (rows share prompts: the update forwards them whole instead)
    batch = _batch(plain.module.config.vocab_size)
    want = 0.5 * _transformers_aux(tiny_moe_dir, batch, slice(0, 4)) + \
        0.5 * _transformers_aux(tiny_moe_dir, batch, slice(4, 8))  # two micro-batches of 4 of the 8 sequences
    m, m0 = w.update_actor(batch), plain.update_actor(batch)
    assert "actor/aux_loss" not in m0
    assert m["actor/aux_loss"] == pytest.approx(want, rel=1e-5) and want > 1.0
    assert m["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], abs=1e-6)  # the same forward, the same policy
    assert m["actor/grad_norm"] != pytest.approx(m0["actor/grad_norm"], rel=1e-4)  # the router term's gradient


@pytest.fixture(scope="module")
def skewed_moe_dir(tiny_moe_dir, tmp_path_factory):  # noqa: F811
    """The tiny Mixtral with every layer's router leaning to expert 0 (its row moved along the mean router input):
    the router loss starts well above its balanced value (top-2 of 4 experts: 2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    means = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _m, inputs, _out, i=i: means.__setitem__(i, inputs[0].reshape(-1, inputs[0].shape[-1]).mean(0)))
        for i, layer in enumerate(model.model.layers)]
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        for i, layer in enumerate(model.model.layers):
            layer.mlp.gate.weight[0] += 3 * means[i] / means[i].norm()
    for hook in hooks:
        hook.remove()
    path = tmp_path_factory.mktemp("skewed") / "mixtral"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_moe_dir).save_pretrained(path)
    return path


def test_the_router_loss_alone_balances_the_experts(skewed_moe_dir):
    """Zero advantages: the router loss is the only gradient, and steps on it lower it towards the balanced 2 (a
    sign error would raise it); without the coefficient nothing moves."""
    w = _worker(skewed_moe_dir, "actor_rollout_ref.actor.router_aux_loss_coef=1.0")
    batch = _batch(w.module.config.vocab_size, advantages=0)
    values = [w.update_actor(batch)["actor/aux_loss"] for _ in range(6)]
    assert values[0] > 2.5 and values[-1] < values[0] - 0.3, values
    plain = _worker(skewed_moe_dir, "actor_rollout_ref.actor.optim.weight_decay=0")
    before = {k: v.clone() for k, v in plain.module.state_dict().items()}
    plain.update_actor(batch)
    assert all(torch.equal(before[k], v) for k, v in plain.module.state_dict().items())


def test_refusals_name_the_key(tiny_moe_dir, tiny_model_dir):  # noqa: F811
    with pytest.raises(ConfigError, match="router_aux_loss_coef.*not a mixture-of-experts"):
        _worker(tiny_model_dir, "actor_rollout_ref.actor.router_aux_loss_coef=0.01")
    with pytest.raises(ConfigError, match="router_aux_loss_coef must be >= 0"):
        _worker(tiny_moe_dir, "actor_rollout_ref.actor.router_aux_loss_coef=-1")
    with pytest.raises(ConfigError, match="router_aux_loss_coef with actor.ulysses_sequence_parallel_size"):
        load_config([f"actor_rollout_ref.model.path={tiny_moe_dir}",
                     "actor_rollout_ref.actor.router_aux_loss_coef=0.01",
                     "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "trainer.backend=ray",
                     "trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=true"])


def test_trl_and_openrlhf_front_ends_map_their_coefficients(tiny_moe_dir, tiny_model_dir, tmp_path):  # noqa: F811
    """TRL GRPO's router_aux_loss_coef=None takes the MoE model's own coefficient (Mixtral's config: 0.001), a number
    is that number, and a number with a dense model is refused (TRL raises too); OpenRLHF PPO's --actor.aux_loss_coef
    (flat: --aux_loss_coef) is the key."""
    from tiller.openrlhf.parse import parse_command
    from tiller.openrlhf.translate import translate
    from tiller.trl import GRPOConfig, GRPOTrainer

    def keys(model, **kw):
        args = GRPOConfig(output_dir=str(tmp_path / f"run{len(kw)}"), bf16=False, **kw)
        trainer = GRPOTrainer(model=str(model), reward_funcs=lambda completions, **_: [1.0] * len(completions),
                              args=args, train_dataset=[{"prompt": f"q{i} "} for i in range(16)])
        return trainer.translate()[0]

    key = "actor_rollout_ref.actor.router_aux_loss_coef"
    assert keys(tiny_moe_dir)[key] == pytest.approx(0.001)
    assert keys(tiny_moe_dir, router_aux_loss_coef=0.25)[key] == 0.25
    assert key not in keys(tiny_moe_dir, router_aux_loss_coef=0.0) and key not in keys(tiny_model_dir)
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.1: refused: .* not a mixture-of-experts model"):
        keys(tiny_model_dir, router_aux_loss_coef=0.1)
    for argv in (["--pretrain", "m", "--aux_loss_coef", "0.02", "--remote_rm_url", "http://x/r", "--prompt_data",
                  "p.jsonl"],
                 ["--actor.model_name_or_path", "m", "--actor.aux_loss_coef", "0.02", "--reward.remote_url",
                  "http://x/r", "--data.prompt_dataset", "p.jsonl"]):
        assert translate(parse_command(["train_ppo_ray", *argv])).values[key] == 0.02


def test_two_forwards_of_a_micro_batch_are_weighted_by_their_tokens():
    """A micro-batch whose few long responses run as a second forward (split_long_responses) records two router
    losses: their mean weighted by the tokens each routed."""
    from tiller.workers.router_aux import micro_batch_aux

    records = [(torch.tensor(2.0), torch.tensor(30)), (torch.tensor(4.0), 10)]
    assert float(micro_batch_aux(records)) == pytest.approx((2.0 * 30 + 4.0 * 10) / 40)
    assert float(micro_batch_aux(records[:1])) == 2.0
    with pytest.raises(RuntimeError, match="no forward"):
        micro_batch_aux([])
