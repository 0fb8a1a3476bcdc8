"""The recipe presets `skywork_or1` and `darling`: they load and validate, every key carries a comment with the
paper's value and source, the loaded values are those values (unless the comment says why tiller's differ),
and command-line overrides go on top."""

from __future__ import annotations

import re

import pytest
import yaml

from tiller.config import load_config, to_dict
from tiller.config.loader import preset_path
from tiller.errors import ConfigError

RECIPES = ["skywork_or1", "darling"]
MODEL = "actor_rollout_ref.model.path=/nonexistent/model"  # loading a config does not touch the model
PAPER = re.compile(r"#\s*paper:\s*(?P<value>.+?)\s*\((?P<source>[^)]+)\)(?P<rest>.*)$")


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_leaves(value, path + "."))
        else:
            out[path] = value
    return out


def _comments(name: str) -> dict[str, re.Match]:
    """dotted key -> the `# paper: VALUE (SOURCE)...` match on its line (indentation gives the nesting)."""
    stack: list[tuple[int, str]] = []
    out = {}
    for line in preset_path(name).read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        key = line.strip().split(":", 1)[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        value_part = line.split(":", 1)[1].split("#", 1)[0].strip()
        if value_part:  # a leaf
            out[".".join(k for _, k in stack)] = PAPER.search(line)
    return out


def _get(cfg_dict: dict, dotted: str):
    node = cfg_dict
    for part in dotted.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize("name", RECIPES)
def test_preset_loads_validates_and_every_key_states_the_papers_value(name):
    cfg = to_dict(load_config([MODEL], preset=name))
    raw = yaml.safe_load(preset_path(name).read_text())
    comments = _comments(name)
    assert set(comments) == set(_leaves(raw)), "the comment parser and the YAML disagree on the keys"
    for key, value in _leaves(raw).items():
        match = comments[key]
        assert match, f"{name}.yaml: {key} has no '# paper: VALUE (SOURCE)' comment"
        assert match["source"].strip(), key
        assert _get(cfg, key) == value, key  # the preset's value is what load_config gives
        if "tiller:" in match["rest"]:  # tiller's value differs from the paper's, and the comment says why
            continue
        paper = yaml.safe_load(match["value"])
        assert paper == value, f"{name}.yaml: {key} = {value!r} but its comment says the paper's is {paper!r}"


def test_skywork_or1_values():
    cfg = load_config([MODEL], preset="skywork_or1")
    a, r, algo = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm
    assert (algo.adv_estimator, algo.use_kl_in_reward, a.use_kl_loss) == ("grpo", False, False)  # no KL
    assert algo.filter_groups.enable and algo.filter_groups.metric == "acc"  # zero-advantage groups dropped
    assert algo.filter_groups.max_num_gen_batches == 1  # no resampling to refill the batch
    assert [s[1] for s in r.response_length_schedule] == [8192, 16384, 32768]  # 8K -> 16K -> 32K
    assert cfg.data.max_response_length == 32768
    ae = a.adaptive_entropy
    assert (ae.enable, ae.target_entropy, ae.delta, ae.max_coeff, ae.init_coeff) == (True, 0.2, 1e-4, 5e-3, 0.0)
    assert a.entropy_coeff == 0.0 and r.temperature == 1.0 and r.n == 16 and a.loss_agg_mode == "token-mean"
    assert a.ppo_mini_batch_size == cfg.data.train_batch_size == 256 and a.ppo_epochs == 1  # on-policy
    assert a.optim.lr == 1e-6


def test_darling_values():
    cfg = load_config([MODEL], preset="darling")
    d = cfg.reward_model.diversity
    assert d.enable and d.fusion == "multiplicative" and d.partitioner == "ngram"
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "token-mean" and cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.data.train_batch_size == 256 and cfg.data.max_response_length == 8192


def test_overrides_go_on_top_of_the_presets():
    cfg = load_config([MODEL, "actor_rollout_ref.rollout.n=4", "data.train_batch_size=8",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "data.max_response_length=8",
                       "actor_rollout_ref.rollout.response_length_schedule=[[0,4],[3,8]]"], preset="skywork_or1")
    assert cfg.actor_rollout_ref.rollout.n == 4 and cfg.data.train_batch_size == 8
    assert cfg.actor_rollout_ref.rollout.response_length_schedule == [[0, 4], [3, 8]]
    assert cfg.actor_rollout_ref.actor.adaptive_entropy.target_entropy == 0.2  # the rest of the preset stays
    cfg = load_config([MODEL, "reward_model.diversity.partitioner=exact", "reward_model.diversity.enable=false"],
                      preset="darling")
    assert cfg.reward_model.diversity.partitioner == "exact" and not cfg.reward_model.diversity.enable
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False


def test_a_stage_longer_than_the_response_width_is_refused_by_name():
    # shrinking data.max_response_length under the preset's 8K..32K schedule would cut every stage silently
    with pytest.raises(ConfigError, match=r"response_length_schedule\[0\].*> the response width 8"):
        load_config([MODEL, "data.max_response_length=8"], preset="skywork_or1")
    with pytest.raises(ConfigError, match=r"response_length_schedule\[1\].*increasing steps"):
        load_config([MODEL, "data.max_response_length=8",
                     "actor_rollout_ref.rollout.response_length_schedule=[[5,4],[5,8]]"])
