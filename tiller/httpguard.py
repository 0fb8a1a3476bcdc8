"""The front door of tiller's HTTP servers (`tiller serve`, `tiller serve-rm`): API key and body size.

`Guard` is plain ASGI middleware, so it runs before any request body is parsed:
- with an API key (`--api-key` or `TILLER_API_KEY`), every route but the open ones (`/health`) needs
  `Authorization: Bearer <key>` (what OpenAI clients send); otherwise 401, compared in constant time;
- a body over `max_body_bytes` is refused with 413: at once when `Content-Length` says so, otherwise while it
  is read (chunked uploads are buffered up to the limit, never past it).
Errors use OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import hmac
import json
import os

API_KEY_ENV = "TILLER_API_KEY"


def resolve_api_key(flag: str | None) -> str | None:
    """`--api-key` if given, else `$TILLER_API_KEY`, else None (no authentication)."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    return key or None


async def _send_error(send, status: int, message: str, param: str | None, code: str) -> None:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: API key on every route but `open_paths`, and a cap on the request body."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, open_paths: tuple[str, ...] = ("/health",)):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = int(max_body_bytes)
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope.get("path") not in self.open_paths:
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                return await _send_error(send, 401, "invalid or missing API key: send `Authorization: Bearer <key>` "
                                         "with the key the server was started with (--api-key / TILLER_API_KEY)",
                                         None, "invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _send_error(send, 400, "Content-Length is not a number", None, "bad_request")
            if declared > self.max_body:
                return await _send_error(send, 413, f"request body of {declared} bytes is over this server's limit of "
                                         f"{self.max_body} bytes (--max-body-mb)", None, "request_too_large")
            return await self.app(scope, receive, send)
        # no Content-Length (chunked): read up to the limit here, then hand the app the whole body
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body:
                return await _send_error(send, 413, f"request body is over this server's limit of {self.max_body} "
                                         "bytes (--max-body-mb)", None, "request_too_large")
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)
