"""transformers' cosine_with_restarts, polynomial, inverse_sqrt and warmup_stable_decay schedules in tiller (the RL
optimizers' `optim.warmup_style` and the jobs' `optim.lr_scheduler`, keywords in `optim.lr_scheduler_kwargs`): the lr
of every step equals transformers' own `get_scheduler` with the same warmup, total and keywords; worked numbers
pin the formulas; bad keywords are refused naming the key."""

from __future__ import annotations

import math

import pytest
import torch

from tiller.config import load_config
from tiller.config.jobs import JobOptimConfig
from tiller.config.schema import OptimConfig
from tiller.errors import ConfigError
from tiller.models.optimizer import hf_schedule_factor
from tiller.workers.common import build_scheduler, lr_lambda

LR, WARMUP, TOTAL = 1e-3, 3, 20
CASES = [
    ("cosine_with_restarts", {}), ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {}), ("polynomial", {"lr_end": 1e-4, "power": 2.0}),
    ("inverse_sqrt", {}), ("inverse_sqrt", {"timescale": 7}),
    ("warmup_stable_decay", {"num_decay_steps": 6}),
    ("warmup_stable_decay", {"num_decay_steps": 5, "num_stable_steps": 8, "warmup_type": "cosine",
                             "decay_type": "1-sqrt", "min_lr_ratio": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 4, "warmup_type": "1-sqrt", "decay_type": "linear"}),
]


def _lrs(make) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = make(opt)
    out = []
    for _ in range(TOTAL + 2):  # two steps past the end: polynomial's lr_end, wsd's floor
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("style, kwargs", CASES, ids=[f"{s}-{i}" for i, (s, _) in enumerate(CASES)])
def test_every_step_equals_transformers(style, kwargs):
    from transformers import get_scheduler

    want = _lrs(lambda opt: get_scheduler(style, opt, num_warmup_steps=WARMUP, num_training_steps=TOTAL,
                                          scheduler_specific_kwargs=dict(kwargs)))
    # the RL actor / critic (verl's keys + tiller's)
    rl = OptimConfig(lr=LR, lr_warmup_steps=WARMUP, warmup_style=style, lr_scheduler_kwargs=dict(kwargs))
    assert _lrs(lambda opt: build_scheduler(opt, rl, total_steps=TOTAL)) == pytest.approx(want, rel=1e-12, abs=1e-15)
    # the SFT / RM / DPO / KTO job loop's lambda
    job = lambda step: lr_lambda(step, warmup=WARMUP, total=TOTAL, style=style, min_lr_ratio=0.0,  # noqa: E731
                                 from_zero=True, lr=LR, kwargs=dict(kwargs))
    assert _lrs(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, job)) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert len(set(round(v, 12) for v in want)) > 4  # the schedule moves


@pytest.mark.parametrize("style, kwargs, step, want", [
    ("cosine_with_restarts", {"num_cycles": 2}, 6, 1.0),  # progress 0.5 -> (2 x 0.5) % 1 = 0: a restart
    ("cosine_with_restarts", {"num_cycles": 2}, 4, 0.5),  # progress 0.25 -> 0.5 -> (1 + cos(pi / 2)) / 2
    ("polynomial", {"lr_end": 1e-4, "power": 2.0}, 6, 0.325),  # (0.9e-3 x 0.5^2 + 1e-4) / 1e-3
    ("polynomial", {"lr_end": 1e-4}, 11, 0.1),  # past the end: lr_end / lr
    ("inverse_sqrt", {}, 8, 0.5),  # timescale = warmup 2: 1 / sqrt((8 + 0) / 2)
    ("warmup_stable_decay", {"num_decay_steps": 4}, 5, 1.0),  # stable: steps 2-5
    ("warmup_stable_decay", {"num_decay_steps": 4, "decay_type": "linear"}, 8, 0.5),  # 1 - 2 / 4
    ("warmup_stable_decay", {"num_decay_steps": 4, "min_lr_ratio": 0.2}, 10, 0.2),  # after the decay: the floor
])
def test_worked_numbers(style, kwargs, step, want):
    got = hf_schedule_factor(step, style=style, warmup=2, total=10, lr=1e-3, kwargs=kwargs)
    assert math.isclose(got, want, abs_tol=1e-12)


def test_a_job_runs_the_schedule(tiny_model_dir, tmp_path):
    import json

    from tests.sft.conftest import MEMO, job_overrides, write_jsonl
    from tiller.config.jobs import SFTConfig, validate_job
    from tiller.trainer.sft import train_sft

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": p, "response": r} for p, r in MEMO])
    run = tmp_path / "run"
    train_sft(load_config(job_overrides(tiny_model_dir, data, run, **{
        "optim.lr_scheduler": "polynomial", "optim.lr_scheduler_kwargs": "{lr_end: 1e-4, power: 2.0}",
        "optim.lr": 1e-3, "optim.warmup_steps_ratio": 0.25, "trainer.total_training_steps": 8,
        "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 8, "trainer.export_hf": False}),
        schema=SFTConfig, validate=validate_job))
    lrs = [json.loads(line)["train/lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    # logged after each step: the next step's lr. Warmup int(0.25 x 8) = 2 from 0 (steps 0, 1: 0, 5e-4), then
    # 0.9e-3 (1 - (s - 2) / 6)^2 + 1e-4
    want = [5e-4] + [0.9e-3 * (1 - (s - 2) / 6) ** 2 + 1e-4 for s in range(2, 9)]
    assert len(lrs) == 8 and lrs == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("overrides, match", [
    (["actor_rollout_ref.actor.optim.warmup_style=polynomial",
      "+actor_rollout_ref.actor.optim.lr_scheduler_kwargs.lr_end=1e-3"],
     r"actor_rollout_ref\.actor\.optim\.lr_scheduler_kwargs\.lr_end=0\.001 must be below the peak lr"),
    (["critic.optim.warmup_style=cosine", "+critic.optim.lr_scheduler_kwargs.num_cycles=2"],
     r"critic\.optim\.lr_scheduler_kwargs\.num_cycles: not a keyword of the 'cosine' schedule \(it takes: none\)"),
    (["actor_rollout_ref.actor.optim.warmup_style=warmup_stable_decay"],
     r"lr_scheduler_kwargs\.num_decay_steps: warmup_stable_decay needs its decay steps"),
    (["actor_rollout_ref.actor.optim.warmup_style=inverse_sqrt",
      "+actor_rollout_ref.actor.optim.lr_scheduler_kwargs.timescal=5"],
     r"lr_scheduler_kwargs\.timescal: not a keyword of the 'inverse_sqrt' schedule \(it takes: timescale\)"),
])
def test_bad_keywords_are_refused_naming_the_key(tiny_model_dir, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", *overrides])


def test_job_keywords_are_checked():
    from tiller.config.jobs import validate_job  # noqa: F401  (the job check is check_schedule_kwargs too)
    from tiller.models.optimizer import check_schedule_kwargs

    assert JobOptimConfig().lr_scheduler_kwargs == {}
    with pytest.raises(ConfigError, match=r"optim\.lr_scheduler_kwargs\.warmup_type='square': one of linear"):
        check_schedule_kwargs("warmup_stable_decay", {"num_decay_steps": 2, "warmup_type": "square"}, 1e-3,
                              "optim.lr_scheduler_kwargs")


def test_trl_grpo_maps_the_schedule_onto_the_actor(tiny_model_dir, tmp_path):
    from tests.trl_front.test_trl_grpo_translate import translate

    keys, _, _ = translate(tiny_model_dir, tmp_path, lr_scheduler_type="warmup_stable_decay", warmup_steps=2,
                           lr_scheduler_kwargs={"num_decay_steps": 3, "decay_type": "1-sqrt"})
    optim = "actor_rollout_ref.actor.optim"
    assert keys[f"{optim}.warmup_style"] == "warmup_stable_decay"
    assert keys[f"{optim}.lr_scheduler_kwargs"] == {"num_decay_steps": 3, "decay_type": "1-sqrt"}
    assert keys[f"{optim}.lr_warmup_steps"] >= 1
    # k = 4 optimizer steps per generation batch: TRL's step counts (warmup, decay steps) become tiller steps
    keys, _, _ = translate(tiny_model_dir, tmp_path, lr_scheduler_type="warmup_stable_decay", warmup_steps=8,
                           per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                           steps_per_generation=4, num_iterations=2,
                           lr_scheduler_kwargs={"num_decay_steps": 8, "num_stable_steps": 6})
    assert keys[f"{optim}.lr_warmup_steps"] == 2
    assert keys[f"{optim}.lr_scheduler_kwargs"] == {"num_decay_steps": 2, "num_stable_steps": 2}
