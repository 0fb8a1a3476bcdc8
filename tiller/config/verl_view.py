"""The run's config as verl's user code reads it (agent loops, reward managers: `self.config`)."""

from __future__ import annotations

from typing import Any


def verl_config(cfg: Any) -> Any:
    """An OmegaConf of `cfg` with attribute access; the rollout's prompt_length / response_length resolved from
    data.max_prompt_length / max_response_length as verl's are, and verl 0.10's `reward` section mirroring the legacy
    keys tiller resolved it onto (reward_kwargs, custom_reward_function)."""
    from omegaconf import OmegaConf  # import cost: omegaconf, only when user code wants verl's view

    conf = OmegaConf.structured(cfg)
    rollout, data = conf.actor_rollout_ref.rollout, conf.data
    rollout.prompt_length = rollout.prompt_length or data.max_prompt_length
    rollout.response_length = rollout.response_length or data.max_response_length
    conf.reward.reward_kwargs = {**dict(conf.reward.reward_kwargs), **dict(conf.reward_model.reward_kwargs or {})}
    conf.reward.custom_reward_function = conf.custom_reward_function
    return conf
