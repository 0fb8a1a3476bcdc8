"""Asynchronous RL (async_training.*): the producer's schedule in worked numbers, the staleness filter, bad
values, staleness 0 = the synchronous loop exactly, staleness 1 within its bound and learning, a crashing
producer stopping the run with its cause, resume without lost or repeated steps, partial rollouts' per-token
versions in the native engine, the trainer borrowing the idle producer's torch threads, the update's
micro-batch lanes (actor.update_lanes, and the lane lent by the producer)."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest
import torch

from tests.trainer.test_rl import _jsonl, _train, make_cfg
from tiller.errors import ConfigError
from tiller.protocol import Batch
from tiller.tasks import arithmetic
from tiller.trainer.async_rollout import (
    RolloutProducer,
    RolloutProducerError,
    ThreadSharing,
    batches_per_sync,
    earliest_version,
    max_age,
    staleness_filter,
    trainer_version,
)

REWARD_SRC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_data")
    arithmetic.write_task(root, n_train=48, n_test=8, seed=0)
    (root / "reward.py").write_text(REWARD_SRC)
    return root


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------ schedule
def test_schedule_worked_numbers():
    # s=1, trigger=1: F = floor(2 x 1) = 2 batches per sync; step s may start at version ceil(s - 2):
    # steps 1, 2 at v0 (one ahead), step 3 at v1, step 4 at v2; the trainer holds c(s) = s - 1 -> age 1
    assert batches_per_sync(1, 1) == 2 and max_age(1, 1) == 1
    assert [earliest_version(s, 1, 1) for s in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [trainer_version(s, 1) for s in (1, 2, 3, 4)] == [0, 1, 2, 3]
    # s=0, trigger=1: the synchronous order, step s waits for version s - 1
    assert [earliest_version(s, 0, 1) for s in (1, 2, 3)] == [0, 1, 2] and max_age(0, 1) == 0
    # s=0, trigger=2 (verl's "stream off-policy"): two steps per sync, both from the same weights, age 0
    assert [earliest_version(s, 0, 2) for s in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 2]
    assert [trainer_version(s, 2) for s in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 2] and max_age(0, 2) == 0
    # s=0.5, trigger=2: F = floor(1.5 x 2) = 3; step 5 may start at ceil((5 - 3) / 2) = 1 and runs at c = 2
    assert batches_per_sync(0.5, 2) == 3 and earliest_version(5, 0.5, 2) == 1 and max_age(0.5, 2) == 1
    # a fraction below one batch rounds down: s=0.5, trigger=1 is synchronous
    assert batches_per_sync(0.5, 1) == 1 and max_age(0.5, 1) == 0
    assert max_age(2, 1) == 2


def test_staleness_filter_drops_by_oldest_token_and_counts():
    # 4 samples of 3 tokens, started at version 1; trainer step 4 with trigger 1 holds version 3.
    versions = torch.tensor([[1, 1, 1], [1, 2, 2], [2, 3, 3], [3, 3, 3]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]])  # row 3: empty response -> start version 1
    batch = Batch({"rollout_token_version": versions, "response_mask": mask, "x": torch.arange(4)})
    kept, m = staleness_filter(batch, start_version=1, step=4, staleness_threshold=1, trigger=1)
    # ages by oldest masked token: 3-1=2, 3-1=2, 3-2=1, 3-1=2 (empty row) -> only row 2 is within 1
    assert kept["x"].tolist() == [2]
    assert m["async/dropped_stale"] == 3 and m["async/staleness_max"] == 1 and m["async/staleness_mean"] == 1
    assert m["async/partial_samples"] == 1  # row 2 holds versions 2 and 3
    # with staleness 2 rows 0, 1, 2, 3 are kept: ages 2, 2, 1, 2 -> mean 7/4; rows 1 and 2 are partial
    kept, m = staleness_filter(batch, 1, 4, 2, 1)
    assert len(kept) == 4 and m["async/staleness_mean"] == 1.75 and m["async/partial_samples"] == 2
    # verl's off-policy metrics: (oldest, newest) = (1, 1), (1, 2), (2, 3), (1, 1) against version 3
    want = {"trajectory_spans": (1.5, 2, 1), "trajectory_staleness": (1.25, 2, 0),
            "trajectory_staleness_worst": (1.75, 2, 1)}
    for name, (mean, most, least) in want.items():
        got = tuple(m[f"training/off_policy/{name}/{k}"] for k in ("mean", "max", "min"))
        assert got == (mean, most, least), name


@pytest.mark.parametrize("override,expect", [
    ("async_training.staleness_threshold=-1", "staleness_threshold must be a number >= 0"),
    ("async_training.trigger_parameter_sync_step=0", "trigger_parameter_sync_step must be >= 1"),
    ("async_training.partial_rollout=true", "partial_rollout=True needs async_training.staleness_threshold > 0"),
    ("async_training.require_batches=2", "require_batches=2 x actor_rollout_ref.actor.ppo_mini_batch_size=4"),
    ("async_training.staleness_threshold=1 actor_rollout_ref.rollout.name=vllm", "in-process engine"),
    # trainer.backend=ray runs a rollout pool (tests/distributed/test_rl_ray.py): its size; the split layout without it
    ("async_training.staleness_threshold=1 trainer.backend=ray rollout.n_gpus_per_node=0",
     "rollout.n_gpus_per_node must be a whole number >= 1"),
    ("async_training.staleness_threshold=1 actor_rollout_ref.hybrid_engine=false",
     "is tiller's asynchronous RL on Ray: set trainer.backend=ray"),
    ("async_training.staleness_threshold=1 async_training.partial_rollout=true actor_rollout_ref.rollout.name=hf",
     "partial_rollout=True needs actor_rollout_ref.rollout.name=native"),
    ("async_training.staleness_threshhold=1", "did you mean async_training.staleness_threshold"),
    ("actor_rollout_ref.actor.update_lanes=0", "actor_rollout_ref.actor.update_lanes must be an integer >= 1"),
    ("actor_rollout_ref.actor.update_lanes=2 trainer.backend=ray", "update_lanes=2 needs trainer.backend=local"),
    ("critic.update_lanes=-1", "critic.update_lanes must be an integer >= 1"),
])
def test_bad_async_values_are_config_errors(tmp_path, tiny_model_dir, rl_data, override, expect):
    with pytest.raises(ConfigError, match=expect.replace(".", r"\.").replace("(", r"\(")):
        make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *override.split())


# --------------------------------------------------------------------------------------- runs
COMMON = ("data.val_files=[]", "trainer.total_training_steps=3")


def test_staleness_zero_is_the_synchronous_loop_exactly(tmp_path, tiny_model_dir, rl_data):
    common = (*COMMON, f"custom_reward_function.path={rl_data / 'reward.py'}",
              "actor_rollout_ref.actor.ppo_mini_batch_size=2")  # 2 mini-batches: recomputed old logprobs
    _, _, plain = _train(make_cfg(tmp_path / "a", tiny_model_dir, rl_data, *common))
    _, _, zero = _train(make_cfg(tmp_path / "b", tiny_model_dir, rl_data, *common,
                                 "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
                                 "async_training.require_batches=2"))
    for k in plain:
        assert torch.equal(plain[k], zero[k]), k
    a, b = _jsonl(tmp_path / "a" / "metrics.jsonl"), _jsonl(tmp_path / "b" / "metrics.jsonl")
    assert a == b and sorted(a) == [1, 2, 3]
    assert not any(k.startswith("async/") for k in a[3])  # no producer ran


def test_staleness_one_stays_within_its_bound_and_learns(tmp_path, tiny_model_dir, rl_data):
    # reward: the fraction of digits in the response, which the untrained model rarely writes (~0.01)
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "data.val_files=[]", "trainer.total_training_steps=12",
                   "async_training.staleness_threshold=1", "actor_rollout_ref.actor.optim.lr=1e-2",
                   "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32")
    _, changed, _ = _train(cfg)
    assert changed
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert sorted(rows) == list(range(1, 13))
    for step, m in rows.items():
        assert m["async/staleness_max"] <= 1 and m["async/dropped_stale"] == 0
        if step == 1:  # generated with the start weights, used by the first update
            assert m["async/staleness_max"] == 0
        assert m["async/policy_version"] == step - 1
        assert "training/rollout_probs_diff_mean" in m  # the update's own logprobs vs the rollout's
    full = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("timing_s/wait_for_rollout" in r and "timing_s/wait_for_train" in r for r in full)
    assert max(rows[s]["async/staleness_max"] for s in rows) == 1  # it did run ahead
    assert all(0.0 <= rows[s]["async/threads_borrowed_frac"] <= 1.0 for s in rows)  # share_idle_threads (default)
    score = [rows[s]["critic/score/mean"] for s in sorted(rows)]
    start, end = sum(score[:3]) / 3, sum(score[-3:]) / 3
    assert end > start + 0.1, score


def test_a_crash_in_the_rollout_producer_stops_the_run_with_its_cause(tmp_path, tiny_model_dir, rl_data):
    from tiller.trainer.rl import RLTrainer

    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "data.val_files=[]", "trainer.total_training_steps=6",
                   "async_training.staleness_threshold=1")
    trainer = RLTrainer(cfg)
    produce = trainer._produce

    def failing(step, hook):
        if step == 3:
            raise ValueError("engine fell over")
        return produce(step, hook)

    trainer._produce = failing
    box = {}

    def run():
        try:
            trainer.fit()
        except BaseException as err:  # noqa: BLE001 - inspected below
            box["err"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the trainer hung on a dead producer"
    trainer.shutdown()
    err = box.get("err")
    assert isinstance(err, RolloutProducerError), err
    assert "step 3" in str(err) and "engine fell over" in str(err)
    assert isinstance(err.__cause__, ValueError)
    assert _steps(tmp_path / "run" / "metrics.jsonl") == [1, 2]  # steps 1-2 trained, nothing after
    assert not trainer.producer._thread.is_alive()


def test_resume_after_an_interrupted_async_run_repeats_and_loses_no_step(tmp_path, tiny_model_dir, rl_data):
    from tiller.models.checkpoint import load_checkpoint
    from tiller.trainer.rl import RLTrainer

    common = ("data.val_files=[]", "async_training.staleness_threshold=1", "trainer.save_freq=2")
    _train(make_cfg(tmp_path / "straight", tiny_model_dir, rl_data, *common, "trainer.total_training_steps=6"))
    # the interrupted run: step 5 fails after step 4's checkpoint, with batches generated ahead of it
    trainer = RLTrainer(make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *common, "trainer.total_training_steps=6"))
    step_fn = trainer.train_step

    def interrupted():
        if trainer.global_step == 5:
            raise KeyboardInterrupt
        return step_fn()

    trainer.train_step = interrupted
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    trainer.shutdown()
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "global_step_4")
    assert state["async_in_flight"] >= 1  # step 5's batch at least was generated ahead
    _train(make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *common, "trainer.total_training_steps=6",
                    "trainer.resume_mode=auto"))
    assert _steps(tmp_path / "run" / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows[5]["async/regenerated_on_resume"] == state["async_in_flight"]
    # the prompts drawn: the resumed run's sampler is where the straight run's is after 6 steps
    done = load_checkpoint(tmp_path / "run" / "checkpoints" / "global_step_6")
    straight = load_checkpoint(tmp_path / "straight" / "checkpoints" / "global_step_6")
    assert done["sampler"] == straight["sampler"] and done["step"] == 6
    assert rows[5]["async/staleness_max"] == 0  # regenerated with the resumed (step-4) weights


# ------------------------------------------------------------------------------- partial rollouts
def test_native_engine_takes_new_weights_between_decode_steps(tiny_model_dir):
    from tiller.models.loading import load_causal_lm, load_tokenizer
    from tiller.rollout import SamplingParams, build_rollout_engine

    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    model_a = load_causal_lm(str(tiny_model_dir), dtype="float32")
    state_b = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
               for k, v in model_a.state_dict().items()}
    prompts = [tok("12+34=", add_special_tokens=False)["input_ids"], tok("7+5=", add_special_tokens=False)["input_ids"]]
    sampling = SamplingParams(n=2, max_new_tokens=6, do_sample=False, ignore_eos=True)

    def run(switch_at: int | None):
        module = copy.deepcopy(model_a).requires_grad_(False).eval()
        engine = build_rollout_engine("native", module, tok, dtype="float32")
        calls = {"n": 0, "v": 0}

        def hook():  # call 1: before the prefill; call k + 1: before the forward that gives token k's logits
            calls["n"] += 1
            if switch_at is not None and calls["n"] == switch_at + 1 and calls["v"] == 0:
                module.load_state_dict(state_b)
                calls["v"] = 1
            return calls["v"]

        return engine.generate(prompts, sampling, weights_hook=hook)

    plain, switched = run(None), run(2)  # the switch before the forward giving token 2's logits
    assert plain.token_versions == [[0] * 6] * 4
    assert switched.token_versions == [[0, 0, 1, 1, 1, 1]] * 4
    for row in range(4):
        assert switched.response_ids[row][:2] == plain.response_ids[row][:2]
        assert switched.logprobs[row][:2] == plain.logprobs[row][:2]
    assert any(switched.logprobs[r][2:] != plain.logprobs[r][2:] for r in range(4))  # new weights from token 2 on


def test_partial_rollout_run_records_versions_within_the_bound(tmp_path, tiny_model_dir, rl_data):
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *COMMON, "async_training.staleness_threshold=2",
                   "async_training.partial_rollout=true")
    _, changed, _ = _train(cfg)
    assert changed
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [rows[s]["async/staleness_max"] <= 2 for s in (1, 2, 3)] == [True] * 3
    assert all(rows[s]["async/partial_samples"] >= 0 for s in rows)


def test_steps_with_nothing_to_train_on_do_not_stall_the_producer(tmp_path, tiny_model_dir, rl_data):
    # a constant reward: every group fails the filter, every step trains on nothing, and the run still ends
    (tmp_path / "zero.py").write_text("def compute_score(*args, **kwargs):\n    return 0.0\n")
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *COMMON, "trainer.total_training_steps=4",
                   f"custom_reward_function.path={tmp_path / 'zero.py'}", "algorithm.filter_groups.enable=true",
                   "algorithm.filter_groups.metric=score", "algorithm.filter_groups.max_num_gen_batches=1",
                   "async_training.staleness_threshold=1")
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=_train(cfg)), daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the run stalled"
    assert _steps(tmp_path / "run" / "metrics.jsonl") == [1, 2, 3, 4]
    assert box["result"][1] is False  # nothing was trained


# ------------------------------------------------------------------ threads: the trainer borrows the idle producer's
class _Producer:
    generating = False


def test_thread_sharing_follows_the_producer_in_the_trainer_thread_only(monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    before = torch.get_num_threads()
    producer = _Producer()
    try:
        torch.set_num_threads(1)
        share = ThreadSharing(producer, own=1, lent=4)
        assert share.shared == 3  # own + lent, at most the machine's cores
        share()  # the producer waits: the trainer takes its threads
        assert torch.get_num_threads() == 3
        producer.generating = True
        share()
        assert torch.get_num_threads() == 1
        producer.generating = False
        seen = []
        other = threading.Thread(target=lambda: (torch.set_num_threads(1), share(), seen.append(torch.get_num_threads())))
        other.start()
        other.join()
        assert seen == [1]  # a call from another thread (the producer's, say) changes nothing
        assert share.take_stats() == {"async/threads_borrowed_frac": pytest.approx(1 / 2)}
        assert share.take_stats() == {"async/threads_borrowed_frac": 0.0}  # counted per step
    finally:
        torch.set_num_threads(before)


def test_async_run_splits_the_cores_between_trainer_and_producer_and_restores_them(tmp_path, tiny_model_dir, rl_data):
    from tiller.trainer.rl import RLTrainer

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        trainer = RLTrainer(make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *COMMON,
                                     "async_training.staleness_threshold=1", "trainer.num_threads=0"))
        produce, seen = trainer._produce, []
        trainer._produce = lambda step, hook: (seen.append(torch.get_num_threads()), produce(step, hook))[1]
        trainer.fit()
        trainer.shutdown()
        assert seen == [1, 1, 1]  # trainer.num_threads=0: torch's 2 threads split, one per side
        assert torch.get_num_threads() == 2  # the trainer thread's count is back
    finally:
        torch.set_num_threads(before)


def test_the_producer_runs_on_its_own_thread_count_and_says_when_it_generates():
    before = torch.get_num_threads()
    seen = []

    def produce(step, hook):
        seen.append((step, torch.get_num_threads(), producer.generating))
        return Batch({}), {}, {}

    producer = RolloutProducer(produce=produce, load_weights=lambda state: None, first_step=1, last_step=2,
                               staleness_threshold=1, trigger=1, num_threads=1)
    try:
        torch.set_num_threads(2)
        producer.publish(0, None)
        producer.start()
        producer.get(1)
        producer.publish(1, None)
        producer.get(2)
        assert seen == [(1, 1, True), (2, 1, True)]  # the trainer thread's 2 threads are not the producer's
        assert torch.get_num_threads() == 2 and not producer.generating
    finally:
        producer.stop()
        torch.set_num_threads(before)


def test_layer_hooks_fire_at_every_decoder_layer_forward_and_backward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from tiller.workers.common import layer_hooks

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    calls = []
    handles = layer_hooks(model, lambda: calls.append(torch.is_grad_enabled()))
    n_layers = model.config.num_hidden_layers
    ids = torch.tensor([[1, 2, 3, 4]])
    out = model(input_ids=ids)
    assert len(calls) == n_layers
    out.logits.sum().backward()
    assert len(calls) == 2 * n_layers  # one per layer in the backward too
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == 3 * n_layers
    for h in handles:
        h.remove()
    model(input_ids=ids).logits.sum().backward()
    assert len(calls) == 3 * n_layers


# ------------------------------------------------------------------------------- micro-batch lanes
def _lane_spy(monkeypatch, calls: list):
    """Wrap the actor's run_in_lanes: record (items, lanes, threads) and make the first `lanes` items meet at a
    barrier, which only passes when that many lanes really run at once."""
    from tiller.workers import actor as actor_mod

    real = actor_mod.run_in_lanes

    def spy(fn, items, lanes, threads=1):
        calls.append((len(items), lanes, threads))
        barrier = threading.Barrier(max(1, min(lanes, len(items))), timeout=60)

        def met(i, item):
            if i < lanes:
                barrier.wait()
            return fn(i, item)

        return real(met, items, lanes, threads)

    monkeypatch.setattr(actor_mod, "run_in_lanes", spy)


def test_run_in_lanes_runs_items_side_by_side_in_order_on_the_lane_threads():
    from tiller.workers.common import run_in_lanes

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        barrier, seen = threading.Barrier(2, timeout=30), []

        def fn(i, item):
            if i < 2:
                barrier.wait()  # items 0 and 1 run at the same time, or this times out
            seen.append((threading.get_ident(), torch.get_num_threads()))
            return item * 10

        assert run_in_lanes(fn, [1, 2, 3, 4, 5], lanes=2, threads=1) == [10, 20, 30, 40, 50]
        assert len({ident for ident, _ in seen}) == 2 and {n for _, n in seen} == {1}
        assert torch.get_num_threads() == 2  # the caller's count is back

        def bad(i, item):
            if i == 1:
                raise ValueError("micro-batch 1 failed")
            return item

        with pytest.raises(ValueError, match="micro-batch 1 failed"):
            run_in_lanes(bad, [1, 2, 3, 4], lanes=2, threads=1)
        assert torch.get_num_threads() == 2
        caller = threading.get_ident()
        assert run_in_lanes(lambda i, x: threading.get_ident() == caller, [1, 2], lanes=1) == [True, True]
    finally:
        torch.set_num_threads(before)


def test_update_lanes_equal_the_sequential_update_over_the_same_micro_batches(tmp_path, tiny_model_dir, rl_data,
                                                                                monkeypatch):
    """16 samples per step, micro-batches of 16: two lanes split them 8 + 8 and run both at once; the weights
    and metrics equal a sequential run with micro-batches of 8, bit for bit (two gradient sums commute)."""
    common = (*COMMON, "trainer.num_threads=1", "trainer.seed=3")
    _, _, seq = _train(make_cfg(tmp_path / "a", tiny_model_dir, rl_data, *common,
                                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"))
    calls: list = []
    _lane_spy(monkeypatch, calls)
    _, _, lanes = _train(make_cfg(tmp_path / "b", tiny_model_dir, rl_data, *common,
                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                                  "actor_rollout_ref.actor.update_lanes=2"))
    assert calls == [(2, 2, 1)] * 3  # one update per step: 2 micro-batches in 2 lanes of 1 thread
    for k in seq:
        assert torch.equal(seq[k], lanes[k]), k
    a, b = _jsonl(tmp_path / "a" / "metrics.jsonl"), _jsonl(tmp_path / "b" / "metrics.jsonl")
    for step in a:
        same = {k for k in a[step] if k.startswith(("actor/", "training/"))}
        assert same and {k: a[step][k] for k in same} == {k: b[step][k] for k in same}


def test_critic_update_lanes_equal_the_sequential_update(tmp_path, tiny_model_dir, rl_data, monkeypatch):
    """PPO with a critic: actor and critic updates in 2 lanes equal micro-batches of half the size run one after
    the other, bit for bit, for both models."""
    from tiller.trainer.rl import RLTrainer

    def run(run_dir, *overrides):
        trainer = RLTrainer(make_cfg(run_dir, tiny_model_dir, rl_data, *COMMON, "trainer.num_threads=1",
                                     "algorithm.adv_estimator=gae", *overrides))
        try:
            trainer.fit()
            return trainer.actor.execute("state_dict"), {k: v.clone() for k, v in
                                                         trainer.critic.worker.module.state_dict().items()}
        finally:
            trainer.shutdown()

    seq = run(tmp_path / "a", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
              "critic.ppo_micro_batch_size_per_gpu=8")
    calls: list = []
    _lane_spy(monkeypatch, calls)
    from tiller.workers import critic as critic_mod

    critic_calls: list = []
    real = critic_mod.run_in_lanes
    monkeypatch.setattr(critic_mod, "run_in_lanes",
                        lambda fn, items, lanes, threads=1: (critic_calls.append((len(items), lanes)),
                                                             real(fn, items, lanes, threads))[1])
    lanes = run(tmp_path / "b", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                "critic.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.update_lanes=2",
                "critic.update_lanes=2")
    assert calls == [(2, 2, 1)] * 3 and critic_calls == [(2, 2)] * 3
    for a, b in zip(seq, lanes):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_async_update_runs_a_lane_on_the_producers_threads(tmp_path, tiny_model_dir, rl_data, monkeypatch):
    calls: list = []
    _lane_spy(monkeypatch, calls)
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *COMMON, "trainer.num_threads=1",
                                 "async_training.staleness_threshold=1"))
    try:
        trainer.fit()
        assert [lanes for _, lanes, _ in calls] == [2, 2, 2]  # actor.update_lanes=1 + the producer's lane
        assert trainer.actor.worker._lent_lanes == 0  # returned after the run
    finally:
        trainer.shutdown()
    for run, override in (("off", "async_training.share_idle_threads=false"), ("two", "trainer.num_threads=2")):
        calls.clear()  # sharing off, or sides of 2 threads (per-layer borrowing instead): no lent lane
        trainer = RLTrainer(make_cfg(tmp_path / run, tiny_model_dir, rl_data, *COMMON, "trainer.num_threads=1",
                                     "async_training.staleness_threshold=1", override))
        try:
            trainer.fit()
        finally:
            trainer.shutdown()
        assert [lanes for _, lanes, _ in calls] == [1, 1, 1], run
