"""Sampling on the device: penalties, temperature, top-k, top-p, min-p, the draw, and the sampled token's logprob.

The filters are applied in Hugging Face's warper order (temperature -> top-k -> top-p -> min-p), with the
same tie and keep-at-least-one rules, so the `native` and `hf` engines sample from the same
distribution and report the same logprobs:

- top-k: keep logits >= the k-th largest (ties at the boundary are kept).
- top-p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"): sort ascending, drop the
  tokens whose cumulative probability is <= 1 - top_p; the most likely token always stays.
- min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"): drop tokens whose probability is
  below min_p x the top token's probability.

The logprob returned is `log_softmax(filtered scores)[token]`, i.e. under the distribution actually sampled.
Greedy returns `argmax(logits)` and `log_softmax(logits)[token]`.

Penalties (`apply_penalties`, on the raw logits, before temperature and the filters, as vLLM and HF's processors
order them; greedy rows take them too):

- repetition penalty (Keskar et al. 2019, CTRL, arXiv 1909.05858, section 4.1; HF's `RepetitionPenaltyLogitsProcessor`,
  vLLM's `repetition_penalty`): a token already in the prompt or the response so far has its logit divided by
  `r` when positive, multiplied by `r` when negative (`r > 1` discourages repeats);
- presence and frequency penalties (OpenAI's definition, as vLLM implements it): a token that occurs `c` times in the
  response so far loses `frequency_penalty * c + presence_penalty * (c > 0)`; prompt tokens do not count.

With penalties the logprobs are those of the penalised distribution (vLLM's `processed_logprobs`), which the
trainer's teacher-forced forward does not reproduce: the rollout / actor mismatch metrics show the gap.

Letters: `B` rows, `V` vocabulary.
"""

from __future__ import annotations

import torch


def token_counts(ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """How often each token occurs in each row: ids (B lists) -> counts [B, V] fp32."""
    counts = torch.zeros((len(ids), vocab_size), dtype=torch.float32, device=device)
    for row, row_ids in enumerate(ids):
        if row_ids:
            index = torch.tensor(row_ids, dtype=torch.long, device=device)
            counts[row].index_add_(0, index, torch.ones(len(row_ids), device=device))
    return counts


def apply_penalties(logits: torch.Tensor, prompt_seen: torch.Tensor, output_counts: torch.Tensor,
                    repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0) -> torch.Tensor:
    """Penalised logits [B, V] (fp32, a new tensor) from logits [B, V], prompt_seen [B, V] bool (the token is in
    the row's prompt) and output_counts [B, V] (its count in the row's response so far).

    Worked numbers: logits [2.0, -1.0, 0.5], prompt holds token 0, the response token 1 twice; repetition 2,
    presence 0.1, frequency 0.25 -> [2 / 2, -1 * 2 - 0.25 * 2 - 0.1, 0.5] = [1.0, -2.6, 0.5].
    """
    scores = logits.float().clone()
    if repetition_penalty != 1.0:
        seen = prompt_seen | (output_counts > 0)
        penalised = torch.where(scores > 0, scores / repetition_penalty, scores * repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if frequency_penalty != 0.0:
        scores = scores - frequency_penalty * output_counts
    if presence_penalty != 0.0:
        scores = scores - presence_penalty * (output_counts > 0).float()
    return scores


class PenaltyState:
    """The token counts a decode loop keeps for `apply_penalties`: rows in the loop's batch order.

    `penalize(logits)` before sampling, `record(tokens)` after, `select(keep)` when the loop drops rows."""

    def __init__(self, prompts: list[list[int]], vocab_size: int, device, repetition_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0):
        self.prompt_seen = token_counts(prompts, vocab_size, device) > 0
        self.output_counts = torch.zeros((len(prompts), vocab_size), dtype=torch.float32, device=device)
        self.penalties = (repetition_penalty, presence_penalty, frequency_penalty)

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_penalties(logits, self.prompt_seen, self.output_counts, *self.penalties)

    def record(self, tokens: torch.Tensor) -> None:
        rows = torch.arange(len(tokens), device=tokens.device)
        self.output_counts[rows, tokens] += 1

    def select(self, keep: torch.Tensor) -> None:
        self.prompt_seen, self.output_counts = self.prompt_seen[keep], self.output_counts[keep]


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                min_p: float = 0.0) -> torch.Tensor:
    """Filtered scores [B, V] (fp32; dropped tokens are -inf) from raw logits [B, V]."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    neg_inf = float("-inf")
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, neg_inf)
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        scores = scores.masked_fill(drop, neg_inf)
    if min_p > 0.0:
        probs = scores.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        drop = probs < min_p * top
        scores = scores.masked_fill(drop, neg_inf)
    return scores


def sample_tokens(logits: torch.Tensor, *, do_sample: bool, temperature: float = 1.0, top_k: int = -1,
                  top_p: float = 1.0, min_p: float = 0.0,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits [B, V] -> (tokens [B] long, logprobs [B] fp32)."""
    if not do_sample:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    scores = warp_logits(logits, temperature, top_k, top_p, min_p)
    logp = torch.log_softmax(scores, dim=-1)
    tokens = draw_from(logp.exp(), generator)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def draw_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from probs [B, V] by inverting the CDF: tokens [B].

    Token i is chosen when cdf[i-1] <= u < cdf[i] with u ~ U[0, cdf[-1]), which has probability p_i
    and can never pick a zero-probability token (its interval is empty). It needs B uniforms instead of
    the B x V exponentials `torch.multinomial` draws (~10x faster on CPU at V = 512). The CDF is
    accumulated in float64 so large vocabularies keep their tail mass.
    """
    u = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64, device=probs.device)
    return draw_with_uniforms(probs, u)


DRAW_BLOCK = 1024
"""Vocabulary entries per block of `draw_blocked`."""


def draw_blocked(scores: torch.Tensor, lse: torch.Tensor, u: torch.Tensor, block: int = DRAW_BLOCK) -> torch.Tensor:
    """`draw_with_uniforms(exp(scores - lse), u)` without a [B, V] cumulative sum: scores [B, V] fp32 (filtered
    tokens -inf), lse [B, 1] their logsumexp, u [B, 1] float64 in [0, 1) -> tokens [B].

    The vocabulary is cut into blocks of `block` entries: each block's probability mass (float64) is one reduction
    over the scores, a cumulative sum over the blocks picks the block where u x total falls, and a cumulative sum over
    that block's `block` entries picks the token, cdf[i-1] <= u x total < cdf[i] as in `draw_with_uniforms` (the sums
    differ from its one running float64 sum only by rounding, ~1e-16 of the total). Compiled (the static decode step
    on a GPU), nothing of size [B, V] is written: the scores are read by the logsumexp and by the block sums, where the
    inverse CDF wrote and read the probabilities and their float64 CDF (at 256 rows of a 152k vocabulary, ~0.2 GB
    read for ~1 GB). A zero-probability token is never drawn: the block and the token are capped at the last one with
    mass (where rounding puts u x total at or past the end)."""
    b, v = scores.shape
    nb = -(-v // block)
    p = torch.nn.functional.pad(torch.exp(scores - lse), (0, nb * block - v)).view(b, nb, block)
    sums = p.double().sum(-1)  # [B, nb]
    csum = sums.cumsum(-1)
    target = u * csum[:, -1:]
    blocks = torch.arange(nb, device=scores.device)
    last_block = torch.where(sums > 0, blocks, 0).amax(-1, keepdim=True)
    blk = torch.minimum(torch.searchsorted(csum, target, right=True), last_block)  # [B, 1]
    before = torch.nn.functional.pad(csum[:, :-1], (1, 0)).gather(1, blk)  # the mass of the blocks before it
    idx = blk * block + torch.arange(block, device=scores.device)  # [B, block]
    vals = torch.where(idx < v, torch.exp(scores.gather(1, idx.clamp_max(v - 1)) - lse), 0.0).double()
    within = torch.searchsorted(before + vals.cumsum(-1), target, right=True)
    last = torch.where(vals > 0, torch.arange(block, device=scores.device), 0).amax(-1, keepdim=True)
    return (blk * block + torch.minimum(within, last)).squeeze(-1)


def draw_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`draw_from` with the uniforms given: probs [B, V], u [B, 1] float64 in [0, 1) -> tokens [B].

    The continuous-batching engine draws each seeded row's uniform from that row's own generator, so a
    seeded request samples the same tokens whatever else shares its batch.
    """
    cdf = probs.double().cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return tokens.clamp_max(probs.shape[-1] - 1)
