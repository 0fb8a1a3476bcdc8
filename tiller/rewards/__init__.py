"""tiller.rewards: scorers by data_source, reward managers, reward models, remote rewards, sandbox,
DARLING diversity partitioners. The contract is in docs/internals.md (`tiller.rewards`)."""

from tiller.rewards.pipeline import RewardPipeline, build_reward_manager
from tiller.rewards.registry import default_compute_score, get_scorer, register_scorer
from tiller.rewards.types import RewardRequest, RewardResult

__all__ = [
    "RewardPipeline",
    "RewardRequest",
    "RewardResult",
    "build_reward_manager",
    "default_compute_score",
    "get_scorer",
    "register_scorer",
]
