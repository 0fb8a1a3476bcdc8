"""Reward managers built from an RLConfig: naive, batch, parallel (per-sample timeout), dapo shaping,
custom functions with reward_kwargs, error counting."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tiller.config.schema import RLConfig
from tiller.errors import ConfigError, UserError
from tiller.rewards import RewardRequest, build_reward_manager
from tiller.rewards.managers import overlong_penalty

USER_FN = '''
import math, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if solution_str == "raise":
        raise RuntimeError("boom")
    if solution_str == "nan":
        return math.nan
    if solution_str == "sleep":
        time.sleep(30)
    if solution_str == "dict":
        return {"score": 0.5 + bonus, "acc": 1.0, "note": "text is dropped"}
    return (1.0 if solution_str == ground_truth else 0.0) + bonus

def batch_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
    return [scale * (s == g) for s, g in zip(solution_strs, ground_truths)]
'''


def _req(response, truth="a", source="user/task", length=0, group="g"):
    return RewardRequest(data_source=source, prompt="p", response=response, ground_truth=truth,
                         extra_info={}, response_length=length, group=group)


@pytest.fixture()
def user_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FN)
    return path


def _cfg(manager="naive", path=None, name="compute_score", **kwargs):
    cfg = RLConfig()
    cfg.reward_model.reward_manager = manager
    cfg.custom_reward_function.path = str(path) if path else None
    cfg.custom_reward_function.name = name
    cfg.custom_reward_function.reward_kwargs = kwargs
    return cfg


def test_naive_custom_function_errors_nan_and_dicts(user_fn):
    manage = build_reward_manager(_cfg("naive", user_fn, bonus=0.25))
    result = manage([_req("a"), _req("b"), _req("raise"), _req("nan"), _req("dict")])
    # a: 1 + 0.25; b: 0 + 0.25; raise / nan: 0 and counted; dict: 0.5 + 0.25 with acc as an extra
    np.testing.assert_allclose(result.scores, [1.25, 0.25, 0.0, 0.0, 0.75])
    assert result.metrics["reward/num_errors"] == 2.0
    np.testing.assert_allclose(result.extras["acc"], [np.nan, np.nan, np.nan, np.nan, 1.0])
    assert "note" not in result.extras  # non-numeric keys are not logged
    assert result.scores.dtype == np.float32


def test_default_scorer_through_naive_manager():
    manage = build_reward_manager(RLConfig())
    result = manage([_req("#### 7", "7", "openai/gsm8k"), _req("#### 8", "7", "openai/gsm8k")])
    assert result.scores.tolist() == [1.0, 0.0]
    with pytest.raises(UserError, match="no reward scorer"):
        manage([_req("x", "y", "unknown/source")])


def test_batch_manager(user_fn):
    manage = build_reward_manager(_cfg("batch", user_fn, name="batch_score", scale=2.0))
    assert manage([_req("a"), _req("b")]).scores.tolist() == [2.0, 0.0]
    default_batch = build_reward_manager(_cfg("batch"))
    assert default_batch([_req("#### 3", "3", "openai/gsm8k")]).scores.tolist() == [1.0]


def test_parallel_manager_times_out_one_sample_only(user_fn):
    cfg = _cfg("parallel", user_fn)
    cfg.reward_model.num_workers = 2
    cfg.reward_model.timeout = 1.5
    manage = build_reward_manager(cfg)
    try:
        start = time.monotonic()
        result = manage([_req("a"), _req("sleep"), _req("b"), _req("raise"), _req("a")])
        elapsed = time.monotonic() - start
        assert result.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert result.metrics["reward/num_timeouts"] == 1.0
        assert result.metrics["reward/num_errors"] == 1.0
        assert elapsed < 20.0  # not the 30 s sleep
        # the pool recovered: another batch works
        assert manage([_req("a")]).scores.tolist() == [1.0]
        # default scorer in workers, including a user error raised in a worker
        cfg2 = _cfg("parallel")
        manage2 = build_reward_manager(cfg2)
        assert manage2([_req("#### 3", "3", "openai/gsm8k")]).scores.tolist() == [1.0]
        with pytest.raises(UserError, match="no reward scorer"):
            manage2([_req("x", "y", "unknown/source")])
        manage2.close()
    finally:
        manage.close()


def test_prime_manager_is_parallel_scoring_with_verls_300_s(user_fn):
    # verl's PrimeRewardManager: per-sample calls in processes, each bounded by 300 s (not reward_model.timeout)
    cfg = _cfg("prime", user_fn)
    cfg.reward_model.timeout = 1.5
    manage = build_reward_manager(cfg)
    try:
        assert manage.base.timeout == 300.0 and manage.base.pool is not None
        result = manage([_req("a"), _req("raise"), _req("b")])
        assert result.scores.tolist() == [1.0, 0.0, 0.0] and result.metrics["reward/num_errors"] == 1.0
    finally:
        manage.close()


def test_overlong_penalty_worked_numbers():
    # L_max = 16, L_buf = 4 -> expected length 12; penalty = min(-(len - 12) / 4 * 0.5, 0)
    # len 10 -> 0; len 12 -> 0; len 14 -> -(2/4)*0.5 = -0.25; len 16 -> -(4/4)*0.5 = -0.5
    got = overlong_penalty(np.array([10, 12, 14, 16]), 16, 4, 0.5)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5])


def test_dapo_manager_shapes_rewards(user_fn):
    cfg = _cfg("dapo", user_fn)
    cfg.data.max_response_length = 16
    cfg.reward_model.overlong_buffer.enable = True
    cfg.reward_model.overlong_buffer.len = 4
    cfg.reward_model.overlong_buffer.penalty_factor = 1.0
    cfg.reward_model.overlong_buffer.log = True
    manage = build_reward_manager(cfg)
    result = manage([_req("a", length=8), _req("a", length=14), _req("b", length=16)])
    # 1 + 0; 1 - (14-12)/4 = 0.5; 0 - (16-12)/4 = -1
    np.testing.assert_allclose(result.scores, [1.0, 0.5, -1.0])
    np.testing.assert_allclose(result.extras["overlong_reward"], [0.0, -0.5, -1.0])
    np.testing.assert_allclose(result.extras["acc"], [1.0, 1.0, 0.0])
    assert result.metrics["reward/overlong_frac"] == pytest.approx(2 / 3)
    cfg.reward_model.overlong_buffer.log = False  # verl: the penalty is a logged component only with log
    assert "overlong_reward" not in build_reward_manager(cfg)([_req("a", length=14)]).extras


@pytest.mark.parametrize("where", ["custom_reward_function", "reward_kwargs"])
def test_overlong_buffer_in_verls_other_places(user_fn, where):
    """The first DAPO recipe put the settings under custom_reward_function.overlong_buffer, verl's reward
    managers take them as reward_model.reward_kwargs.overlong_buffer_cfg (+ max_resp_len): same shaping."""
    cfg = _cfg("dapo", user_fn)
    cfg.data.max_response_length = 64  # max_resp_len=16 below wins for the penalty
    if where == "custom_reward_function":
        ob = cfg.custom_reward_function.overlong_buffer
        ob.enable, ob.len, ob.penalty_factor = True, 4, 1.0
        cfg.reward_model.reward_kwargs = {"max_resp_len": 16}
    else:
        cfg.reward_model.reward_kwargs = {"overlong_buffer_cfg": {"enable": True, "len": 4, "penalty_factor": 1.0},
                                          "max_resp_len": 16}
    result = build_reward_manager(cfg)([_req("a", length=8), _req("a", length=14), _req("b", length=16)])
    np.testing.assert_allclose(result.scores, [1.0, 0.5, -1.0])
    cfg.reward_model.overlong_buffer.enable, cfg.reward_model.overlong_buffer.len = True, 8
    with pytest.raises(ConfigError, match="different settings"):
        build_reward_manager(cfg)
    cfg.reward_model.overlong_buffer.enable = False
    cfg.reward_model.reward_kwargs["nope"] = 1
    with pytest.raises(ConfigError, match=r"reward_kwargs: unknown keys \['nope'\]"):
        build_reward_manager(cfg)


def test_config_errors(user_fn, tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        build_reward_manager(_cfg("naive", tmp_path / "missing.py"))
    with pytest.raises(ConfigError, match="no function 'nope'"):
        build_reward_manager(_cfg("naive", user_fn, name="nope"))
    with pytest.raises(ConfigError, match="valid: naive, batch, parallel, dapo"):
        build_reward_manager(_cfg("naiv"))
    cfg = _cfg("naive")
    cfg.reward_model.overlong_buffer.enable = True
    with pytest.raises(ConfigError, match="reward_manager=dapo"):
        build_reward_manager(cfg)
    cfg = _cfg("dapo")
    cfg.reward_model.overlong_buffer.enable = True
    cfg.reward_model.overlong_buffer.len = 10_000
    with pytest.raises(ConfigError, match="overlong_buffer.len"):
        build_reward_manager(cfg)
    cfg = RLConfig()
    cfg.reward_model.enable = True
    with pytest.raises(ConfigError, match="model.path"):
        build_reward_manager(cfg)


def test_empty_batch():
    result = build_reward_manager(RLConfig())([])
    assert result.scores.shape == (0,)


SLEEPY_SRC = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "slow":
        time.sleep(60)
    return 1.0 if solution_str == ground_truth else 0.0

def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos):
    time.sleep(60)
"""


@pytest.mark.parametrize("in_thread", [False, True], ids=["main-thread", "worker-thread"])
@pytest.mark.parametrize("manager", ["naive", "dapo"])
def test_a_sleeping_reward_call_times_out_scores_zero_and_is_counted(tmp_path, manager, in_thread):
    import threading
    import time

    from tiller.rewards.managers import DapoRewardManager, NaiveRewardManager, load_function_ref

    (tmp_path / "sleepy.py").write_text(SLEEPY_SRC)
    ref = load_function_ref(str(tmp_path / "sleepy.py"), "compute_score")
    mgr = (NaiveRewardManager(ref, timeout=0.5) if manager == "naive"
           else DapoRewardManager(ref, max_response_length=8, timeout=0.5))
    reqs = [RewardRequest("x", "p", "7", "7"), RewardRequest("x", "p", "slow", "slow"), RewardRequest("x", "p", "3", "7")]
    out = {}
    start = time.monotonic()
    if in_thread:
        t = threading.Thread(target=lambda: out.update(batch=mgr.score(reqs)))
        t.start()
        t.join()
    else:
        out["batch"] = mgr.score(reqs)
    assert time.monotonic() - start < 30  # the 60 s call was cut off, not waited for
    batch = out["batch"]
    assert batch.scores.tolist() == [1.0, 0.0, 0.0]
    assert batch.metrics["reward/num_timeouts"] == 1.0 and batch.metrics["reward/num_errors"] == 0.0


def test_a_sleeping_batch_call_times_out_for_the_whole_batch(tmp_path):
    from tiller.rewards.managers import BatchRewardManager, load_function_ref

    (tmp_path / "sleepy.py").write_text(SLEEPY_SRC)
    mgr = BatchRewardManager(load_function_ref(str(tmp_path / "sleepy.py"), "compute_score_batch"), timeout=0.5)
    batch = mgr.score([RewardRequest("x", "p", "1", "1"), RewardRequest("x", "p", "2", "2")])
    assert batch.scores.tolist() == [0.0, 0.0] and batch.metrics["reward/num_timeouts"] == 2.0


def test_reward_timeout_must_be_positive():
    from tiller.errors import ConfigError
    from tiller.rewards.managers import NaiveRewardManager

    with pytest.raises(ConfigError, match="reward_model.timeout"):
        NaiveRewardManager(timeout=0)
