"""The prefill instance of prefill-decode disaggregation: its rooms and its bootstrap server.

A room is one request as the router named it (`bootstrap_room`): the prefill request arrives on the API
port, the decode instance's `Destination` on the bootstrap port, in either order. Once both are known, every
step's newly computed prompt rows go to the sending thread, so the transfer of one chunk overlaps the compute
of the next; when the request has sampled its first token and every row is written, the room resolves with
that token (the decode instance's answer), the prefill request's own answer is sent and its memory goes back.
A room fails, and frees its memory, when the decode side cancels it, a write fails (the decode instance is
gone), the prefill request is aborted, or its other half does not come within the timeout.

Rooms live in the engine thread (`after_step`, and `EngineLoop.call` from the HTTP handlers); the bootstrap
server's handlers only wait on a room's futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hisparse.disaggregation.kv_sender import KVSender, SendJob, SendResult
from hisparse.disaggregation.protocol import Destination, prompt_digest
from hisparse.disaggregation.row_transfer import check_compatible
from hisparse.disaggregation.transfer_engine import KVTransferEngine
from hisparse.engine.request import Request as EngineRequest
from hisparse.server.engine_loop import EngineLoop
from hisparse.server.protocol import ErrorResponse

log = logging.getLogger("hisparse.server")


class RoomFailed(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class _Room:
    room: int
    created: float = field(default_factory=time.monotonic)
    request: EngineRequest | None = None
    destination: Destination | None = None
    sent: int = 0  # prompt positions handed to the sender
    written: int = 0  # prompt positions the decode side's memory holds
    in_flight: int = 0  # jobs not yet reported
    outcome: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # the first token
    quiet: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # no write in flight


class PrefillRooms:
    def __init__(self, engine_loop: EngineLoop, transfer: KVTransferEngine, timeout: float) -> None:
        self.engine_loop = engine_loop
        self.engine = engine_loop.engine
        self.timeout = timeout
        self.pools = transfer.register_pools(self.engine.row_pools())
        self.sender = KVSender(transfer, lambda result: engine_loop.call(lambda _: self._sent(result)))
        self.rooms: dict[int, _Room] = {}  # engine thread only
        # Rooms that ended, for as long as a late half may still come: it gets their outcome at once.
        self.ended: dict[int, tuple[float, concurrent.futures.Future]] = {}
        engine_loop.after_step.append(self._after_step)
        engine_loop.idle_wakeup = 0.25  # rooms time out while nothing else happens

    # -- engine thread (after_step, or EngineLoop.call) -----------------------------------------------

    def _room(self, room: int) -> _Room:
        if room in self.ended:  # a late half gets the room's failure, or is a duplicate of a room sent
            raise self.ended[room][1].exception() or RoomFailed(409, f"bootstrap_room {room} has ended already",
                                                                "room_ended")
        if room not in self.rooms:
            self.rooms[room] = _Room(room)
        return self.rooms[room]

    def attach_request(self, room: int, request_id: str) -> concurrent.futures.Future:
        """The prefill request of `room` is in the engine; returns the room's outcome."""
        request = self.engine.find_request(request_id)
        try:
            entry = self._room(room)
            if entry.request is not None:
                raise RoomFailed(400, f"bootstrap_room {room} is already in use by another request", "room_in_use")
        except RoomFailed:
            if request is not None:  # it may have finished already: its held rows go back too
                self._release(request)
            raise
        if request is None:
            self._fail(entry, RoomFailed(400, "the prefill request ended before its room was known", "aborted"))
        else:
            entry.request = request
            self._check_prompt(entry)
        return entry.outcome

    def set_destination(self, room: int, destination: Destination
                        ) -> tuple[concurrent.futures.Future, concurrent.futures.Future]:
        """The decode instance's memory for `room`; ValueError when it cannot take this instance's rows. Returns
        the room's outcome and `quiet` (no write in flight): a failure is answered only once quiet, so that the
        decode side never frees memory a write could still reach."""
        check_compatible(self.pools, destination.pools)
        entry = self._room(room)
        if entry.destination is not None:
            raise ValueError(f"room {room} has a destination already")
        entry.destination = destination
        entry.sent = entry.written = destination.start
        self._check_prompt(entry)
        return entry.outcome, entry.quiet

    def cancel(self, room: int) -> concurrent.futures.Future:
        """The decode side gave up on `room`: fail it; the returned future resolves once no write is in flight."""
        if room in self.ended:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done
        entry = self._room(room)  # a room not known yet is failed all the same: a half that comes later fails at once
        self._fail(entry, RoomFailed(499, "the decode instance cancelled the request", "cancelled"))
        return entry.quiet

    def _check_prompt(self, entry: _Room) -> None:
        request, destination = entry.request, entry.destination
        if request is None or destination is None:
            return
        if (destination.num_prompt_tokens != request.num_prompt_tokens
                or destination.prompt_digest != prompt_digest(request.prompt_token_ids)):
            self._fail(entry, RoomFailed(400, f"room {entry.room}: the decode instance's prompt "
                                              f"({destination.num_prompt_tokens} tokens) is not this one's "
                                              f"({request.num_prompt_tokens} tokens): is the same model and "
                                              f"chat template on both?", "prompt_mismatch"))

    def _fail(self, entry: _Room, failure: RoomFailed) -> None:
        if not entry.outcome.done():
            entry.outcome.set_exception(failure)
            self.engine_loop.metrics.kv_transfer_rooms.labels("failed").inc()
        self.sender.dropped.add(entry.room)
        if entry.request is not None:
            self._release(entry.request)
        self._settle(entry)

    def _release(self, request: EngineRequest) -> None:
        if request.request_id in self.engine.scheduler.held:
            self.engine.release_held(request.request_id)
        elif not request.finished:
            self.engine_loop.abort(request.request_id)

    def fail_all(self, message: str) -> None:
        """At shutdown: every room fails and counts as quiet (the sending thread stops with the process)."""
        for entry in list(self.rooms.values()):
            self._fail(entry, RoomFailed(503, message, "server_shutting_down"))
            if not entry.quiet.done():
                entry.quiet.set_result(None)

    def _settle(self, entry: _Room) -> None:
        """Forget a resolved room once nothing of it is in flight."""
        if entry.outcome.done() and entry.in_flight == 0:
            if not entry.quiet.done():
                entry.quiet.set_result(None)
            if self.rooms.pop(entry.room, None) is not None:
                self.ended[entry.room] = (time.monotonic(), entry.outcome)

    def _sent(self, result: SendResult) -> None:
        entry = self.rooms.get(result.job.room)
        if entry is None:
            return
        entry.in_flight -= 1
        metrics = self.engine_loop.metrics
        metrics.kv_transfer_bytes.inc(result.nbytes)
        metrics.kv_transfer_seconds.inc(result.seconds)
        if result.error is not None:
            self._fail(entry, RoomFailed(502, f"room {entry.room}: writing the rows to the decode instance failed: "
                                              f"{result.error}", "kv_transfer_failed"))
        else:
            entry.written = max(entry.written, result.job.end)
        self._settle(entry)

    def _after_step(self) -> None:
        now = time.monotonic()
        for room in [r for r, (when, _) in self.ended.items() if now - when > self.timeout]:
            del self.ended[room]
            self.sender.dropped.discard(room)
        for entry in list(self.rooms.values()):
            if entry.outcome.done():
                self._settle(entry)
                continue
            request, destination = entry.request, entry.destination
            if request is not None and request.finished and request.request_id not in self.engine.scheduler.held:
                self._fail(entry, RoomFailed(499 if request.finish_reason == "abort" else 500,
                                             f"room {entry.room}: the prefill request ended "
                                             f"({request.finish_reason}) before its rows were sent", "aborted"))
                continue
            if request is not None and destination is not None:
                self._send_new_rows(entry, request, destination)
                if request.finished and entry.written == request.num_prompt_tokens and entry.in_flight == 0:
                    entry.outcome.set_result(request.output_token_ids[0])
                    self.engine_loop.metrics.kv_transfer_rooms.labels("sent").inc()
                    self.engine.release_held(request.request_id)
                    self._settle(entry)
                    continue
            if now - entry.created > self.timeout:
                missing = ("the decode instance never claimed it" if destination is None
                           else "its prefill request never came" if request is None else "the transfer stalled")
                self._fail(entry, RoomFailed(504, f"room {entry.room} timed out after {self.timeout:.0f} s: {missing}",
                                             "room_timeout"))

    def _send_new_rows(self, entry: _Room, request: EngineRequest, destination: Destination) -> None:
        computed = request.num_prompt_tokens if request.finished else min(request.num_computed_tokens,
                                                                          request.num_prompt_tokens)
        if computed <= entry.sent:
            return
        start = entry.sent
        rows = self.engine.row_slots(request)
        offset = destination.start
        self.sender.send(SendJob(entry.room, destination.session_id, self.pools, rows[start:computed],
                                 destination.pools, destination.rows[start - offset:computed - offset], computed))
        entry.sent = computed
        entry.in_flight += 1


def bootstrap_app(engine_loop: EngineLoop, rooms: PrefillRooms) -> FastAPI:
    """The bootstrap server (`--disaggregation-bootstrap-port`): where decode instances claim their rooms."""
    app = FastAPI(title="hisparse bootstrap")

    def error(status: int, message: str, code: str) -> JSONResponse:
        return JSONResponse(ErrorResponse.of(status, message, None, code).model_dump(), status_code=status)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "pools": [p.name for p in rooms.pools]})

    @app.put("/rooms/{room}")
    async def claim(room: int, raw: Request) -> JSONResponse:
        try:
            destination = Destination.from_json(await raw.json())
            outcome, quiet = await asyncio.wrap_future(
                engine_loop.call(lambda _: rooms.set_destination(room, destination)))
        except RoomFailed as failure:  # the room has ended already
            return error(failure.status, failure.message, failure.code)
        except ValueError as failure:
            return error(400, str(failure), "bad_destination")
        except RuntimeError as failure:  # the engine is not running
            return error(503, str(failure), "engine_unavailable")
        try:
            first_token = await asyncio.wrap_future(outcome)
        except RoomFailed as failure:
            await asyncio.wrap_future(quiet)
            return error(failure.status, failure.message, failure.code)
        return JSONResponse({"first_token": first_token})

    @app.delete("/rooms/{room}")
    async def cancel(room: int) -> JSONResponse:
        try:
            quiet = await asyncio.wrap_future(engine_loop.call(lambda _: rooms.cancel(room)))
            await asyncio.wrap_future(quiet)
        except RuntimeError as failure:
            return error(503, str(failure), "engine_unavailable")
        return JSONResponse({"cancelled": room})

    return app


class PrefillInstance:
    """A prefill server's rooms and its bootstrap server, which runs on the API server's event loop."""

    def __init__(self, engine_loop: EngineLoop, transfer: KVTransferEngine, host: str, port: int,
                 timeout: float) -> None:
        self.engine_loop = engine_loop
        self.rooms = PrefillRooms(engine_loop, transfer, timeout)
        self.host, self.port = host, port
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as error:
            self._socket.close()
            raise ValueError(f"--disaggregation-bootstrap-port {port}: cannot listen on {host}:{port} "
                             f"({error.strerror})") from None
        self.port = self._socket.getsockname()[1]  # port 0: the kernel's choice
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    def attach(self, request_id: str, room: int) -> concurrent.futures.Future:
        """The future of the room's outcome future (RoomFailed when the room cannot be this request's)."""
        return self.engine_loop.call(lambda _: self.rooms.attach_request(room, request_id))

    async def start(self) -> None:
        self._server = uvicorn.Server(uvicorn.Config(bootstrap_app(self.engine_loop, self.rooms), log_level="warning",
                                                     lifespan="off", timeout_graceful_shutdown=5))
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                raise RuntimeError(f"the bootstrap server could not start on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        log.info("bootstrap server for decode instances on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        failing = self.engine_loop.call(lambda _: self.rooms.fail_all("the prefill server is shutting down"))
        try:
            await asyncio.wait_for(asyncio.wrap_future(failing), 5)
        except Exception:  # the engine loop has ended already: nothing runs, nothing is written
            pass
        if self._server is not None:
            self._server.should_exit = True
            await self._task
        self.rooms.sender.close()
        self._socket.close()
