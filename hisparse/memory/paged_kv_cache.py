"""The baseline: every token's K/V on the device, in a token-granular pool behind per-request page tables.

This is what HiSparse is measured against under the same device budget. One pool row holds one token's
K and V of one layer, side by side, so a token moves between pools as a single row copy.

With a sparse-attention model the cache also holds every token's lightning-indexer key
(`IndexerKeyCache`) and decode attends only to the `top_k` positions the indexer selects (the whole K/V
still sits on the device here: this is sparse attention without the memory hierarchy). Prefill stays
dense and causal but writes the index key of every prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hisparse.engine.forward_batch import ForwardBatch
from hisparse.engine.request import Request
from hisparse.layers.attention import causal_attention
from hisparse.layers.dsa_indexer import IndexKeyFormat
from hisparse.memory.host_memory import GIB, available_host_memory
from hisparse.memory.indexer_cache import IndexerKeyCache
from hisparse.memory.rows import attend_rows, gather_rows, split_kv
from hisparse.memory.slot_allocator import SlotAllocator


@dataclass
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> KVLayout:
        """The K/V layout of a model with this config (a LlamaConfig: its weights need not be loaded)."""
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, dtype)

    @property
    def row_size(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        """One token's K/V in one layer: a row of the pools."""
        return self.row_size * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Device bytes of one token's K/V across all layers."""
        return self.num_layers * self.row_bytes

    def baseline_bytes_per_token(self, index_key: IndexKeyFormat | None = None) -> int:
        """What one token costs the baseline's device pool: its K/V in every layer plus, with an indexer,
        its index key row in every layer."""
        return self.bytes_per_token + (0 if index_key is None else self.num_layers * index_key.row_bytes)


@dataclass
class PagedAllocation:
    slots: torch.Tensor  # int64 [max_total_tokens]: pool row of each position
    index_slots: torch.Tensor | None = None  # int64 [max_total_tokens]: indexer-key slot of each position


# Runners-up a recorded decode step keeps per top_k position: score_lru reads 2 per spare slot, which is
# 4 x top_k at a buffer of 3 x top_k, the largest the miss-rate benchmark replays.
TRACE_NEXT_PER_TOP_K = 4


@dataclass
class SparseDecode:
    """How decode uses the indexer: top_k positions per step, except in `dense_layers` or when off."""

    index_key: IndexKeyFormat
    enabled: bool = True
    top_k: int = 256
    dense_layers: tuple[int, ...] = ()
    trace_next_ranks: int | None = None  # runners-up a recorded step keeps; None: TRACE_NEXT_PER_TOP_K x top_k

    @property
    def recorded_next_ranks(self) -> int:
        return TRACE_NEXT_PER_TOP_K * self.top_k if self.trace_next_ranks is None else self.trace_next_ranks

    def sparse_in(self, layer: int) -> bool:
        return self.enabled and layer not in self.dense_layers


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_slots: int, scale: float, device: str = "cpu",
                 sparse: SparseDecode | None = None) -> None:
        self.layout = layout
        self.scale = scale
        self.kv = torch.zeros(layout.num_layers, num_slots, layout.row_size, dtype=layout.dtype, device=device)
        self.allocator = SlotAllocator(num_slots)
        self.sparse = sparse
        self.index_cache = None if sparse is None else IndexerKeyCache(layout.num_layers, num_slots,
                                                                       sparse.index_key, device)

    @classmethod
    def from_budget(cls, layout: KVLayout, budget_bytes: int, scale: float, device: str = "cpu",
                    sparse: SparseDecode | None = None):
        """As many token slots as the budget buys; with an indexer each token also costs its index keys. A
        budget that buys none is refused here: a server started with it would refuse every request."""
        per_token = layout.baseline_bytes_per_token(None if sparse is None else sparse.index_key)
        if budget_bytes < per_token:
            raise ValueError(f"the device KV budget ({budget_bytes} bytes) buys no token slot: one token's K/V "
                             f"takes {per_token} bytes on the device; raise the device KV budget")
        num_slots = budget_bytes // per_token
        available = available_host_memory() if device == "cpu" else None  # on the CPU the pool is host memory
        if available is not None and num_slots * per_token > available:
            raise ValueError(f"the device KV budget ({budget_bytes / GIB:.1f} GiB) is more than this machine has "
                             f"available ({available / GIB:.1f} GiB); lower the device KV budget")
        return cls(layout, num_slots, scale, device, sparse)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_slots

    def can_admit(self, request: Request) -> bool:
        return request.max_total_tokens <= self.allocator.num_free

    def admit(self, request: Request) -> None:
        n = request.max_total_tokens
        index_slots = None if self.index_cache is None else torch.from_numpy(self.index_cache.allocator.allocate(n))
        request.kv = PagedAllocation(torch.from_numpy(self.allocator.allocate(n)), index_slots)

    def release(self, request: Request) -> None:
        if request.kv is not None:
            self.allocator.free(request.kv.slots.numpy())
            if request.kv.index_slots is not None:
                self.index_cache.allocator.free(request.kv.index_slots.numpy())
            request.kv = None

    def bind(self, batch: ForwardBatch) -> PagedAttention:
        return PagedAttention(self, batch)

    def usage(self) -> dict[str, int]:
        return {"device_slots_total": self.allocator.num_slots, "device_slots_used": self.allocator.num_used}


class PagedAttention:
    """The attention backend for one step over a PagedKVCache."""

    def __init__(self, cache: PagedKVCache, batch: ForwardBatch) -> None:
        self.cache = cache
        self.batch = batch
        self.write_rows = torch.cat([s.request.kv.slots[s.start:s.end] for s in batch.spans])
        self.prefill = batch.prefill_spans
        self.decode = batch.decode_spans
        if cache.index_cache is not None:
            self.index_write = torch.cat([s.request.kv.index_slots[s.start:s.end] for s in batch.spans])
        if self.decode:
            self.decode_lengths = torch.tensor([s.end for s in self.decode])
            width = int(self.decode_lengths.max())
            self.decode_rows = torch.stack([  # -1: past a request's length
                F.pad(s.request.kv.slots[:s.end], (0, width - s.end), value=-1) for s in self.decode])
            self.decode_offsets = torch.tensor([s.offset for s in self.decode])
            if cache.index_cache is not None:
                self.decode_index_slots = torch.stack([
                    F.pad(s.request.kv.index_slots[:s.end], (0, width - s.end)) for s in self.decode])
            # Requests that record their top-k get one entry per decode step: the context length and,
            # filled layer by layer, the positions selected and those ranked next (hisparse.engine.topk_trace
            # reads these).
            self.trace_steps = {}
            for b, span in enumerate(self.decode):
                if span.request.record_topk and cache.index_cache is not None:
                    step = {"seq_len": span.end, "layers": [None] * cache.layout.num_layers,
                            "next": [None] * cache.layout.num_layers}
                    if span.request.topk_trace is None:
                        span.request.topk_trace = []
                    span.request.topk_trace.append(step)
                    self.trace_steps[b] = step

    def attend(self, layer, q, k, v, index_q=None, index_k=None, index_w=None):
        cache = self.cache
        layout = cache.layout
        pool = cache.kv[layer]
        pool.index_copy_(0, self.write_rows, torch.cat([k.flatten(1), v.flatten(1)], 1).to(pool.dtype))
        has_index = cache.index_cache is not None and index_k is not None
        if has_index:
            cache.index_cache.write(layer, self.index_write, index_k)
        out = torch.empty_like(q)
        for span in self.prefill:
            rows = gather_rows(pool, span.request.kv.slots[:span.end])
            ks, vs = split_kv(rows, layout.num_kv_heads, layout.head_dim)
            sl = slice(span.offset, span.offset + span.length)
            out[sl] = causal_attention(q[sl], ks, vs, cache.scale)
        if self.decode:
            rows = self.decode_rows
            sparse = has_index and cache.sparse.sparse_in(layer)
            if sparse or (has_index and self.trace_steps):
                args = (layer, index_q[self.decode_offsets], index_w[self.decode_offsets], self.decode_index_slots,
                        self.decode_lengths, cache.sparse.top_k)
                if self.trace_steps:
                    selected, following = cache.index_cache.select_with_next(*args, cache.sparse.recorded_next_ranks)
                else:
                    selected = cache.index_cache.select(*args)
                for b, step in self.trace_steps.items():
                    step["layers"][layer] = selected[b].to(torch.int32).numpy()
                    step["next"][layer] = following[b].to(torch.int32).numpy()
                if sparse:
                    rows = torch.where(selected >= 0, rows.gather(1, selected.clamp(min=0)), -1)
            out[self.decode_offsets] = attend_rows(pool, rows, q[self.decode_offsets], cache.scale, layout.num_kv_heads,
                                                   layout.head_dim)
        return out
