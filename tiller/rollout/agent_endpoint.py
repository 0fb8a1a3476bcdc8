"""The OpenAI-compatible endpoint an agent rollout trains through (AReaL's black-box agent pattern).

`AgentEndpoint(engine, tokenizer, app=..., ...)` starts an OpenAI app on 127.0.0.1 (a free port, uvicorn in a
daemon thread) in front of the rollout engine, and records every completion made during an episode at token
level. The app comes from above, as a factory: `tiller.serve.app.agent_app` (tiller's OpenAI server) is the
one the trainer hands its actor worker; it calls `recorder.check` / `recorder.record` for every request and
reads the episode from `CURRENT_EPISODE`, both defined here. An episode is addressed by its base URL, `http://127.0.0.1:PORT/episodes/<id>/v1`,
or by its id as the API key (`Authorization: Bearer <id>`) against `http://127.0.0.1:PORT/v1`, so agent code
written against `openai.AsyncOpenAI(base_url=..., api_key=...)` runs unmodified. A request outside a live
episode is refused (404), as is one whose `temperature` / `top_p` / `top_k` differ from the rollout's.

    endpoint = AgentEndpoint(engine, tokenizer, app=tiller.serve.app.agent_app, max_model_len=2048,
                             fixed_sampling={"temperature": 1.0})
    eid = endpoint.open_episode()
    ... the agent calls endpoint.base_url(eid) ...
    segments = endpoint.close_episode(eid)     # list[tiller.rollout.episodes.Segment]
    endpoint.close()
"""

from __future__ import annotations

import contextvars
import re
import socket
import threading
import time
import uuid
from typing import Any, Callable

from tiller.errors import UserError
from tiller.rollout.episodes import call_user, describe, Episode, episode_reward, failure, Segment, segment_of

CURRENT_EPISODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("tiller_episode", default=None)
"""The agent episode a request belongs to (set by `EpisodeRouter`)."""

AppFactory = Callable[..., tuple[Any, Any]]
"""`app(engine, tokenizer, recorder, *, max_model_len, max_tokens_default, max_rows) -> (served, asgi_app)`:
`served` has `policy_version`, `fixed_sampling`, `chat_template_kwargs` and `batcher.close()`; the app calls `recorder.check(episode)`
before and `recorder.record(episode, out, version)` after every completion (`tiller.serve.app.agent_app`)."""


class EpisodeNotFound(UserError):
    """A request outside a live episode (the app answers 404, code `episode_not_found`)."""

_EPISODE_PATH = re.compile(r"^/episodes/([A-Za-z0-9_-]+)(/.*)$")


class EpisodeRecorder:
    """Live episodes and the segments recorded for each (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._episodes: dict[str, list[Segment]] = {}

    def open(self) -> str:
        eid = f"ep-{uuid.uuid4().hex}"
        with self._lock:
            self._episodes[eid] = []
        return eid

    def close(self, eid: str) -> list[Segment]:
        with self._lock:
            return self._episodes.pop(eid)

    def check(self, eid: str | None) -> None:
        with self._lock:
            live = eid in self._episodes
        if not live:
            raise EpisodeNotFound("this endpoint serves agent episodes: use the episode's base URL "
                                  "(.../episodes/<id>/v1) or its id as the API key; "
                                  f"{'no episode given' if eid is None else f'episode {eid!r} is not running'}")

    def record(self, eid: str, out, version: int) -> None:
        segments = [segment_of(p, out, row, version) for row, p in enumerate(out.prompt_ids)]
        with self._lock:
            if eid in self._episodes:  # an episode closed while its request ran: the completion is not kept
                self._episodes[eid].extend(segments)


class EpisodeRouter:
    """ASGI wrapper: `/episodes/<id>/...` -> `/...` with the episode set, else the bearer token as the id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        eid = None
        if scope["type"] == "http":
            match = _EPISODE_PATH.match(scope["path"])
            if match:
                eid, path = match.group(1), match.group(2)
                scope = {**scope, "path": path, "raw_path": path.encode()}
            else:
                auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
                if auth.lower().startswith("bearer "):
                    eid = auth[7:].strip() or None
        token = CURRENT_EPISODE.set(eid)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT_EPISODE.reset(token)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AgentEndpoint:
    """An OpenAI app (`app`, see `AppFactory`) on loopback in front of `engine`, recording episodes (see the
    module docstring)."""

    def __init__(self, engine, tokenizer, *, app: AppFactory, max_model_len: int, max_tokens_default: int = 512,
                 fixed_sampling: dict | None = None, max_rows: int = 256):
        import uvicorn

        self.recorder = EpisodeRecorder()
        self.served, asgi = app(engine, tokenizer, self.recorder, max_model_len=max_model_len,
                                max_tokens_default=max_tokens_default, max_rows=max_rows)
        self.served.fixed_sampling = dict(fixed_sampling or {})
        self.port = _free_port()
        config = uvicorn.Config(EpisodeRouter(asgi), host="127.0.0.1", port=self.port,
                                log_level="error", timeout_keep_alive=60)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="tiller-agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise UserError("the agent endpoint (uvicorn on 127.0.0.1) did not start")
            time.sleep(0.02)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def base_url(self, eid: str) -> str:
        """The OpenAI base URL of episode `eid` (ends in /v1)."""
        return f"{self.root}/episodes/{eid}/v1"

    def open_episode(self) -> str:
        return self.recorder.open()

    def close_episode(self, eid: str) -> list[Segment]:
        return self.recorder.close(eid)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self.served.batcher.close()


def run_agent_episodes(endpoint: AgentEndpoint, agent, samples: list[dict], *, max_concurrency: int = 0,
                       client: str = "base_url") -> list:
    """Run `agent(base_url_or_client, sample)` once per sample, concurrently (at most `max_concurrency` at once,
    0 = all), each in its own episode; returns one `tiller.rollout.episodes.Episode` per sample, in order.

    A plain (blocking) agent function runs in a daemon thread per call (`call_user`), so Ctrl-C stops the run
    while one hangs. An agent that raises (or calls sys.exit()), or returns something other than a finite number
    / {'reward': finite number}, is a UserError naming the agent and the sample."""
    import asyncio

    async def one(i: int, sample: dict, gate: asyncio.Semaphore) -> Episode:
        async with gate:
            eid = endpoint.open_episode()
            handle, api = endpoint.base_url(eid), None
            try:
                if client == "openai":
                    import openai  # lazily: only agent rollouts with client=openai need it

                    api = openai.AsyncOpenAI(base_url=handle, api_key=eid, max_retries=0, timeout=3600)
                    handle = api
                value = await call_user(agent, handle, sample)
                reward, info = episode_reward(value, f"agent on sample {i}")
            except (Exception, SystemExit) as err:  # noqa: BLE001 - named and re-raised as the user's error
                raise UserError(f"actor_rollout_ref.rollout.agent: the agent {describe(agent)} failed on sample {i} "
                                f"(data_source {sample.get('data_source')!r}): {failure(err)}") from err
            finally:
                segments = endpoint.close_episode(eid)
                if api is not None:
                    await api.close()
            return Episode(segments=segments, reward=reward, info=info)

    async def main() -> list[Episode]:
        gate = asyncio.Semaphore(max_concurrency or max(1, len(samples)))
        return list(await asyncio.gather(*(one(i, s, gate) for i, s in enumerate(samples))))

    return asyncio.run(main())
