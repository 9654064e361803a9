"""HiSparse for the default model: a token's row is its K and V of every KV head, side by side.

The memory hierarchy itself (host pool, per-request hot buffer with a reserved newest slot, indexer keys
on the device, the fast path, per-layer swap-in, counters, the reference's sizing and admission) is
`hisparse_pools.HiSparsePools`; this module adds what the engine needs: admission by `Request`, and the
attention backend that runs prefill over the host pool and decode over the hot buffer.
"""

from __future__ import annotations

import torch

from hisparse.engine.forward_batch import ForwardBatch
from hisparse.engine.request import Request
from hisparse.layers.attention import causal_attention
from hisparse.layers.dsa_indexer import IndexKeyFormat
from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.memory.hisparse_pools import HiSparseAllocation, HiSparsePools
from hisparse.memory.paged_kv_cache import KVLayout
from hisparse.memory.rows import attend_rows, gather_rows, split_kv


class HiSparseKVCache(HiSparsePools):
    def __init__(self, layout: KVLayout, config: HiSparseConfig, budget_bytes: int, index_key: IndexKeyFormat,
                 max_requests: int, max_context: int, scale: float, device: str = "cpu",
                 swap_in_backend: str = "auto") -> None:
        super().__init__(layout.num_layers, layout.row_size, layout.dtype, index_key, config, budget_bytes,
                         max_requests, max_context, device, swap_in_backend)
        self.layout = layout
        self.scale = scale

    def can_admit(self, request: Request) -> bool:
        return self.can_allocate(request.max_total_tokens)

    def admit(self, request: Request) -> None:
        request.kv = self.allocate(request.max_total_tokens)

    def release(self, request: Request) -> None:
        alloc: HiSparseAllocation | None = request.kv
        if alloc is None:
            return
        self.free(alloc)
        request.kv = None

    def bind(self, batch: ForwardBatch) -> HiSparseAttention:
        return HiSparseAttention(self, batch)


class HiSparseAttention:
    """The attention backend for one step over a HiSparseKVCache; metadata built once per step."""

    def __init__(self, cache: HiSparseKVCache, batch: ForwardBatch) -> None:
        self.cache = cache
        self.host_write = torch.cat([torch.from_numpy(s.request.kv.host_rows[s.start:s.end]) for s in batch.spans])
        self.index_write = torch.cat([torch.from_numpy(s.request.kv.index_slots[s.start:s.end])
                                      for s in batch.spans]).to(cache.device)
        self.prefill = batch.prefill_spans
        self.decode = batch.decode_spans
        if not self.decode:
            return
        self.step = cache.begin_decode([s.request.kv for s in self.decode], [s.start for s in self.decode])
        self.decode_offsets = torch.tensor([s.offset for s in self.decode], device=cache.device)
        self.lengths = self.step.lengths
        width = int(self.lengths.max())
        self.index_slots = torch.stack([torch.nn.functional.pad(
            torch.from_numpy(s.request.kv.index_slots[:s.end]), (0, width - s.end))
            for s in self.decode]).to(cache.device)

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
        device_kv.index_copy_(0, self.step.device_write, new_rows)
        args = (layer, index_q, index_w, self.index_slots, self.lengths, cache.config.top_k)
        next_ranked = None
        if cache.num_next_ranks and self.step.has_swapping:  # the policy also reads the runners-up
            selected, next_ranked = cache.index_cache.select_with_next(*args, cache.num_next_ranks)
        else:
            selected = cache.index_cache.select(*args)  # [B, K] ascending, newest included
        page = cache.page_table(layer, self.step, selected, next_ranked)
        layout = cache.layout
        return attend_rows(device_kv, page, q, cache.scale, layout.num_kv_heads, layout.head_dim)
