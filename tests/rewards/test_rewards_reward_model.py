"""Reward-model scorer on tiny classifiers built from the tiny-model kit's tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiller.config.schema import RLConfig
from tiller.errors import UserError
from tiller.rewards import RewardRequest, build_reward_manager
from tiller.rewards.reward_model import RewardModelScorer


def _build_rm(out_dir, kind="sequence"):
    from transformers import Qwen2ForSequenceClassification, Qwen2ForTokenClassification

    from tiller.models.tiny import build_config, train_tokenizer

    tokenizer = train_tokenizer()
    config = build_config(tokenizer, hidden_size=64, num_layers=2, num_labels=1)
    torch.manual_seed(0)
    cls = Qwen2ForSequenceClassification if kind == "sequence" else Qwen2ForTokenClassification
    model = cls(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return _build_rm(tmp_path_factory.mktemp("rm") / "seq")


@pytest.fixture(scope="module")
def value_head_dir(tmp_path_factory):
    return _build_rm(tmp_path_factory.mktemp("rm") / "tok", kind="token")


PROMPTS = ["What is 2+3?", "Name a colour.", "Say hi", "12*12=?", "Count to three"]
RESPONSES = ["5", "A long answer about the colour blue and why the sky looks that way.", "hi", "144", "1 2 3"]


def test_scores_match_a_manual_forward_and_do_not_depend_on_batching(rm_dir):
    scorer = RewardModelScorer(str(rm_dir), micro_batch_size=2)
    batched = scorer.score_texts(PROMPTS, RESPONSES)
    one_by_one = np.concatenate([scorer.score_texts([p], [r]) for p, r in zip(PROMPTS, RESPONSES)])
    np.testing.assert_allclose(batched, one_by_one, atol=1e-5)  # right padding is masked out
    assert len(set(np.round(batched, 6))) == len(PROMPTS)  # a real model: different texts, different scores
    # manual: render with the RM's chat template, forward, read the single logit
    text = scorer.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": RESPONSES[0]}], tokenize=False)
    ids = scorer.tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        manual = scorer.model(**ids).logits[0, 0].item()
    assert batched[0] == pytest.approx(manual, abs=1e-5)


def test_token_budget_micro_batches_give_the_same_scores(rm_dir):
    """reward_model.use_dynamic_bsz: micro-batches packed by padded tokens, scores unchanged."""
    fixed = RewardModelScorer(str(rm_dir), micro_batch_size=5).score_texts(PROMPTS, RESPONSES)
    scorer = RewardModelScorer(str(rm_dir), max_tokens=64)
    texts = [scorer.tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                                                  tokenize=False) for p, r in zip(PROMPTS, RESPONSES)]
    lengths = [len(ids) for ids in scorer.tokenizer(texts, add_special_tokens=False)["input_ids"]]
    parts = scorer._token_budget_parts(texts)
    assert len(parts) > 1 and all(len(p) * max(lengths[i] for i in p) <= 64 for p in parts)
    np.testing.assert_allclose(scorer.score_texts(PROMPTS, RESPONSES), fixed, atol=1e-5)
    with pytest.raises(UserError, match="forward_max_token_len_per_gpu=8"):
        RewardModelScorer(str(rm_dir), max_tokens=8).score_texts(PROMPTS, RESPONSES)


def test_value_head_model_takes_the_last_token(value_head_dir):
    scorer = RewardModelScorer(str(value_head_dir), micro_batch_size=3)
    assert scorer.token_level
    batched = scorer.score_texts(PROMPTS, RESPONSES)
    text = scorer.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[1]}, {"role": "assistant", "content": RESPONSES[1]}], tokenize=False)
    ids = scorer.tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        manual = scorer.model(**ids).logits[0, -1, 0].item()
    assert batched[1] == pytest.approx(manual, abs=1e-5)


def test_max_length_keeps_the_end(rm_dir):
    scorer = RewardModelScorer(str(rm_dir), max_length=8)
    long_a = scorer.score_texts(["x " * 50], ["the same ending"])
    long_b = scorer.score_texts(["y " * 80], ["the same ending"])
    np.testing.assert_allclose(long_a, long_b, atol=1e-5)  # only the last 8 tokens are seen


def test_build_reward_manager_with_a_reward_model(rm_dir):
    cfg = RLConfig()
    cfg.reward_model.enable = True
    cfg.reward_model.model.path = str(rm_dir)
    cfg.reward_model.micro_batch_size_per_gpu = 4
    manage = build_reward_manager(cfg)
    requests = [RewardRequest("any/source", p, r, None, {}, 3, str(i)) for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))]
    result = manage(requests)
    expected = RewardModelScorer(str(rm_dir)).score_texts(PROMPTS, RESPONSES)
    np.testing.assert_allclose(result.scores, expected, atol=1e-5)
    np.testing.assert_allclose(result.extras["rm_score"], expected, atol=1e-5)


def test_bad_paths_are_user_errors(tmp_path):
    with pytest.raises(UserError):
        RewardModelScorer(str(tmp_path / "nope"))


def test_served_reward_model_gives_the_same_scores(rm_dir):
    from test_rewards_remote import serve

    from tiller.rewards.remote import RemoteRewardClient
    from tiller.rewards.server import create_app

    scorer = RewardModelScorer(str(rm_dir))
    with serve(create_app(scorer)) as url:
        remote = RemoteRewardClient(url).score_texts(PROMPTS, RESPONSES, [{} for _ in PROMPTS])
    np.testing.assert_allclose(remote, scorer.score_texts(PROMPTS, RESPONSES), atol=1e-5)
