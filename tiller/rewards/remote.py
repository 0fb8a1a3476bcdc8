"""Rewards from a remote HTTP server (`reward_model.remote_url`).

Wire format (one POST per batch, JSON):

    request:  {"prompts": [str, ...], "responses": [str, ...],
               "labels": [{"data_source": str, "ground_truth": any, "extra_info": {...}}, ...]}
    response: {"scores": [float, ...]}            # same length as the request lists

`tiller serve-rm MODEL` (tiller.rewards.server) speaks it. With `wire_format="openrlhf"`
(`reward_model.remote_format=openrlhf`) the client speaks OpenRLHF's instead (`tiller.rewards.openrlhf_api`:
{"query", "prompts", "labels"} -> {"rewards", "scores", "extra_logs"}), with the same retries and time limit. The client retries connection errors,
timeouts and 5xx answers with exponential backoff (backoff_s * 2**attempt), and raises a
`UserError` naming the URL when the server stays unreachable; a 4xx answer or a malformed body
is a `UserError` at once (retrying would not help).
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from tiller.errors import UserError
from tiller.rewards.managers import ScoreBatch
from tiller.rewards.openrlhf_api import openrlhf_request, parse_reply
from tiller.rewards.types import RewardRequest


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


class RemoteRewardClient:
    """POST batches to `url`; `score(requests) -> ScoreBatch`."""

    def __init__(self, url: str, timeout: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5,
                 wire_format: str = "tiller"):
        import httpx

        if wire_format not in ("tiller", "openrlhf"):
            raise UserError(f"reward_model.remote_format must be tiller or openrlhf, got {wire_format!r}")
        self.wire_format = wire_format
        if not url.startswith(("http://", "https://")):
            raise UserError(f"reward_model.remote_url must start with http:// or https://, got {url!r}")
        self.url = url
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._client = httpx.Client(timeout=httpx.Timeout(timeout))

    def _post(self, payload: dict) -> dict:
        import httpx

        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                reply = self._client.post(self.url, json=payload)
            except httpx.TimeoutException as exc:
                last = f"timed out ({type(exc).__name__})"
                continue
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if reply.status_code >= 500:
                last = f"HTTP {reply.status_code}: {reply.text[:200]}"
                continue
            if reply.status_code >= 400:
                raise UserError(f"reward server {self.url} rejected the request: HTTP {reply.status_code}: {reply.text[:300]}")
            try:
                return reply.json()
            except ValueError:
                raise UserError(f"reward server {self.url} answered with non-JSON: {reply.text[:200]!r}") from None
        raise UserError(f"reward server {self.url} unreachable after {self.max_retries + 1} attempts: {last}")

    def score_texts(self, prompts: list[str], responses: list[str], labels: list[dict]) -> np.ndarray:
        """[B] scores from the server."""
        body = self._post({"prompts": prompts, "responses": responses, "labels": _jsonable(labels)})
        scores = body.get("scores") if isinstance(body, dict) else None
        if not isinstance(scores, list) or len(scores) != len(prompts):
            raise UserError(f"reward server {self.url} must answer {{'scores': [{len(prompts)} numbers]}}, got {str(body)[:200]}")
        try:
            out = np.array([float(s) for s in scores], dtype=np.float32)
        except (TypeError, ValueError):
            raise UserError(f"reward server {self.url} sent non-numeric scores: {str(scores)[:200]}") from None
        return out

    def score(self, requests: list[RewardRequest]) -> ScoreBatch:
        if self.wire_format == "openrlhf":
            body = self._post(_jsonable(openrlhf_request(requests)))
            return parse_reply(body, len(requests), f"reward server {self.url}")
        labels = [{"data_source": r.data_source, "ground_truth": r.ground_truth, "extra_info": r.extra_info}
                  for r in requests]
        scores = self.score_texts([r.prompt for r in requests], [r.response for r in requests], labels)
        bad = ~np.isfinite(scores)
        scores[bad] = 0.0
        return ScoreBatch(scores=scores, metrics={"reward/num_errors": float(bad.sum())})

    def close(self) -> None:
        self._client.close()


__all__ = ["RemoteRewardClient"]
