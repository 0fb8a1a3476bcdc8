"""`tiller serve-rm MODEL`: serve a reward model over HTTP in the `tiller.rewards.remote` wire format.

    tiller serve-rm ./my_rm --port 8000              # POST http://127.0.0.1:8000/score
    tiller serve-rm rules --port 8000                # rule-based scores (default_compute_score)

Endpoints: `POST /score` (`{"prompts", "responses", "labels"}` -> `{"scores"}`), `GET /health`.
One request is scored at a time (a lock around the model); FastAPI + uvicorn.
"""

from __future__ import annotations

import argparse
import math
import threading
from typing import Any

from pydantic import BaseModel, Field

from tiller.errors import UserError


class ScoreRequest(BaseModel):
    """Body of `POST /score`."""

    prompts: list[Any]
    responses: list[str]
    labels: list[dict] = Field(default_factory=list)


class RuleScorer:
    """Scores with `default_compute_score` from the labels (no model)."""

    def score_texts(self, prompts: list[str], responses: list[str], labels: list[dict]) -> list[float]:
        from tiller.rewards.managers import _unpack
        from tiller.rewards.registry import default_compute_score

        out = []
        for response, label in zip(responses, labels):
            value = default_compute_score(label.get("data_source", ""), response, label.get("ground_truth"),
                                          label.get("extra_info") or {})
            out.append(_unpack(value)[0])
        return out


def create_app(scorer: Any):
    """A FastAPI app around `scorer.score_texts(prompts, responses[, labels])`."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="tiller reward server")
    lock = threading.Lock()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/score")
    def score(req: ScoreRequest) -> dict:
        if len(req.prompts) != len(req.responses) or (req.labels and len(req.labels) != len(req.prompts)):
            raise HTTPException(status_code=422, detail="prompts, responses and labels must have the same length")
        labels = req.labels or [{} for _ in req.prompts]
        try:
            with lock:
                if isinstance(scorer, RuleScorer) or getattr(scorer, "uses_labels", False):
                    scores = scorer.score_texts(req.prompts, req.responses, labels)
                else:
                    scores = scorer.score_texts(req.prompts, req.responses)
        except UserError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        return {"scores": [float(s) if math.isfinite(float(s)) else 0.0 for s in scores]}

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiller serve-rm", description="Serve a reward model over HTTP.")
    parser.add_argument("model", help="reward model dir (sequence classifier or value-head model), or 'rules'")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=None)
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    args = parser.parse_args(argv)
    import uvicorn

    if args.model == "rules":
        scorer: Any = RuleScorer()
    else:
        from tiller.rewards.reward_model import RewardModelScorer

        scorer = RewardModelScorer(args.model, micro_batch_size=args.micro_batch_size,
                                   max_length=args.max_length, device=args.device)
    print(f"tiller serve-rm: POST http://{args.host}:{args.port}/score", flush=True)
    uvicorn.run(create_app(scorer), host=args.host, port=args.port, log_level="warning")
    return 0
