"""`GET /metrics`: Prometheus text from one registry per app.

Latencies are histograms observed by the engine thread the moment a token leaves the engine (prometheus_client
is thread-safe). Everything the engine already counts (tokens, memory, hits, misses, swap-in bytes) is read
from its latest `stats_dict()` snapshot at scrape time instead of being counted twice: the engine is the one
source of truth, the exporter only renames.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# stats_dict()["swap_in"] key -> (metric name, help)
_SWAP_IN_COUNTERS = {
    "hits": ("hisparse_swap_in_hits", "Selected tokens already in the device hot buffer"),
    "misses": ("hisparse_swap_in_misses", "Selected tokens copied from the host pool"),
    "evictions": ("hisparse_swap_in_evictions", "Hot-buffer slots overwritten to make room for a miss"),
    "bytes_host_to_device": ("hisparse_swap_in_bytes", "Bytes copied host -> device by swap-in"),
    "swap_in_seconds": ("hisparse_swap_in_seconds", "Time spent in swap-in"),
}


class _EngineCollector(Collector):
    """Turns the engine's latest stats snapshot (and the server's queue count) into metrics at scrape time."""

    def __init__(self, snapshot: Callable[[], dict], queued: Callable[[], int]) -> None:
        self.snapshot = snapshot
        self.queued = queued

    def collect(self) -> Iterable[Metric]:
        stats = self.snapshot()
        yield GaugeMetricFamily("hisparse_num_running_requests", "Requests in the running batch",
                                value=stats.get("running", 0))
        yield GaugeMetricFamily("hisparse_num_queued_requests",
                                "Requests accepted by the server and waiting for a running slot", value=self.queued())
        yield CounterMetricFamily("hisparse_prompt_tokens", "Prompt tokens of the requests that started (cached ones "
                                  "included)",
                                  value=stats.get("prompt_tokens", 0))
        yield CounterMetricFamily("hisparse_cached_prompt_tokens", "Prompt tokens reused from the prefix cache, "
                                  "not prefilled", value=stats.get("cached_prompt_tokens", 0))
        memory = stats.get("memory", {})
        yield GaugeMetricFamily("hisparse_prefix_cache_tokens", "Tokens the prefix cache (radix tree) holds",
                                value=memory.get("prefix_cache_tokens", 0))
        yield GaugeMetricFamily("hisparse_prefix_cache_evictable_tokens", "Tokens of the prefix cache that no running "
                                "request uses (free to evict)", value=memory.get("prefix_cache_evictable_tokens", 0))
        yield CounterMetricFamily("hisparse_generation_tokens", "Tokens generated",
                                  value=stats.get("generated_tokens", 0))
        yield CounterMetricFamily("hisparse_engine_steps", "Engine steps run", value=stats.get("steps", 0))
        yield CounterMetricFamily("hisparse_engine_step_seconds", "Time in engine steps",
                                  value=stats.get("step_seconds", 0.0))
        # Their ratio is the engine's own decode step time, to set against the inter-token latency clients see.
        yield CounterMetricFamily("hisparse_engine_decode_steps", "Engine steps that only decoded (no prompt chunk)",
                                  value=stats.get("decode_steps", 0))
        yield CounterMetricFamily("hisparse_engine_decode_seconds", "Time in engine steps that only decoded",
                                  value=stats.get("decode_seconds", 0.0))
        yield CounterMetricFamily("hisparse_engine_decode_tokens", "Tokens of engine steps that only decoded",
                                  value=stats.get("decode_tokens", 0))
        used = GaugeMetricFamily("hisparse_kv_slots_used", "KV token slots in use, per pool (the prefix cache's "
                                 "included)", labels=["pool"])
        total = GaugeMetricFamily("hisparse_kv_slots_total", "KV token slots, per pool", labels=["pool"])
        ratio = GaugeMetricFamily("hisparse_kv_usage", "Share of KV token slots in use, per pool", labels=["pool"])
        # "device" is the hot buffer (or the whole paged cache without HiSparse), "host" the host pool,
        # "indexer" the indexer's key cache.
        for key, value in memory.items():
            if key.endswith("_slots_used"):
                pool = key.removesuffix("_slots_used")
                slots = memory.get(f"{pool}_slots_total", 0)
                used.add_metric([pool], value)
                total.add_metric([pool], slots)
                ratio.add_metric([pool], value / slots if slots else 0.0)
        yield from (used, total, ratio)
        yield GaugeMetricFamily("hisparse_tp_size", "Ranks (tensor parallel: each holds every token's rows for its "
                                "share of the KV heads, the slot counts above are every rank's)",
                                value=stats.get("tp_size", 1))
        yield GaugeMetricFamily("hisparse_dp_size", "Data-parallel attention ranks (each holds its own requests' "
                                "rows: the slot counts above are the ranks' summed)", value=stats.get("dp_size", 1))
        pools = {kind: GaugeMetricFamily(f"hisparse_{kind}_kv_bytes", f"Bytes of the {kind} KV pools, per rank",
                                         labels=["rank"]) for kind in ("device", "host")}
        for rank, sizes in enumerate(stats.get("ranks", [])):
            for kind, family in pools.items():
                family.add_metric([str(rank)], sizes.get(f"{kind}_kv_bytes", 0))
        yield from pools.values()
        swap_in = stats.get("swap_in")
        if swap_in is not None:
            for key, (name, text) in _SWAP_IN_COUNTERS.items():
                yield CounterMetricFamily(name, text, value=swap_in.get(key, 0))
            rate = swap_in.get("hit_rate")
            yield GaugeMetricFamily("hisparse_swap_in_hit_rate", "Hits / (hits + misses) since start",
                                    value=rate if rate is not None else 0.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "hisparse_time_to_first_token_seconds", "From arrival at the server to the first token",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "hisparse_inter_token_latency_seconds", "Between consecutive tokens of one request",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e_latency = Histogram(
            "hisparse_e2e_request_latency_seconds", "From arrival at the server to the last token",
            buckets=_E2E_BUCKETS, registry=self.registry)
        self.requests = Counter("hisparse_requests", "Requests that ended, by finish reason (stop, length, "
                                "abort, error)", ["finish_reason"], registry=self.registry)
        self.rejected = Counter("hisparse_requests_rejected", "Requests refused before reaching the engine, by "
                                "HTTP status", ["status"], registry=self.registry)
        # Prefill-decode disaggregation: the prefill side counts what it writes, the decode side how long it waits.
        self.kv_transfer_bytes = Counter("hisparse_kv_transfer_bytes", "Bytes of prompt rows written into decode "
                                         "instances' memory", registry=self.registry)
        self.kv_transfer_seconds = Counter("hisparse_kv_transfer_seconds", "Time the sending thread spent writing "
                                           "them", registry=self.registry)
        self.kv_transfer_rooms = Counter("hisparse_kv_transfer_rooms", "Rooms that ended, by outcome (sent, failed)",
                                         ["outcome"], registry=self.registry)
        self.kv_transfer_wait = Histogram(
            "hisparse_kv_transfer_wait_seconds", "Decode side: from admission to the prompt's rows all written",
            buckets=_LATENCY_BUCKETS, registry=self.registry)

    def bind(self, snapshot: Callable[[], dict], queued: Callable[[], int]) -> None:
        """Export the engine's counters; separate from __init__ because the engine loop needs the histograms
        before it exists to be read."""
        self.registry.register(_EngineCollector(snapshot, queued))

    def render(self) -> bytes:
        return generate_latest(self.registry)
