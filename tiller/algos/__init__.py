"""tiller.algos: the math of RL post-training as small pure functions.

Tensors and numbers in; tensors and a metrics dict out. No config objects, no `.item()`, no
collectives, no I/O. Shapes: `B` sequences, `T` response tokens, `V` vocabulary.
See docs/internals.md for the contract and each module's docstring for the equations.
"""

from tiller.algos.advantages import ADV_ESTIMATORS, get_advantage_estimator, register_advantage_estimator
from tiller.algos.aggregate import LOSS_AGG_MODES, aggregate_loss
from tiller.algos.diversity import diversity_from_partition, fuse_diversity
from tiller.algos.entropy import (
    AdaptiveEntropyController,
    entropy_from_logits,
    logprobs_and_entropy,
    logprobs_from_logits,
    sum_pi_squared_from_logits,
)
from tiller.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
    kl_penalty,
)
from tiller.algos.policy_losses import (
    FORCED_LOSS_AGG_MODE,
    POLICY_LOSSES,
    get_policy_loss,
    register_policy_loss,
)
from tiller.algos.pf_ppo import pf_ppo_resample, pf_ppo_weights
from tiller.algos.preference import dpo_loss, kto_loss, pairwise_rm_loss, reference_free_loss
from tiller.algos.sft import SFT_LOSSES, sft_token_loss
from tiller.algos.prime import compute_prime, prime_prm_loss, prime_token_rewards
from tiller.algos.rollout_correction import rollout_correction, rollout_mismatch_metrics
from tiller.algos.token_baseline import compute_optimal_token_baseline, compute_tir_optimal_token_baseline
from tiller.algos.utils import group_ids, masked_mean, masked_sum, masked_var, masked_whiten
from tiller.algos.value_loss import explained_variance, value_loss

__all__ = [
    "SFT_LOSSES",
    "sft_token_loss",
    "ADV_ESTIMATORS",
    "AdaptiveEntropyController",
    "AdaptiveKLController",
    "FORCED_LOSS_AGG_MODE",
    "FixedKLController",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "aggregate_loss",
    "apply_kl_in_reward",
    "build_kl_controller",
    "compute_optimal_token_baseline",
    "compute_prime",
    "compute_tir_optimal_token_baseline",
    "diversity_from_partition",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "fuse_diversity",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_ids",
    "kl_penalty",
    "kto_loss",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pairwise_rm_loss",
    "pf_ppo_resample",
    "pf_ppo_weights",
    "prime_prm_loss",
    "prime_token_rewards",
    "register_advantage_estimator",
    "reference_free_loss",
    "register_policy_loss",
    "rollout_correction",
    "rollout_mismatch_metrics",
    "sum_pi_squared_from_logits",
    "value_loss",
]
