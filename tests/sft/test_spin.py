"""`tiller spin`: the SPIN loss with worked numbers, the pairs it builds, and a tiny run in which the SFT target's
likelihood rises relative to the model's own generation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tiller.algos import dpo_loss
from tiller.config import load_config
from tiller.config.jobs import SPINConfig, validate_job
from tiller.errors import ConfigError


def test_spin_loss_worked_numbers():
    # Paper Eq. 4.7 with the logistic loss l(t) = log(1 + e^-t), lambda = 0.5:
    #   real y:       log p_theta = -2, log p_theta_t = -3   -> log ratio +1
    #   generated y': log p_theta = -1, log p_theta_t = -1.5 -> log ratio +0.5
    #   t = 0.5 * 1 - 0.5 * 0.5 = 0.25;  l(0.25) = log(1 + e^-0.25) = 0.575939
    # d l / d log p_theta(y) = -lambda * sigma(-t) = -0.5 * 0.437823 = -0.218912 (pushes the real response up),
    # d l / d log p_theta(y') = +0.218912 (pushes the generation down).
    real = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    gen = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    loss, r_real, r_gen = dpo_loss(real, gen, torch.tensor([-3.0], dtype=torch.float64),
                                   torch.tensor([-1.5], dtype=torch.float64), beta=0.5)
    assert float(loss.detach()) == pytest.approx(0.575939, abs=1e-6)
    assert (float(r_real), float(r_gen)) == pytest.approx((0.5, 0.25))
    loss.sum().backward()
    assert float(real.grad) == pytest.approx(-0.218912, abs=1e-6)
    assert float(gen.grad) == pytest.approx(0.218912, abs=1e-6)
    # at the start of an iteration p_theta = p_theta_t: t = 0, the loss is log 2 whatever the pair
    loss0, _, _ = dpo_loss(real.detach(), gen.detach(), real.detach(), gen.detach(), beta=0.5)
    assert float(loss0) == pytest.approx(math.log(2))


def test_spin_pairs_take_the_target_as_chosen_and_the_generation_as_rejected():
    from tiller.trainer.spin import spin_pairs

    rows = [([5, 6], [7, 8, 2], "row 0")]
    pairs = spin_pairs(rows, [[9, 2]], max_length=16, truncation="error")
    assert pairs[0].chosen.input_ids == [5, 6, 7, 8, 2] and pairs[0].rejected.input_ids == [5, 6, 9, 2]
    assert pairs[0].rejected.num_loss_tokens == 2  # the loss is on the completion only


@pytest.mark.parametrize("override, match", [
    ("algorithm.iterations=0", "algorithm.iterations"),
    ("algorithm.beta=0", "algorithm.beta"),
    ("algorithm.temperature=0", "algorithm.temperature"),
    ("algorithm.top_p=1.5", "algorithm.top_p"),
    ("model.ref_path=/x", "model.ref_path"),
    ("algorithm.lambda=0.1", "algorithm.lambda"),
])
def test_bad_spin_settings_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(["model.partial_pretrain=M", "data.train_files=[x.jsonl]", override], schema=SPINConfig,
                    validate=validate_job)


def test_spin_raises_the_target_likelihood_relative_to_its_own_generation(tiny_model_dir, tmp_path):
    """Two iterations on 32 arithmetic SFT rows: in each, the mean log p(y|x) - log p(y'|x) over its pairs rises."""
    from tiller.trainer.spin import run_spin

    rows = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in zip(range(10, 42), range(50, 82))]
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config([f"model.partial_pretrain={tiny_model_dir}", f"data.train_files=[{data}]",
                       "data.apply_chat_template=false", "data.max_length=32", "data.train_batch_size=8",
                       "data.micro_batch_size_per_gpu=8", "optim.lr=1e-3", "optim.lr_scheduler=constant",
                       "trainer.total_epochs=2", "trainer.logger=[jsonl]", "algorithm.iterations=2",
                       "algorithm.max_new_tokens=6", "algorithm.beta=0.1",
                       f"trainer.default_local_dir={tmp_path / 'run'}"], schema=SPINConfig, validate=validate_job)
    summary = run_spin(cfg)
    its = summary["iterations"]
    assert [r["iteration"] for r in its] == [0, 1]
    for r in its:
        print(f"iteration {r['iteration']}: margin {r['margin_before']:.2f} -> {r['margin_after']:.2f}")
        assert r["margin_after"] > r["margin_before"] + 1.0
    assert its[1]["model_in"].endswith("iter_0/hf_model")  # the reference of iteration 1 is iteration 0's model
    assert (tmp_path / "run" / "hf_model" / "config.json").exists()
    pairs = [json.loads(line) for line in (tmp_path / "run" / "iter_0" / "pairs.jsonl").read_text().splitlines()]
    assert len(pairs) == 32 and pairs[0]["real"] == "60"
    # run again: both iterations are done, nothing is retrained
    again = run_spin(cfg)
    assert again["iterations"] == its
