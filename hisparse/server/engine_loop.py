"""The engine loop: the only code that touches the engine while the server runs.

The engine is not thread-safe, and a decode step takes long enough (tens to hundreds of milliseconds) that
running it on the asyncio loop would stall every HTTP connection. So HTTP handlers never call the engine:
they put commands (add, abort) on a thread-safe queue, and the loop drains the queue between steps, runs
one step, and posts each request's new text back to that request's asyncio queue with
`loop.call_soon_threadsafe`. With nothing to do it blocks on the command queue, so an idle server costs no
CPU.

The server runs this loop in the process's main thread, the thread that loaded the model, and uvicorn in a
thread of its own (`run`; tests and programs that keep their main thread use `start`, a thread for the loop).
Torch's work is cheapest in the thread that did it first. Measured on our 2 cores, the same engine in one
process, batch 4 at 1.5k tokens of context, phases alternating: decode steps in a second thread took 1.3-1.5x
those in the main thread (103 against 70 ms, medians of 3; 147 against 101 through this loop in a thread). In
that thread, 8 steps cost 17k voluntary context switches (the main thread: under 10), because the thread's
OpenMP worker sleeps on a futex between parallel regions where the main thread's spins, and 50-150k page
faults from the thread's own malloc arena (the main thread: none). Run from the main thread, the loop's steps
match direct `engine.step()` calls (94 against 101 ms). Below, "the engine thread" is whichever thread runs it.

A failure is confined to the requests it concerns: a request the engine refuses (ValueError) gets a 400, an
unexpected error while adding one gets a 500, and a step that raises fails the requests that were in that
step (the engine cannot say which one caused it) and frees their memory; the loop itself keeps going.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hisparse.engine.errors import RequestError
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.request import Request, RequestStatus
from hisparse.engine.sampling_params import SamplingParams
from hisparse.server.metrics import ServerMetrics

log = logging.getLogger("hisparse.server")


# -- events: engine thread -> one request's asyncio queue ----------------------------------------------


@dataclass(frozen=True)
class Accepted:
    """The engine took the request (sent before any text, so a refusal can still become an HTTP 400)."""

    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    text: str  # new text since the last Delta
    completion_tokens: int  # tokens generated so far
    finish_reason: str | None  # set on the last Delta: stop, length or abort
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache


@dataclass(frozen=True)
class Failed:
    status: int  # the HTTP status the handler should answer with
    message: str
    field: str | None = None  # the engine's name of the field at fault (`RequestError.field`)
    code: str | None = None


Event = Accepted | Delta | Failed


class RequestStream:
    """One request's mailbox on the asyncio side; the engine thread only ever calls `put`."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def get(self) -> Event:
        event = await self._queue.get()
        if isinstance(event, Failed) or (isinstance(event, Delta) and event.finish_reason is not None):
            self.finished = True
        return event


# -- commands: asyncio side -> engine thread --------------------------------------------------------------


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: RequestStream
    arrival: float
    remote_prefill: bool = False
    hold_kv: bool = False


@dataclass(frozen=True)
class _Abort:
    request_id: str
    force: bool = False


class _Stop:
    pass


@dataclass(frozen=True)
class _Call:
    """Run `fn(engine)` in the engine thread between steps; its result or exception goes to `done`."""

    fn: Callable[[LLMEngine], object]
    done: concurrent.futures.Future


@dataclass(frozen=True)
class _StartDecode:
    request_id: str
    first_token: int


@dataclass(frozen=True)
class _Fail:
    request_id: str
    failure: Failed


@dataclass
class _Tracked:
    """What the thread remembers about a request between steps to cut its output into deltas."""

    request: Request
    stream: RequestStream
    arrival: float
    hold_back: int  # characters kept unsent while a stop string could still begin in them
    sent_chars: int = 0
    sent_tokens: int = 0
    last_token_time: float = 0.0


class EngineUnavailable(RuntimeError):
    pass


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._in_flight = 0  # submitted and not yet ended; both threads, under _lock
        self._lock = threading.Lock()
        self._stats: dict = engine.stats_dict()  # replaced whole by the engine thread, read by anyone
        self._started = False
        self._draining = False  # set by `drain`: no new request is taken
        self._exited = threading.Event()
        # Prefill-decode disaggregation's hooks, in the engine thread: `after_step` after every turn of the loop,
        # `on_abort_transfer(request_id)` instead of aborting a request whose rows are still arriving (the rows'
        # sender must stop writing before its memory can go back: `force_abort` then ends it).
        self.after_step: list[Callable[[], None]] = []
        self.on_abort_transfer: Callable[[str], None] | None = None
        self.idle_wakeup: float | None = None  # seconds: an idle loop still runs its hooks this often (timeouts)
        self.metrics.bind(self.stats, self.num_queued)

    # -- any thread -----------------------------------------------------------------------------------

    def run(self, on_running: Callable[[], None] | None = None) -> None:
        """Run the loop in the calling thread until `stop`. `on_running` is called once the loop counts as
        alive, before its first command: start the HTTP server there, and its first request finds the loop
        alive (its lifespan starts a loop that is not)."""
        self._claim()
        self._run_until_stopped(on_running)

    def start(self) -> None:
        """Run the loop in a daemon thread of its own ("hisparse-engine")."""
        self._claim()
        threading.Thread(target=self._run_until_stopped, name="hisparse-engine", daemon=True).start()

    def _claim(self) -> None:
        with self._lock:
            if self._started:
                raise RuntimeError("the engine loop has been started already")
            self._started = True

    def _run_until_stopped(self, on_running: Callable[[], None] | None = None) -> None:
        try:
            if on_running is not None:
                on_running()
            self._run()
        finally:
            self._exited.set()

    def drain(self) -> None:
        """Take no new request (they get a 503) while the running ones go on: the first step of a shutdown."""
        self._draining = True

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the loop to end (queued and running requests get a 503) and wait for it, from another thread."""
        if self.alive:
            self._commands.put(_Stop())
            self._exited.wait(timeout)

    @property
    def started(self) -> bool:
        return self._started

    @property
    def alive(self) -> bool:
        return self._started and not self._exited.is_set()

    def stats(self) -> dict:
        """The engine's stats_dict() as of the end of its latest step."""
        return self._stats

    def num_in_flight(self) -> int:
        return self._in_flight

    def num_queued(self) -> int:
        """Requests the server holds that will wait for a running slot: those the engine's latest step left
        waiting, and of those submitted since, the ones beyond the batch's free places. (Counting every request
        the latest step has not seen as waiting refused most of a burst at an idle server with 429.) While
        some wait, memory is what holds them back, so none of the newcomers is counted as running."""
        stats = self._stats
        running, waiting = stats.get("running", 0), stats.get("waiting", 0)
        newcomers = max(0, self._in_flight - running - waiting)
        places = self.engine.scheduler.max_running_requests * stats.get("dp_size", 1)  # DP attention: per rank
        free = 0 if waiting else max(0, places - running)
        return waiting + max(0, newcomers - free)

    def _ended(self) -> None:
        with self._lock:
            self._in_flight -= 1

    # -- the asyncio side -----------------------------------------------------------------------------

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               arrival: float | None = None, remote_prefill: bool = False, hold_kv: bool = False) -> RequestStream:
        """Call from the event loop; events for the request arrive on the returned stream. remote_prefill,
        hold_kv: its part in prefill-decode disaggregation (`engine.request.Request`)."""
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._lock:
            self._in_flight += 1
        self._commands.put(_Add(request_id, prompt, params, stream,
                                time.perf_counter() if arrival is None else arrival, remote_prefill, hold_kv))
        return stream

    def abort(self, request_id: str) -> None:
        """Harmless for a request that already ended; commands run in order, so never overtakes its add."""
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run `fn(engine)` in the engine thread between two steps (from any thread)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            done.set_exception(EngineUnavailable("the engine is not running"))
        else:
            self._commands.put(_Call(fn, done))
        return done

    def start_decode(self, request_id: str, first_token: int) -> None:
        """A transferring request's prompt rows have arrived: it decodes from `first_token` on (any thread)."""
        self._commands.put(_StartDecode(request_id, first_token))

    def fail(self, request_id: str, failure: Failed) -> None:
        """End a request with an error (its stream gets `failure`) and free its memory (any thread)."""
        self._commands.put(_Fail(request_id, failure))

    async def flush_cache(self) -> bool:
        """Empty the engine's prefix cache between two steps; False while a running request reuses it."""
        return await asyncio.wrap_future(self.call(lambda engine: engine.flush_cache()))

    # -- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        stalled = False
        while True:
            idle = not self.engine.has_unfinished
            # Idle: sleep until a command comes. Stalled (work waiting, nothing could run): poll gently.
            commands = self._take_commands(block=idle or stalled, timeout=self.idle_wakeup if idle else 0.01)
            for command in commands:
                if isinstance(command, _Stop):
                    self._shutdown()
                    return
                try:
                    if isinstance(command, _Add):
                        self._add(command)
                    elif isinstance(command, _Call):
                        self._call(command)
                    elif isinstance(command, _StartDecode):
                        self._start_decode(command)
                    elif isinstance(command, _Fail):
                        self._fail(command.request_id, command.failure)
                    else:
                        self._abort(command.request_id, command.force)
                except Exception:  # a bug here must not end the thread
                    log.exception("engine thread: handling %s failed", type(command).__name__)
            stalled = False
            if self.engine.has_unfinished:
                stalled = not self._step()
            for hook in self.after_step:
                try:
                    hook()
                except Exception:
                    log.exception("engine thread: an after-step hook failed")
            try:
                self._stats = self.engine.stats_dict()
            except Exception:
                log.exception("engine thread: stats_dict failed")
            stalled = stalled and self._stats.get("running", 0) == 0

    def _take_commands(self, block: bool, timeout: float | None) -> list:
        try:
            commands = [self._commands.get(timeout=timeout) if block else self._commands.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, command: _Add) -> None:
        try:
            request = self.engine.add_request(command.prompt, command.params, command.request_id,
                                              remote_prefill=command.remote_prefill, hold_kv=command.hold_kv)
        except RequestError as error:
            self._refuse(command.stream, Failed(400, str(error), error.field, error.code))
            return
        except ValueError as error:
            self._refuse(command.stream, Failed(400, str(error)))
            return
        except Exception as error:
            log.exception("engine thread: add_request failed")
            self._refuse(command.stream, Failed(500, f"internal error: {type(error).__name__}: {error}"))
            return
        stops = request.params.stop
        self._tracked[request.request_id] = _Tracked(request, command.stream, command.arrival,
                                                     max((len(s) for s in stops), default=1) - 1)
        command.stream.put(Accepted(request.num_prompt_tokens))

    def _refuse(self, stream: RequestStream, failure: Failed) -> None:
        stream.put(failure)
        if failure.status >= 500:  # a 4xx is counted once, by the HTTP layer, as a rejected request
            self.metrics.requests.labels("error").inc()
        self._ended()

    def _call(self, command: _Call) -> None:
        try:
            command.done.set_result(command.fn(self.engine))
        except Exception as error:
            command.done.set_exception(error)

    def _start_decode(self, command: _StartDecode) -> None:
        tracked = self._tracked.get(command.request_id)
        if tracked is None or tracked.request.status is not RequestStatus.TRANSFERRING:
            return  # aborted or failed meanwhile
        self.engine.start_decode(command.request_id, command.first_token)
        self._deliver(tracked, time.perf_counter())

    def _fail(self, request_id: str, failure: Failed) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.engine.abort(request_id)
        self._refuse(tracked.stream, failure)

    def force_abort(self, request_id: str) -> None:
        """Abort even a request whose rows are arriving (its sender has stopped): from any thread."""
        self._commands.put(_Abort(request_id, force=True))

    def _abort(self, request_id: str, force: bool = False) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        transferring = tracked.request.status is RequestStatus.TRANSFERRING
        if transferring and not force and self.on_abort_transfer is not None:
            self.on_abort_transfer(request_id)
            return
        del self._tracked[request_id]
        self.engine.abort(request_id)
        tracked.stream.put(Delta("", tracked.sent_tokens, "abort"))
        self.metrics.requests.labels("abort").inc()
        self._ended()

    def _step(self) -> bool:
        """One engine step; False when it produced no token."""
        try:
            outputs = self.engine.step()
        except Exception as error:
            log.exception("engine thread: step failed; failing the requests in it")
            self._fail_running(error)
            return True
        now = time.perf_counter()
        for request in outputs:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None:
                self._deliver(tracked, now)
        return bool(outputs)

    def _deliver(self, t: _Tracked, now: float) -> None:
        request = t.request
        tokens = len(request.output_token_ids)
        if tokens > t.sent_tokens:
            if t.sent_tokens == 0:
                self.metrics.time_to_first_token.observe(now - t.arrival)
            else:
                for _ in range(tokens - t.sent_tokens):
                    self.metrics.inter_token_latency.observe((now - t.last_token_time) / (tokens - t.sent_tokens))
            t.last_token_time = now
        text = request.output_text
        # A stop string is cut from output_text only once complete, so its first characters may already be
        # in the text; hold them back until it can no longer match (a match always lies past what was sent).
        end = len(text) if request.finished else len(text) - t.hold_back
        delta = text[t.sent_chars:end] if end > t.sent_chars else ""
        t.sent_chars += len(delta)
        t.sent_tokens = tokens
        t.stream.put(Delta(delta, tokens, request.finish_reason if request.finished else None,
                           request.num_cached_tokens))
        if request.finished:
            del self._tracked[request.request_id]
            self.metrics.e2e_latency.observe(now - t.arrival)
            self.metrics.requests.labels(request.finish_reason or "stop").inc()
            self._ended()

    def _fail_running(self, error: Exception) -> None:
        """Fail the requests that were in the step. When none was running the failure came from admitting
        the waiting ones, and they fail instead: either way the next step cannot fail the same way forever."""
        in_step = [r for r, t in self._tracked.items() if t.request.status is RequestStatus.RUNNING]
        waiting = [r for r, t in self._tracked.items() if t.request.status is RequestStatus.WAITING]
        for request_id in in_step or waiting:  # never one whose rows are arriving: a write could still land
            t = self._tracked.pop(request_id)
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("engine thread: abort after a failed step failed")
            self._refuse(t.stream, Failed(500, f"internal error while generating: {type(error).__name__}: {error}"))

    def _shutdown(self) -> None:
        pending = self._take_commands(block=False, timeout=None)
        for command in pending:
            if isinstance(command, _Add):
                self._refuse(command.stream, Failed(503, "the server is shutting down"))
            elif isinstance(command, _Call):
                command.done.set_exception(EngineUnavailable("the server is shutting down"))
        for request_id, t in list(self._tracked.items()):
            del self._tracked[request_id]
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("engine thread: abort at shutdown failed")
            # Its stream closes with an error event after the text sent so far; a plain request gets the 503.
            self._refuse(t.stream, Failed(503, "the server is shutting down: the request was aborted", None,
                                          "server_shutting_down"))
