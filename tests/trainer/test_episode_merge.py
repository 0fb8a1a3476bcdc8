"""Agent rollouts on several workers: the ranks' segment batches merge into the batch one process builds
(`tiller.trainer.episode_merge`): episode ids offset per rank, the padding prompts' rows dropped, widths padded."""

from __future__ import annotations

import pytest
import torch

from tiller.protocol import Batch
from tiller.trainer.episode_merge import merge_episode_parts
from tiller.workers.common import position_ids_from_mask

PAD = 0
REWARD = {"a": 1.0, "b": 0.0, "c": 0.5}  # an episode's reward on each of its rows


def segments_batch(rows: list[tuple], P: int, T: int) -> Batch:
    """The worker's layout (ActorRolloutRefWorker._generate_episodes) of rows (uid, episode, context ids, sampled
    ids, logprobs) at widths P / T: contexts left-padded, responses right-padded."""
    B = len(rows)
    prompts, responses = torch.full((B, P), PAD), torch.full((B, T), PAD)
    pmask, rmask, logp = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T)
    for i, (_, _, ctx, ids, lps) in enumerate(rows):
        prompts[i, P - len(ctx):], pmask[i, P - len(ctx):] = torch.tensor(ctx), 1
        if ids:
            responses[i, :len(ids)], rmask[i, :len(ids)], logp[i, :len(ids)] = torch.tensor(ids), 1, torch.tensor(lps)
    attention = torch.cat([pmask, rmask], 1)
    return Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": attention, "position_ids": position_ids_from_mask(attention),
                  "response_mask": rmask, "rollout_log_probs": logp, "episode": torch.tensor([r[1] for r in rows]),
                  "agent_reward": torch.tensor([REWARD[r[0]] for r in rows])},
                 {"uid": [r[0] for r in rows]}, {"prompt_width": P, "response_width": T})


def test_two_ranks_merge_into_the_one_process_batch():
    # 3 prompts (a, b, c), n = 2 episodes each, 2 ranks: the dispatch pads the prompts to 4 (a copied last), rank 0
    # runs a, b (its episodes 0-3), rank 1 runs c and the copy of a (its episodes 0-1 are c's, 2-3 the copy's).
    # One process numbers a's episodes 0, 1, b's 2, 3, c's 4, 5: rank 1's episode e is 2 prompts x 2 + e = 4 + e,
    # and its episodes 2, 3 (its prompt 1: the step's prompt 2 + 1 = 3, not one of the 3) are dropped. Widths:
    # rank 0 saw contexts of up to 4 ids and segments of up to 2, rank 1 of up to 2 and 3 -> merged P = 4, T = 3.
    rank0 = [("a", 0, [5, 6], [7], [-0.1]), ("a", 0, [5, 6, 7, 8], [9], [-0.2]),  # a two-segment episode
             ("a", 1, [5, 6], [3, 4], [-0.3, -0.4]), ("b", 2, [2], [1], [-0.5]), ("b", 3, [2], [], [])]
    rank1 = [("c", 0, [4, 4], [6, 6, 6], [-0.6, -0.7, -0.8]), ("c", 1, [4], [2], [-0.9]),
             ("a", 2, [5, 6], [8], [-1.0]), ("a", 3, [5, 6], [9, 9], [-1.1, -1.2])]
    parts = [segments_batch(rank0, 4, 2), segments_batch(rank1, 2, 3)]
    merged = merge_episode_parts(parts, n_prompts=3, n=2, pad_token_id=PAD)

    assert merged["episode"].tolist() == [0, 0, 1, 2, 3, 4, 5]
    assert list(merged["uid"]) == ["a", "a", "a", "b", "b", "c", "c"]
    assert merged.meta["prompt_width"] == 4 and merged.meta["response_width"] == 3
    # rank 1's first row: context [4, 4] left-padded to 4, response [6, 6, 6] already 3 wide
    assert merged["input_ids"][5].tolist() == [PAD, PAD, 4, 4, 6, 6, 6]
    assert merged["position_ids"][5].tolist() == [0, 0, 0, 1, 2, 3, 4]
    # rank 0's first row: response [7] right-padded from 2 to 3; its pads' positions continue from the last token
    assert merged["input_ids"][0].tolist() == [PAD, PAD, 5, 6, 7, PAD, PAD]
    assert merged["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 2, 2]
    # exactly what one process lays out for the 3 real prompts' rows (global episode ids, global widths)
    one = segments_batch(rank0 + [(u, e + 4, c, i, lp) for u, e, c, i, lp in rank1[:2]], 4, 3)
    assert set(merged.keys()) == set(one.keys())
    for key in one.tensors:
        assert torch.equal(merged[key], one[key]), key


def test_one_rank_is_the_worker_batch_itself_and_unknown_tensors_are_refused():
    rows = [("a", 0, [5], [7, 8], [-0.1, -0.2]), ("a", 1, [5], [9], [-0.3])]
    part = segments_batch(rows, 1, 2)
    merged = merge_episode_parts([part], n_prompts=1, n=2, pad_token_id=PAD)
    for key in part.tensors:
        assert torch.equal(merged[key], part[key]), key
    part["mystery"] = torch.zeros(2, 5)  # a [B, *] tensor the merge does not know how to widen: not guessed
    with pytest.raises(ValueError, match="'mystery' of shape \\(2, 5\\)"):
        merge_episode_parts([part, part], n_prompts=2, n=2, pad_token_id=PAD)


def test_generation_rounds_of_different_widths_concatenate():
    # DAPO's rounds (algorithm.filter_groups) of agent episodes: round 1 is P = 2, T = 1 wide, round 2 P = 3, T = 2
    # (a longer context and segment); scored rounds carry token_level_scores[B, T] (the reward on the last token)
    from tiller.trainer.episode_merge import concat_episode_batches

    rounds = [[("a", 0, [5, 6], [7], [-0.1])], [("b", 1, [2, 3, 4], [8, 9], [-0.2, -0.3])]]
    parts = [segments_batch(rows, P, T) for rows, P, T in zip(rounds, (2, 3), (1, 2))]
    for part in parts:
        scores = torch.zeros(part["response_mask"].shape)
        scores[0, int(part["response_mask"][0].sum()) - 1] = 1.0
        part["token_level_scores"] = scores
    merged = concat_episode_batches(parts, PAD)
    assert merged["input_ids"].tolist() == [[PAD, 5, 6, 7, PAD], [2, 3, 4, 8, 9]]
    assert merged["token_level_scores"].tolist() == [[1.0, 0.0], [0.0, 1.0]]
    one = segments_batch(rounds[0] + rounds[1], 3, 2)
    for key in one.tensors:
        assert torch.equal(merged[key], one[key]), key
