"""A reward function that calls `sys.exit()` while scoring stops the run with one line naming the function, in the
synchronous loop (exit 2, not the function's exit code with nothing said) and in asynchronous RL's producer (no
trainer waiting on a dead producer); whatever else the producer's code raises reaches the trainer promptly."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tiller.cli import main
from tiller.errors import UserError
from tiller.rewards.managers import (BatchRewardManager, NaiveRewardManager, ParallelRewardManager, RewardExit,
                                     call_or_error)
from tiller.rewards.types import RewardRequest
from tiller.trainer.async_rollout import RolloutProducer

EXITS = {  # the body of compute_score -> what the message quotes
    "exit3": ("sys.exit(3)", "sys.exit(3)"),
    "exit_text": ("sys.exit('no more')", "sys.exit('no more')"),
    "exit_none": ("sys.exit()", "sys.exit(None)"),
    "raise": ("raise SystemExit(0)", "sys.exit(0)"),
}


def _fn(tmp_path, body: str, name: str = "compute_score"):
    path = tmp_path / f"reward_{abs(hash(body))}.py"
    path.write_text(f"import sys\n\n\ndef {name}(*args, **kwargs):\n    {body}\n")
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - the test's own file
    return path, namespace[name]


def _requests(n=3):
    return [RewardRequest(data_source="tiller/arithmetic", prompt="1+1=", response="2", ground_truth="2",
                          extra_info={}, response_length=1, group="g") for _ in range(n)]


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - inspected by the caller
            box["err"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the reward call did not come back"
    return box


@pytest.mark.parametrize("case", sorted(EXITS))
@pytest.mark.parametrize("where", ["main_no_timeout", "main_timer", "thread_timer"])
def test_sys_exit_in_a_reward_call_is_one_named_error(tmp_path, case, where):
    body, quoted = EXITS[case]
    path, fn = _fn(tmp_path, body)
    timeout = None if where == "main_no_timeout" else 5.0
    call = lambda: call_or_error(fn, "tiller/arithmetic", "2", "2", {}, timeout=timeout)  # noqa: E731
    if where == "thread_timer":
        err = _in_thread(call).get("err")
    else:
        with pytest.raises(RewardExit) as info:
            call()
        err = info.value
    assert isinstance(err, RewardExit) and isinstance(err, UserError), err
    assert quoted in str(err) and f"{path}:4" in str(err) and "compute_score" in str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize("in_thread", [False, True], ids=["main", "producer_thread"])
def test_the_naive_manager_stops_at_the_first_exit_in_either_thread(tmp_path, in_thread):
    """In a thread (the async producer) calls run on one helper thread: the exit must not kill that helper and
    leave the caller waiting out every call's timeout."""
    _, fn = _fn(tmp_path, "sys.exit(3)")
    manager = NaiveRewardManager(timeout=60.0)
    manager.fn = fn
    if in_thread:
        err = _in_thread(lambda: manager.score(_requests())).get("err")
    else:
        with pytest.raises(RewardExit) as info:
            manager.score(_requests())
        err = info.value
    assert isinstance(err, RewardExit) and "sys.exit(3)" in str(err)  # (_in_thread gives up after 30 s of 180)


def test_a_base_exception_in_the_producer_threads_reward_call_is_raised_not_waited_out(tmp_path):
    _, fn = _fn(tmp_path, "raise KeyboardInterrupt")
    manager = NaiveRewardManager(timeout=60.0)
    manager.fn = fn
    err = _in_thread(lambda: manager.score(_requests())).get("err")
    assert isinstance(err, KeyboardInterrupt)  # without the re-raise: 3 calls x 60 s, then "timeout" scores


def test_batch_and_parallel_managers_name_the_exit(tmp_path):
    path, fn = _fn(tmp_path, "sys.exit(7)")
    batch = BatchRewardManager(timeout=5.0)
    batch.fn = fn
    with pytest.raises(RewardExit, match=r"sys.exit\(7\)"):
        batch.score(_requests())
    pool = ParallelRewardManager(("file", str(path), "compute_score"), num_workers=1, timeout=10.0)
    try:
        with pytest.raises(RewardExit, match=r"compute_score .*called sys.exit\(7\)"):
            pool.score(_requests(2))
    finally:
        pool.close()


@pytest.mark.parametrize("fault", [SystemExit(3), SystemExit("bye"), KeyboardInterrupt(), ValueError("x")])
def test_the_trainer_never_waits_on_a_producer_that_died(fault):
    def produce(step, hook):
        raise fault

    producer = RolloutProducer(produce, load_weights=lambda state: None, first_step=1, last_step=3,
                               staleness_threshold=1.0, trigger=1)
    producer.publish(0, None)
    producer.start()
    with pytest.raises(BaseException) as info:
        producer.get(1)
    if isinstance(fault, SystemExit):
        assert isinstance(info.value, UserError) and f"sys.exit({fault.code!r})" in str(info.value)
        assert "step 1" in str(info.value)
    else:
        assert type(fault).__name__ in str(info.value) and "step 1" in str(info.value)
    producer.stop()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tiller_rl_stops_with_one_line_when_the_reward_exits(tmp_path, capsys, tiny_model_dir, mode):
    from tiller.tasks import arithmetic

    arithmetic.write_task(tmp_path / "arith", n_train=8, n_test=4, seed=0)
    path, _ = _fn(tmp_path, "sys.exit(3)")
    argv = ["rl", f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{tmp_path}/arith/train.parquet]",
            "data.val_files=[]", "data.max_prompt_length=32", "data.max_response_length=2", "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.total_training_steps=2", "trainer.logger=[jsonl]", f"trainer.default_local_dir={tmp_path}/run",
            f"custom_reward_function.path={path}"]
    if mode == "async":  # the trainer in a thread of its own, so a hang fails the test instead of stalling it
        code = _in_thread(lambda: main(argv + ["async_training.staleness_threshold=1"])).get("value")
    else:  # the main thread, as `tiller rl` runs: the reward calls are timed by SIGALRM there
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tiller rl: error: the reward function compute_score") and "sys.exit(3)" in last, err
