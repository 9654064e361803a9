"""Continuous batching: who runs this step, and with how many new tokens.

Every running request that has finished its prompt decodes one token each step; the rest of the
step's token budget (`chunked_prefill_size`) goes to prompt chunks, first come first served. A request
enters only when the cache manager can hold everything it could ever need (prompt + max_tokens), so a
step can never run out of memory halfway: capacity is refused at the door, not discovered mid-step. A
prompt whose prefix the cache holds from an earlier request starts its prefill after that prefix.

Under prefill-decode disaggregation a decode instance's request has no prefill: it is admitted the same way
(it takes no token budget), waits in `transferring` while a prefill instance writes its prompt's rows, and
decodes from `start_decode` on; a prefill instance's request keeps its rows in `held` after it finishes
until they are sent.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from hisparse.engine.request import Request, RequestStatus
from hisparse.formats.forward_batch import ForwardBatch


class CacheManager(Protocol):
    def admit(self, request: Request) -> int | None:
        """Allocate all the request could need; None when that does not fit now, else the number of prompt
        tokens whose rows it reuses from the prefix cache (the prefill starts after them)."""
        ...

    def share_prefill(self, request: Request) -> None:
        """The prompt rows the request has computed so far may be reused by requests admitted later."""
        ...

    def release(self, request: Request) -> None: ...


class Scheduler:
    def __init__(self, cache: CacheManager, max_running_requests: int, chunked_prefill_size: int) -> None:
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        if chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {chunked_prefill_size}")
        self.cache = cache
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.transferring: list[Request] = []
        self.held: dict[str, Request] = {}
        self.peak_running = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ForwardBatch | None:
        """Decodes first, then prompt chunks of running requests, then new requests while the step's token
        budget lasts: a request is admitted only when its prefill can start, so that it matches the prefix
        cache as late as possible (after the chunks of the requests before it)."""
        spans: list[tuple[Request, int]] = []
        budget = self.chunked_prefill_size
        for request in self.running:
            if not request.in_prefill:
                spans.append((request, 1))
                budget -= 1
        for request in self.running:
            if request.in_prefill and budget > 0:
                n = min(request.num_prompt_tokens - request.num_computed_tokens, budget)
                spans.append((request, n))
                budget -= n
        while self.waiting and len(self.running) + len(self.transferring) < self.max_running_requests:
            remote = self.waiting[0].remote_prefill
            if not remote and budget <= 0:
                break
            cached = self.cache.admit(self.waiting[0])
            if cached is None:
                break
            request = self.waiting.popleft()
            request.num_computed_tokens = request.num_cached_tokens = cached
            if remote:
                request.status = RequestStatus.TRANSFERRING
                self.transferring.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            n = min(request.num_prompt_tokens - cached, budget)
            spans.append((request, n))
            budget -= n
        self.peak_running = max(self.peak_running, len(self.running))
        return ForwardBatch.build(spans) if spans else None

    def advance(self, batch: ForwardBatch) -> None:
        """The step has run: its tokens' rows are in the cache, and prompt rows join the prefix cache."""
        for span in batch.spans:
            prefilling = span.request.in_prefill
            span.request.num_computed_tokens = span.end
            if prefilling:
                self.cache.share_prefill(span.request)

    def start_decode(self, request: Request) -> None:
        """A transferring request's prompt rows have all arrived: it decodes from the next step."""
        self.transferring.remove(request)
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.cache.share_prefill(request)

    def finish(self, request: Request, reason: str) -> None:
        """Retire a request (finished or aborted) and give back all of its memory (a finished `hold_kv` request
        keeps it until `release_held`)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        admitted = next((q for q in (self.running, self.transferring) if request in q), None)
        if admitted is not None:
            admitted.remove(request)
            if request.hold_kv and reason != "abort":
                self.held[request.request_id] = request
            else:
                self.cache.release(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def release_held(self, request_id: str) -> None:
        request = self.held.pop(request_id, None)
        if request is not None:
            self.cache.release(request)

    def abort(self, request_id: str) -> Request | None:
        if request_id in self.held:
            self.release_held(request_id)
            return None
        for request in [*self.running, *self.transferring, *self.waiting]:
            if request.request_id == request_id:
                self.finish(request, "abort")
                return request
        return None
