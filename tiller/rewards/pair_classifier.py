"""A pair classifier ("are these two responses the same?"), as DARLING and NoveltyBench use to partition
responses into equivalence classes.

NoveltyBench (Zhang et al. 2025, arXiv 2504.05228, `src/partition.py`, `src/classifier/finetune_classifier.py`)
and DARLING (Li et al. 2025, arXiv 2509.02534; its released partition classifier is served with vLLM's
`/classify`) both use a *cross-encoder*: one sequence classifier reads the two responses together,

    [CLS] a (at most max_length tokens) [SEP] b (at most max_length tokens) [SEP]

with token type 0 up to the first [SEP] and 1 after it, and has two labels: 0 = different, 1 = same.
P(same) = softmax(logits)[1]; two responses are the same when P(same) >= threshold (NoveltyBench's DeBERTa
uses a calibrated 0.102, DARLING 0.5). NoveltyBench trains on both orders of every pair (a, b) and (b, a)
with class-weighted cross-entropy; `tiller train-partitioner` does the same.

A served classifier (`classifier_path=http://host:port`, as DARLING runs its own with `vllm serve`) is asked the
way DARLING's client asks it (`partition_reward_vllm_serve.py`): POST `{url}/classify` with `{"model": name,
"input": ["<cls> a <sep> b <sep>", ...]}`, P(same) = the last entry of each `data[i].probs`. The special-token
strings come from `classifier_tokenizer` (the served model's tokenizer); each response keeps its first
`max_length` whitespace-separated words (DARLING: (4096 - 3) // 2).

The pair is assembled by hand (not with the tokenizer's pair template) so any tokenizer works: [CLS] / [SEP]
are the tokenizer's `cls_token` / `sep_token`, else its `bos_token` / `eos_token`; a tokenizer with neither
cls nor bos (a decoder such as Qwen2, whose sequence classifier pools the last token) starts without one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from tiller.errors import ConfigError, DataError, UserError

SAME_LABEL = 1
ID2LABEL = {0: "different", 1: "same"}


def special_ids(tokenizer) -> tuple[int | None, int, int]:
    """(cls or None, sep, pad) token ids of `tokenizer`, falling back to bos / eos / sep."""
    cls = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    if sep is None:
        raise ConfigError("the pair classifier's tokenizer has neither a sep nor an eos token to join a pair")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sep
    return cls, sep, pad


def encode_pairs(tokenizer, a: Sequence[str], b: Sequence[str], max_length: int = 128,
                 token_types: bool = True) -> dict[str, torch.Tensor]:
    """Right-padded batch for a cross-encoder: input_ids / attention_mask (/ token_type_ids) [N, L]."""
    cls, sep, pad = special_ids(tokenizer)
    rows, types = [], []
    enc_a = tokenizer(list(a), add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
    enc_b = tokenizer(list(b), add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
    for ia, ib in zip(enc_a, enc_b):
        first = ([cls] if cls is not None else []) + [*ia, sep]
        rows.append(first + [*ib, sep])
        types.append([0] * len(first) + [1] * (len(ib) + 1))
    width = max((len(r) for r in rows), default=1)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    tt = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, t) in enumerate(zip(rows, types)):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
        tt[i, :len(t)] = torch.tensor(t)
    out = {"input_ids": ids, "attention_mask": mask}
    if token_types:
        out["token_type_ids"] = tt
    return out


def uses_token_types(model) -> bool:
    """Whether the model has token type embeddings to tell the two segments apart (BERT / DeBERTa do)."""
    return int(getattr(model.config, "type_vocab_size", 0) or 0) >= 2


class PairClassifier:
    """A saved cross-encoder (`save_pretrained` dir) giving P(same) for pairs of texts."""

    def __init__(self, path: str | Path, *, max_length: int = 128, batch_size: int = 64,
                 key: str = "reward_model.diversity.classifier_path"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = str(path)
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{key}={path}: not a model dir (no config.json); train one with "
                              "`tiller train-partitioner --data PAIRS.jsonl --out DIR`")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        except (OSError, ValueError) as err:
            raise ConfigError(f"{key}={path}: cannot load a sequence classifier: {err}") from err
        if self.model.config.num_labels != 2:
            raise ConfigError(f"{key}={path}: the classifier has {self.model.config.num_labels} labels; a pair "
                              "classifier has 2 (0 = different, 1 = same)")
        self.max_length, self.batch_size = max_length, batch_size
        self.token_types = uses_token_types(self.model)
        self.calls = 0

    @torch.no_grad()
    def prob_same(self, a: Sequence[str], b: Sequence[str]) -> np.ndarray:
        """[N] P(same) of the pairs (a[i], b[i])."""
        out: list[np.ndarray] = []
        for k in range(0, len(a), self.batch_size):
            batch = encode_pairs(self.tokenizer, a[k:k + self.batch_size], b[k:k + self.batch_size],
                                 self.max_length, self.token_types)
            logits = self.model(**batch).logits.float()
            out.append(logits.softmax(-1)[:, SAME_LABEL].numpy())
            self.calls += 1
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


class RemotePairClassifier:
    """A classifier served behind vLLM's `/classify` (DARLING's setup; see the module doc)."""

    def __init__(self, url: str, tokenizer_path: str | None, model: str | None = None, *, max_length: int = 128,
                 batch_size: int = 64, timeout: float = 60.0):
        import httpx
        from transformers import AutoTokenizer

        if not tokenizer_path:
            raise ConfigError(f"reward_model.diversity.classifier_path={url} is a served classifier: set "
                              "reward_model.diversity.classifier_tokenizer to its tokenizer (dir or hub id), whose "
                              "cls / sep tokens join the pair")
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        except (OSError, ValueError) as err:
            raise ConfigError(f"reward_model.diversity.classifier_tokenizer={tokenizer_path}: cannot load: {err}") from err
        cls, sep, _ = special_ids(tokenizer)
        self.cls_text = tokenizer.convert_ids_to_tokens(cls) if cls is not None else None
        self.sep_text = tokenizer.convert_ids_to_tokens(sep)
        self.url = url.rstrip("/") + "/classify"
        self.model = model or "default"
        self.max_length, self.batch_size = max_length, batch_size
        self.client = httpx.Client(timeout=timeout)
        self.calls = 0

    def pair_text(self, a: str, b: str) -> str:
        """DARLING's string form of a pair: `<cls> a <sep> b <sep>`, each side cut to max_length words."""
        cut = lambda t: " ".join(t.split()[:self.max_length])  # noqa: E731
        head = f"{self.cls_text} " if self.cls_text else ""
        return f"{head}{cut(a)} {self.sep_text} {cut(b)} {self.sep_text}"

    def prob_same(self, a: Sequence[str], b: Sequence[str]) -> np.ndarray:
        import httpx


        out: list[float] = []
        for k in range(0, len(a), self.batch_size):
            texts = [self.pair_text(x, y) for x, y in zip(a[k:k + self.batch_size], b[k:k + self.batch_size])]
            self.calls += 1
            try:
                reply = self.client.post(self.url, json={"model": self.model, "input": texts})
                reply.raise_for_status()
                data = reply.json()["data"]
                probs = [float(row["probs"][-1]) for row in data]
            except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
                raise UserError(f"pair classifier at {self.url} failed: {type(exc).__name__}: {exc}") from exc
            if len(probs) != len(texts):
                raise UserError(f"pair classifier at {self.url} answered {len(probs)} results for {len(texts)} pairs")
            out += probs
        return np.asarray(out, dtype=np.float32)


def load_pair_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows `{"a": str, "b": str, "same": bool}` of a jsonl file, checked (DataError naming file and line)."""
    import json


    p = Path(path)
    if not p.is_file():
        raise DataError(f"--data {path}: no such file")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"--data {path} line {n}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"--data {path} line {n}: expected an object with a, b, same")
        for key in ("a", "b"):
            if not isinstance(row.get(key), str):
                raise DataError(f"--data {path} line {n}: {key!r} must be a string")
        same = row.get("same")
        if isinstance(same, (int, float)) and not isinstance(same, bool) and same in (0, 1):
            same = bool(same)
        if not isinstance(same, bool):
            raise DataError(f"--data {path} line {n}: 'same' must be true or false, got {row.get('same')!r}")
        rows.append({"a": row["a"], "b": row["b"], "same": same})
    if not rows:
        raise DataError(f"--data {path}: the file has no rows")
    return rows
