"""What a request must pass before any handler sees it: a bounded body, and the API key where one is set.

Both are plain ASGI wrappers around the app, so they answer before the body is read (a 413 for a body the
Content-Length says is too large, without reading it) and they never buffer a streamed response.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hisparse.server.protocol import ErrorInfo, ErrorResponse

OPEN_PATHS = ("/health",)  # answered without the API key: what a load balancer probes


async def send_error(send: Send, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
    """The OpenAI-style error body the handlers answer with too, sent straight through ASGI."""
    body = ErrorResponse(error=ErrorInfo(message=message, type="invalid_request_error", code=code)).model_dump_json()
    body = body.encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Refuse a request body larger than `max_bytes` with 413: at once when its Content-Length says so, else as
    soon as the bytes read pass the limit. A body within it is read here and handed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refusal: Callable[[int], None] = lambda status: None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send, f"{int(length)} bytes")
        pending: list[Message] = []
        size = 0
        while True:
            message = await receive()
            pending.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send, f"more than {self.max_bytes} bytes")
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, size: str) -> None:
        self.on_refusal(413)
        await send_error(send, 413, f"the request body is {size}, more than the server takes ({self.max_bytes} "
                                    "bytes, --max-request-bytes)", "request_too_large")


class APIKeyCheck:
    """Every path but /health wants `Authorization: Bearer <key>` (as vLLM and SGLang check it); else 401."""

    def __init__(self, app: ASGIApp, api_key: str, on_refusal: Callable[[int], None] = lambda status: None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            self.on_refusal(401)
            return await send_error(send, 401, "a valid API key is needed: send Authorization: Bearer <key>",
                                    "invalid_api_key", {"www-authenticate": "Bearer"})
        await self.app(scope, receive, send)
