"""The engine's refusal of one request, as a type: the field at fault and an OpenAI-style code travel with it,
so the server maps them (to its own parameter names, to HTTP) without reading the message."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine will not run. `field`: what the caller got wrong ("prompt", "max_tokens", a
    sampling field, ...); `code`: e.g. "context_length_exceeded", None where the field says it all."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code
