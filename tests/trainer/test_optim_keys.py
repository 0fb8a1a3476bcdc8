"""verl's optimizer and loss-scale keys: optim.optimizer / optimizer_impl / override_optimizer_config (verl's
build_optimizer), optim.num_cycles / zero_indexed_step (verl's cosine-with-warmup), loss_scale_factor
(seq-mean-token-sum-norm's constant); checkpoints refuse a resume with another optimizer class."""

from __future__ import annotations

import math

import pytest
import torch

from tiller.algos.aggregate import aggregate_loss
from tiller.config import load_config
from tiller.config.schema import OptimConfig
from tiller.errors import ConfigError, UserError
from tiller.models.checkpoint import load_checkpoint, save_checkpoint
from tiller.models.optimizer import make_optimizer, optimizer_class_name
from tiller.protocol import Batch
from tiller.workers.common import build_scheduler, global_counts, verl_lr_lambda

A = "actor_rollout_ref.actor"


# ------------------------------------------------------------------------------------------ LR schedule
COS = dict(warmup=2, total=10, style="cosine", min_lr_ratio=0.0)


@pytest.mark.parametrize("kw, table", [
    # verl: s < warmup -> s / warmup; else p = (s - 2) / 8, max(m, cos(2 pi c p) (1 - m) / 2 + (1 + m) / 2)
    (dict(COS), {0: 0.0, 1: 0.5, 2: 1.0, 6: 0.5, 10: 0.0}),  # step 6: p = 0.5, cos(pi / 2) = 0 -> 0.5
    # zero_indexed_step False (torchtitan's): s = step + 1, the whole schedule one step ahead
    (dict(COS, zero_indexed_step=False), {0: 0.5, 1: 1.0, 5: 0.5, 9: 0.0}),
    # num_cycles 1: a whole cosine, down at p = 0.5 (step 6: cos(pi) = -1 -> 0), back up at p = 1 (step 10)
    (dict(COS, num_cycles=1.0), {4: 0.5, 6: 0.0, 8: 0.5, 10: 1.0}),  # step 4: p = 0.25, cos(pi / 2) = 0
    # min_lr_ratio 0.1: coef 0.45, intercept 0.55; step 6: 0.55; step 10: -0.45 + 0.55 = 0.1
    (dict(COS, min_lr_ratio=0.1), {6: 0.55, 10: 0.1}),
    # num_cycles 1 with floor 0.2: step 6 -> max(0.2, -0.4 + 0.6) = 0.2; step 5: p = 3/8, cos(3 pi / 4) = -0.7071
    # -> -0.7071 * 0.4 + 0.6 = 0.31716
    (dict(COS, num_cycles=1.0, min_lr_ratio=0.2), {6: 0.2, 5: 0.6 - 0.4 * math.sqrt(0.5)}),
    # constant: step / warmup, then 1; num_cycles and zero_indexed_step are not read (verl's constant schedule)
    (dict(warmup=4, total=10, style="constant", min_lr_ratio=0.0, zero_indexed_step=False, num_cycles=3.0),
     {0: 0.0, 1: 0.25, 3: 0.75, 4: 1.0, 9: 1.0}),
])
def test_verl_lr_table(kw, table):
    for step, want in table.items():
        assert math.isclose(verl_lr_lambda(step, **kw), want, abs_tol=1e-12), (step, kw)


def test_scheduler_runs_the_table_and_takes_the_warmup_ratio_when_steps_are_not_positive():
    # lr_warmup_steps 0 with a ratio: verl's `<= 0` takes int(0.2 x 10) = 2 warmup steps
    cfg = OptimConfig(lr=2.0, lr_warmup_steps=0, lr_warmup_steps_ratio=0.2, warmup_style="cosine", num_cycles=1.0,
                      zero_indexed_step=False)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # s = step + 1: 1/2, then p = (s - 2) / 8 through a whole cosine: 1, cos(pi/4), 0, cos(3pi/4), -1, ...
    want = [0.5, 1.0] + [0.5 * (1 + math.cos(2 * math.pi * (s - 2) / 8)) for s in range(3, 11)]
    assert lrs == pytest.approx([2.0 * w for w in want], abs=1e-12)
    assert lrs[5] == pytest.approx(0.0, abs=1e-12)  # step 5: s = 6, p = 0.5, the trough


# ------------------------------------------------------------------------------------------ loss_scale_factor
def test_seq_mean_token_sum_norm_divides_by_loss_scale_factor():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    mb = Batch({"response_mask": mask})
    # verl agg_loss: seq sums 6 and 4, seq-mean (6 + 4) / 2 = 5, then / loss_scale_factor (null: T = 3)
    assert global_counts(mb)["max_len"] == 3
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", **global_counts(mb))) == pytest.approx(5 / 3)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", **global_counts(mb, 4.0))) == 1.25
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", **global_counts(mb, 0.5))) == 10.0  # as given
    # the other modes do not read it
    assert float(aggregate_loss(loss, mask, "token-mean", **global_counts(mb, 4.0))) == 2.5  # 10 / 4 tokens


def test_seq_mean_counts_a_row_rejected_whole_as_verls_trainer():
    # verl 0.10's trainer passes agg_loss global_batch_size = ppo_mini_batch_size x n: a row rejected whole by
    # rollout correction (mask 0) still counts. The driver flags the rows that count (`seq_counted`; world-size
    # padding rows are not). Rows: sums 6 and 4, a rejected row, a padding row ->
    # seq-mean-token-sum (6 + 4 + 0) / 3 = 3.333333 (not (6 + 4) / 2 = 5); seq-mean-token-mean (2 + 4 + 0) / 3 = 2;
    # token-mean 10 / 4 valid tokens = 2.5.
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [0, 0, 0]])
    counts = global_counts(Batch({"response_mask": mask, "seq_counted": torch.tensor([True, True, True, False])}))
    assert counts["global_seqs"] == 3 and counts["global_tokens"] == 4
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum", **counts)) == pytest.approx(10 / 3)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean", **counts)) == pytest.approx(2.0)
    assert float(aggregate_loss(loss, mask, "token-mean", **counts)) == pytest.approx(2.5)
    # without rejection there is no flag: the rows with a valid token count (padding rows have none)
    assert global_counts(Batch({"response_mask": mask}))["global_seqs"] == 2


def test_loss_scale_factor_config_critic_follows_actor_and_must_be_positive():
    cfg = load_config([f"{A}.loss_scale_factor=4096"])
    assert (cfg.actor_rollout_ref.actor.loss_scale_factor, cfg.critic.loss_scale_factor) == (4096, 4096)
    cfg = load_config([f"{A}.loss_scale_factor=4096", "critic.loss_scale_factor=512"])
    assert cfg.critic.loss_scale_factor == 512
    assert load_config([]).critic.loss_scale_factor is None
    with pytest.raises(ConfigError, match=rf"{A}.loss_scale_factor must be > 0"):
        load_config([f"{A}.loss_scale_factor=0"])


def test_critic_loss_agg_mode_follows_the_actors():
    # verl: critic.loss_agg_mode = ${oc.select:actor_rollout_ref.actor.loss_agg_mode,token-mean}
    assert load_config([f"{A}.loss_agg_mode=seq-mean-token-mean"]).critic.loss_agg_mode == "seq-mean-token-mean"
    assert load_config([f"{A}.loss_agg_mode=seq-mean-token-mean",
                        "critic.loss_agg_mode=token-sum"]).critic.loss_agg_mode == "token-sum"
    assert load_config([]).critic.loss_agg_mode == "token-mean"
    with pytest.raises(ConfigError, match="critic.loss_agg_mode"):
        load_config(["critic.loss_agg_mode=token-avg"])


# ------------------------------------------------------------------------------------------ optimizer class
def _params():
    return [torch.nn.Parameter(torch.ones(2, 2))]


def _optim(*items: str) -> OptimConfig:
    return load_config(list(items)).actor_rollout_ref.actor.optim


def test_default_is_adamw_with_tillers_hyperparameters():
    cfg = _optim(f"{A}.optim.lr=3e-4", f"{A}.optim.betas=[0.8,0.95]", f"{A}.optim.eps=1e-6",
                 f"{A}.optim.weight_decay=0.1")
    opt = make_optimizer(_params(), cfg, "k")
    ref = torch.optim.AdamW(_params(), lr=3e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    assert type(opt) is torch.optim.AdamW
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in ref.param_groups[0].items() if k != "params"}
    # Megatron's name (verl's Megatron layout default) is the same decoupled AdamW
    assert type(make_optimizer(_params(), _optim(f"{A}.optim.optimizer=adam"), "k")) is torch.optim.AdamW


def test_sgd_gets_lr_and_weight_decay_and_override_kwargs_no_betas():
    cfg = _optim(f"{A}.optim.optimizer=SGD", f"{A}.optim.optimizer_impl=torch.optim", f"{A}.optim.lr=0.5",
                 f"{A}.optim.weight_decay=0.02", f"+{A}.optim.override_optimizer_config.momentum=0.9",
                 f"+{A}.optim.override_optimizer_config.nesterov=true")
    group = make_optimizer(_params(), cfg, "k").param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"], group["nesterov"]) == (0.5, 0.02, 0.9, True)
    assert "betas" not in group and "eps" not in group


def test_override_kwargs_reach_adamw_and_may_replace_verls_own():
    cfg = _optim(f"+{A}.optim.override_optimizer_config.amsgrad=true",
                 f"+{A}.optim.override_optimizer_config.weight_decay=0.0")
    opt = make_optimizer(_params(), cfg, "k")
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["amsgrad"] is True
    assert opt.param_groups[0]["weight_decay"] == 0.0  # override last, as verl's optimizer_args.update


@pytest.mark.parametrize("items, match", [
    ([f"{A}.optim.optimizer_impl=no_such_pkg.optim"], rf"{A}.optim.optimizer_impl='no_such_pkg.optim': cannot import"),
    ([f"{A}.optim.optimizer=AdamQ"], rf"{A}.optim.optimizer='AdamQ': torch.optim has no class of that name.*AdamW"),
    ([f"{A}.optim.optimizer=lr_scheduler"], rf"{A}.optim.optimizer='lr_scheduler': .*not an optimizer class"),
    ([f"{A}.optim.optimizer=LBFGS"], "needs a closure"),
    ([f"+{A}.optim.override_optimizer_config.momentm=0.9", f"{A}.optim.optimizer=SGD"],
     rf"{A}.optim.override_optimizer_config: torch.optim.sgd.SGD\(.*momentm"),
    ([f"+{A}.optim.override_optimizer_config.nesterov=true", f"{A}.optim.optimizer=SGD"],
     rf"{A}.optim.override_optimizer_config: .*Nesterov"),  # a value the constructor rejects
    ([f"{A}.optim.optimizer=SGD", f"{A}.optim.betas=[0.8,0.9]"], rf"{A}.optim.betas=\[0.8, 0.9\] does not reach"),
    ([f"{A}.optim.optimizer=RMSprop", f"{A}.optim.eps=1e-5"], rf"{A}.optim.eps=1e-05 does not reach"),
    (["algorithm.adv_estimator=gae", "critic.optim.optimizer=Nope"], r"critic.optim.optimizer='Nope'"),
])
def test_bad_optimizer_is_a_load_time_error_naming_the_key(items, match):
    with pytest.raises(ConfigError, match=match):
        load_config(items)


def test_critic_optimizer_checked_only_when_a_critic_is_built():
    cfg = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "critic.optim.optimizer=Nope"])
    assert cfg.critic.optim.optimizer == "Nope"


# ------------------------------------------------------------------------------------------ the actor worker
def _actor(model_dir, *extra: str):
    from tiller.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=hf",
                       f"{A}.ppo_micro_batch_size_per_gpu=4", f"{A}.ppo_mini_batch_size=4", "data.train_batch_size=4",
                       "actor_rollout_ref.rollout.n=2", f"{A}.loss_agg_mode=seq-mean-token-sum-norm",
                       f"{A}.grad_clip=1e9", f"{A}.optim.optimizer=SGD", f"{A}.optim.lr=1.0",
                       f"{A}.optim.weight_decay=0.0", *extra])
    return ActorRolloutRefWorker(cfg, total_training_steps=1)


def _update_batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    rmask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])[:, None]).long()
    prompts, responses = torch.randint(5, 300, (8, 4), generator=g), torch.randint(5, 300, (8, 5), generator=g)
    return Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": torch.cat([torch.ones(8, 4, dtype=torch.long), rmask], 1),
                  "response_mask": rmask, "advantages": torch.randn(8, 5, generator=g) * rmask,
                  "old_log_probs": -torch.rand(8, 5, generator=g) - 5.0,
                  "values": torch.randn(8, 5, generator=g) * rmask, "returns": torch.randn(8, 5, generator=g) * rmask},
                 meta={"mini_batch_size": 8, "temperature": 1.0})


def _assert_half_step(deltas):
    scale = max(float(d.abs().max()) for d in deltas[0].values())
    assert scale > 1e-6
    for k in deltas[0]:
        torch.testing.assert_close(deltas[1][k], 0.5 * deltas[0][k], atol=1e-5 * scale, rtol=1e-4)


def test_actor_with_sgd_and_loss_scale_factor(tiny_model_dir):
    batch = _update_batch()
    # SGD, lr 1, no momentum / decay: the weight change is -gradient, so the two runs compare gradients directly.
    # T = 5: loss_scale_factor 10 divides the loss, so the gradient, by 10 instead of 5: half of it.
    deltas, metrics = [], []
    for extra in ([], [f"{A}.loss_scale_factor=10"]):
        w = _actor(tiny_model_dir, *extra)
        assert type(w.optimizer) is torch.optim.SGD and w.optimizer.param_groups[0]["lr"] == 1.0
        before = w.state_dict()
        metrics.append(w.update_actor(batch))
        deltas.append({k: v - before[k] for k, v in w.state_dict().items()})
    _assert_half_step(deltas)
    assert metrics[1]["actor/pg_loss"] == pytest.approx(0.5 * metrics[0]["actor/pg_loss"], rel=1e-5)
    assert metrics[1]["actor/grad_norm"] == pytest.approx(0.5 * metrics[0]["actor/grad_norm"], rel=1e-5)


def test_critic_with_sgd_follows_the_actors_loss_scale_factor(tiny_model_dir):
    from tiller.workers.critic import CriticWorker

    batch = _update_batch()
    deltas, metrics = [], []
    for extra in ([], [f"{A}.loss_scale_factor=10"]):  # critic.loss_scale_factor null: the actor's, as verl's default
        cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "algorithm.adv_estimator=gae",
                           "critic.ppo_micro_batch_size_per_gpu=4", "critic.loss_agg_mode=seq-mean-token-sum-norm",
                           "critic.grad_clip=1e9", "critic.optim.optimizer=SGD", "critic.optim.lr=1.0",
                           "critic.optim.weight_decay=0.0", *extra])
        w = CriticWorker(cfg, total_training_steps=1)
        assert type(w.optimizer) is torch.optim.SGD
        before = {k: v.detach().clone() for k, v in w.module.state_dict().items()}
        metrics.append(w.update_critic(batch))
        deltas.append({k: v - before[k] for k, v in w.module.state_dict().items()})
    _assert_half_step(deltas)  # T = 5: divided by 10 instead of 5
    assert metrics[1]["critic/vf_loss"] == pytest.approx(0.5 * metrics[0]["critic/vf_loss"], rel=1e-5)


# ------------------------------------------------------------------------------------------ checkpoints
class _Wrapped:  # FSDP2's gathered optimizer state hands the optimizer on as `.optimizer`
    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_resume_with_another_optimizer_class_is_refused(tmp_path):
    adamw = torch.optim.AdamW(_params(), lr=1e-3)
    path = save_checkpoint(tmp_path, 1, optimizer=adamw, extra_states={"critic_optimizer": adamw})
    assert optimizer_class_name(_Wrapped(adamw)) == "torch.optim.adamw.AdamW"
    assert load_checkpoint(path, optimizer=torch.optim.AdamW(_params()), restore_rng=False)["step"] == 1
    sgd = torch.optim.SGD(_params(), lr=0.1)
    with pytest.raises(UserError, match=r"^optimizer.pt holds torch.optim.adamw.AdamW state but this run builds "
                                        r"torch.optim.sgd.SGD"):
        load_checkpoint(path, optimizer=_Wrapped(sgd), restore_rng=False)
    with pytest.raises(UserError, match=r"^critic_optimizer.pt holds .* builds torch.optim.sgd.SGD"):
        load_checkpoint(path, extra_states={"critic_optimizer": sgd}, restore_rng=False)
    assert "momentum" in sgd.param_groups[0] and "betas" not in sgd.param_groups[0]  # nothing was loaded into it
    # a checkpoint from before the classes were recorded holds AdamW state (tiller's only optimizer then)
    state = torch.load(path / "state.pt", weights_only=False)
    del state["optimizer_classes"]
    torch.save(state, path / "state.pt")
    with pytest.raises(UserError, match="holds torch.optim.adamw.AdamW state"):
        load_checkpoint(path, optimizer=sgd, restore_rng=False)
    assert load_checkpoint(path, optimizer=torch.optim.AdamW(_params()), restore_rng=False)["step"] == 1
