"""MoE routing replay (verl's actor / ref `router_replay.mode` R2 / R3 and `rollout.enable_rollout_routing_replay`,
`tiller.models.routing`): the native engine records each token's experts, the actor's forwards replay a recorded
routing (mixing weights from the router's own probabilities), R2 records in the old-logprob pass.

Models: tests/layer_kinds.py's tiny Qwen3-MoE (a dense first layer), Qwen2-MoE (a shared expert), Mixtral and
GLM-4.5 (sigmoid routing with a correction bias, a scaling factor), 4 experts top-2."""

from __future__ import annotations

import pytest
import torch

from tests.layer_kinds import MOE

REPLAYED = (*MOE, "qwen3_next")  # (Qwen3-Next: Gated DeltaNet layers, experts with a shared expert)
from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.models import routing
from tiller.protocol import Batch


def _load(layer_kind_dir, model_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = layer_kind_dir(model_type)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _teacher_routes(model, ids: torch.Tensor, **inputs) -> torch.Tensor:
    """The routing of `model`'s own forward of ids [b, s] (and `inputs`): [b, s, layers, top-k]."""
    layers, top_k = routing.install(model, "test")
    table = routing.empty_table(ids.numel(), layers, top_k, "cpu")
    grid = torch.arange(ids.numel()).view(ids.shape)
    with torch.no_grad(), routing.session(table, "record", grid), routing.view(lambda g: g):
        model(input_ids=ids, **inputs)
    return table.view(*ids.shape, layers, top_k)


def _other_experts(routes: torch.Tensor, experts: int = 4) -> torch.Tensor:
    """Each recorded top-2 moved to other experts (no duplicates), -1 kept."""
    out = routes.clone()
    live = out[..., 0] >= 0
    out[..., 0][live] = (out[..., 0][live] + 1) % experts
    clash = live & (out[..., 0] == out[..., 1])
    out[..., 0][clash] = (out[..., 0][clash] + 1) % experts
    return out


@pytest.mark.parametrize("model_type", REPLAYED)
def test_replaying_a_routing_runs_those_experts_with_the_routers_weights(model_type, layer_kind_dir):
    """Replaying a forward's own routing gives its logits bit for bit; another routing reaches the experts as the
    indices, with the router's probabilities at them (normalised as the family does) as weights and the router's
    gradient flowing through them; tokens without a recorded routing route themselves."""
    model, _ = _load(layer_kind_dir, model_type)
    ids = torch.randint(5, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    own = _teacher_routes(model, ids)
    assert (own >= 0).all()
    grid = torch.arange(ids.numel()).view(3, 9)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with routing.session(own.reshape(27, *own.shape[2:]), "replay", grid) as s, routing.view(lambda g: g):
            again = model(input_ids=ids).logits
    assert torch.equal(again, plain) and int(s.agreed) == int(s.routed) == own[..., 0].numel()

    other = _other_experts(own)
    other[2] = -1  # the third row: nothing recorded
    seen = []
    blocks = routing.moe_blocks(model)
    hooks = [b.experts.register_forward_pre_hook(lambda _m, args: seen.append((args[1], args[2]))) for b in blocks]
    gates = routing.routers(model, "test")
    logits_of = []
    hooks += [g.register_forward_hook(lambda _m, _a, out: logits_of.append(out[0].detach())) for g in gates]
    try:
        with routing.session(other.reshape(27, *other.shape[2:]), "replay", grid) as s, routing.view(lambda g: g):
            out = model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    assert (out[:2] - plain[:2]).abs().max() > 1e-2  # other experts, other logits
    for layer, ((index, weights), logits, gate) in enumerate(zip(seen, logits_of, gates)):
        want = other[:, :, layer].reshape(27, -1).long()
        want[18:] = own[2, :, layer].long()  # (the unrecorded row chose its own)
        assert torch.equal(index.long(), want)
        torch.testing.assert_close(weights.float(), routing.mixing_weights(gate, logits, want))
        if type(gate).__name__ in routing.SOFTMAX:  # the probabilities at those experts (renormalised: Mixtral, ...)
            p = torch.softmax(logits.float(), -1).gather(1, want)
            norm = getattr(gate, "norm_topk_prob", True)
            torch.testing.assert_close(weights.float(), p / p.sum(-1, keepdim=True) if norm else p)
    # (after the first layer the router sees other hidden states, and may choose a replayed pair itself)
    assert int(s.routed) == 2 * 9 * len(gates) and int(s.agreed) < int(s.routed) / 4
    out[:, -1].logsumexp(-1).sum().backward()
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in gates)


@pytest.mark.parametrize("model_type", REPLAYED)
def test_native_engine_records_the_experts_a_teacher_forced_forward_takes(model_type, layer_kind_dir):
    """Each row's recorded routing (prompt and response tokens, fp32) is the one the model's own forward of that
    row takes; the last token (never fed) has none; the n samples of a prompt share its prompt's routing."""
    from tiller.rollout import SamplingParams, build_rollout_engine, compiled_decode

    model, tok = _load(layer_kind_dir, model_type)
    prompts = [tok(t)["input_ids"] for t in ["hello there", "a", "Once upon a time there was"]]
    engines = [dict(prefill_tokens=16), dict(fused_decode=False)]
    if model_type == "qwen2_moe" and compiled_decode.available():  # (the compiled step: its experts op)
        engines.append(dict(compile_decode=True))
    for kw in engines:
        engine = build_rollout_engine("native", model, tok, dtype="float32", record_routing=True, **kw)
        out = engine.generate(prompts, SamplingParams(n=2, do_sample=True, max_new_tokens=10, seed=3))
        same = total = 0
        for row, (p, r, routes) in enumerate(zip(out.prompt_ids, out.response_ids, out.routed_experts)):
            assert routes.dtype == torch.int16 and routes.shape[0] == len(p) + len(r)
            assert (routes[-1] == -1).all() and (routes[:-1] >= 0).all()
            teacher = _teacher_routes(model, torch.tensor([p + r]))[0]
            same += int((routes[:-1].sort(-1).values == teacher[:-1].sort(-1).values).all(-1).sum())
            total += teacher[:-1, :, 0].numel()
            if row % 2:
                assert torch.equal(routes[:len(p)], out.routed_experts[row - 1][:len(p)])
        # (an off-by-one column or row would agree on ~1/6 of the routes; fp32 summation order may flip a near-tie)
        assert same >= 0.99 * total, (kw, same, total)


@pytest.mark.parametrize("fixture", ["tiny_qwen3vl_moe_dir", "tiny_glm4v_moe_dir", "tiny_qwen3_5_moe_vlm_dir"])
def test_native_engine_records_the_routing_of_image_prompts(fixture, request):
    """Qwen3-VL-MoE, GLM-4.5V and Qwen3.5-MoE on image prompts: the recorded routing of each row (its image tokens
    too) is the one the model's forward with the pixels takes."""
    from PIL import Image

    from tests.vision.slots import for_model
    from tiller.models.loading import load_causal_lm
    from tiller.models.vision import encode_image_prompt, load_processor
    from tiller.rollout import SamplingParams, build_rollout_engine

    path = request.getfixturevalue(fixture)
    model, proc = load_causal_lm(path).eval(), load_processor(path)
    texts = [("a<|vision_start|><|image_pad|><|vision_end|>how many?", (255, 0, 0)),
             ("count <|vision_start|><|image_pad|><|vision_end|> now", (20, 200, 20))]
    prompts = [encode_image_prompt(proc, for_model(proc, t), [Image.new("RGB", (64, 48), c)]) for t, c in texts]
    mm = [{"pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw} for p in prompts]
    engine = build_rollout_engine("native", model, proc.tokenizer, dtype="float32", record_routing=True)
    out = engine.generate([p.prompt_ids for p in prompts], SamplingParams(n=2, max_new_tokens=6, seed=0,
                                                                          ignore_eos=True), multi_modal=mm)
    same = total = 0
    for row, (p, r, routes) in enumerate(zip(out.prompt_ids, out.response_ids, out.routed_experts)):
        ids = torch.tensor([p + r])
        table = _teacher_routes(model, ids, attention_mask=torch.ones_like(ids), **mm[row // 2],
                                mm_token_type_ids=(ids == model.config.image_token_id).int())[0]
        assert (routes[-1] == -1).all() and (routes[:-1] >= 0).all()
        same += int((routes[:-1].sort(-1).values == table[:-1].sort(-1).values).all(-1).sum())
        total += table[:-1, :, 0].numel()
    assert same >= 0.99 * total, (same, total)


def _worker(model_dir, *extra, need_ref=False):
    from tiller.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                       "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                       "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.dtype=float32",
                       "actor_rollout_ref.actor.optim.lr=1e-2", *extra])
    return ActorRolloutRefWorker(cfg, total_training_steps=8, need_ref=need_ref)


R3 = ("actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=True")


def _rollout(worker) -> Batch:
    tok = worker.tokenizer
    prompts = Batch({}, fields={"prompt_ids": [tok(t)["input_ids"] for t in ("hello there", "Once upon a time")]},
                    meta={"sampling": dict(n=4, max_new_tokens=8, seed=1), "prompt_width": 16, "response_width": 8})
    batch = worker.generate_sequences(prompts)
    g = torch.Generator().manual_seed(0)
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    batch.meta.update(mini_batch_size=len(batch), temperature=1.0)
    return batch


def _with_routes(batch: Batch, routes: torch.Tensor) -> Batch:
    out = batch.select(list(batch.keys()))
    out["routed_experts"] = routes
    return out


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe"])
def test_r3_replays_the_rollouts_routing_in_the_old_logprob_pass_and_the_update(model_type, layer_kind_dir):
    """R3: the batch carries the rollout's routing laid out as input_ids; the old-logprob pass and the update replay
    it (the update reports how often the policy chose the same experts itself), packed or padded."""
    w = _worker(layer_kind_dir(model_type), *R3)
    batch = _rollout(w)
    routes, mask = batch["routed_experts"], batch["attention_mask"].bool()
    assert routes.dtype == torch.int16 and routes.shape[:2] == mask.shape
    last = mask.long().cumsum(1).argmax(1)  # each row's last token: no forward routed it
    recorded = routes[..., 0, 0] >= 0
    assert torch.equal(recorded, mask & (torch.arange(mask.shape[1]) != last[:, None]))
    own = w.compute_log_prob(batch)["old_log_probs"]
    torch.testing.assert_close(own, batch["rollout_log_probs"], atol=1e-4, rtol=0)  # (fp32 engine: same routing)
    other = _with_routes(batch, _other_experts(routes))
    moved = w.compute_log_prob(other)["old_log_probs"]
    assert (moved - own).abs().max() > 0.1
    for extra in ((), ("actor_rollout_ref.model.use_remove_padding=true",)):
        m = _worker(layer_kind_dir(model_type), *R3, *extra).update_actor(batch)
        assert m["actor/router_replay_agreement"] >= 0.99
        assert _worker(layer_kind_dir(model_type), *R3, *extra).update_actor(other)[
            "actor/router_replay_agreement"] < 0.5


def test_r3_gradient_is_the_same_under_gradient_checkpointing(layer_kind_dir):
    """The recomputed layers (inside backward, after the forward's session closed) replay the same routing."""
    path = layer_kind_dir("qwen3_moe")
    batch = _rollout(_worker(path, *R3))
    other = _with_routes(batch, _other_experts(batch["routed_experts"]))
    plain = _worker(path, *R3).update_actor(other)
    checkpointed = _worker(path, *R3, "actor_rollout_ref.model.enable_gradient_checkpointing=true").update_actor(other)
    assert checkpointed["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=1e-5)
    unreplayed = _worker(path).update_actor(other)  # (the same batch routed by the policy itself: another gradient)
    assert unreplayed["actor/grad_norm"] != pytest.approx(plain["actor/grad_norm"], rel=1e-3)


def test_r2_records_in_the_old_logprob_pass_and_the_update_replays_it(layer_kind_dir):
    path = layer_kind_dir("mixtral")
    w = _worker(path, "actor_rollout_ref.actor.router_replay.mode=R2")
    batch = _rollout(w)
    assert "routed_experts" not in batch  # (the engine records nothing under R2)
    out = w.compute_log_prob(batch)
    routes = out["routed_experts"]
    real = batch["attention_mask"].bool()
    real[torch.arange(len(real)), real.long().cumsum(1).argmax(1)] = False  # (the last column is not an input)
    assert routes.shape[:2] == real.shape and (routes[real] >= 0).all()
    teacher = _teacher_routes(w.module, batch["input_ids"][:1, -routes.shape[1]:][:, real[0]])
    assert torch.equal(routes[0][real[0]].sort(-1).values, teacher[0].sort(-1).values)
    kept = batch.union(out)
    assert _worker(path, "actor_rollout_ref.actor.router_replay.mode=R2").update_actor(kept)[
        "actor/router_replay_agreement"] == 1.0
    m = _worker(path, "actor_rollout_ref.actor.router_replay.mode=R2").update_actor(
        _with_routes(kept, _other_experts(routes, experts=4)))
    assert m["actor/router_replay_agreement"] < 0.5
    assert "actor/router_replay_agreement" not in _worker(path).update_actor(kept)


def test_reference_replays_the_rollouts_routing_under_ref_r3(layer_kind_dir):
    path = layer_kind_dir("qwen3_moe")
    refs = _worker(path, *R3, "actor_rollout_ref.ref.router_replay.mode=R3", "actor_rollout_ref.actor.use_kl_loss=true",
                   need_ref=True)
    plain = _worker(path, *R3, "actor_rollout_ref.actor.use_kl_loss=true", need_ref=True)
    batch = _rollout(refs)
    other = _with_routes(batch, _other_experts(batch["routed_experts"]))
    torch.testing.assert_close(refs.compute_ref_log_prob(batch)["ref_log_prob"],
                               plain.compute_ref_log_prob(other)["ref_log_prob"], atol=1e-5, rtol=0)
    assert (refs.compute_ref_log_prob(other)["ref_log_prob"] - refs.compute_ref_log_prob(batch)["ref_log_prob"]
            ).abs().max() > 0.1


def test_r3_with_lora_replays_through_peft_wrapped_routers(layer_kind_dir):
    """LoRA all-linear on Qwen3-MoE: peft wraps each router's weight (target_parameters); the wrapped router still
    replays, in the update and in the reference (the policy with its adapters off)."""
    lora = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")
    w = _worker(layer_kind_dir("qwen3_moe"), *R3, *lora, "actor_rollout_ref.ref.router_replay.mode=R3",
                "actor_rollout_ref.actor.use_kl_loss=true", need_ref=True)
    assert type(w.module.get_base_model().model.layers[1].mlp.gate).__name__ == "ParamWrapper"
    batch = _rollout(w)
    other = _with_routes(batch, _other_experts(batch["routed_experts"]))
    assert (w.compute_ref_log_prob(other)["ref_log_prob"] - w.compute_ref_log_prob(batch)["ref_log_prob"]
            ).abs().max() > 0.1
    batch["ref_log_prob"] = other["ref_log_prob"] = batch["rollout_log_probs"]  # (the KL loss reads it)
    assert w.update_actor(batch)["actor/router_replay_agreement"] >= 0.99
    assert w.update_actor(other)["actor/router_replay_agreement"] < 0.5


@pytest.mark.parametrize("extra, message", [
    (("actor_rollout_ref.actor.router_replay.mode=R3",), "set actor_rollout_ref.rollout.enable_rollout_routing_replay"),
    (("actor_rollout_ref.rollout.enable_rollout_routing_replay=True",),
     "set actor_rollout_ref.actor.router_replay.mode=R3"),
    (("actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"),
     "R2 replays the old-logprob pass"),
    ((*R3, "actor_rollout_ref.rollout.name=hf"), "rollout.name=hf does not"),
    ((*R3, "actor_rollout_ref.rollout.multi_turn.enable=true"), "continuous batcher"),
    (("actor_rollout_ref.ref.router_replay.mode=R2",), "the reference only scores"),
    (("actor_rollout_ref.actor.router_replay.mode=R4",), "router_replay.mode = 'R4' is not one of"),
    (("actor_rollout_ref.actor.router_replay.mode=R2", "algorithm.rollout_correction.bypass_mode=true"),
     "bypass_mode skips"),
    (("actor_rollout_ref.rollout.moe_load_balance_metrics_interval=2",),
     "counts the experts of the routing the rollout engine records"),
    (("actor_rollout_ref.rollout.moe_load_balance_metrics_interval=-1",), "an integer >= 0"),
])
def test_router_replay_settings_that_cannot_work_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["actor_rollout_ref.model.path=m", *extra])


def test_a_dense_model_is_refused_naming_the_key(tiny_model_dir):
    with pytest.raises(ConfigError, match="router_replay.mode: Qwen2ForCausalLM is not a mixture-of-experts"):
        _worker(tiny_model_dir, "actor_rollout_ref.actor.router_replay.mode=R2")


def _rl_config(layer_kind_dir, tmp_path, *extra):
    """`tiller rl` on a tiny Qwen3-MoE: 2 steps of 2 prompts x n=4, 2 PPO epochs, metrics to metrics.jsonl."""
    from tiller.tasks import arithmetic

    arithmetic.write_task(tmp_path / "data", n_train=16, n_test=4, seed=0)
    return load_config([
        f"actor_rollout_ref.model.path={layer_kind_dir('qwen3_moe')}",
        f"data.train_files={tmp_path / 'data/train.parquet'}",
        "data.train_batch_size=2", "data.max_prompt_length=32", "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.ppo_epochs=2",
        "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2", "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable", "trainer.val_before_train=false",
        f"trainer.default_local_dir={tmp_path / 'run'}", *extra])


def test_grpo_with_r3_runs_through_the_trainer(layer_kind_dir, tmp_path):
    """`tiller rl` with verl's R3 keys on a tiny Qwen3-MoE: each step's batch carries the rollout's routing into the
    old-logprob pass (two PPO epochs need it) and the update, and the step logs the update's routing agreement."""
    import json

    from tiller.trainer.rl import RLTrainer

    cfg = _rl_config(layer_kind_dir, tmp_path, *R3)
    trainer = RLTrainer(cfg)
    seen = []
    execute = trainer.actor.execute

    def spy(method, *args, **kwargs):
        if method in ("compute_log_prob", "update_actor"):
            seen.append((method, "routed_experts" in args[0]))
        return execute(method, *args, **kwargs)

    trainer.actor.execute = spy
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    assert seen == [("compute_log_prob", True), ("update_actor", True)] * 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/router_replay_agreement" in r]
    assert len(steps) == 2 and all(0.5 < r["actor/router_replay_agreement"] <= 1.0 for r in steps)


def test_moe_load_balance_counts_and_metrics_worked_numbers():
    """verl's rollout/moe metrics on a hand-counted batch: 2 rows, 1 prompt + 3 response columns, 2 MoE layers,
    top-2 of 3 experts. Counted: response tokens but each row's last (row 0: t0, t1; row 1: t0; its t2 is padding)."""
    from tiller.trainer.rl_metrics import moe_expert_counts, moe_load_balance_metrics

    x = [-1, -1]
    routes = torch.tensor([
        [[[1, 1], [1, 1]], [[0, 1], [0, 1]], [[0, 2], [1, 0]], [[2, 2], [2, 2]]],  # prompt, t0, t1, t2 (last)
        [[[2, 2], [2, 2]], [[0, 1], [0, 1]], [[1, 1], [1, 1]], [x, x]],  # prompt, t0, t1 (last), padding
    ], dtype=torch.int16)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    counts = moe_expert_counts(routes, mask, num_experts=3)
    assert counts.tolist() == [[3, 2, 1], [3, 3, 0]]
    m = moe_load_balance_metrics(counts)
    # layer 0: shares (3, 2, 1) / 6 x 3 - 1 = (0.5, 0, -0.5); layer 1: (3, 3, 0) / 6 x 3 - 1 = (0.5, 0.5, -1)
    want = {"max_vio/layer_0": 0.5, "min_vio/layer_0": -0.5, "avg_vio/layer_0": 1 / 3,
            "max_vio/layer_1": 0.5, "min_vio/layer_1": -1.0, "avg_vio/layer_1": 2 / 3,
            "max_vio/max": 0.5, "max_vio/avg": 0.5, "min_vio/max": -0.5, "min_vio/avg": -0.75,
            "avg_vio/max": 2 / 3, "avg_vio/avg": 0.5, "routed_expert_assignments": 12.0, "routed_experts_found": 1.0}
    assert m.keys() == {f"rollout/moe/{k}" for k in want}
    for k, v in want.items():
        assert m[f"rollout/moe/{k}"] == pytest.approx(v, abs=1e-12), k
    with pytest.raises(ValueError, match="routed expert id 2 >= the model's 2 experts"):
        moe_expert_counts(routes, mask, num_experts=2)


@pytest.mark.parametrize("source", ["rollout", "R2"])
def test_moe_load_balance_metrics_every_interval_steps(layer_kind_dir, tmp_path, source):
    """rollout.moe_load_balance_metrics_interval=2 over 2 steps: nothing at step 1, at step 2 the counts of both
    steps' response tokens (each row's last left out) x MoE layers x top-k, from the engine's recorded routing alone
    (no replay) or from R2's old-logprob pass."""
    import json

    from transformers import AutoConfig

    from tiller.trainer.rl import RLTrainer

    extra = ("actor_rollout_ref.rollout.enable_rollout_routing_replay=True" if source == "rollout"
             else "actor_rollout_ref.actor.router_replay.mode=R2")
    cfg = _rl_config(layer_kind_dir, tmp_path, extra, "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=2")
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
        layers = len(routing.moe_blocks(trainer.actor.worker.module))
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "response_length/mean" in r]
    assert len(rows) == 2 and not any(k.startswith("rollout/moe/") for k in rows[0])
    logged = rows[1]
    assert {k for k in logged if k.startswith("rollout/moe/max_vio/layer_")} == \
        {f"rollout/moe/max_vio/layer_{i}" for i in range(layers)}
    top_k = AutoConfig.from_pretrained(layer_kind_dir("qwen3_moe")).num_experts_per_tok
    samples = 2 * 4
    tokens = sum(round(r["response_length/mean"] * samples) - samples for r in rows)
    assert logged["rollout/moe/routed_expert_assignments"] == tokens * layers * top_k
    assert 0 <= logged["rollout/moe/max_vio/max"] and -1 <= logged["rollout/moe/min_vio/avg"] <= 0
