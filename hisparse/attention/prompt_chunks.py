"""The prompt chunks of a step, as both backends attend to them: what every layer reads of a chunk is built once
per step, and each layer attends the same way (causal, or each query over its own top-k)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse.attention.functional import aligned_key_count, attend_prompt, causal_mask
from hisparse.attention.step_selection import StepSelection, rows_of
from hisparse.formats.kv_layout import KVLayout, RowLayout
from hisparse.formats.sparse_attention import SparseAttention
from hisparse.kernels import prompt_attention_cpu
from hisparse.kernels.c_library import autograd_records


@dataclass
class PromptChunk:
    """One request's prompt tokens in a step."""

    tokens: slice  # its tokens in the flat batch
    pool_rows: torch.Tensor  # [S]: the rows of its positions 0..S-1 in the pool prefill reads
    index_slots: torch.Tensor | None  # [S]: their indexer-key slots, on the key cache's device
    positions: torch.Tensor | None  # [T]: the chunk's positions, on the key cache's device
    # Its causal mask and the rows it reads (pool_rows padded to `aligned_key_count` with the first row, which the
    # mask hides), built by the first layer that attends causally with a mask, kept for the rest. An aligned square
    # chunk, or a long unaligned one, has neither: SDPA's own causal path serves it.
    mask: torch.Tensor | None = None
    causal_rows: torch.Tensor | None = None


# A square chunk (a prompt's first) of unaligned length up to this many tokens is padded and masked too; a longer
# one keeps SDPA's own causal path, which skips the blocks above the diagonal (1500 tokens: 6.1 ms against 8.7 ms
# padded and masked; 7-300 tokens: 0.6-0.9x the time padded; 509: 0.68x; 500: 1.06x).
MAX_PADDED_SQUARE = 512


def attend_prompt_chunks(out: torch.Tensor, layer: int, q: torch.Tensor, index_q: torch.Tensor | None,
                         index_w: torch.Tensor | None, chunks: list[PromptChunk], pool: torch.Tensor, scale: float,
                         layout: RowLayout, sparse: SparseAttention | None, selection: StepSelection | None) -> None:
    """Each chunk's attention output into its rows of `out`: over the pool rows of its context, each query over
    its own top-k where the model selects in prefill (DSA), else causal."""
    selects = sparse is not None and sparse.sparse_prefill_in(layer)
    for number, chunk in enumerate(chunks):
        chosen = None
        if selects:
            chosen = selection.chunk(layer, number, rows_of(index_q, chunk.tokens), rows_of(index_w, chunk.tokens),
                                     chunk.index_slots, chunk.positions)
        queries = q[chunk.tokens]
        if chosen is not None:
            out[chunk.tokens] = attend_prompt(pool, chunk.pool_rows, queries, scale, layout, chosen)
            continue
        if (isinstance(layout, KVLayout) and prompt_attention_cpu.takes(queries, pool, layout.num_kv_heads)
                and not autograd_records(queries) and prompt_attention_cpu.available()):
            # AMX tiles, straight from the pool rows, no mask: the kernel knows which keys each query sees
            out[chunk.tokens] = prompt_attention_cpu.prompt_attention(queries, pool, chunk.pool_rows,
                                                                      layout.num_kv_heads, scale)
            continue
        context = chunk.pool_rows.shape[0]
        keys = aligned_key_count(context)
        if chunk.causal_rows is None and (queries.shape[0] < context
                                          or keys > context and context <= MAX_PADDED_SQUARE):
            chunk.mask = causal_mask(queries.shape[0], context, queries.dtype, queries.device, width=keys)
            chunk.causal_rows = (chunk.pool_rows if keys == context
                                 else torch.cat([chunk.pool_rows, chunk.pool_rows[:1].expand(keys - context)]))
        rows = chunk.pool_rows if chunk.causal_rows is None else chunk.causal_rows
        out[chunk.tokens] = attend_prompt(pool, rows, queries, scale, layout, None, chunk.mask)
