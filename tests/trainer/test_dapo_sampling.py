"""DAPO dynamic sampling (algorithm.filter_groups + max_num_gen_batches, data.gen_batch_size) through the
real driver, with a scripted reward: prompts whose extra_info.index is a multiple of 3 get a reward that
varies with the response; every other prompt gets a constant 1.0, so its group has no learning signal.

With data.shuffle=false and 4 prompts per round, rounds see indices 0-3 (groups 0 and 3 vary), 4-7
(6), 8-11 (9): train_batch_size=4 varying groups take 3 generation rounds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiller.config import load_config
from tiller.protocol import Batch
from tiller.tasks import arithmetic

SCRIPTED_SRC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 3:
        return 1.0
    return (sum(map(ord, solution_str)) * 7 + len(solution_str)) % 11 / 10.0
'''


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dapo_data")
    arithmetic.write_task(root, n_train=48, n_test=4, seed=0)
    (root / "scripted.py").write_text(SCRIPTED_SRC)
    return root


def _run(tmp_path, model_dir, data, *overrides):
    from tiller.trainer.rl import RLTrainer

    cfg = load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data / 'train.parquet'}",
        f"custom_reward_function.path={data / 'scripted.py'}", "data.shuffle=false",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "algorithm.adv_estimator=grpo",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
        "trainer.total_training_steps=1", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
        "trainer.val_before_train=false", f"trainer.default_local_dir={tmp_path}", *overrides])
    trainer = RLTrainer(cfg)
    seen: list[Batch] = []
    execute = trainer.actor.execute

    def spy(method, *args, **kwargs):
        if method == "update_actor":
            seen.append(args[0])
        return execute(method, *args, **kwargs)

    trainer.actor.execute = spy
    try:
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    return metrics, seen


def test_dynamic_sampling_collects_exactly_train_batch_size_groups(tmp_path, tiny_model_dir, data):
    metrics, seen = _run(tmp_path, tiny_model_dir, data, "algorithm.filter_groups.max_num_gen_batches=0")
    assert metrics["batch/num_gen_batches"] == 3  # groups 0, 3 | 6 | 9
    assert metrics["batch/num_groups"] == 12
    assert metrics["batch/num_groups_kept"] == 4
    (batch,) = seen
    assert len(batch) == 4 * 4  # exactly train_batch_size groups of n samples
    # every trained group has a learning signal: GRPO advantages are not all zero in any group
    adv = batch["advantages"].sum(-1).view(4, 4)
    assert (adv.abs().sum(-1) > 0).all()


def test_dynamic_sampling_cap_trains_on_what_was_collected(tmp_path, tiny_model_dir, data, capsys):
    metrics, seen = _run(tmp_path, tiny_model_dir, data, "algorithm.filter_groups.max_num_gen_batches=2")
    assert metrics["batch/num_gen_batches"] == 2
    assert metrics["batch/num_groups_kept"] == 3  # groups 0, 3 | 6
    assert len(seen[0]) == 3 * 4
    assert "3 of 4 groups passed algorithm.filter_groups after 2 generation rounds" in capsys.readouterr().out


def test_no_group_passes_within_the_cap_trains_on_nothing(tmp_path, tiny_model_dir, data):
    (data / "constant.py").write_text("def compute_score(*args, **kwargs):\n    return 1.0\n")
    metrics, seen = _run(tmp_path, tiny_model_dir, data, "algorithm.filter_groups.max_num_gen_batches=1",
                         f"custom_reward_function.path={data / 'constant.py'}")
    assert seen == [] and metrics["batch/num_groups_kept"] == 0 and metrics["batch/num_gen_batches"] == 1


def test_gen_batch_size_sets_the_round_size(tmp_path, tiny_model_dir, data):
    # 12 prompts per round: indices 0-11 hold 4 varying groups (0, 3, 6, 9): one round is enough
    metrics, seen = _run(tmp_path, tiny_model_dir, data, "data.gen_batch_size=12")
    assert metrics["batch/num_gen_batches"] == 1
    assert metrics["batch/num_groups"] == 12 and metrics["batch/num_groups_kept"] == 4
    assert len(seen[0]) == 16


def test_filter_metrics_follow_verl():
    """seq_reward is the sum of token_level_scores, seq_final_reward of the KL-penalised rewards."""
    from tiller.algos.kl import FixedKLController
    from tiller.trainer.rl import RLTrainer

    # two groups of 2: scores constant in group a, varying in group b; KL (old - ref) varies in group a
    scores = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0], [-1.0, -3.0], [-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.full((4, 2), -1.0)
    batch = Batch({"token_level_scores": scores, "old_log_probs": old, "ref_log_prob": ref,
                   "response_mask": torch.ones(4, 2, dtype=torch.long), "acc": scores.sum(-1),
                   "score": scores.sum(-1)}, {"uid": ["a", "a", "b", "b"]})

    def kept(metric: str, kl: bool) -> list[str]:
        cfg = load_config([f"algorithm.filter_groups.metric={metric}", f"algorithm.use_kl_in_reward={kl}"])
        fake = SimpleNamespace(cfg=cfg, kl_ctrl=FixedKLController(0.5))
        return sorted(set(RLTrainer._filter_groups(fake, batch)["uid"]))

    assert kept("seq_reward", kl=True) == ["b"]  # scores: group a constant
    assert kept("score", kl=True) == ["b"]
    # a's KL-in-reward rewards differ (row 1 has kl -2 on its last token), b's do not (same kl, different scores)
    assert kept("seq_final_reward", kl=True) == ["a", "b"]
    assert kept("seq_final_reward", kl=False) == ["b"]
