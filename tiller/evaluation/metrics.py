"""Sampling-based evaluation metrics: mean@n, pass@k (unbiased), maj@k (majority vote).

For one prompt with n sampled answers, c of them correct:

- mean@n = c / n, the expected accuracy of one sample.
- pass@k = P(at least one of k samples drawn without replacement from the n is correct)
         = 1 - C(n-c, k) / C(n, k)                                   (Chen et al. 2021, "Evaluating Large
  Language Models Trained on Code", arXiv 2107.03374, eq. 1). It is unbiased for the pass@k of the model,
  unlike 1 - (1 - c/n)^k. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), the paper's numerically stable
  form (no huge binomials).
- maj@k = accuracy of the most frequent extracted answer among k samples (self-consistency, Wang et al.
  2022, arXiv 2203.11171). Samples without an extracted answer (None) do not vote; a prompt where none
  votes scores 0. Ties go to the answer that appears first in sample order, so the result is deterministic.
  For k = n the vote is over all samples; for k < n it is the mean over random k-subsets (without
  replacement, seeded), estimated with up to `n_resamples` subsets, or exactly when C(n, k) is small.

NoveltyBench's diversity metrics (Zhang et al. 2025, "NoveltyBench: Evaluating Language Models for Humanlike
Diversity", arXiv 2504.05228, section 3 and `src/score.py`), from a partition of a prompt's samples into
equivalence classes c_1..c_n (class ids in order of first appearance, as a greedy partition gives them) and a
quality u_i per sample:

- distinct_k = |{c_i : i <= k}|, the number of distinct classes among the first k samples.
- utility_k = (1 - p) / (1 - p^k) * sum_{i=1}^{k} p^(i-1) * 1[c_i != c_j for all j < i] * u_i, with patience
  p = 0.8: a user reads sample i with probability p^(i-1), and only the first sample of each class is worth
  anything; the factor normalises the weights to sum to 1, so utility_k lies in the range of u. (NoveltyBench
  computes it as np.average(generation_scores, weights=p ** arange(k)), the same number.) NoveltyBench's
  u_i is a 1..10 calibration of its Skywork reward model; `tiller eval --diversity` uses the reward score as is.

Dataset-level values are the means over prompts. Deviation from verl's `process_validation_metrics`: verl
bootstraps maj@k with replacement; here subsets are drawn without replacement (k distinct samples, as the
metric's definition says) and enumerated exactly when there are at most `n_resamples` of them.

Pure functions: numbers in, numbers out; no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Any, Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `n` samples of which `c` are correct.

    >>> pass_at_k(4, 1, 1)   # 1 - C(3,1)/C(4,1) = 1 - 3/4
    0.25
    >>> pass_at_k(4, 1, 2)   # 1 - C(3,2)/C(4,2) = 1 - 3/6
    0.5
    >>> pass_at_k(4, 3, 2)   # n - c = 1 < k: every pair holds a correct sample
    1.0
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_answer(answers: Sequence[Hashable | None]) -> int | None:
    """Index of the first sample holding the most frequent non-None answer (None when no sample votes).

    >>> majority_answer(["7", "8", "8", "7"])   # tie 2-2: "7" appears first
    0
    >>> majority_answer([None, "3", "5", "5"])
    2
    """
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, i)
    if not counts:
        return None
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[best]


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[float], k: int, *,
             n_resamples: int = 1000, seed: int = 0) -> float:
    """maj@k of one prompt: the accuracy of the majority answer over k of its n samples.

    answers[n]: extracted answer per sample (None = no answer); correct[n]: 1/0 (or a score) per sample.
    The majority answer's correctness is that of its first sample (samples with equal answers are scored
    equally by any deterministic scorer).
    """
    n = len(answers)
    if len(correct) != n or not 1 <= k <= n:
        raise ValueError(f"maj_at_k needs len(correct) == len(answers) and 1 <= k <= n, got n={n}, k={k}")

    def vote(idx: Sequence[int]) -> float:
        top = majority_answer([answers[i] for i in idx])
        return 0.0 if top is None else float(correct[idx[top]])

    if k == n:
        return vote(range(n))
    if math.comb(n, k) <= n_resamples:
        subsets = list(itertools.combinations(range(n), k))
        return float(np.mean([vote(s) for s in subsets]))
    rng = np.random.default_rng(seed)
    return float(np.mean([vote(sorted(rng.choice(n, size=k, replace=False).tolist())) for _ in range(n_resamples)]))


def k_ladder(n: int) -> list[int]:
    """The k values reported for n samples: powers of two below n, then n.

    >>> k_ladder(1), k_ladder(6), k_ladder(8)
    ([1], [1, 2, 4, 6], [1, 2, 4, 8])
    """
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def distinct_k(labels: Sequence[Hashable], k: int) -> int:
    """Number of distinct classes among the first k samples.

    >>> distinct_k([0, 0, 1, 2, 1], 2), distinct_k([0, 0, 1, 2, 1], 5)
    (1, 3)
    """
    if not 1 <= k <= len(labels):
        raise ValueError(f"distinct_k needs 1 <= k <= n, got n={len(labels)}, k={k}")
    return len(set(labels[:k]))


def utility_k(labels: Sequence[Hashable], quality: Sequence[float], k: int, patience: float = 0.8) -> float:
    """NoveltyBench's cumulative utility of the first k samples (see the module doc).

    >>> round(utility_k([0, 0, 1], [4.0, 9.0, 2.0], 3, 0.5), 6)  # (4 + 0.25 * 2) / (1 + 0.5 + 0.25)
    2.571429
    """
    if len(quality) != len(labels) or not 1 <= k <= len(labels):
        raise ValueError(f"utility_k needs len(quality) == len(labels) and 1 <= k <= n, got n={len(labels)}, k={k}")
    if not 0.0 < patience <= 1.0:
        raise ValueError(f"patience must be in (0, 1], got {patience}")
    seen: set = set()
    total = 0.0
    for i in range(k):
        if labels[i] not in seen:
            seen.add(labels[i])
            total += patience ** i * float(quality[i])
    return total / float(np.sum(patience ** np.arange(k)))


def evaluation_metrics(records: Sequence[dict[str, Any]], *, n_resamples: int = 1000,
                       seed: int = 0, patience: float = 0.8) -> dict[str, dict[str, float]]:
    """Per data source metrics from one record per sample.

    A record has `data_source`, `prompt_index` (samples of one prompt share it), `acc` (1/0 correctness),
    `score` (the reward) and `pred` (extracted answer or None). Every prompt of a source must have the same
    number of samples n. Returns {data_source: {"num_prompts", "n", "mean@n", "reward/mean@n",
    "pass@k" and "maj@k" for k in `k_ladder(n)`}}. When the records carry `class` (the sample's equivalence
    class within its prompt) and `sample_index`, it adds "distinct@k" and "utility@k" (NoveltyBench, quality =
    `score`, patience `patience`) over the first k samples in sample order.
    """
    groups: dict[str, dict[Any, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        groups[str(r["data_source"])][r["prompt_index"]].append(r)
    out: dict[str, dict[str, float]] = {}
    for source, prompts in sorted(groups.items()):
        sizes = {len(s) for s in prompts.values()}
        if len(sizes) != 1:
            raise ValueError(f"data source {source!r}: prompts have different sample counts {sorted(sizes)}")
        n = sizes.pop()
        m: dict[str, float] = {"num_prompts": float(len(prompts)), "n": float(n)}
        accs = [[float(r["acc"]) for r in s] for s in prompts.values()]
        m[f"mean@{n}"] = float(np.mean([np.mean(a) for a in accs]))
        m[f"reward/mean@{n}"] = float(np.mean([np.mean([float(r["score"]) for r in s]) for s in prompts.values()]))
        for k in k_ladder(n):
            m[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(sum(a > 0.5 for a in acc)), k) for acc in accs]))
        for k in k_ladder(n):
            m[f"maj@{k}"] = float(np.mean([
                maj_at_k([r["pred"] for r in s], [float(r["acc"]) for r in s], k, n_resamples=n_resamples, seed=seed)
                for s in prompts.values()
            ]))
        if all("class" in r for s in prompts.values() for r in s):
            ordered = [sorted(s, key=lambda r: r.get("sample_index", 0)) for s in prompts.values()]
            for k in k_ladder(n):
                m[f"distinct@{k}"] = float(np.mean([distinct_k([r["class"] for r in s], k) for s in ordered]))
            for k in k_ladder(n):
                m[f"utility@{k}"] = float(np.mean([
                    utility_k([r["class"] for r in s], [float(r["score"]) for r in s], k, patience) for s in ordered]))
        out[source] = m
    return out
