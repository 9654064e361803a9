"""The baseline: every token's row on the device, in a token-granular pool behind per-request page tables.

This is what HiSparse is measured against under the same device budget. One pool row holds one token's
row of one layer (K and V side by side, or an MLA latent: the cache's `RowLayout`), so a token moves
between pools as a single row copy.

With a sparse-attention model the cache also holds every token's lightning-indexer key
(`IndexerKeyCache`) and decode attends only to the `top_k` positions the indexer selects (the whole cache
still sits on the device here: this is sparse attention without the memory hierarchy). Prefill is dense
and causal, or, for a model whose indexers select in prefill too (DSA), each prompt token attends to its
own top-k; either way it writes the index key of every prompt token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
from hisparse.kernels.page_rows_cpu import bind_page_rows
from hisparse.memory.host_memory import GIB, available_host_memory
from hisparse.memory.indexer_cache import IndexerKeyCache
from hisparse.memory.prefix_cache import PrefixCache, PrefixClaim
from hisparse.memory.slot_allocator import SlotAllocator


@dataclass
class PagedAllocation:
    """A request's rows, as the prefix cache gave them (its reused prefix's, then its own) and on the cache's
    device (where a step's metadata is built from them)."""

    claim: PrefixClaim  # columns: pool row, then (with an indexer) indexer-key slot, of each position
    slots: torch.Tensor  # int64 [max_total_tokens] on the device: the pool row of each position
    index_slots: torch.Tensor | None = None  # int64 [max_total_tokens] on the device: its indexer-key slot


class PagedKVCache:
    def __init__(self, layout: RowLayout, num_slots: int, scale: float, device: str = "cpu",
                 sparse: SparseAttention | None = None, prefix_caching: bool = False) -> None:
        self.layout = layout
        self.scale = scale
        self.device = torch.device(device)
        self.kv = torch.zeros(layout.num_layers, num_slots, layout.row_width, dtype=layout.row_dtype,
                              device=device)
        self.allocator = SlotAllocator(num_slots)
        self.sparse = sparse
        self.index_cache = None if sparse is None else IndexerKeyCache(layout.num_layers, num_slots,
                                                                       sparse.index_key, device)
        self.selector = None if sparse is None else IndexSelector(self.index_cache, sparse.select_newest)
        self.prefix = PrefixCache([self.allocator] + ([] if sparse is None else [self.index_cache.allocator]),
                                  prefix_caching)

    @classmethod
    def from_budget(cls, layout: RowLayout, budget_bytes: int, scale: float, device: str = "cpu",
                    sparse: SparseAttention | None = None, prefix_caching: bool = False,
                    capacity_layout: RowLayout | None = None):
        """As many token slots as the budget buys; with an indexer each token also costs its index keys. A
        budget that buys none is refused here: a server started with it would refuse every request.
        capacity_layout: the rows that decide the count, when they are not `layout` (a tensor-parallel rank holds
        as many tokens as the largest share's rows fit in the budget)."""
        per_token = (capacity_layout or layout).baseline_bytes_per_token(None if sparse is None else sparse.index_key)
        if budget_bytes < per_token:
            raise ValueError(f"the device KV budget ({budget_bytes} bytes) buys no token slot: one token's K/V "
                             f"takes {per_token} bytes on the device; raise the device KV budget")
        num_slots = budget_bytes // per_token
        available = available_host_memory() if device == "cpu" else None  # on the CPU the pool is host memory
        if available is not None and num_slots * per_token > available:
            raise ValueError(f"the device KV budget ({budget_bytes / GIB:.1f} GiB) is more than this machine has "
                             f"available ({available / GIB:.1f} GiB); lower the device KV budget")
        return cls(layout, num_slots, scale, device, sparse, prefix_caching)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_slots

    def admit(self, request: BatchedRequest) -> int | None:
        """Give the request its rows; returns how many prompt tokens it reuses from the prefix cache, or None
        when its prompt + max_tokens do not fit now (cached prefixes nobody uses count as free)."""
        claim = self.prefix.claim(request.prompt_token_ids, request.max_total_tokens)
        if claim is None:
            return None
        slots = [torch.from_numpy(claim.column(i)).to(self.device) for i in range(claim.slots.shape[1])]
        request.kv = PagedAllocation(claim, slots[0], None if self.index_cache is None else slots[1])
        return claim.cached

    def share_prefill(self, request: BatchedRequest) -> None:
        """The prompt rows computed so far join the prefix cache, for the requests admitted after this step."""
        self.prefix.share(request.kv.claim, request.prompt_token_ids[:request.num_computed_tokens])

    def release(self, request: BatchedRequest) -> None:
        """Its computed rows stay in the prefix cache; the rest go back."""
        if request.kv is not None:
            self.prefix.release(request.kv.claim, reusable_tokens(request, self.sparse))
            request.kv = None

    def row_pools(self) -> list[tuple[str, torch.Tensor]]:
        """The pools a position's slots (the prefix claim's columns) index, named: its row, its indexer keys."""
        return [("kv", self.kv)] + ([] if self.index_cache is None else [("index_keys", self.index_cache.rows)])

    def bind(self, batch: ForwardBatch) -> PagedAttention:
        return PagedAttention(self, batch)

    def usage(self) -> dict[str, int]:
        return {"device_slots_total": self.allocator.num_slots, "device_slots_used": self.allocator.num_used,
                **self.prefix.usage()}


class PagedAttention:
    """The attention backend for one step over a PagedKVCache."""

    def __init__(self, cache: PagedKVCache, batch: ForwardBatch) -> None:
        self.cache = cache
        self.batch = batch
        self.write_rows = torch.cat([s.request.kv.slots[s.start:s.end] for s in batch.spans])
        self.decode = batch.decode_spans
        self.selection = None if cache.selector is None else StepSelection(cache.sparse, cache.selector)
        selects = cache.sparse is not None and cache.sparse.sparse_prefill
        self.prefill = [PromptChunk(slice(s.offset, s.offset + s.length), s.request.kv.slots[:s.end],
                                    None if s.request.kv.index_slots is None else s.request.kv.index_slots[:s.end],
                                    torch.arange(s.start, s.end, device=cache.device) if selects else None)
                        for s in batch.prefill_spans]
        if cache.index_cache is not None:
            self.index_write = torch.cat([s.request.kv.index_slots[s.start:s.end] for s in batch.spans])
        self.trace_steps = {}
        self.decode_only = bool(self.decode) and not self.prefill
        width = max((s.end for s in self.decode), default=0)
        self.reads_index_queries = self.selection is not None and reads_index_queries(cache.sparse, bool(self.prefill),
                                                                                      width)
        self.index_query_rows = None
        if self.decode:
            on_device = {"device": cache.device}
            self.decode_lengths = torch.tensor([s.end for s in self.decode], **on_device)
            self.decode_rows = torch.stack([  # -1: past a request's length
                F.pad(s.request.kv.slots[:s.end], (0, width - s.end), value=-1) for s in self.decode])
            self.decode_offsets = torch.tensor([s.offset for s in self.decode], **on_device)
            self.index_query_rows = index_query_rows(cache.sparse, bool(self.prefill), self.decode_offsets)
            if cache.index_cache is not None:
                self.decode_index_slots = torch.stack([
                    F.pad(s.request.kv.index_slots[:s.end], (0, width - s.end)) for s in self.decode])
            # Requests that record their top-k get one entry per decode step: the context length and,
            # filled layer by layer, the positions selected and those ranked next (hisparse.engine.topk_trace
            # reads these).
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
        write_rows(pool, self.write_rows, layout, k, v)
        if cache.index_cache is not None and index_k is not None:
            cache.index_cache.write(layer, self.index_write, index_k)
        sparse = cache.sparse
        if not self.prefill:  # a decode-only step: every token is a request's decode query, in order
            return self._decode(layer, pool, q, index_q, index_w)
        out = q.new_empty(q.shape[0], q.shape[1], layout.v_dim)
        attend_prompt_chunks(out, layer, q, index_q, index_w, self.prefill, pool, cache.scale, layout, sparse,
                             self.selection)
        if self.decode:
            at = self.decode_offsets
            if self.index_query_rows is None:  # else index_q and index_w hold the decode rows alone
                index_q, index_w = rows_of(index_q, at), rows_of(index_w, at)
            out[at] = self._decode(layer, pool, q[at], index_q, index_w)
        return out

    def bind_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor | None,
                    index_k: torch.Tensor | None, index_w: torch.Tensor | None,
                    out: torch.Tensor) -> Callable[[int], None] | None:
        """`attend` of this decode-only step as C calls bound once (`AttentionBackend.bind_decode`), where the rows
        and the indexer keys are in the CPU kernels' formats and no request records its top-k; else None."""
        cache, sparse, keys = self.cache, self.cache.sparse, self.cache.index_cache
        if not self.decode_only or self.trace_steps or not compiled_rows(cache.layout, cache.kv, q, k, v):
            return None
        if keys is not None and (index_k is None or not keys.compiled_write):
            return None
        layers = range(cache.layout.num_layers)
        # The layers whose decode reads the selection (`_decode`): a context longer than top_k, a sparse layer.
        selecting = [self.reads_index_queries and sparse.sparse_in(layer) for layer in layers]
        if any(selecting) and (index_q is None or not cache.selector.compiled_scores or not page_rows_cpu.available()
                               or any(sparse.shares_selection(layer) for layer in layers)):
            return None
        layout, rows = cache.layout, self.decode_rows
        write = bind_write_kv_rows(cache.kv, self.write_rows, k, v)
        write_keys = None if keys is None else bind_write_int8_keys(keys.rows, self.index_write, index_k)
        attend_all = bind_sparse_decode_attention(cache.kv, rows, q, cache.scale, layout.num_kv_heads, layout.head_dim,
                                                  out)
        if any(selecting):
            selected = torch.empty(rows.shape[0], min(sparse.top_k, rows.shape[1]), dtype=torch.int64)
            page = torch.empty_like(selected)
            select = bind_int8_top_k(keys.rows, keys.index_dim, self.decode_index_slots, index_q, index_w,
                                     self.decode_lengths, selected.shape[1], selected)
            look_up = bind_page_rows(rows, selected, page)
            attend_page = bind_sparse_decode_attention(cache.kv, page, q, cache.scale, layout.num_kv_heads,
                                                       layout.head_dim, out)

        def attend(layer: int) -> None:
            write(layer)
            if write_keys is not None:
                write_keys(layer)
            if selecting[layer]:
                select(layer)
                look_up()
                attend_page(layer)
            else:
                attend_all(layer)
        return attend

    def _decode(self, layer, pool, q, index_q, index_w):
        """The decode queries' attention: over every row of their requests, or over the rows the indexer selects."""
        cache, sparse = self.cache, self.cache.sparse
        rows = self.decode_rows
        if self.selection is not None:
            selects = sparse.sparse_in(layer)
            if selects or self.trace_steps:
                num_next = sparse.recorded_next_ranks if self.trace_steps else 0
                selected, following = self.selection.decode(layer, index_q, index_w, self.decode_index_slots,
                                                            self.decode_lengths, num_next)
                for b, step in self.trace_steps.items():  # a recording step waits for the device, per layer
                    step["layers"][layer] = selected[b].to(torch.int32).cpu().numpy()
                    step["next"][layer] = following[b].to(torch.int32).cpu().numpy()
                if selects and selected.shape[1] < rows.shape[1]:  # else every position is selected
                    rows = torch.where(selected >= 0, rows.gather(1, selected.clamp(min=0)), -1)
        return attend_rows(pool, rows, q, cache.scale, cache.layout)
