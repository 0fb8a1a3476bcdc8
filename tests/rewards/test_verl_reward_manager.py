"""verl's custom reward managers (reward.reward_manager.source=importlib, module.path, name) on tiller's reward path:
verl's own reward-loop managers (naive, dapo; their source files as verl ships them) score as tiller's built-in ones
do, an older-API (AbstractRewardManager) manager's token-level rewards sum per sample, and a run trains with one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.test_rl import _train, make_cfg, rl_data  # noqa: F401  (rl_data is a fixture)
from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.models.loading import load_tokenizer
from tiller.rewards.pipeline import build_reward_manager
from tiller.rewards.types import RewardRequest

DATA = Path(__file__).resolve().parents[1] / "data" / "verl_reward_managers"
SCORE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return {"score": scale * float(str(ground_truth) in solution_str), "hit": float(len(solution_str) > 3)}
'''


def _requests(tok) -> list[RewardRequest]:
    texts = ["12 apples", "no", "it is 7", "777"]
    truths = ["12", "12", "7", "8"]
    return [RewardRequest(data_source="test", prompt=f"q{i}", response=t, ground_truth=g, extra_info={"k": i},
                          response_length=len(tok(t, add_special_tokens=False)["input_ids"]), group=f"g{i // 2}",
                          response_ids=tok(t, add_special_tokens=False)["input_ids"],
                          prompt_ids=tok(f"q{i}", add_special_tokens=False)["input_ids"])
            for i, (t, g) in enumerate(zip(texts, truths))]


def _cfg(tiny_model_dir, tmp_path, *keys):
    (tmp_path / "score.py").write_text(SCORE)
    return load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", f"custom_reward_function.path="
                        f"{tmp_path / 'score.py'}", "+custom_reward_function.reward_kwargs.scale=2.0", *keys])


def test_verls_own_naive_manager_scores_as_tillers_naive(tiny_model_dir, tmp_path):
    tok = load_tokenizer(str(tiny_model_dir))
    custom = build_reward_manager(_cfg(tiny_model_dir, tmp_path, "reward.reward_manager.source=importlib",
                                       f"reward.reward_manager.module.path={DATA / 'verl_naive_loop.py'}",
                                       "reward.reward_manager.name=NaiveRewardManager"), tok)
    builtin = build_reward_manager(_cfg(tiny_model_dir, tmp_path), tok)
    got, want = custom(_requests(tok)), builtin(_requests(tok))
    assert got.scores.tolist() == want.scores.tolist() == [2.0, 0.0, 2.0, 0.0]  # reward_kwargs scale=2 bound
    assert got.extras["hit"].tolist() == want.extras["hit"].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_verls_dapo_manager_reads_its_overlong_settings_from_the_config(tiny_model_dir, tmp_path):
    # verl 0.10's DAPO reward-loop manager reads config.reward.reward_kwargs.overlong_buffer_cfg / max_resp_len:
    # with max_resp_len 4 and a buffer of 2, a response of L tokens loses min((L - 2) / 2, 0)... as tiller's dapo
    tok = load_tokenizer(str(tiny_model_dir))
    keys = ("reward.reward_kwargs.overlong_buffer_cfg.enable=true", "reward.reward_kwargs.overlong_buffer_cfg.len=2",
            "reward.reward_kwargs.max_resp_len=4")
    custom = build_reward_manager(_cfg(tiny_model_dir, tmp_path, "reward.reward_manager.source=importlib",
                                       f"reward.reward_manager.module.path={DATA / 'verl_dapo_loop.py'}",
                                       "reward.reward_manager.name=DAPORewardManager", *keys), tok)
    builtin = build_reward_manager(_cfg(tiny_model_dir, tmp_path, "reward_model.reward_manager=dapo", *keys), tok)
    requests = _requests(tok)
    lengths = [len(r.response_ids) for r in requests]
    got, want = custom(requests).scores, builtin(requests).scores
    assert got.tolist() == pytest.approx(want.tolist(), abs=1e-6)
    penalty = [min(-(n - 2) / 2, 0.0) for n in lengths]
    assert got.tolist() == pytest.approx([s + p for s, p in zip([2.0, 0.0, 2.0, 0.0], penalty)], abs=1e-6)
    assert any(p < 0 for p in penalty)  # the penalty bites on some of these responses


def test_an_older_api_manager_sums_its_token_rewards(tiny_model_dir, tmp_path):
    tok = load_tokenizer(str(tiny_model_dir))
    manager = build_reward_manager(_cfg(tiny_model_dir, tmp_path, "reward_manager.source=importlib",
                                        f"reward_manager.module.path={DATA / 'legacy_length_bonus.py'}",
                                        "reward_manager.name=LengthBonusManager",
                                        "+reward_model.reward_kwargs.bonus=0.5"), tok)
    requests = _requests(tok)
    result = manager(requests)
    base = [2.0, 0.0, 2.0, 0.0]
    assert result.scores.tolist() == pytest.approx([b + 0.5 * len(r.response_ids) for b, r in zip(base, requests)])
    assert result.extras["base"].tolist() == base


def test_errors_name_the_key(tiny_model_dir, tmp_path):
    tok = load_tokenizer(str(tiny_model_dir))
    with pytest.raises(ConfigError, match="reward.reward_manager: a custom reward manager needs source=importlib and "
                                          "module.path"):
        build_reward_manager(_cfg(tiny_model_dir, tmp_path, "reward.reward_manager.source=importlib",
                                  "reward.reward_manager.name=X"), tok)
    with pytest.raises(ConfigError, match="reward.reward_manager.module.path=.*verl_naive_loop.py: no class named "
                                          "'Nope'"):
        build_reward_manager(_cfg(tiny_model_dir, tmp_path, "reward.reward_manager.source=importlib",
                                  f"reward.reward_manager.module.path={DATA / 'verl_naive_loop.py'}",
                                  "reward.reward_manager.name=Nope"), tok)


def test_a_run_with_verls_naive_manager_trains_as_with_the_builtin(tmp_path, tiny_model_dir, rl_data):
    # the same reward function through verl's NaiveRewardManager (its file) and through tiller's naive manager: the
    # same step, number for number
    keys = ("trainer.total_training_steps=1", "data.val_files=[]")
    custom = make_cfg(tmp_path / "a", tiny_model_dir, rl_data, *keys, "reward.reward_manager.source=importlib",
                      f"reward.reward_manager.module.path={DATA / 'verl_naive_loop.py'}",
                      "reward.reward_manager.name=NaiveRewardManager")
    ours, _, _ = _train(custom)
    builtin, _, _ = _train(make_cfg(tmp_path / "b", tiny_model_dir, rl_data, *keys))
    for key in ("critic/score/mean", "critic/advantages/max", "actor/pg_loss", "actor/grad_norm"):
        assert ours[key] == builtin[key], key
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert np.isfinite(rows[0]["critic/score/mean"])
