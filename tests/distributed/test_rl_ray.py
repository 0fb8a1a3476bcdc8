"""GRPO through the real driver on Ray: 2 workers x 1 thread == one process; a killed worker is named
and resume_mode=auto continues the same trajectory (issue 8's done-when tests).

The local reference run samples its prompts in 2 seeded chunks (`rollout_seed_chunks = 2`), as the
2 ranks do, so both runs see the same responses; everything after that is fp32 math whose only
difference is the order of the cross-rank gradient sum. The rollout runs in fp32 too (`rollout.dtype=float32`): a
bf16 rollout rounds the weights, and two runs' weights ~1e-7 apart after a step (the order of that sum) round to
different bf16 values here and there, enough to flip a sampled token (the SP run's step-2 loss 3e-3 off).

What is compared has signal, so that the order of a sum cannot decide the outcome: the reward (distinct
characters in the response) differs within every group, so every step has a real gradient; the gradient norm
before the optimizer is compared step by step; and the actor's Adam runs with eps = 1 (>> |g|), where a step is
lr * m / (1 + sqrt(v)) ~ lr * m, momentum SGD. With the default eps, Adam's first step is lr * sign(g), so a
weight whose gradient is ~0 moved by +-lr on the sign of its ~1e-9 reassociation noise (two runs 1.5e-3 apart at
lr 1e-3, a flaky test); now the weights differ by ~lr x that noise, while a defect (a rank's samples lost or
doubled) moves them by ~lr x the gradient (~1e-3 here).
"""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from tests.sft.test_router_aux import tiny_moe_dir  # noqa: E402,F401  (a fixture)
from tiller.config import load_config  # noqa: E402
from tiller.distributed import WorkerError  # noqa: E402
from tiller.tasks import arithmetic  # noqa: E402

pytestmark = pytest.mark.ray

REWARD_SRC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(set(solution_str)) / 8
'''


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_data")
    arithmetic.write_task(root, n_train=48, n_test=8, seed=0)
    (root / "reward.py").write_text(REWARD_SRC)
    return root


def make_cfg(run_dir, model_dir, data, *overrides):
    return load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data / 'train.parquet'}]",
        f"custom_reward_function.path={data / 'reward.py'}", "data.train_batch_size=4",
        "data.max_prompt_length=32", "data.max_response_length=6", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1.0", "actor_rollout_ref.actor.optim.eps=1.0",
        "actor_rollout_ref.rollout.dtype=float32", "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}", *overrides,
    ])


def train(cfg, seed_chunks=None, on_execute=None, calls=None, layout=None, critic_layout=None):
    """Fit; returns (per-step (actor/pg_loss, actor/grad_norm), final full weights). `on_execute(trainer, method)`
    runs before each actor-group call (used to kill a worker mid-step); `calls` collects (method, dispatch
    keywords) of each actor-group call; `layout` / `critic_layout` the ranks' `parallel_layout()`."""
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    try:
        if seed_chunks:
            trainer.rollout_seed_chunks = seed_chunks
        losses: list[float] = []
        execute = trainer.actor.execute

        def spy(method, *args, **kwargs):
            if on_execute:
                on_execute(trainer, method)
            if calls is not None:
                calls.append((method, {k: v for k, v in kwargs.items() if k in ("dispatch", "replicas")}))
            out = execute(method, *args, **kwargs)
            if method == "update_actor":
                losses.append((out["actor/pg_loss"], out["actor/grad_norm"]))
            return out

        trainer.actor.execute = spy
        if layout is not None:
            layout.extend(execute("parallel_layout", dispatch="all"))
        if critic_layout is not None:
            critic_layout.extend(trainer.critic.execute("parallel_layout", dispatch="all"))
        trainer.fit()
        return losses, execute("state_dict")
    finally:
        trainer.shutdown()


def assert_same(a, b, atol=1e-5, steps=2):
    (losses_a, state_a), (losses_b, state_b) = a, b
    assert len(losses_a) == len(losses_b) == steps
    assert all(norm > 0.05 for _, norm in losses_b), losses_b  # every step has a real gradient to compare
    assert [loss for loss, _ in losses_a] == pytest.approx([loss for loss, _ in losses_b], abs=atol)
    # the norm is a sum of ~1M squares in another order per backend: 3.4e-6 apart seen (ray fsdp vs local, AVX2)
    assert [norm for _, norm in losses_a] == pytest.approx([norm for _, norm in losses_b], rel=1e-4)
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        torch.testing.assert_close(state_a[key], state_b[key], atol=atol, rtol=0)


RAY = ("trainer.backend=ray", "trainer.nnodes=1", "trainer.n_gpus_per_node=2", "trainer.cpus_per_worker=1")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tiny_model_dir, rl_data):
    return train(make_cfg(tmp_path_factory.mktemp("local"), tiny_model_dir, rl_data), seed_chunks=2)


# ddp on Ray is also checked, without a training loop, by tests/distributed/test_ray_groups.py; the whole loop is slow
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_grpo_two_ray_workers_equal_one_process(strategy, ray_session, local_run, tmp_path, tiny_model_dir, rl_data):
    ray_run = train(make_cfg(tmp_path, tiny_model_dir, rl_data, *RAY, f"actor_rollout_ref.actor.strategy={strategy}"))
    assert_same(ray_run, local_run)


@pytest.mark.slow  # ~20-40 s: PPO with a critic group colocated with the actor group
@pytest.mark.parametrize("critic_lora", [(), ("critic.model.lora_rank=4", "critic.model.lora_alpha=8",
                                               "trainer.save_freq=2")], ids=["full", "lora"])
def test_ppo_gae_with_critic_two_ray_workers_equal_one_process(ray_session, tmp_path, tiny_model_dir, rl_data,
                                                              critic_lora):
    gae = ("algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "trainer.total_training_steps=1", *critic_lora)
    local = train(make_cfg(tmp_path / "local", tiny_model_dir, rl_data, *gae), seed_chunks=2)
    ray_run = train(make_cfg(tmp_path / "ray", tiny_model_dir, rl_data, *gae, *RAY, "critic.strategy=fsdp"))
    # One step (one rollout, one critic and actor update each): Adam at lr 1e-3 turns the reassociated gradient
    # sums' ~1e-7 differences into ~1e-5 on weights whose second moment is tiny (1.2e-5 seen on an AVX-512 host); a
    # defect (a rank's samples lost or doubled) moves them ~1e-3. From the second rollout on, those ~1e-5 weight
    # differences can flip a sampled token (seen at step 3 on one host, at step 2 on another), after which the runs
    # are different trajectories, not a defect: so the actor's step and both updated models are compared
    assert_same(ray_run, local, atol=5e-5, steps=1)
    from safetensors.torch import load_file  # the FSDP2 critic's checkpoint (gathered) is the one process's

    folder = "checkpoints/critic/global_step_1/model"
    name = "adapter_model.safetensors" if critic_lora else "model.safetensors"
    saved = {run: load_file(str(tmp_path / run / folder / name)) for run in ("local", "ray")}
    assert saved["local"].keys() == saved["ray"].keys()
    if critic_lora:
        assert "base_model.model.score.weight" in saved["ray"]
    for key, value in saved["local"].items():
        torch.testing.assert_close(saved["ray"][key], value, atol=5e-5, rtol=0)


@pytest.mark.slow  # ~15-35 s: two more Ray groups and FSDP2 checkpoints
def test_killed_worker_is_named_and_auto_resume_continues(ray_session, local_run, tmp_path, tiny_model_dir, rl_data):
    cfg = make_cfg(tmp_path, tiny_model_dir, rl_data, *RAY, "trainer.save_freq=1", "trainer.resume_mode=auto")

    def kill_rank1_in_step2(trainer, method):
        if method == "update_actor" and trainer.global_step == 2:  # in the second step
            import os
            import signal

            os.kill(trainer.actor.pids[1], signal.SIGKILL)

    with pytest.raises(WorkerError, match=r"'actor_rollout_ref' rank 1 \(pid \d+ .*\) died during 'update_actor'"):
        train(cfg, on_execute=kill_rank1_in_step2)
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("global_step_*"))
    assert ckpts == ["global_step_1"]
    # resume_mode=auto: a new driver picks up global_step_1 and runs step 2 only
    losses, state = train(cfg)
    assert len(losses) == 1
    (loss, norm), (local_loss, local_norm) = losses[0], local_run[0][1]
    assert loss == pytest.approx(local_loss, abs=1e-5) and norm == pytest.approx(local_norm, rel=1e-4)
    for key in state:
        torch.testing.assert_close(state[key], local_run[1][key], atol=1e-5, rtol=0)


@pytest.mark.slow  # ~40-60 s; the balancing itself: tests/trainer/test_balance_batch.py (fast lane)
def test_balance_batch_gives_each_ray_worker_equal_tokens(ray_session, local_run, tmp_path, tiny_model_dir, rl_data):
    """trainer.balance_batch on 2 Ray workers: the update batch is reordered so each worker's half holds
    (near) equal tokens, whole GRPO groups moving together; with one mini-batch per step the update does not
    depend on the order, so the run still equals the one-process run."""
    from tiller.trainer.rl import RLTrainer

    cfg = make_cfg(tmp_path, tiny_model_dir, rl_data, *RAY, "trainer.balance_batch=true",
                   "actor_rollout_ref.actor.strategy=ddp")
    trainer = RLTrainer(cfg)
    halves, losses = [], []
    execute = trainer.actor.execute

    def spy(method, *args, **kwargs):
        out = execute(method, *args, **kwargs)
        if method == "update_actor":  # dispatch "dp": rank 0 gets the first half, rank 1 the second
            tokens = args[0]["attention_mask"].sum(-1)
            halves.append((int(tokens[:8].sum()), int(tokens[8:].sum())))
            losses.append((out["actor/pg_loss"], out["actor/grad_norm"]))
        return out

    trainer.actor.execute = spy
    try:
        last = trainer.fit()
        state = execute("state_dict")
    finally:
        trainer.shutdown()
    assert {"global_seqlen/balanced_max", "global_seqlen/minmax_diff"} <= set(last)
    assert last["global_seqlen/balanced_max"] - last["global_seqlen/balanced_min"] <= last["global_seqlen/minmax_diff"]
    a, b = halves[-1]
    assert abs(a - b) == last["global_seqlen/balanced_max"] - last["global_seqlen/balanced_min"]
    assert_same((losses, state), local_run)


@pytest.mark.slow  # ~35 s; the rank-agreement logic itself is unit-tested in tests/trainer/test_dynamic_batches.py
def test_dynamic_bsz_two_fsdp_ray_workers_equal_one_process(ray_session, local_run, tmp_path, tiny_model_dir, rl_data):
    """use_dynamic_bsz under FSDP2: each rank packs its share into token-budget micro-batches, the ranks agree on
    the largest count (padding micro-batches where a rank has fewer), and the update equals the one-process,
    fixed-size run (global counts)."""
    ray_run = train(make_cfg(tmp_path, tiny_model_dir, rl_data, *RAY, "actor_rollout_ref.actor.strategy=fsdp",
                             "actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80"))
    assert_same(ray_run, local_run)


@pytest.fixture(scope="module")
def even_heads_dir(tiny_even_heads_dir):
    return tiny_even_heads_dir  # 4 attention heads: 2 per rank


@pytest.mark.slow  # ~20 s in CI; the split itself: tests/distributed/test_ulysses.py (gloo, fast lane)
def test_ulysses_two_ray_workers_equal_one_process(ray_session, tmp_path, even_heads_dir, rl_data):
    """actor.ulysses_sequence_parallel_size=2 on 2 FSDP2 workers: one data-parallel replica whose two ranks split
    every packed micro-batch of the old-logprob, reference and update forwards (tiller.workers.ulysses); the run
    equals one process's with whole sequences, KL loss and entropy bonus included."""
    common = ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_kl_loss=true",
              "actor_rollout_ref.actor.kl_loss_coef=0.1", "actor_rollout_ref.actor.entropy_coeff=0.01",
              "actor_rollout_ref.actor.ppo_epochs=2")
    local = train(make_cfg(tmp_path / "local", even_heads_dir, rl_data, *common), seed_chunks=2)
    calls, layout = [], []
    ray_run = train(make_cfg(tmp_path / "ray", even_heads_dir, rl_data, *common, *RAY,
                             "actor_rollout_ref.actor.strategy=fsdp",
                             "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"), calls=calls, layout=layout)
    assert_same(ray_run, local)
    assert [(p["world"], p["sp"], p["sp_rank"]) for p in layout] == [(2, 2, 0), (2, 2, 1)]
    split = {m: kw for m, kw in calls if m in ("compute_log_prob", "compute_ref_log_prob", "update_actor")}
    assert split.keys() == {"compute_log_prob", "compute_ref_log_prob", "update_actor"}
    assert all(kw == {"dispatch": "dp", "replicas": 2} for kw in split.values()), split
    assert dict(calls)["generate_sequences"] == {"dispatch": "dp"}  # sampling stays split by rows over both ranks


@pytest.mark.slow  # ~20 s
def test_lora_actor_with_a_saved_module_on_two_fsdp_workers_equals_one_process(ray_session, tmp_path, tiny_model_dir,
                                                                                 rl_data):
    """LoRA adapters plus the tied LM head / embedding trained in full (modules_to_save) under FSDP2 on 2 workers:
    peft's wrapped copy shards, gathers for the rollout sync and steps as in one process."""
    lora = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.model.modules_to_save=[lm_head]", "actor_rollout_ref.actor.optim.lr=1e-2")
    local = train(make_cfg(tmp_path / "local", tiny_model_dir, rl_data, *lora), seed_chunks=2)
    ray_run = train(make_cfg(tmp_path / "ray", tiny_model_dir, rl_data, *lora, *RAY,
                             "actor_rollout_ref.actor.strategy=fsdp"))
    assert_same(ray_run, local)
    assert any("modules_to_save" in k for k in local[1])  # the compared weights include the trained copy


@pytest.mark.slow  # ~20 s
def test_moe_router_loss_on_two_fsdp_workers_equals_one_process(ray_session, tmp_path, rl_data,
                                                                 tiny_moe_dir):  # noqa: F811
    """A Mixtral policy with actor.router_aux_loss_coef under FSDP2 on 2 workers: the hooks on the sharded module
    record each rank's router loss, and the update (and actor/aux_loss, each rank's share of the sequences summed)
    equals one process's."""
    import json

    moe, aux = tiny_moe_dir, ("actor_rollout_ref.actor.router_aux_loss_coef=0.5",)
    local = train(make_cfg(tmp_path / "local", moe, rl_data, *aux), seed_chunks=2)
    ray_run = train(make_cfg(tmp_path / "ray", moe, rl_data, *aux, *RAY, "actor_rollout_ref.actor.strategy=fsdp"))
    assert_same(ray_run, local)
    rows = {run: [json.loads(line)["actor/aux_loss"] for line in (tmp_path / run / "metrics.jsonl").read_text()
                  .splitlines()] for run in ("local", "ray")}
    assert rows["ray"] == pytest.approx(rows["local"], rel=1e-5) and min(rows["local"]) > 1.0


@pytest.mark.slow  # ~30-50 s: PPO with a critic group, both split (the critic's forward is the value model's)
def test_ppo_critic_ulysses_two_ray_workers_equal_one_process(ray_session, tmp_path, even_heads_dir, rl_data):
    """critic.ulysses_sequence_parallel_size=2 with the actor's: GAE's values and the critic update run on packed,
    split micro-batches; one step equals one process's (the actor's step, both models, as the PPO test above)."""
    gae = ("algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "trainer.total_training_steps=1",
           "actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true",
           "trainer.save_freq=1")
    local = train(make_cfg(tmp_path / "local", even_heads_dir, rl_data, *gae), seed_chunks=2)
    layout = []
    ray_run = train(make_cfg(tmp_path / "ray", even_heads_dir, rl_data, *gae, *RAY, "critic.strategy=fsdp",
                             "actor_rollout_ref.actor.strategy=fsdp",
                             "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                             "critic.ulysses_sequence_parallel_size=2"), critic_layout=layout)
    assert [(p["sp"], p["sp_rank"]) for p in layout] == [(2, 0), (2, 1)]
    assert_same(ray_run, local, atol=5e-5, steps=1)
    from safetensors.torch import load_file

    folder = "checkpoints/critic/global_step_1/model/model.safetensors"
    saved = {run: load_file(str(tmp_path / run / folder)) for run in ("local", "ray")}
    assert saved["local"].keys() == saved["ray"].keys()
    for key, value in saved["local"].items():
        torch.testing.assert_close(saved["ray"][key], value, atol=5e-5, rtol=0)


# asynchronous RL on Ray: the trainer's one worker updates, a rollout pool of two workers of their own generates
ASYNC_RAY = ("trainer.backend=ray", "trainer.nnodes=1", "trainer.n_gpus_per_node=1", "rollout.nnodes=1",
             "rollout.n_gpus_per_node=2")


def test_async_rollout_pool_at_half_a_step_of_staleness_equals_the_synchronous_run(ray_session, local_run, tmp_path,
                                                                                  tiny_model_dir, rl_data):
    """staleness_threshold=0.5 lets the producer run one batch ahead at most, so each step's batch is generated
    with the weights the trainer published after the step before: the synchronous schedule, whatever the timing.
    Two rollout workers (no process group, seeded by their place in the pool) sample the 2 seeded chunks the
    one-process run samples, with the weights rank 0 put in the object store after each step: the losses, the
    norms and the final weights equal the synchronous one-process run's (a pool still on the first weights, or
    seeded alike on both workers, would sample other responses from step 2 / step 1 on)."""
    import json

    calls = []
    ray_run = train(make_cfg(tmp_path, tiny_model_dir, rl_data, *ASYNC_RAY,
                             "async_training.staleness_threshold=0.5"), calls=calls)
    assert_same(ray_run, local_run)
    methods = [m for m, _ in calls]
    assert "generate_sequences" not in methods and "update_actor" in methods  # the trainer's workers only update
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 0.0]
    assert [r["async/policy_version"] for r in rows] == [0.0, 1.0]


@pytest.mark.slow  # ~40 s: two runs with checkpoints
def test_async_rollout_pool_resumes_from_a_checkpoint(ray_session, local_run, tmp_path, tiny_model_dir, rl_data):
    """One step with a checkpoint, then a new driver with resume_mode=auto: the pool starts from the checkpoint's
    weights (published from the resumed trainer) and step 2 is the straight run's (at half a step of staleness, the
    synchronous one-process run's)."""
    common = (*ASYNC_RAY, "async_training.staleness_threshold=0.5", "trainer.save_freq=1", "trainer.resume_mode=auto")
    first, _ = train(make_cfg(tmp_path, tiny_model_dir, rl_data, *common, "trainer.total_training_steps=1"))
    assert len(first) == 1
    losses, state = train(make_cfg(tmp_path, tiny_model_dir, rl_data, *common))
    assert len(losses) == 1  # step 2 only
    (loss, norm), (local_loss, local_norm) = losses[0], local_run[0][1]
    assert loss == pytest.approx(local_loss, abs=1e-5) and norm == pytest.approx(local_norm, rel=1e-4)
    for key in state:
        torch.testing.assert_close(state[key], local_run[1][key], atol=1e-5, rtol=0)


@pytest.mark.slow  # ~30 s; the staleness schedule itself: tests/trainer/test_async_rl.py (fast lane)
def test_async_rollout_pool_generates_ahead_with_the_weights_it_has(ray_session, tmp_path, tiny_model_dir, rl_data):
    """staleness_threshold=1 on the pool: step 2's batch is generated while step 1 trains, with the step-0 weights
    (the update of step 1 waits here until the producer has started that batch, so this does not hang on timing);
    its samples are one version old, none older, none dropped, and the trainer trains every step and validates."""
    import json
    import time

    def hold_step_one(trainer, method):
        if method == "update_actor" and trainer.global_step == 1:
            deadline = time.monotonic() + 120
            while trainer.producer._started_step < 2 and time.monotonic() < deadline:
                time.sleep(0.01)

    losses, _ = train(make_cfg(tmp_path, tiny_model_dir, rl_data, *ASYNC_RAY, "trainer.total_training_steps=4",
                               "async_training.staleness_threshold=1", f"data.val_files=[{rl_data / 'test.parquet'}]",
                               "trainer.test_freq=2"), on_execute=hold_step_one)
    assert len(losses) == 4 and all(norm > 0 for _, norm in losses)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # validation (steps 2 and 4) on the trainer's worker, whose engine starts then
    assert [r["step"] for r in rows if "val-core/tiller/arithmetic/acc/mean@1" in r] == [2, 4]
    assert [r["async/policy_version"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert rows[1]["async/staleness_max"] == 1.0 and all(r["async/staleness_max"] <= 1.0 for r in rows)
    assert all(r["async/dropped_stale"] == 0.0 for r in rows)


@pytest.mark.slow  # ~20 s in CI; partial rollouts in one process: tests/trainer/test_async_rl.py (fast lane)
def test_async_rollout_pool_partial_rollouts_take_new_weights_between_decode_steps(ray_session, tmp_path,
                                                                                   tiny_model_dir, rl_data):
    """async_training.partial_rollout on the pool: a worker generating step 2's batch (started with the step-0
    weights) asks the board for newer weights between decode steps and continues with the step-1 weights once
    published, its KV cache kept. Paced here: the board holds step 2's generations at their third question until
    version 1 is out, so every step-2 sample has tokens of both versions (ignore_eos: every row runs 6 tokens)."""
    import json
    import time

    from tiller.distributed.ray_group import WeightBoard
    from tiller.trainer.rl import RLTrainer

    class PacedBoard(WeightBoard):  # (a local class: Ray pickles it by value to the workers)
        poll_s = 0.0

        def latest(self, step=None):
            self.asked = getattr(self, "asked", 0) + 1
            while True:
                version, ref, stopped = super().latest(step)
                if step != 2 or self.asked < 3 or version >= 1 or stopped:
                    return version, ref, stopped
                time.sleep(0.02)

    cfg = make_cfg(tmp_path, tiny_model_dir, rl_data, *ASYNC_RAY, "async_training.staleness_threshold=1",
                   "async_training.partial_rollout=true", "actor_rollout_ref.rollout.ignore_eos=true")
    trainer = RLTrainer(cfg)
    try:
        trainer._board.close()
        trainer._board = PacedBoard()
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["async/policy_version"] for r in rows] == [0.0, 1.0]
    # step 2: 4 prompts x 4 samples, each begun with version 0 and finished with version 1; none too old
    assert rows[1]["async/partial_samples"] == 16.0 and rows[1]["async/staleness_max"] == 1.0
    assert all(r["async/dropped_stale"] == 0.0 for r in rows)


@pytest.mark.slow  # ~25 s
def test_lora_on_moe_experts_on_two_fsdp_workers_equals_one_process(ray_session, tmp_path, rl_data,
                                                                     tiny_moe_dir):  # noqa: F811
    """LoRA all-linear on a Mixtral (peft adapts each expert's 3-D weights and the router through target_parameters,
    tests/test_lora_moe.py) under FSDP2 on 2 workers: the expert adapters shard, gather for the rollout sync and step
    as in one process."""
    lora = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.actor.optim.lr=1e-2")
    local = train(make_cfg(tmp_path / "local", tiny_moe_dir, rl_data, *lora), seed_chunks=2)
    ray_run = train(make_cfg(tmp_path / "ray", tiny_moe_dir, rl_data, *lora, *RAY,
                             "actor_rollout_ref.actor.strategy=fsdp"))
    assert_same(ray_run, local)
    assert any(".mlp.experts." in k and "lora_" in k for k in local[1])  # the compared weights include the experts'
