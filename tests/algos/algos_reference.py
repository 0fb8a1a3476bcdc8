"""Plain-loop reference implementations (one sample / one token at a time, Python floats) used to
check the vectorised code in tiller.algos. They follow verl's dict-of-lists formulation."""

from __future__ import annotations

import math
from collections import defaultdict


def scores_of(rewards, mask):
    return [sum(r * m for r, m in zip(rr, mm)) for rr, mm in zip(rewards, mask)]


def _groups(index):
    out = defaultdict(list)
    for i, g in enumerate(index):
        out[g].append(i)
    return out


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):  # unbiased
    mu = _mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def grpo(rewards, mask, index, eps=1e-6, norm=True):
    s = scores_of(rewards, mask)
    adv = [0.0] * len(s)
    for members in _groups(index).values():
        vals = [s[i] for i in members]
        mu, sd = (0.0, 1.0) if len(vals) == 1 else (_mean(vals), _std(vals))
        for i in members:
            adv[i] = (s[i] - mu) / (sd + eps) if norm else s[i] - mu
    return [[adv[i] * m for m in mask[i]] for i in range(len(s))]


def rloo(rewards, mask, index):
    s = scores_of(rewards, mask)
    adv = list(s)
    for members in _groups(index).values():
        n = len(members)
        if n > 1:
            for i in members:
                others = [s[j] for j in members if j != i]
                adv[i] = s[i] - _mean(others)
    return [[adv[i] * m for m in mask[i]] for i in range(len(s))]


def opo(rewards, mask, index):
    s = scores_of(rewards, mask)
    lens = [sum(mm) for mm in mask]
    adv = [0.0] * len(s)
    for members in _groups(index).values():
        if len(members) == 1:
            b = 0.0
        else:
            tot = sum(lens[i] for i in members)
            b = sum(lens[i] * s[i] for i in members) / tot if tot else 0.0
        for i in members:
            adv[i] = s[i] - b
    return [[adv[i] * m for m in mask[i]] for i in range(len(s))]


def gpg(rewards, mask, index, f_norm=1.0):
    s = scores_of(rewards, mask)
    alpha = len(s) / max(1, sum(1 for x in s if x != 0))
    adv = [0.0] * len(s)
    for members in _groups(index).values():
        mu = 0.0 if len(members) == 1 else _mean([s[i] for i in members])
        for i in members:
            adv[i] = alpha * (s[i] - mu) / f_norm
    return [[adv[i] * m for m in mask[i]] for i in range(len(s))]


def passk(rewards, mask, index, eps=1e-6, norm=True):
    s = scores_of(rewards, mask)
    adv = [0.0] * len(s)
    for members in _groups(index).values():
        best = max(members, key=lambda i: (s[i], -i))  # first index among ties
        second = max(s[i] for i in members if i != best)
        gap = s[best] - second
        if norm:
            gap /= _std([s[i] for i in members]) + eps
        adv[best] = gap
    return [[adv[i] * m for m in mask[i]] for i in range(len(s))]


def whiten(x, mask):
    vals = [v for row, mrow in zip(x, mask) for v, m in zip(row, mrow) if m]
    mu = _mean(vals)
    var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)
    return [[(v - mu) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(row, mrow)] for row, mrow in zip(x, mask)]


def gae(rewards, values, mask, gamma, lam):
    """Per row: walk back over the valid tokens only (masked steps are skipped)."""
    raw = []
    for r, v, m in zip(rewards, values, mask):
        row = [0.0] * len(r)
        next_v, last = 0.0, 0.0
        for t in reversed(range(len(r))):
            if not m[t]:
                row[t] = last
                continue
            delta = r[t] + gamma * next_v - v[t]
            last = delta + gamma * lam * last
            next_v = v[t]
            row[t] = last
        raw.append(row)
    returns = [[(a + vv) * m for a, vv, m in zip(ra, rv, rm)] for ra, rv, rm in zip(raw, values, mask)]
    return whiten(raw, mask), returns


def discounted_returns(rewards, mask, gamma):
    out = []
    for r, m in zip(rewards, mask):
        row = [0.0] * len(r)
        running = 0.0
        for t in reversed(range(len(r))):
            if m[t]:  # masked tokens (padding, observation turns) are skipped: the return crosses them unchanged
                running = r[t] + gamma * running
                row[t] = running
        out.append(row)
    return out


def vanilla_token(logp, old, adv, low, high, c):
    ratio = math.exp(max(-20.0, min(20.0, logp - old)))
    l1, l2 = -adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high)
    clip1 = max(l1, l2)
    return min(clip1, -adv * c) if adv < 0 else clip1


def assert_close(actual, expected, atol=1e-9):
    """Compare a tensor (or nested list) with a nested list of floats elementwise."""
    import torch

    a = torch.as_tensor(actual, dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(a, e, atol=atol, rtol=0)
