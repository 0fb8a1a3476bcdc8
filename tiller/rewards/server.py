"""`tiller serve-rm MODEL`: serve a reward model over HTTP in the `tiller.rewards.remote` wire format.

    tiller serve-rm ./my_rm --port 8000              # POST http://127.0.0.1:8000/score
    tiller serve-rm rules --port 8000                # rule-based scores (default_compute_score)

Endpoints: `POST /score` (`{"prompts", "responses", "labels"}` -> `{"scores"}`), `GET /health`, and OpenRLHF's
`POST /get_reward` (`{"query", "prompts", "labels"}` -> `{"rewards", "scores", "extra_logs"}`, as its
`openrlhf.cli.serve_rm`): a reward model scores each query (the whole prompt + response text) as it is, as
OpenRLHF's server does; `rules` scores the response (the query after its prompt) against the label as ground
truth under `--data-source`. `--normalize` applies the mean / std of the model's config.json (OpenRLHF's
--reward.normalize_enable), so an OpenRLHF run can use a tiller reward server.
One request is scored at a time (a lock around the model); FastAPI + uvicorn.
"""

from __future__ import annotations

import argparse
import math
import threading
from typing import Any

from pydantic import BaseModel, Field

from tiller.errors import UserError
from tiller.httpguard import Guard, resolve_api_key
from tiller.rewards.managers import call_or_error, unpack
from tiller.rewards.registry import CODE_SOURCES, default_compute_score, get_scorer
from tiller.rewards.reward_model import RewardModelScorer
from tiller.rewards.sandbox import sandbox_backend


class ScoreRequest(BaseModel):
    """Body of `POST /score`."""

    prompts: list[Any]
    responses: list[str]
    labels: list[dict] = Field(default_factory=list)


class GetRewardRequest(BaseModel):
    """Body of OpenRLHF's `POST /get_reward`."""

    query: list[str]
    prompts: list[str] = Field(default_factory=list)
    labels: list[Any] = Field(default_factory=list)


def openrlhf_scores(scorer: Any, req: GetRewardRequest, data_source: str | None) -> list[float]:
    """Scores of OpenRLHF's request: a model scores the whole queries; rules score query minus prompt vs label."""
    if hasattr(scorer, "score_full_texts"):
        return list(scorer.score_full_texts(req.query))
    if len(req.prompts) != len(req.query) or len(req.labels) != len(req.query):
        raise UserError("rules need prompts and labels as long as query")
    if not data_source:
        raise UserError("this server was started without --data-source: OpenRLHF's labels carry no data_source, "
                        "so the rule scorer cannot pick a scorer")
    responses = []
    for i, (query, prompt) in enumerate(zip(req.query, req.prompts)):
        if not query.startswith(prompt):
            raise UserError(f"query[{i}] does not start with prompts[{i}]")
        responses.append(query[len(prompt):])
    labels = [{"data_source": data_source, "ground_truth": label} for label in req.labels]
    if isinstance(scorer, RuleScorer) or getattr(scorer, "uses_labels", False):
        return list(scorer.score_texts(req.prompts, responses, labels))
    return list(scorer.score_texts(req.prompts, responses))


class RuleScorer:
    """Scores with `default_compute_score` from the labels (no model). Data sources whose scorer runs the
    response as code (`registry.CODE_SOURCES`, in the sandbox) are refused unless `allow_code_execution`.
    A scorer that fails on one sample scores it 0, as in training."""

    def __init__(self, allow_code_execution: bool = False):
        self.allow_code_execution = allow_code_execution

    def check_labels(self, labels: list[dict]) -> None:
        """UserError (-> 400) naming the label when one cannot be scored at all."""
        for i, label in enumerate(labels):
            source = label.get("data_source", "")
            if not isinstance(source, str):
                raise UserError(f"labels[{i}].data_source must be a string")
            extra = label.get("extra_info")
            if extra is not None and not isinstance(extra, dict):
                raise UserError(f"labels[{i}].extra_info must be an object (a dict), got {type(extra).__name__}")
            get_scorer(source)  # unknown data source: UserError listing the known ones
            if source in CODE_SOURCES and not self.allow_code_execution:
                raise UserError(f"labels[{i}].data_source={source!r} is scored by running the response as code; this "
                                "server was not started with --allow-code-execution")

    def score_texts(self, prompts: list[str], responses: list[str], labels: list[dict]) -> list[float]:
        self.check_labels(labels)
        out = []
        for response, label in zip(responses, labels):
            value, status = call_or_error(default_compute_score, label.get("data_source", ""), response,
                                           label.get("ground_truth"), label.get("extra_info") or {})
            out.append(unpack(value)[0] if status == "ok" else 0.0)
        return out


def create_app(scorer: Any, *, api_key: str | None = None, max_body_bytes: int = 8 << 20,
               data_source: str | None = None):
    """A FastAPI app around `scorer.score_texts(prompts, responses[, labels])`, behind `tiller.httpguard.Guard`
    (API key on every route but /health, body cap)."""
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

    @app.post("/get_reward")
    def get_reward(req: GetRewardRequest) -> dict:
        try:
            with lock:
                scores = openrlhf_scores(scorer, req, data_source)
        except UserError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        rewards = [float(s) if math.isfinite(float(s)) else 0.0 for s in scores]
        return {"rewards": rewards, "scores": rewards, "extra_logs": {}}

    return Guard(app, api_key=api_key, max_body_bytes=max_body_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiller serve-rm", description="Serve a reward model over HTTP.")
    parser.add_argument("model", help="reward model dir (sequence classifier or value-head model), or 'rules'")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=None)
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every route but /health (default: $TILLER_API_KEY)")
    parser.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body, MiB (413 past it)")
    parser.add_argument("--normalize", action="store_true",
                        help="(score - mean) / std with the mean / std of the model's config.json (OpenRLHF's "
                             "--reward.normalize_enable)")
    parser.add_argument("--data-source", default=None,
                        help="rules: the data_source OpenRLHF's /get_reward labels are scored under")
    parser.add_argument("--allow-code-execution", action="store_true",
                        help="rules: score code data sources by running the response in tiller's sandbox")
    args = parser.parse_args(argv)
    import uvicorn

    if args.max_body_mb <= 0:
        raise UserError(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    api_key = resolve_api_key(args.api_key)
    if args.model == "rules":
        scorer: Any = RuleScorer(allow_code_execution=args.allow_code_execution)
        if args.allow_code_execution:
            print(f"tiller serve-rm: code data sources run in the sandbox (backend {sandbox_backend()})", flush=True)
    else:
        scorer = RewardModelScorer(args.model, micro_batch_size=args.micro_batch_size,
                                   max_length=args.max_length, device=args.device, normalize=args.normalize)
    print(f"tiller serve-rm: POST http://{args.host}:{args.port}/score (OpenRLHF: /get_reward); "
          f"body <= {args.max_body_mb:g} MiB; API key "
          f"{'required' if api_key else 'off (--api-key or TILLER_API_KEY to require one)'}", flush=True)
    if args.normalize and args.model == "rules":
        raise UserError("--normalize applies to a reward model (its config.json holds the mean / std), not rules")
    app = create_app(scorer, api_key=api_key, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                     data_source=args.data_source)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
