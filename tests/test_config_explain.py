"""`tiller config explain`: batch arithmetic worked out by hand, problems in plain words, and the peak-memory
estimate against the measured peak RSS of short CPU runs (the 2M model in the fast lane, 30M slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiller.config import load_config
from tiller.config.explain import (
    Arithmetic,
    ModelShape,
    batch_arithmetic,
    explain,
    memory_estimate,
    model_shape,
    one_line,
)
from tiller.models.tiny import count_params


def test_batch_arithmetic_worked_numbers():
    # 8 prompts x n 3 = 24 samples; mini-batch 4 prompts -> 2 mini-batches of 12 samples, x 2 epochs = 4 optimizer
    # steps; 2 ray workers -> 6 samples per rank per mini-batch, micro-batches of 2 -> 3 (grad accumulation);
    # lengths 48 + 16 = 64 -> 2 x 64 = 128 tokens per micro-batch
    cfg = load_config(["data.train_batch_size=8", "actor_rollout_ref.rollout.n=3",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=2",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.backend=ray",
                       "trainer.n_gpus_per_node=2", "data.max_prompt_length=48", "data.max_response_length=16",
                       "trainer.total_epochs=3"])
    a = batch_arithmetic(cfg)
    assert (a.samples_per_step, a.mini_batches_per_step, a.optimizer_steps_per_step) == (24, 2, 4)
    assert (a.workers, a.samples_per_rank, a.grad_accumulation, a.tokens_per_micro_batch) == (2, 6, 3, 128)
    assert a.total_steps is None and not a.problems  # no training files to count
    # dynamic batches: budget 200 tokens holds 200 // 64 = 3 rows -> ceil(6 / 3) = 2 micro-batches per rank
    cfg.actor_rollout_ref.actor.use_dynamic_bsz, cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = True, 200
    a = batch_arithmetic(cfg)
    assert (a.rows_per_dynamic_micro_batch, a.grad_accumulation) == (3, 2)


def test_problems_in_plain_words_with_the_fix(tmp_path):
    # 2 prompts x n 3 = 6 samples per mini-batch over 4 workers: does not split
    cfg = load_config(["data.train_batch_size=2", "actor_rollout_ref.rollout.n=3",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.backend=ray",
                       "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    problems = batch_arithmetic(cfg).problems
    assert any("not a multiple of the 4 data-parallel workers" in p and "Fix:" in p for p in problems), problems
    # steps from the training file's row count: 10 prompts // 4 = 2 per epoch, x 3 epochs
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join('{"prompt": "x"}\n' for _ in range(10)))
    cfg = load_config([f"data.train_files=[{rows}]", "data.train_batch_size=4", "actor_rollout_ref.actor."
                       "ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                       "trainer.total_epochs=3"])
    a = batch_arithmetic(cfg)
    assert (a.prompts, a.steps_per_epoch, a.total_steps) == (10, 2, 6)


def test_memory_estimate_components(tiny_model_dir):
    # weights 4 N, gradients 4 N, AdamW 8 N (one rank, no reference without a KL term)
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}"])
    shape = model_shape(str(tiny_model_dir))
    mem = memory_estimate(cfg, shape)
    assert (mem["weights"], mem["gradients"], mem["optimizer"], mem["reference"]) == (
        4 * shape.params, 4 * shape.params, 8 * shape.params, 0)
    cfg.actor_rollout_ref.actor.use_kl_loss = True
    assert memory_estimate(cfg, shape)["reference"] == 4 * shape.params
    # the optimizer's state is the configured class's: plain SGD keeps none, SGD with momentum one fp32 buffer
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.actor.optim.optimizer=SGD",
                       "actor_rollout_ref.actor.optim.optimizer_impl=torch.optim", "actor_rollout_ref.actor.optim."
                       "weight_decay=0"])
    assert memory_estimate(cfg, shape)["optimizer"] == 0
    cfg.actor_rollout_ref.actor.optim.override_optimizer_config = {"momentum": 0.9}
    assert memory_estimate(cfg, shape)["optimizer"] == 4 * shape.params
    text = explain(cfg)
    assert "samples per step" in text and "peak memory per rank" in text and "optimizer" in text
    assert "peak memory per rank ~" in one_line(cfg)


def test_memory_estimate_counts_the_ppo_critic(tiny_model_dir):
    # the value model is the actor's body + a value head (tiller's critic: AutoModelForTokenClassification, num_labels
    # 1): its parameter count is read off the shape exactly; AdamW -> 4 + 8 bytes per parameter resident
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    base = [f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.n=4"]
    shape = model_shape(str(tiny_model_dir))
    with torch.device("meta"):
        critic = AutoModelForTokenClassification.from_config(AutoConfig.from_pretrained(tiny_model_dir, num_labels=1))
    n_critic = sum(p.numel() for p in critic.parameters())
    assert n_critic == shape.params - shape.lm_head + shape.hidden + 1
    grpo = memory_estimate(load_config([*base, "algorithm.adv_estimator=grpo"]), shape)
    gae = memory_estimate(load_config([*base, "algorithm.adv_estimator=gae"]), shape)
    assert (grpo["critic"], grpo["critic_update"]) == (0, 0)
    assert gae["critic"] == 12 * n_critic and gae["critic_update"] > 4 * n_critic
    assert gae["peak"] >= grpo["peak"] + 12 * n_critic
    # LoRA on the critic: full weights, optimizer state only for the adapters and the head
    lora = memory_estimate(load_config([*base, "algorithm.adv_estimator=gae", "critic.model.lora_rank=4"]), shape)
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_dim
    adapters = 4 * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 3) * shape.layers
    assert lora["critic"] == 4 * n_critic + 8 * (adapters + h + 1)
    assert "critic" in explain(load_config([*base, "algorithm.adv_estimator=gae"]))


def test_model_shape_counts_parameters_exactly(tiny_model_dir):
    import json

    hf = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    shape = model_shape(str(tiny_model_dir))
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "head_dim")
    expected = count_params({k: hf[k] for k in keys}, hf["vocab_size"], "qwen2")
    assert shape.params == expected


# the peak resident set of the child's own address space: /proc/self/status VmHWM (Linux), which starts afresh at
# exec; getrusage's ru_maxrss is kept across execve, so a child forked from a big pytest process would report the
# parent's size (the fallback off Linux)
# the peak RSS less the file-backed pages resident at the end (the shared libraries' code, mapped once and kept):
# how many of a library's pages are resident depends on the page cache's state (a freshly installed torch maps
# ~2x the pages of one read back from disk), not on tiller, so the estimate is held against the anonymous peak
PEAK = ("def _peak():\n"
        "    import resource\n"
        "    try:\n"
        "        status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
        "        return int(status['VmHWM'].split()[0]) - int(status['RssFile'].split()[0])\n"
        "    except (OSError, KeyError, ValueError):\n"
        "        pass\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n")
IDLE = (PEAK + "import sys, torch, transformers, pyarrow.parquet\n"
        "import tiller.cli, tiller.trainer.rl, tiller.rewards, tiller.workers.actor\n"
        "print('MAXRSS', _peak(), file=sys.stderr)\n")
RUN = (PEAK + "import sys\nfrom tiller.cli import main\n"
       "try:\n    main(sys.argv[1:])\nfinally:\n"
       "    print('MAXRSS', _peak(), file=sys.stderr)\n")


def _maxrss(code: str, args=()) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("MAXRSS")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return int(lines[-1].split()[1]) * 1024  # Linux: KiB


@pytest.mark.parametrize("n_params,estimator", [(2_000_000, "grpo"),
                                                 pytest.param(2_000_000, "gae", marks=pytest.mark.slow),
                                                 pytest.param(30_000_000, "grpo", marks=pytest.mark.slow),
                                                 pytest.param(30_000_000, "gae", marks=pytest.mark.slow)])
def test_memory_estimate_within_35_percent_of_measured_peak_rss(tmp_path, n_params, estimator):
    from tiller.models.tiny import make_tiny_model
    from tiller.tasks import arithmetic

    model = make_tiny_model(tmp_path / "model", n_params=n_params, seed=0)
    arithmetic.write_task(tmp_path, n_train=16, n_test=4, seed=0)
    (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return float(len(solution_str) % 2)\n")
    overrides = [f"actor_rollout_ref.model.path={model}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
                 "data.val_files=[]", f"custom_reward_function.path={tmp_path / 'reward.py'}",
                 "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_prompt_length=48",
                 "data.max_response_length=32", "trainer.total_training_steps=2", "trainer.logger=[jsonl]",
                 "trainer.resume_mode=disable", "trainer.val_before_train=false", "trainer.save_freq=100",
                 f"trainer.default_local_dir={tmp_path / 'run'}", f"algorithm.adv_estimator={estimator}"]
    peak, base = _maxrss(RUN, ["rl", *overrides]), _maxrss(IDLE)
    measured = peak - base
    cfg = load_config(overrides)
    estimate = memory_estimate(cfg, model_shape(str(model)))["peak"]
    print(f"{n_params / 1e6:g}M {estimator}: estimate {estimate / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB")
    assert abs(estimate - measured) <= 0.35 * measured, (estimate / 2**20, measured / 2**20, peak / 2**20, base / 2**20)


def test_memory_estimate_counts_the_distillation_teacher_and_prime_prm(tiny_model_dir):
    # a teacher: one frozen fp32 copy (4 N); PRIME: PRM weights + AdamW (12 N / W) and its frozen reference (4 N)
    base = ["actor_rollout_ref.model.path=" + str(tiny_model_dir), "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=4"]
    shape = model_shape(str(tiny_model_dir))
    plain = memory_estimate(load_config(base), shape)
    teacher = memory_estimate(load_config([*base, f"algorithm.distill.teacher_path={tiny_model_dir}"]), shape)
    assert teacher["teacher"] == 4 * shape.params and teacher["peak"] == plain["peak"] + 4 * shape.params
    # gjsd: the teacher's logits of a micro-batch's responses, two fp32 copies (r x T_resp x V x 4 x 2)
    gjsd = memory_estimate(load_config([*base, f"algorithm.distill.teacher_path={tiny_model_dir}",
                                        "algorithm.distill.loss_mode=gjsd",
                                        "algorithm.distill.use_policy_gradient=false"]), shape)
    cfg = load_config(base)
    rows = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    extra = rows * cfg.data.max_response_length * shape.vocab * 4 * 2
    assert gjsd["activations"] == teacher["activations"] + extra > teacher["activations"]
    prime = memory_estimate(load_config([*base, "algorithm.adv_estimator=prime"]), shape)
    assert prime["prm"] == 16 * shape.params and prime["peak"] == plain["peak"] + 16 * shape.params


def test_sequence_parallel_splits_tokens_not_rows():
    """actor.ulysses_sequence_parallel_size=2 on 4 Ray workers: 2 data-parallel replicas hold the rows (8 per
    mini-batch instead of 4), the budget is per worker (x 2), and the activation estimate is halved."""
    base = ["trainer.backend=ray", "trainer.n_gpus_per_node=4", "actor_rollout_ref.model.use_remove_padding=true",
            "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"]
    plain = batch_arithmetic(load_config(base), count_prompts=False)
    split = batch_arithmetic(load_config([*base, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]),
                             count_prompts=False)
    assert (plain.data_parallel, plain.samples_per_rank, plain.token_budget) == (4, 4, 4096)
    assert (split.data_parallel, split.samples_per_rank, split.token_budget) == (2, 8, 8192)
    shape = ModelShape(params=10_000_000, layers=4, hidden=256, kv_dim=256, intermediate=768, vocab=1000)
    cfg = load_config([*base, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    same_rows = Arithmetic(**{**split.__dict__, "seq_parallel": 1})
    assert memory_estimate(cfg, shape, split)["activations"] == memory_estimate(cfg, shape, same_rows)["activations"] // 2


def test_async_runs_are_explained_with_their_schedule_and_place():
    """Asynchronous RL: how far generation runs ahead (verl's rule: floor((1 + s) x trigger) batches per sync) and
    where: a thread of this process, or a Ray rollout pool of rollout.nnodes x rollout.n_gpus_per_node workers."""
    assert "asynchronous RL" not in explain(load_config([]))
    local = explain(load_config(["async_training.staleness_threshold=0.5",
                                 "async_training.trigger_parameter_sync_step=2"]))
    assert "at most 3 step batches per weight sync (every 2 step(s)); samples at most 1 version(s) old" in local
    assert "a thread of this process" in local
    pool = explain(load_config(["trainer.backend=ray", "trainer.n_gpus_per_node=2", "rollout.nnodes=2",
                                "rollout.n_gpus_per_node=3", "async_training.staleness_threshold=1",
                                "async_training.partial_rollout=true"]))
    assert "at most 2 step batches per weight sync (every 1 step(s)); samples at most 1 version(s) old; partial" in pool
    assert "rollout pool               6 workers of their own" in pool and "the 2 trainer workers only update" in pool
