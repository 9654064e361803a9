"""The OpenAI-compatible HTTP API over one EngineLoop.

Handlers run on the asyncio loop and never touch the engine: they validate, tokenize, hand the request to
the engine loop and relay its deltas. Every refusal is an OpenAI-style error body
`{"error": {"message", "type", "param", "code"}}` with a 4xx status, so a client bug never reaches the
engine and never costs another request anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from hisparse.engine.errors import RequestError
from hisparse.engine.sampling_params import SamplingParams
from hisparse.server.args import DEFAULT_MAX_REQUEST_BYTES
from hisparse.server.engine_loop import Accepted, Delta, EngineLoop, EngineUnavailable, Failed, RequestStream
from hisparse.server.pd_decode import DecodeRooms
from hisparse.server.pd_prefill import PrefillInstance, RoomFailed
from hisparse.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
    new_id,
    now,
)
from hisparse.server.request_guards import APIKeyCheck, BodyLimit

DEFAULT_CHAT_MAX_TOKENS = 128  # SGLang's default when a chat request gives no limit
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's names for union members


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 counted: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.counted = counted  # the engine thread has counted it already (a request that failed in the engine)

    def body(self) -> ErrorResponse:
        return ErrorResponse.of(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


class _ClientGone(Exception):
    pass


def _param_of_loc(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part.lower() not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path or None


def _validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors of a request body (FastAPI's or `parse_body`'s) -> the OpenAI-style 400 that names the
    field."""
    if not errors:
        return APIError(400, "invalid request")
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{': ' + detail if detail else ''}",
                        code="invalid_json")
    # A union (prompt: str | list[int]) fails once per member; the deepest error is the informative one.
    error = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _param_of_loc(tuple(error.get("loc", ())))
    if error.get("type") == "missing":
        return APIError(400, f"missing required field {param!r}" if param else "missing request body", param,
                        code="missing_field")
    got = error.get("input")
    if isinstance(got, bytes):  # FastAPI parses a body as JSON only when its Content-Type says so
        return APIError(400, "the request body must be a JSON object sent with Content-Type: application/json",
                        code="invalid_json")
    shown = json.dumps(got)[:80] if isinstance(got, (str, int, float, bool, type(None))) else type(got).__name__
    code = "invalid_type" if str(error.get("type", "")).endswith("_type") else "invalid_value"
    return APIError(400, f"{param or 'request body'}: {error.get('msg', 'invalid value')} (got {shown})", param,
                    code=code)


RequestBody = TypeVar("RequestBody", bound=BaseModel)
Settle = Callable[[], Awaitable[None]]


def _decode(data: bytes, model: type[RequestBody], max_items: int) -> RequestBody:
    """The body as `model`, or the APIError that names what is wrong with it. Runs on a worker thread. A 9 MB
    body of 300,000 messages took 0.3 s to parse and 1.4 s more to validate, in calls that hold the GIL (every
    stream stopped for as long), so a `messages` or `prompt` list longer than `max_items` (the context: each
    item takes a token at least) is refused between the two."""
    try:
        value = json.loads(data)
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not valid UTF-8: byte {error.object[error.start]:#04x} at "
                            f"position {error.start}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays or objects too deeply to parse",
                       code="invalid_json") from None
    except json.JSONDecodeError as error:
        raise APIError(400, f"the request body is not valid JSON: {error.msg} at line {error.lineno} column "
                            f"{error.colno}", code="invalid_json") from None
    for name in ("messages", "prompt"):
        items = value.get(name) if isinstance(value, dict) else None
        if isinstance(items, list) and len(items) >= max_items:
            raise APIError(400, f"{name} holds {len(items)} items, more than fit the model's context length of "
                                f"{max_items} tokens", name, "context_length_exceeded")
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise _validation_error(error.errors()) from None


async def parse_body(raw: Request, model: type[RequestBody], max_items: int) -> RequestBody:
    """The request's JSON body as `model`, parsed off the event loop (see `_decode`)."""
    if not raw.headers.get("content-type", "").split(";")[0].strip().endswith("json"):
        raise APIError(400, "the request body must be a JSON object sent with Content-Type: application/json",
                       code="invalid_json")
    return await asyncio.to_thread(_decode, await raw.body(), model, max_items)


class _AbortOnCloseResponse(StreamingResponse):
    """A stream that ends for any reason other than its last token (client gone, server stopping) aborts
    the request so that its memory is freed at once."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch() -> None:  # a client that hangs up while nothing is sent (rows awaited) is noticed too
            while (await receive())["type"] != "http.disconnect":
                pass
            self._on_close()

        watcher = asyncio.create_task(watch())
        try:
            await super().__call__(scope, receive, send)
        finally:
            watcher.cancel()
            self._on_close()


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _bootstrap_of(body: CompletionRequest | ChatCompletionRequest) -> tuple[str, int, int] | None:
    """(host, port, room) of the prefill instance's bootstrap server, as sglang-router names them (a list of one
    for a list of one prompt), or None when the request carries none."""
    fields = {"bootstrap_host": body.bootstrap_host, "bootstrap_port": body.bootstrap_port,
              "bootstrap_room": body.bootstrap_room}
    for name, value in fields.items():
        if isinstance(value, list):
            if len(value) != 1:
                raise APIError(400, f"{name} must hold one entry (one prompt per request), got {len(value)}", name)
            fields[name] = value[0]
    if fields["bootstrap_room"] is None:
        return None
    for name in ("bootstrap_host", "bootstrap_port"):
        if fields[name] is None:
            raise APIError(400, f"bootstrap_room needs {name}: the prefill instance's bootstrap server", name)
    return fields["bootstrap_host"], fields["bootstrap_port"], fields["bootstrap_room"]


def create_app(engine_loop: EngineLoop, model_name: str, max_queued_requests: int = 256,
               api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               disaggregation: PrefillInstance | DecodeRooms | None = None) -> FastAPI:
    """The app stops the engine loop when it shuts down, and starts it in a thread of its own at start-up unless
    it was started already (`python -m hisparse.launch_server` runs it in the main thread). `api_key`: the key
    every request but /health must carry (None: none asked); `max_request_bytes`: the largest body taken;
    `disaggregation`: this server's part in prefill-decode disaggregation (None: it serves requests whole)."""
    engine = engine_loop.engine
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    metrics = engine_loop.metrics
    started = now()

    prefill = disaggregation if isinstance(disaggregation, PrefillInstance) else None
    decode = disaggregation if isinstance(disaggregation, DecodeRooms) else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine_loop.started:
            engine_loop.start()
        if prefill is not None:
            await prefill.start()
        yield
        if prefill is not None:
            await prefill.stop()
        await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="hisparse", lifespan=lifespan)
    app.state.engine_loop = engine_loop

    def refused(status: int) -> None:
        metrics.rejected.labels(str(status)).inc()

    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, on_refusal=refused)
    if api_key is not None:  # outermost: a request without the key is refused before its body is read
        app.add_middleware(APIKeyCheck, api_key=api_key, on_refusal=refused)

    # -- errors ---------------------------------------------------------------------------------------

    def reject(error: APIError) -> JSONResponse:
        if not error.counted:
            metrics.rejected.labels(str(error.status)).inc()
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return reject(_validation_error(exc.errors()))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return reject(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return reject(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return reject(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))

    # -- shared steps ---------------------------------------------------------------------------------

    def check_common(body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found")
        if body.n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", "n")
        if body.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", "logprobs")
        unhonoured = {"response_format": body.response_format not in (None, {"type": "text"}),
                      "tools": bool(body.tools), "tool_choice": body.tool_choice not in (None, "none"),
                      "best_of": body.best_of not in (None, 1), "suffix": bool(body.suffix)}
        for name, given in unhonoured.items():
            if given:
                raise APIError(400, f"{name} is not supported by this server", name, "unsupported_parameter")

    def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                        max_tokens_param: str) -> SamplingParams:
        bias = {}
        for key, value in (body.logit_bias or {}).items():
            if not key.isdigit():
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            bias[int(key)] = value
        try:
            return SamplingParams(max_tokens=max_tokens,
                                  temperature=1.0 if body.temperature is None else body.temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p,
                                  top_k=-1 if body.top_k is None else body.top_k, seed=body.seed, stop=body.stop,
                                  stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
                                  presence_penalty=body.presence_penalty or 0.0,
                                  frequency_penalty=body.frequency_penalty or 0.0, logit_bias=bias)
        except RequestError as error:
            param, message = error.field, str(error)
            if param == "max_tokens" and max_tokens_param != "max_tokens":
                param, message = max_tokens_param, message.replace("max_tokens", max_tokens_param, 1)
            raise APIError(400, message, param) from None

    def check_fits(text: str, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it: tokenizing holds the GIL (about a
        second per MB), so a multi-megabyte prompt stalled every other request's stream while it ran."""
        at_least = tokenizer.min_tokens(text)
        if at_least >= max_model_len:
            raise APIError(400, f"{param} is at least {at_least} tokens, which leaves no room for max_tokens in the "
                                f"model's context length of {max_model_len} tokens", param, "context_length_exceeded")

    def templated_ids(messages: list[dict[str, str]]) -> list[int]:
        """The chat prompt's token ids, its templated text checked to fit before it is tokenized."""
        text = tokenizer.apply_chat_template(messages)
        check_fits(text, "messages")
        return tokenizer.encode(text, add_special_tokens=False)

    @asynccontextmanager
    async def abort_on_disconnect(stream: RequestStream, raw: Request):
        """Nothing tells a handler that its client hung up, so listen for it: the body has been read, so the
        next ASGI message is the disconnect. The engine then ends the request with finish_reason "abort"."""
        async def listen() -> None:
            while (await raw.receive())["type"] != "http.disconnect":
                pass
            engine_loop.abort(stream.request_id)

        listener = asyncio.create_task(listen())
        try:
            yield
        finally:
            listener.cancel()

    async def next_event(stream: RequestStream) -> Accepted | Delta | Failed:
        event = await stream.get()
        if isinstance(event, Delta) and event.finish_reason == "abort":
            raise _ClientGone()
        return event

    async def start(request_id: str, prompt_ids: list[int], params: SamplingParams, raw: Request,
                    prompt_param: str, max_tokens_param: str,
                    bootstrap: tuple[str, int, int] | None) -> tuple[RequestStream, int, Settle | None]:
        """Queue the request in the engine and wait until it is accepted or refused. Under disaggregation a
        prefill instance computes the prompt and samples one token, and the request's answer waits (`Settle`)
        until its rows are in the decode instance's memory; a decode instance takes the rows from the prefill
        instance's room instead of computing them."""
        arrival = time.perf_counter()
        queued = engine_loop.num_queued()
        if queued >= max_queued_requests:
            raise APIError(429, f"the server is at capacity: {queued} requests already wait for a running "
                                f"slot (--max-queued-requests {max_queued_requests}); retry later",
                           code="queue_full")
        pd_prefill = prefill is not None and bootstrap is not None
        if decode is not None:
            if bootstrap is None:
                raise APIError(400, "this is a decode instance (--disaggregation-mode decode): it takes requests "
                                    "with bootstrap_host, bootstrap_port and bootstrap_room, as sglang-router "
                                    "--pd-disaggregation sends them", "bootstrap_room", "missing_bootstrap")
            decode.expect(request_id, *bootstrap)
        if pd_prefill:
            params = dataclasses.replace(params, max_tokens=1)
        try:
            try:
                stream = engine_loop.submit(request_id, prompt_ids, params, arrival, remote_prefill=decode is not None,
                                            hold_kv=pd_prefill)
            except EngineUnavailable as error:
                raise APIError(503, str(error), code="engine_unavailable") from None
            async with abort_on_disconnect(stream, raw):
                event = await next_event(stream)
            if isinstance(event, Failed):
                param = {"prompt": prompt_param, "max_tokens": max_tokens_param}.get(event.field, event.field)
                raise APIError(event.status, event.message, param, event.code, counted=event.status >= 500)
        except BaseException:
            if decode is not None:
                decode.forget(request_id)
            raise
        assert isinstance(event, Accepted)
        if not pd_prefill:
            return stream, event.prompt_tokens, None

        async def room_outcome(future: concurrent.futures.Future):
            try:
                return await asyncio.wrap_future(future)
            except RoomFailed as failure:
                raise APIError(failure.status, failure.message, "bootstrap_room", failure.code) from None

        outcome = await room_outcome(prefill.attach(request_id, bootstrap[2]))  # a failed attach frees the request
        return stream, event.prompt_tokens, lambda: room_outcome(outcome)

    def on_close(stream: RequestStream) -> Callable[[], None]:
        def close() -> None:
            if not stream.finished:
                engine_loop.abort(stream.request_id)
            if decode is not None:
                decode.forget(stream.request_id)
        return close

    async def collect(stream: RequestStream, raw: Request) -> tuple[str, Delta]:
        """The whole text, and the last event (its finish reason and token counts)."""
        parts: list[str] = []
        try:
            async with abort_on_disconnect(stream, raw):
                while True:
                    event = await next_event(stream)
                    if isinstance(event, Failed):
                        raise APIError(event.status, event.message, code=event.code, counted=event.status >= 500)
                    assert isinstance(event, Delta)
                    parts.append(event.text)
                    if event.finish_reason is not None:
                        return "".join(parts), event
        finally:
            on_close(stream)()  # a handler that ends early for any reason frees the request's memory

    async def respond(stream: RequestStream, raw: Request, streaming: bool, include_usage: bool, prompt_tokens: int,
                      opening: list[str], pieces: Callable[[str, str | None], list[str]],
                      usage_chunk: Callable[[Usage], BaseModel],
                      whole: Callable[[str, str, Usage], BaseModel], settle: Settle | None = None) -> Response:
        """Stream the request's output as server-sent events ending in [DONE], or collect it into one JSON
        body. The two endpoints differ only in how they wrap the pieces: `opening` events, the events of
        one piece of text and/or the finish reason, the usage chunk and the whole answer. `settle`: awaited
        before the last piece (a prefill instance's transfer), its APIError the answer's."""

        def usage(last: Delta) -> Usage:
            return Usage.of(prompt_tokens, last.completion_tokens, last.cached_tokens)

        if streaming:
            async def events() -> AsyncIterator[str]:
                for event in opening:
                    yield event
                while True:
                    event = await stream.get()
                    if isinstance(event, Failed):
                        yield _sse(APIError(event.status, event.message, code=event.code).body().model_dump_json())
                        break
                    assert isinstance(event, Delta)
                    if event.finish_reason is not None and settle is not None:
                        try:
                            await settle()
                        except APIError as error:
                            yield _sse(error.body().model_dump_json())
                            break
                    for piece in pieces(event.text, event.finish_reason):
                        yield piece
                    if event.finish_reason is not None:
                        if include_usage:
                            yield _sse(usage_chunk(usage(event)).model_dump_json())
                        break
                yield _sse("[DONE]")

            return _AbortOnCloseResponse(events(), on_close(stream))
        try:
            text, last = await collect(stream, raw)
        except _ClientGone:
            return Response(status_code=499)
        if settle is not None:
            await settle()
        return JSONResponse(whole(text, last.finish_reason, usage(last)).model_dump())

    # -- routes ---------------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if not engine_loop.alive:
            return APIError(503, "the engine loop is not running", code="engine_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        """SGLang's endpoint: drop every cached prefix, refused while a running request reuses one."""
        try:
            flushed = await engine_loop.flush_cache()
        except EngineUnavailable as error:
            raise APIError(503, str(error), code="engine_unavailable") from None
        if not flushed:
            raise APIError(400, "the prefix cache is in use by running requests; flush it when they have ended",
                           code="cache_in_use")
        return Response("Cache flushed.\n", media_type="text/plain")

    @app.get("/model_info")
    async def model_info() -> JSONResponse:
        """SGLang's endpoint, which sglang-router reads when it adds a worker."""
        return JSONResponse({"model_path": model_name, "tokenizer_path": None, "is_generation": True})

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        mode = "prefill" if prefill is not None else "decode" if decode is not None else "null"
        return JSONResponse({"model_path": model_name, "served_model_name": model_name,
                             "disaggregation_mode": mode, "max_total_num_tokens": engine.cache.capacity_tokens,
                             "bootstrap_port": prefill.port if prefill is not None else None})

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=started, max_model_len=max_model_len)])

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        body = await parse_body(raw, CompletionRequest, max_model_len)
        check_common(body)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request is supported, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            check_fits(prompt, "prompt")
        # Tokenizing holds the GIL for about a second per MB: on a worker thread the event loop still gets turns.
        prompt_ids = await asyncio.to_thread(tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, "max_tokens")
        request_id, created = new_id("cmpl"), now()
        try:
            stream, prompt_tokens, settle = await start(request_id, prompt_ids, params, raw, "prompt", "max_tokens",
                                                        _bootstrap_of(body))
        except _ClientGone:
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(text: str, finish_reason: str | None) -> str:
            payload = CompletionResponse(id=request_id, created=created, model=model_name,
                                         choices=[CompletionChoice(text=text, finish_reason=finish_reason)])
            return _sse(payload.model_dump_json(exclude=None if include_usage else {"usage"}))

        return await respond(
            stream, raw, body.stream, include_usage, prompt_tokens, [],
            lambda text, finish: [chunk(text, finish)] if text or finish is not None else [],
            lambda usage: CompletionResponse(id=request_id, created=created, model=model_name, choices=[], usage=usage),
            lambda text, finish, usage: CompletionResponse(
                id=request_id, created=created, model=model_name,
                choices=[CompletionChoice(text=text, finish_reason=finish)], usage=usage), settle)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        body = await parse_body(raw, ChatCompletionRequest, max_model_len)
        check_common(body)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        check_fits("".join(m["content"] for m in messages), "messages")
        try:
            prompt_ids = await asyncio.to_thread(templated_ids, messages)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from None
        if body.max_completion_tokens is not None:
            max_tokens, max_tokens_param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens = DEFAULT_CHAT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
            max_tokens_param = "max_tokens"
        params = sampling_params(body, max_tokens, max_tokens_param)
        request_id, created = new_id("chatcmpl"), now()
        try:
            stream, prompt_tokens, settle = await start(request_id, prompt_ids, params, raw, "messages",
                                                        max_tokens_param, _bootstrap_of(body))
        except _ClientGone:
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(delta: ChatDelta, finish_reason: str | None) -> str:
            payload = ChatCompletionChunk(id=request_id, created=created, model=model_name,
                                          choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])
            return _sse(payload.model_dump_json(exclude=None if include_usage else {"usage"}))

        def pieces(text: str, finish: str | None) -> list[str]:
            return ([chunk(ChatDelta(content=text), None)] if text else []) + (
                [chunk(ChatDelta(), finish)] if finish is not None else [])

        return await respond(
            stream, raw, body.stream, include_usage, prompt_tokens,
            [chunk(ChatDelta(role="assistant", content=""), None)], pieces,
            lambda usage: ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=[],
                                              usage=usage),
            lambda text, finish, usage: ChatCompletionResponse(
                id=request_id, created=created, model=model_name,
                choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)], usage=usage),
            settle)

    return app
