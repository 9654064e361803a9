"""HiSparse: every request's full K/V in a host pool, only a small hot buffer of it on the device.

Per request the device holds `device_buffer_size` hot slots per layer plus one reserved slot for the
newest token (written by the forward pass, never evicted), and the lightning indexer's key for every
token (it is what lets selection run without the big cache). Each decode step, per layer, the
indexer picks the top-k positions, `swap_in` brings the missing ones from the host pool into the hot
buffer (evicting by the configured policy) and sparse attention reads the selected rows through the
page table it returns.

Sizing follows the reference: one device "cell" = layers x (kv_bytes + ratio x indexer_bytes), so the
budget buys `slots` device rows and `slots x ratio` logical tokens (host rows and indexer keys).

Co-located flow: prefill writes the prompt's K/V to the host pool and attends over it there (on a GPU
this is where the reference stages prefill on the device before the backup); when the prompt is done
the hot buffer is filled with its last tokens, and from then on the request costs the device only its
hot buffer. While a request's length fits its buffer, position p simply lives in slot p (the fast path:
no swap-in at all).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from hisparse.engine.forward_batch import ForwardBatch
from hisparse.engine.request import Request
from hisparse.kernels.swap_in import swap_in
from hisparse.layers.attention import causal_attention, decode_attention
from hisparse.memory.eviction import get_policy, new_slot_tables, reset_row
from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.memory.indexer_cache import IndexerKeyCache
from hisparse.memory.paged_kv_cache import KVLayout
from hisparse.memory.rows import gather_rows, split_kv
from hisparse.memory.slot_allocator import SlotAllocator


@dataclass
class HiSparseAllocation:
    row: int  # this request's row of the slot tables
    device_rows: np.ndarray  # device row of each hot slot, then (if it can outgrow them) the reserved one
    host_rows: np.ndarray  # host row of every position it may hold
    index_slots: np.ndarray  # indexer-key slot of every position
    loaded: bool = False  # its prompt's tail has been copied into the hot buffer
    buffered: bool = False  # its slot tables are live (it has outgrown the fast path)


class SwapInCounters:
    """Per-layer hits, misses, evictions, bytes copied host -> device and swap-in seconds."""

    def __init__(self, num_layers: int) -> None:
        self.hits = np.zeros(num_layers, dtype=np.int64)
        self.misses = np.zeros(num_layers, dtype=np.int64)
        self.evictions = np.zeros(num_layers, dtype=np.int64)
        self.bytes_h2d = np.zeros(num_layers, dtype=np.int64)
        self.seconds = np.zeros(num_layers, dtype=np.float64)
        self.fast_path_lookups = 0  # selections served without swap-in (request still fits its buffer)
        self.prompt_load_bytes = 0  # prompt tails copied into hot buffers after prefill

    def as_dict(self) -> dict:
        lookups = int(self.hits.sum() + self.misses.sum())
        return {
            "hits": int(self.hits.sum()),
            "misses": int(self.misses.sum()),
            "evictions": int(self.evictions.sum()),
            "bytes_host_to_device": int(self.bytes_h2d.sum()),
            "swap_in_seconds": float(self.seconds.sum()),
            "hit_rate": (int(self.hits.sum()) / lookups) if lookups else None,
            "fast_path_lookups": self.fast_path_lookups,
            "prompt_load_bytes": self.prompt_load_bytes,
            "per_layer": {"hits": self.hits.tolist(), "misses": self.misses.tolist(),
                          "evictions": self.evictions.tolist(), "bytes_host_to_device": self.bytes_h2d.tolist(),
                          "swap_in_seconds": self.seconds.tolist()},
        }


class HiSparseKVCache:
    def __init__(self, layout: KVLayout, config: HiSparseConfig, budget_bytes: int, index_dim: int,
                 max_requests: int, max_context: int, scale: float, device: str = "cpu",
                 swap_in_backend: str = "auto") -> None:
        self.layout = layout
        self.config = config
        self.scale = scale
        self.device = device
        self.swap_in_backend = swap_in_backend
        kv_bytes = layout.bytes_per_token  # all layers
        index_bytes = layout.num_layers * (index_dim + 4)
        ratio = config.host_to_device_ratio
        cell = kv_bytes + ratio * index_bytes
        self.device_slots = budget_bytes // cell
        self.logical_capacity = self.device_slots * ratio
        buffer = config.device_buffer_size
        if self.device_slots < buffer + 1:
            raise ValueError(f"the device KV budget ({budget_bytes} bytes) buys {self.device_slots} hot slots, "
                             f"fewer than one request's buffer ({buffer} + 1); raise the budget")
        pin = device != "cpu" and torch.cuda.is_available()
        self.device_kv = torch.zeros(layout.num_layers, self.device_slots, layout.row_size, dtype=layout.dtype,
                                     device=device)
        # Never zeroed: a host row is always written (prefill or decode) before anything reads it, and
        # touching gigabytes of fresh pages would cost seconds at start-up.
        self.host_kv = torch.empty(layout.num_layers, self.logical_capacity, layout.row_size, dtype=layout.dtype,
                                   pin_memory=pin)
        self.index_cache = IndexerKeyCache(layout.num_layers, self.logical_capacity, index_dim, device=device)
        self.device_allocator = SlotAllocator(self.device_slots)
        self.host_allocator = SlotAllocator(self.logical_capacity)
        self.row_allocator = SlotAllocator(max_requests)
        tables = [new_slot_tables(max_requests, buffer, device) for _ in range(layout.num_layers)]
        self.slot_pos = torch.stack([t[0] for t in tables])  # [L, R, S]
        self.lru = torch.stack([t[1] for t in tables])  # [L, R, S]
        self.device_rows = torch.zeros(max_requests, buffer, dtype=torch.int64, device=device)
        self.host_rows = torch.zeros(max_requests, max_context, dtype=torch.int64, device=device)
        self.policies = [get_policy(config.eviction_policy, max_requests, buffer, device)
                         for _ in range(layout.num_layers)]
        self.counters = SwapInCounters(layout.num_layers)

    # -- admission --------------------------------------------------------------------------------

    def _needs(self, request: Request) -> tuple[int, int]:
        """(device rows, logical tokens) a request takes for its whole life."""
        total = request.max_total_tokens
        buffer = self.config.device_buffer_size
        return (total if total <= buffer else buffer + 1), total

    @property
    def capacity_tokens(self) -> int:
        return self.logical_capacity

    def can_admit(self, request: Request) -> bool:
        device, logical = self._needs(request)
        return (device <= self.device_allocator.num_free and logical <= self.host_allocator.num_free
                and logical <= self.index_cache.allocator.num_free and self.row_allocator.num_free > 0)

    def admit(self, request: Request) -> None:
        device, logical = self._needs(request)
        row = int(self.row_allocator.allocate(1)[0])
        alloc = HiSparseAllocation(row, self.device_allocator.allocate(device), self.host_allocator.allocate(logical),
                                   self.index_cache.allocator.allocate(logical))
        buffer = self.config.device_buffer_size
        hot = alloc.device_rows[:buffer]
        self.device_rows[row, :hot.size] = torch.from_numpy(hot)
        self.host_rows[row, :logical] = torch.from_numpy(alloc.host_rows)
        request.kv = alloc

    def release(self, request: Request) -> None:
        alloc: HiSparseAllocation | None = request.kv
        if alloc is None:
            return
        self.device_allocator.free(alloc.device_rows)
        self.host_allocator.free(alloc.host_rows)
        self.index_cache.allocator.free(alloc.index_slots)
        for layer in range(self.layout.num_layers):
            reset_row(self.slot_pos[layer], self.lru[layer], alloc.row, (), self.policies[layer])
        self.row_allocator.free(np.array([alloc.row]))
        request.kv = None

    def usage(self) -> dict[str, int]:
        return {"device_slots_total": self.device_allocator.num_slots,
                "device_slots_used": self.device_allocator.num_used,
                "host_slots_total": self.host_allocator.num_slots,
                "host_slots_used": self.host_allocator.num_used,
                "indexer_slots_total": self.index_cache.allocator.num_slots,
                "indexer_slots_used": self.index_cache.allocator.num_used}

    # -- the hot buffer ---------------------------------------------------------------------------

    def load_prompt(self, request: Request, length: int) -> None:
        """Bring a prompt's last tokens (up to the buffer size) from the host pool into the hot slots, in
        order, before the first decode step; a prompt longer than the buffer also makes its slot tables
        live, its oldest loaded position first to go."""
        alloc: HiSparseAllocation = request.kv
        first = max(0, length - self.config.device_buffer_size)
        src = torch.from_numpy(alloc.host_rows[first:length])
        dst = self.device_rows[alloc.row, :length - first]
        for layer in range(self.layout.num_layers):
            self.device_kv[layer].index_copy_(0, dst, self.host_kv[layer].index_select(0, src).to(self.device))
        self.counters.prompt_load_bytes += (length - first) * self.layout.bytes_per_token
        alloc.loaded = True
        if first > 0 or length == self.config.device_buffer_size:
            self.take_over(request, length)

    def take_over(self, request: Request, length: int) -> None:
        """Leave the fast path: slots 0..S-1 hold the last S positions in order, in every layer."""
        alloc: HiSparseAllocation = request.kv
        positions = torch.arange(length - self.config.device_buffer_size, length)
        for layer in range(self.layout.num_layers):
            reset_row(self.slot_pos[layer], self.lru[layer], alloc.row, positions, self.policies[layer])
        alloc.buffered = True

    def bind(self, batch: ForwardBatch) -> HiSparseAttention:
        return HiSparseAttention(self, batch)


class HiSparseAttention:
    """The attention backend for one step over a HiSparseKVCache; metadata built once per step."""

    def __init__(self, cache: HiSparseKVCache, batch: ForwardBatch) -> None:
        self.cache = cache
        buffer = cache.config.device_buffer_size
        self.host_write = torch.cat([torch.from_numpy(s.request.kv.host_rows[s.start:s.end]) for s in batch.spans])
        self.index_write = torch.cat([torch.from_numpy(s.request.kv.index_slots[s.start:s.end])
                                      for s in batch.spans])
        self.prefill = batch.prefill_spans
        self.decode = batch.decode_spans
        if not self.decode:
            return
        for span in self.decode:
            alloc = span.request.kv
            if not alloc.loaded:
                cache.load_prompt(span.request, span.start)
            elif span.start >= buffer and not alloc.buffered:
                cache.take_over(span.request, span.start)
        self.decode_offsets = torch.tensor([s.offset for s in self.decode])
        # The newest token goes to slot p while it fits the buffer, else to the reserved slot.
        self.device_write = torch.tensor([
            int(s.request.kv.device_rows[s.start] if s.start < buffer else s.request.kv.device_rows[-1])
            for s in self.decode])
        self.swapping = torch.tensor([s.start >= buffer for s in self.decode])
        self.lengths = torch.tensor([s.end for s in self.decode])
        width = int(self.lengths.max())
        self.index_slots = torch.stack([torch.nn.functional.pad(
            torch.from_numpy(s.request.kv.index_slots[:s.end]), (0, width - s.end)) for s in self.decode])
        self.rows = torch.tensor([s.request.kv.row for s in self.decode])
        # Which requests take the fast path and which swap in is fixed for the step: split once, not per layer.
        self.fast = ~self.swapping
        self.has_fast, self.has_swapping = bool(self.fast.any()), bool(self.swapping.any())
        self.fast_rows = self.rows[self.fast].unsqueeze(1)
        self.swap_rows = self.rows[self.swapping]
        self.swap_newest = (self.lengths[self.swapping] - 1).unsqueeze(1)
        self.swap_reserved = self.device_write[self.swapping].unsqueeze(1)

    def attend(self, layer, q, k, v, index_q=None, index_k=None, index_w=None):
        if index_q is None:
            raise ValueError("HiSparse needs a sparse-attention model (a lightning indexer in every layer)")
        cache = self.cache
        layout = cache.layout
        new_rows = torch.cat([k.flatten(1), v.flatten(1)], 1).to(layout.dtype)
        host = cache.host_kv[layer]
        host.index_copy_(0, self.host_write, new_rows.to(host.device))  # the backup (async on a GPU)
        cache.index_cache.write(layer, self.index_write, index_k)
        out = torch.empty_like(q)
        for span in self.prefill:
            rows = gather_rows(host, torch.from_numpy(span.request.kv.host_rows[:span.end])).to(q.device)
            ks, vs = split_kv(rows, layout.num_kv_heads, layout.head_dim)
            sl = slice(span.offset, span.offset + span.length)
            out[sl] = causal_attention(q[sl], ks, vs, cache.scale)
        if self.decode:
            out[self.decode_offsets] = self._decode(layer, q[self.decode_offsets], new_rows[self.decode_offsets],
                                                    index_q[self.decode_offsets], index_w[self.decode_offsets])
        return out

    def _decode(self, layer, q, new_rows, index_q, index_w):
        cache = self.cache
        device_kv = cache.device_kv[layer]
        device_kv.index_copy_(0, self.device_write, new_rows)
        selected = cache.index_cache.select(layer, index_q, index_w, self.index_slots, self.lengths,
                                            cache.config.top_k)  # [B, K] ascending, newest included
        valid = selected >= 0
        page = torch.full_like(selected, -1)
        fast = self.fast
        if self.has_fast:  # the buffer holds every token: position p is in hot slot p
            pos = selected[fast].clamp(min=0)
            page[fast] = torch.where(valid[fast], cache.device_rows[self.fast_rows, pos], -1)
            cache.counters.fast_path_lookups += int(valid[fast].sum())
        if self.has_swapping:
            swap_sel = selected[self.swapping]
            is_newest = swap_sel == self.swap_newest
            top_k = torch.where(is_newest, -1, swap_sel)
            start = time.perf_counter()
            result = swap_in(top_k, self.swap_rows, cache.slot_pos[layer], cache.lru[layer],
                             cache.device_rows, cache.host_rows, cache.host_kv[layer], device_kv,
                             policy=cache.policies[layer], backend=cache.swap_in_backend)
            cache.counters.seconds[layer] += time.perf_counter() - start
            misses = int(result.misses.sum())
            cache.counters.misses[layer] += misses
            cache.counters.hits[layer] += int((top_k >= 0).sum()) - misses
            cache.counters.evictions[layer] += int(result.evictions.sum())
            cache.counters.bytes_h2d[layer] += misses * device_kv.shape[1] * device_kv.element_size()
            page[self.swapping] = torch.where(is_newest, self.swap_reserved.expand_as(top_k), result.page_table)
        layout = cache.layout
        ks, vs = split_kv(gather_rows(device_kv, page.clamp(min=0)), layout.num_kv_heads, layout.head_dim)
        return decode_attention(q, ks, vs, page >= 0, cache.scale)
