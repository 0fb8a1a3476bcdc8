"""Score (prompt, response) pairs with a reward model: one scalar per pair, batched, no grad.

Two model kinds, told apart by the checkpoint's `architectures`:
- `*ForSequenceClassification` with `num_labels=1` (the usual RM head, e.g. Skywork-Reward,
  trained by `tiller rm`): the model itself pools the last non-pad token;
- a causal LM with a value head, saved as `*ForTokenClassification` with `num_labels=1`
  (verl style): we take the value at the last non-pad token;
- OpenRLHF's train_rm output (`architectures: ["RewardModel"]`: the base model + a bias-free `score` head, the same
  weight names as `*ForSequenceClassification`, no `num_labels`): loaded as a 1-label sequence classifier, which
  reads the score at the last non-pad token as OpenRLHF does.

Each pair is rendered with the reward model's own chat template (`[user: prompt, assistant:
response]`); when `extra_info["raw_prompt"]` holds the chat messages they are used as the
conversation instead of the decoded prompt text. A tokenizer without a chat template gets
`prompt + response`. Texts longer than `max_length` tokens are cut from the left, keeping the end
of the response. Pairs are scored `micro_batch_size` at a time, padded on the right; with `max_tokens`
(verl's `reward_model.use_dynamic_bsz` / `forward_max_token_len_per_gpu`) they are packed instead into
micro-batches of at most that many padded tokens (rows x longest text), sorted by length.

`normalize=True` (OpenRLHF's --normalize_reward) returns (score - mean) / std with `mean` / `std` read from the
model's config.json, where OpenRLHF's train_rm and tiller's rm job store them; a config without them is an error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tiller.data.seqlen import token_budget_micro_batches
from tiller.errors import UserError
from tiller.models.loading import load_tokenizer
from tiller.rewards.managers import ScoreBatch
from tiller.rewards.types import RewardRequest


def _render(tokenizer: Any, prompt: Any, response: str) -> str:
    messages = list(prompt) if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": str(prompt)}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
    return "".join(m["content"] for m in messages) + response


OPENRLHF_ARCHS = ("RewardModel", "CriticModel")  # the class names OpenRLHF's save_pretrained writes


def reward_mean_std(config: Any, path: str) -> tuple[float, float]:
    """(mean, std) of a reward model's scores as stored in its config.json (OpenRLHF's `mean` / `std`)."""
    mean, std = getattr(config, "mean", None), getattr(config, "std", None)
    if mean is None or std is None:
        raise UserError(f"reward_model.normalize: {path}/config.json has no 'mean' and 'std' (OpenRLHF's train_rm and "
                        "tiller rm write them); train the reward model with them or drop --normalize_reward")
    if not float(std) > 0:
        raise UserError(f"reward_model.normalize: {path}/config.json has std={std}; it must be > 0")
    return float(mean), float(std)


class RewardModelScorer:
    """A reward model loaded from a local dir; `score_texts(prompts, responses) -> [B] float32`."""

    def __init__(self, path: str, micro_batch_size: int = 16, max_length: int | None = None,
                 trust_remote_code: bool = False, device: str | None = None, dtype: torch.dtype = torch.float32,
                 max_tokens: int | None = None, normalize: bool = False):
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

        if micro_batch_size < 1:
            raise UserError(f"reward_model.micro_batch_size_per_gpu must be >= 1, got {micro_batch_size}")
        self.tokenizer = load_tokenizer(path, padding_side="right", trust_remote_code=trust_remote_code)
        self.tokenizer.truncation_side = "left"
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except OSError as err:
            raise UserError(f"reward_model.model.path: cannot load a model config from {path!r}: {err}") from err
        archs = getattr(config, "architectures", None) or []
        kwargs: dict[str, Any] = {}
        if any(a in OPENRLHF_ARCHS for a in archs):  # OpenRLHF's train_rm: base model + `score` head, no num_labels
            prefix = getattr(config, "value_head_prefix", "score")
            if prefix != "score":
                raise UserError(f"reward_model.model.path: {path} keeps its head as {prefix!r}; tiller reads "
                                "transformers' `score` head only")
            kwargs["num_labels"] = 1
        elif getattr(config, "num_labels", 1) != 1:
            raise UserError(f"reward_model.model.path: {path} has num_labels={config.num_labels}; a reward model needs 1")
        self.token_level = any(a.endswith("ForTokenClassification") for a in archs)
        auto = AutoModelForTokenClassification if self.token_level else AutoModelForSequenceClassification
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = auto.from_pretrained(path, trust_remote_code=trust_remote_code, dtype=dtype,
                                          **kwargs).to(self.device)
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.max_tokens = max_tokens
        self.mean_std = reward_mean_std(config, path) if normalize else None

    @torch.no_grad()
    def _forward(self, texts: list[str]) -> torch.Tensor:
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=self.max_length is not None,
                             max_length=self.max_length, add_special_tokens=False).to(self.device)
        logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        if not self.token_level:
            return logits[:, 0].float()  # [b]: the model pooled the last non-pad token
        # logits [b, L, 1]; right padding, so the last real token is at (number of real tokens - 1)
        last = enc["attention_mask"].sum(dim=1) - 1
        return logits[torch.arange(len(texts), device=logits.device), last, 0].float()

    def score_texts(self, prompts: list[Any], responses: list[str]) -> np.ndarray:
        """[B] scores of prompt/response pairs (prompts: strings or lists of chat messages)."""
        texts = [_render(self.tokenizer, p, r) for p, r in zip(prompts, responses)]
        if not texts:
            return np.zeros(0, dtype=np.float32)
        parts = [list(range(i, min(i + self.micro_batch_size, len(texts))))
                 for i in range(0, len(texts), self.micro_batch_size)]
        if self.max_tokens is not None:
            parts = self._token_budget_parts(texts)
        scores = torch.empty(len(texts))
        for idx in parts:
            scores[idx] = self._forward([texts[i] for i in idx]).cpu()
        if self.mean_std is not None:
            scores = (scores - self.mean_std[0]) / self.mean_std[1]
        return scores.numpy().astype(np.float32)

    def score_full_texts(self, texts: list[str]) -> np.ndarray:
        """[B] scores of whole texts taken as they are (OpenRLHF's queries: prompt + response already rendered)."""
        scores = torch.empty(len(texts))
        for i in range(0, len(texts), self.micro_batch_size):
            scores[i:i + self.micro_batch_size] = self._forward(texts[i:i + self.micro_batch_size]).cpu()
        if self.mean_std is not None:
            scores = (scores - self.mean_std[0]) / self.mean_std[1]
        return scores.numpy().astype(np.float32)

    def _token_budget_parts(self, texts: list[str]) -> list[list[int]]:
        """Indices of micro-batches of at most `max_tokens` padded tokens (rows x longest text)."""
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        if self.max_length is not None:
            lengths = [min(n, self.max_length) for n in lengths]
        try:
            return token_budget_micro_batches([0] * len(texts), lengths, list(range(len(texts))), self.max_tokens)
        except ValueError as err:
            raise UserError(f"reward_model.forward_max_token_len_per_gpu={self.max_tokens}: {err}; raise it "
                            "(or set reward_model.max_length)") from None

    def score(self, requests: list[RewardRequest]) -> ScoreBatch:
        prompts = [r.extra_info.get("raw_prompt", r.prompt) if r.extra_info else r.prompt for r in requests]
        scores = self.score_texts(prompts, [r.response for r in requests])
        return ScoreBatch(scores=scores, extras={"rm_score": scores.copy()}, metrics={"reward/num_errors": 0.0})
