"""`--hisparse-config`: the reference's JSON, parsed once, every error naming its field."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import InitVar, dataclass, fields

import torch

from hisparse.memory.eviction import EVICTION_POLICIES
from hisparse.memory.host_memory import PAGE_KINDS


@dataclass(frozen=True)
class HiSparseConfig:
    top_k: int = 256
    device_buffer_size: int | None = None  # hot slots per request per layer; default 2 x top_k
    host_to_device_ratio: int = 8
    # "auto" picks by device (`policy_for`). lrfu: evict the least recently / frequently selected, this
    # step's runners-up credited, recently evicted tokens' counts kept as ghosts; on held-out traces of the
    # default model it removes 45% of LRU's excess misses over Belady's optimum at 2x top_k over 192 decode
    # steps, 49-50% over 1024 (8 requests of each of two texts; hisparse.bench_missrate). "lru" keeps the
    # reference system's exact semantics.
    eviction_policy: str = "auto"
    # The host pool's pages: "small", or "huge" (2 MiB where the kernel lends them; see `host_memory`).
    host_pages: str = "small"
    # False: the top_k may still be the model's (DSA's index_topk wins), so the buffer is checked against it
    # later (`with_model_top_k`), not against the engine's.
    check_buffer: InitVar[bool] = True

    def __post_init__(self, check_buffer: bool = True) -> None:
        for name in ("top_k", "device_buffer_size", "host_to_device_ratio"):
            value = getattr(self, name)
            if value is None and name == "device_buffer_size":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"hisparse_config.{name} must be an integer, got {json.dumps(value)}")
            if value < 1:
                raise ValueError(f"hisparse_config.{name} must be >= 1, got {value}")
        # Whether the buffer is the default, 2 x top_k, which follows a model's own top_k (`with_model_top_k`).
        # Not a field: the JSON and `asdict` carry only what a user sets.
        object.__setattr__(self, "buffer_from_top_k", self.device_buffer_size is None)
        if self.device_buffer_size is None:
            object.__setattr__(self, "device_buffer_size", 2 * self.top_k)
        if check_buffer and self.device_buffer_size < self.top_k:
            raise ValueError(f"hisparse_config.device_buffer_size ({self.device_buffer_size}) must be >= "
                             f"top_k ({self.top_k}): every selected token needs a hot slot")
        if not isinstance(self.eviction_policy, str) or self.eviction_policy not in ("auto", *EVICTION_POLICIES):
            raise ValueError(f"hisparse_config.eviction_policy must be one of auto, {', '.join(EVICTION_POLICIES)}, "
                             f"got {json.dumps(self.eviction_policy)}")
        if not isinstance(self.host_pages, str) or self.host_pages not in PAGE_KINDS:
            raise ValueError(f"hisparse_config.host_pages must be one of {', '.join(PAGE_KINDS)}, "
                             f"got {json.dumps(self.host_pages)}")

    def with_model_top_k(self, top_k: int) -> HiSparseConfig:
        """This config for a model with its own top_k (DSA's index_topk), which wins as in the reference: a
        buffer left to its default follows it (2 x top_k), a buffer given must still hold it."""
        buffer = None if self.buffer_from_top_k else self.device_buffer_size
        if buffer is not None and buffer < top_k:
            raise ValueError(f"hisparse_config.device_buffer_size ({buffer}) must be >= top_k ({top_k}, the "
                             "model's own index_topk where it has one): every selected token needs a hot slot")
        return dataclasses.replace(self, top_k=top_k, device_buffer_size=buffer)

    def check_context(self, max_context: int) -> None:
        """ValueError unless a request of `max_context` tokens can outgrow the hot buffer. With the newest
        token's reserved slot, a buffer of max_context - 1 or more holds a whole request, which then never
        swaps in and costs at least as much device memory as its K/V without HiSparse."""
        if self.device_buffer_size + 1 >= max_context:
            raise ValueError(f"hisparse_config.device_buffer_size ({self.device_buffer_size}) must be at most "
                             f"{max_context - 2} for a context of {max_context} tokens: with the newest token's "
                             "reserved slot a larger buffer holds a whole request, which then never swaps in and "
                             "costs at least as much device memory as its K/V without HiSparse")

    def policy_for(self, device: str | torch.device) -> str:
        """The eviction policy to run on `device`; "auto" is lrfu on a GPU and lru on the CPU.

        On a GPU a miss is a host -> device transfer over PCIe, which lrfu's fewer misses save (it beats
        score_lru on held-out traces); its 2 x top_k runners-up are a second top-k per layer there, whose
        cost on a GPU is not measured yet (no GPU lent). On the CPU the "device" is the same memory and a
        miss is a row copy of under a kilobyte, so fewer misses buy little: side by side with lru
        (`python -m hisparse.bench.decode_overhead --policies lru,lrfu`, batch 8, 2k tokens of context,
        512-slot buffer), lrfu's decode step took 1.123x with the runners-up and ghosts (90.7% hits instead
        of 89.6%, 10.8% fewer misses; ranking the runners-up and looking them up in the swap-in is most of
        the cost), 1.144x before the ghosts, and 1.017x, 1.025x and 1.052x before lrfu read the runners-up.
        lru keeps the decode overhead target (see the README).
        """
        if self.eviction_policy != "auto":
            return self.eviction_policy
        return "lrfu" if torch.device(device).type == "cuda" else "lru"

    @classmethod
    def parse(cls, value: str | dict | HiSparseConfig | None, default_top_k: int = 256,
              check_buffer: bool = True) -> HiSparseConfig:
        """Accept the JSON text of the CLI flag, a dict from the Python API, or a config. check_buffer False
        leaves the buffer against a top_k the value does not give to `with_model_top_k`, once the model is
        known."""
        if isinstance(value, HiSparseConfig):
            return value
        if value is None or value == "":
            raw: object = {}
        elif isinstance(value, str):
            try:
                raw = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"hisparse_config is not valid JSON: {error.msg} at column {error.colno}") from None
        else:
            raw = value
        if not isinstance(raw, dict):
            raise ValueError(f"hisparse_config must be a JSON object, got {type(raw).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"hisparse_config has an unknown field {unknown[0]!r} (known: {', '.join(known)})")
        # A top_k the user wrote is theirs to match, whatever the model's turns out to be.
        return cls(**{"top_k": default_top_k, **raw}, check_buffer=check_buffer or "top_k" in raw)
