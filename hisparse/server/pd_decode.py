"""The decode instance of prefill-decode disaggregation: it admits each request by its own budget, then claims
the request's room at the prefill instance's bootstrap server with the rows it reserved, and decodes once
they are written.

Admission is the engine's, as for any request (hot buffer, host rows, indexer slots with HiSparse; device rows
without): a request that does not fit waits in the queue. Once admitted (`after_step` sees it transferring),
`PUT /rooms/{room}` carries its `Destination` and returns when the rows are in its memory, with the first token
the prefill side sampled. A request aborted meanwhile (its client gone) cancels its room first and gives its
memory back only once the prefill side says no write is in flight, so no other request's rows can be
overwritten; a prefill instance that is gone or silent fails the request within the timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from hisparse.disaggregation.protocol import Destination, prompt_digest
from hisparse.disaggregation.transfer_engine import KVTransferEngine
from hisparse.server.engine_loop import EngineLoop, Failed

log = logging.getLogger("hisparse.server")


@dataclass
class _Claim:
    room: int
    bootstrap: str  # http://host:port of the prefill instance's bootstrap server
    loop: asyncio.AbstractEventLoop
    started: bool = False  # its room's claim is under way (set by the engine thread)
    task: asyncio.Task | None = None
    cancelled: bool = False


class DecodeRooms:
    def __init__(self, engine_loop: EngineLoop, transfer: KVTransferEngine, timeout: float) -> None:
        self.engine_loop = engine_loop
        self.engine = engine_loop.engine
        self.transfer = transfer
        self.timeout = timeout
        self.pools = transfer.register_pools(self.engine.row_pools())
        self._claims: dict[str, _Claim] = {}  # request id -> its room; both threads, each key by one at a time
        engine_loop.after_step.append(self._after_step)
        engine_loop.on_abort_transfer = self._on_abort
        self._client: httpx.AsyncClient | None = None

    # -- asyncio side ---------------------------------------------------------------------------------

    def expect(self, request_id: str, host: str, port: int, room: int) -> None:
        """Before submitting a request: its rows come from `room` at the bootstrap server host:port."""
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 address
        self._claims[request_id] = _Claim(room, f"http://{host}:{port}", asyncio.get_running_loop())

    def forget(self, request_id: str) -> None:
        """The request's handler has ended: a room never claimed is cancelled, so the prefill side frees at once."""
        claim = self._claims.get(request_id)
        if claim is not None and not claim.started and not claim.cancelled:  # a started claim ends by itself
            claim.cancelled = True
            self._claims.pop(request_id, None)
            claim.loop.create_task(self._cancel(claim))

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=5.0))
        return self._client

    async def _claim_room(self, request_id: str, claim: _Claim, destination: Destination) -> None:
        url = f"{claim.bootstrap}/rooms/{claim.room}"
        started = time.perf_counter()
        try:
            response = await self._http().put(url, json=destination.to_json())
        except asyncio.CancelledError:
            return
        except Exception as error:  # timed out, connection refused or broken, a bad URL
            await self._cancel(claim)  # a live prefill side stops writing before the memory goes back
            if isinstance(error, httpx.TimeoutException):
                self._fail(request_id, f"the prefill instance at {claim.bootstrap} sent no rows for bootstrap_room "
                                       f"{claim.room} within {self.timeout:.0f} s", "kv_transfer_timeout", 504)
            else:
                self._fail(request_id, f"the prefill instance's bootstrap server at {claim.bootstrap} could not be "
                                       f"reached: {type(error).__name__}: {error}", "prefill_unreachable")
            return
        if response.status_code == 200:
            try:
                first_token = int(response.json()["first_token"])
            except (ValueError, KeyError, TypeError):
                self._fail(request_id, f"the prefill instance answered bootstrap_room {claim.room} with "
                                       f"{response.text[:100]!r}", "kv_transfer_failed")
                return
            self.engine_loop.metrics.kv_transfer_wait.observe(time.perf_counter() - started)
            self._claims.pop(request_id, None)
            self.engine_loop.start_decode(request_id, first_token)
            return
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        self._fail(request_id, f"the prefill instance failed bootstrap_room {claim.room}: {message}",
                   "kv_transfer_failed", 400 if response.status_code in (400, 409) else 502)

    async def _cancel(self, claim: _Claim) -> None:
        claim.cancelled = True
        try:
            await self._http().delete(f"{claim.bootstrap}/rooms/{claim.room}", timeout=min(self.timeout, 10.0))
        except Exception:
            pass  # gone: it writes nothing more either (a stalled one checks nothing: the timeout's known gap)

    def _fail(self, request_id: str, message: str, code: str, status: int = 502) -> None:
        self._claims.pop(request_id, None)
        self.engine_loop.fail(request_id, Failed(status, message, None, code))

    async def _abort(self, request_id: str, claim: _Claim) -> None:
        if claim.task is not None:
            claim.task.cancel()
        await self._cancel(claim)
        self._claims.pop(request_id, None)
        self.engine_loop.force_abort(request_id)

    # -- engine thread --------------------------------------------------------------------------------

    def _after_step(self) -> None:
        for request in self.engine.scheduler.transferring:
            claim = self._claims.get(request.request_id)
            if claim is None or claim.started or claim.cancelled:
                continue
            rows = self.engine.row_slots(request)
            start = request.num_cached_tokens
            destination = Destination(self.transfer.session_id, self.pools, rows[start:request.num_prompt_tokens],
                                      start, request.num_prompt_tokens, prompt_digest(request.prompt_token_ids))
            claim.started = True
            claim.loop.call_soon_threadsafe(self._start_claim, request.request_id, claim, destination)

    def _start_claim(self, request_id: str, claim: _Claim, destination: Destination) -> None:
        if self._claims.get(request_id) is not claim or claim.cancelled:  # its handler ended meanwhile
            return
        claim.task = claim.loop.create_task(self._claim_room(request_id, claim, destination))

    def _on_abort(self, request_id: str) -> None:
        """A transferring request is being aborted: cancel its room before its memory goes back."""
        claim = self._claims.get(request_id)
        if claim is None:
            self.engine_loop.force_abort(request_id)
            return
        claim.loop.call_soon_threadsafe(lambda: claim.loop.create_task(self._abort(request_id, claim)))
