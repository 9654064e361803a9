"""DP attention's requests: rank 0 places each request on one data-parallel rank, which alone admits, schedules
and decodes it in its own cache; rank 0 keeps a stand-in `Request` for each one placed elsewhere and brings it up
to date from that rank's report after every step.

Every rank steps together (the MLPs gather every rank's tokens), each on its own batch; a rank's report says what
it sampled for its requests, and rank 0 detokenizes and ends the stand-ins by the same rules as their ranks, so
the server, which talks to rank 0, sees every request as if it ran there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from hisparse.engine.request import Request, RequestStatus
from hisparse.memory.hisparse_pools import hit_rate

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")


@dataclass
class StepReport:
    """What one DP rank's step did to its requests, before any rank commits it."""

    admitted: list[tuple[str, int]] = field(default_factory=list)  # (id, prompt tokens reused from the cache)
    tokens: list[tuple[str, int]] = field(default_factory=list)  # (id, the token sampled)
    error: str | None = None  # the rank could not sample: every rank gives the step up


class Placement:
    """Rank 0's record of which DP rank runs each unfinished request, with stand-ins for the other ranks' ones.

    round_robin places requests on the ranks in turn; shortest_queue on the rank with the fewest unfinished
    requests (SGLang's --load-balance-method)."""

    def __init__(self, size: int, method: str = "round_robin") -> None:
        self.size = size
        self.method = method
        self.owner: dict[str, int] = {}  # every unfinished request's rank, rank 0's own included
        self.remote: dict[str, Request] = {}  # stand-ins for the requests on ranks other than 0
        self._turn = 0

    def place(self, request: Request) -> int:
        if self.method == "round_robin":
            rank, self._turn = self._turn, (self._turn + 1) % self.size
        else:
            load = Counter(self.owner.values())
            rank = min(range(self.size), key=lambda r: (load[r], r))
        self.owner[request.request_id] = rank
        if rank != 0:
            self.remote[request.request_id] = request
        return rank

    def forget(self, request_id: str) -> Request | None:
        """A request that ended: its stand-in (None for rank 0's own)."""
        self.owner.pop(request_id, None)
        return self.remote.pop(request_id, None)

    def admitted(self, report: StepReport) -> Iterator[Request]:
        """The stand-ins another rank admitted in its step, marked running."""
        for request_id, cached in report.admitted:
            request = self.remote[request_id]
            request.status, request.num_cached_tokens = RequestStatus.RUNNING, cached
            yield request

    def count(self, status: RequestStatus) -> int:
        return sum(r.status is status for r in self.remote.values())


def summed(parts: list[dict]) -> dict:
    """The ranks' counters added up key by key (lists element by element, dicts key by key), a hit rate
    recomputed from the sums (a rank that looked nothing up has none): each DP rank's pools and their counters
    are its own."""
    out = {}
    for key, value in parts[0].items():
        values = [part[key] for part in parts]
        if isinstance(value, dict):
            out[key] = summed(values)
        elif isinstance(value, list):
            out[key] = [sum(v) for v in zip(*values, strict=True)]
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = sum(values)
        else:
            out[key] = value
    if "hit_rate" in out:
        out["hit_rate"] = hit_rate(out["hits"], out["misses"])
    return out
