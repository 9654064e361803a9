"""HiSparse through the engine, for every model: admission by `Request`, and the attention backend that runs
prefill over the host pool and decode over the hot buffers.

The memory hierarchy itself (host pool, per-request hot buffer with a reserved newest slot, indexer keys
on the device, the fast path, per-layer swap-in, counters, the reference's sizing and admission) is
`memory.hisparse_pools.HiSparsePools`, which copies rows without looking inside them; the cache's
`RowLayout` says what a row is (K and V heads of the default model, the MLA latent of DSA models).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hisparse.attention.functional import attend_rows, compiled_rows, write_rows
from hisparse.attention.index_selection import IndexSelector
from hisparse.attention.prefix_reuse import reusable_tokens
from hisparse.attention.prompt_chunks import PromptChunk, attend_prompt_chunks
from hisparse.attention.step_selection import StepSelection, index_query_rows, reads_index_queries, rows_of
from hisparse.formats.forward_batch import BatchedRequest, ForwardBatch
from hisparse.formats.kv_layout import RowLayout
from hisparse.formats.sparse_attention import SparseAttention
from hisparse.kernels import page_rows_cpu
from hisparse.kernels.decode_attention_cpu import bind_sparse_decode_attention
from hisparse.kernels.index_keys_cpu import bind_write_int8_keys
from hisparse.kernels.index_scores_cpu import bind_int8_top_k
from hisparse.kernels.kv_rows_cpu import bind_write_kv_rows
from hisparse.kernels.lru_page_table_cpu import PARALLEL_MIN_SELECTED, bind_page_tables
from hisparse.kernels.page_rows_cpu import bind_page_rows
from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.memory.hisparse_pools import HiSparseAllocation, HiSparsePools


class HiSparseKVCache(HiSparsePools):
    def __init__(self, layout: RowLayout, config: HiSparseConfig, budget_bytes: int, sparse: SparseAttention,
                 max_requests: int, max_context: int, scale: float, device: str = "cpu",
                 swap_in_backend: str = "auto", prefix_caching: bool = False,
                 capacity_layout: RowLayout | None = None) -> None:
        """capacity_layout: the rows that size the pools, when they are not `layout` (`PagedKVCache.from_budget`)."""
        super().__init__(layout.num_layers, layout.row_width, layout.row_dtype, sparse.index_key, config,
                         budget_bytes, max_requests, max_context, device, swap_in_backend, prefix_caching,
                         None if capacity_layout is None else capacity_layout.row_bytes)
        self.layout = layout
        self.scale = scale
        self.sparse = sparse
        self.selector = IndexSelector(self.index_cache, sparse.select_newest)

    def admit(self, request: BatchedRequest) -> int | None:
        """Give the request its hot buffer, host rows and indexer slots; returns how many prompt tokens it
        reuses from the prefix cache, or None when it does not fit now."""
        request.kv = self.allocate(request.max_total_tokens, request.prompt_token_ids)
        return None if request.kv is None else request.kv.claim.cached

    def share_prefill(self, request: BatchedRequest) -> None:
        """The prompt's host rows and indexer keys computed so far join the prefix cache."""
        self.prefix.share(request.kv.claim, request.prompt_token_ids[:request.num_computed_tokens])

    def release(self, request: BatchedRequest) -> None:
        alloc: HiSparseAllocation | None = request.kv
        if alloc is None:
            return
        self.free(alloc, reusable_tokens(request, self.sparse))
        request.kv = None

    def row_pools(self) -> list[tuple[str, torch.Tensor]]:
        """The pools a position's slots (the prefix claim's columns) index, named: its host row, its indexer keys."""
        return [("kv", self.host_kv), ("index_keys", self.index_cache.rows)]

    def bind(self, batch: ForwardBatch) -> HiSparseAttention:
        return HiSparseAttention(self, batch)


class HiSparseAttention:
    """The attention backend for one step over a HiSparseKVCache; metadata built once per step."""

    def __init__(self, cache: HiSparseKVCache, batch: ForwardBatch) -> None:
        self.cache = cache
        self.host_write = torch.cat([torch.from_numpy(s.request.kv.host_rows[s.start:s.end]) for s in batch.spans])
        self.index_write = torch.cat([torch.from_numpy(s.request.kv.index_slots[s.start:s.end])
                                      for s in batch.spans]).to(cache.device)
        self.decode = batch.decode_spans
        self.selection = StepSelection(cache.sparse, cache.selector)
        selects = cache.sparse.sparse_prefill
        self.prefill = [PromptChunk(
            slice(s.offset, s.offset + s.length), torch.from_numpy(s.request.kv.host_rows[:s.end]),
            torch.from_numpy(s.request.kv.index_slots[:s.end]).to(cache.device) if selects else None,
            torch.arange(s.start, s.end, device=cache.device) if selects else None) for s in batch.prefill_spans]
        self.decode_only = bool(self.decode) and not self.prefill
        width = max((s.end for s in self.decode), default=0)
        self.reads_index_queries = reads_index_queries(cache.sparse, bool(self.prefill), width)
        self.index_query_rows = None
        if not self.decode:
            return
        self.step = cache.begin_decode([s.request.kv for s in self.decode], [s.start for s in self.decode])
        self.decode_offsets = torch.tensor([s.offset for s in self.decode], device=cache.device)
        self.index_query_rows = index_query_rows(cache.sparse, bool(self.prefill), self.decode_offsets)
        self.lengths = self.step.lengths
        # Built on the host and copied every step (batch x context int64): a device-side table of each row's
        # indexer slots, beside `host_rows`, would save the copy.
        self.index_slots = torch.stack([torch.nn.functional.pad(
            torch.from_numpy(s.request.kv.index_slots[:s.end]), (0, width - s.end))
            for s in self.decode]).to(cache.device)

    def attend(self, layer, q, k, v, index_q=None, index_k=None, index_w=None):
        cache = self.cache
        layout = cache.layout
        # The backup. On a GPU this copy waits for the device, once per layer: the reference backs the newest
        # rows up asynchronously a step later, which this engine does not yet.
        host = cache.host_kv[layer]
        write_rows(host, self.host_write, layout, k, v)
        if index_k is not None:
            cache.index_cache.write(layer, self.index_write, index_k)
        if not self.prefill:  # a decode-only step: every token is a request's decode query, in order
            return self._decode(layer, q, k, v, index_q, index_w)
        out = q.new_empty(q.shape[0], q.shape[1], layout.v_dim)
        # Prefill over the host pool (on a GPU the reference stages it on the device before the backup).
        attend_prompt_chunks(out, layer, q, index_q, index_w, self.prefill, host, cache.scale, layout, cache.sparse,
                             self.selection)
        if self.decode:
            at = self.decode_offsets
            if self.index_query_rows is None:  # else index_q and index_w hold the decode rows alone
                index_q, index_w = rows_of(index_q, at), rows_of(index_w, at)
            out[at] = self._decode(layer, q[at], k[at], rows_of(v, at), index_q, index_w)
        return out

    def _decode(self, layer, q, k, v, index_q, index_w):
        cache = self.cache
        device_kv = cache.device_kv[layer]
        write_rows(device_kv, self.step.device_write, cache.layout, k, v)
        # The policy may also read the runners-up (score_lru, lrfu), when some request swaps in.
        num_next = cache.num_next_ranks if self.step.has_swapping else 0
        selected, next_ranked = self.selection.decode(layer, index_q, index_w, self.index_slots, self.lengths, num_next)
        page = cache.page_table(layer, self.step, selected, next_ranked)
        return attend_rows(device_kv, page, q, cache.scale, cache.layout)

    def bind_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor | None,
                    index_k: torch.Tensor | None, index_w: torch.Tensor | None,
                    out: torch.Tensor) -> Callable[[int], None] | None:
        """`attend` of this decode-only step as C calls bound once (`AttentionBackend.bind_decode`), where its
        requests are all on the fast path or all swap in (with the CPU's lru page table), with int8 keys; else None.
        """
        cache, step = self.cache, self.step if self.decode_only else None
        sparse, keys = cache.sparse, cache.index_cache
        if (step is None or step.has_fast == step.has_swapping or index_k is None or not keys.compiled_write
                or not compiled_rows(cache.layout, cache.device_kv, q, k, v)
                or any(sparse.shares_selection(layer) for layer in range(cache.num_layers))):
            return None
        if step.has_swapping:
            tables = [getattr(swap_in, "lru_page_table", None) for swap_in in cache.swap_in]
            if cache.num_next_ranks or not all(tables):
                return None
        if self.reads_index_queries and (index_q is None or not cache.selector.compiled_scores):
            return None
        if step.has_fast and not page_rows_cpu.available():
            return None
        batch, width = self.index_slots.shape
        selected = torch.empty(batch, min(sparse.top_k, width), dtype=torch.int64)
        page = torch.empty_like(selected)
        write_host = bind_write_kv_rows(cache.host_kv, self.host_write, k, v)
        write_device = bind_write_kv_rows(cache.device_kv, step.device_write, k, v)
        write_keys = bind_write_int8_keys(keys.rows, self.index_write, index_k)
        attend_page = bind_sparse_decode_attention(cache.device_kv, page, q, cache.scale, cache.layout.num_kv_heads,
                                                   cache.layout.head_dim, out)
        if self.reads_index_queries:
            select = bind_int8_top_k(keys.rows, keys.index_dim, self.index_slots, index_q, index_w, self.lengths,
                                     selected.shape[1], selected)
        else:  # every position, unscored (`StepSelection.decode`)
            selected.copy_(self.selection.decode(0, None, None, self.index_slots, self.lengths)[0])
            select = None
        if step.has_swapping:  # each layer's lru page table after its selection, the missed rows copied in
            page_table = bind_page_tables(tables, selected, step.swap_rows, step.swap_newest, step.swap_reserved, page,
                                          page.numel() >= PARALLEL_MIN_SELECTED)
            seconds = cache.counters.seconds

            def fill_page(layer: int) -> None:
                start = time.perf_counter()
                page_table(layer)
                seconds[layer] += time.perf_counter() - start
        else:  # the fast path: position p sits in hot slot p of the request's row of the slot table
            look_up = bind_page_rows(cache.device_rows[step.rows], selected, page)
            fast_path = cache.counters.fast_path
            looked_up = None if select is not None else look_up()  # the same page in every layer

            def fill_page(layer: int) -> None:
                fast_path.add_(look_up() if looked_up is None else looked_up)

        def attend(layer: int) -> None:
            write_host(layer)
            write_device(layer)
            write_keys(layer)
            if select is not None:
                select(layer)
            fill_page(layer)
            attend_page(layer)
        return attend
