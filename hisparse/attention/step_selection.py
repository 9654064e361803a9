"""One step's top-k choices, layer by layer, for both backends.

A layer with an indexer of its own selects; a layer that shares (GLM's "shared" layers) reuses what the
last selecting layer chose in this step, for the decode queries and for each prompt chunk alike. Under
HiSparse a sharing layer still swaps in for itself: every layer has its own hot buffer.
"""

from __future__ import annotations

import torch

from hisparse.attention.index_selection import IndexSelector
from hisparse.formats.sparse_attention import SparseAttention


def rows_of(tensor: torch.Tensor | None, index) -> torch.Tensor | None:
    """tensor[index], or None for a layer without an indexer of its own."""
    return None if tensor is None else tensor[index]


def reads_index_queries(sparse: SparseAttention, selecting_prefill: bool, decode_width: int) -> bool:
    """Whether a step's attention scores positions with the indexer (`AttentionBackend.reads_index_queries`):
    prompt chunks that select, or a decode context of more than top_k positions (`StepSelection.decode` takes
    every position of a shorter one unscored)."""
    return (selecting_prefill and sparse.sparse_prefill) or decode_width > sparse.top_k


def index_query_rows(sparse: SparseAttention | None, prefill: bool,
                     decode_offsets: torch.Tensor) -> torch.Tensor | None:
    """The rows whose indexer queries a step with decodes reads (`AttentionBackend.index_query_rows`): where its
    prompt chunks attend densely beside them, the decode rows alone (a 512-token chunk's queries would take 260 of
    the projection's 324 columns for nothing); else every row (None), as without sparse attention."""
    return decode_offsets if prefill and sparse is not None and not sparse.sparse_prefill else None


class StepSelection:
    def __init__(self, sparse: SparseAttention, selector: IndexSelector) -> None:
        self.sparse = sparse
        self.selector = selector
        self._decode: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._all: torch.Tensor | None = None  # every position of every decode request (see `_everything`)
        self._chunks: dict[int, torch.Tensor] = {}

    def _shared(self, layer: int, chosen):
        if chosen is None:
            raise ValueError(f"layer {layer} shares the top-k of a previous layer, but none selected in this step")
        return chosen

    def decode(self, layer: int, index_q: torch.Tensor | None, index_w: torch.Tensor | None, slots: torch.Tensor,
               lengths: torch.Tensor, num_next: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(selected [B, K] ascending, -1 padded; the `num_next` runners-up [B, M] or None) of the decode
        queries."""
        if self.sparse.shares_selection(layer):
            return self._shared(layer, self._decode)
        if slots.shape[1] <= self.sparse.top_k:  # no context is longer than top_k: every position is selected
            return self._everything(lengths, slots.shape[1], num_next)
        args = (layer, index_q, index_w, slots, lengths, self.sparse.top_k)
        if num_next:
            self._decode = self.selector.select_with_next(*args, num_next)
        else:
            self._decode = self.selector.select(*args), None
        return self._decode

    def _everything(self, lengths: torch.Tensor, width: int, num_next: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What `decode` selects when no request has more than top_k positions, without scoring them: each
        request's positions in order, -1 padded, and no runners-up. Built once per step."""
        if self._all is None:
            positions = torch.arange(width, device=lengths.device)
            self._all = torch.where(positions < lengths[:, None], positions, -1)
        following = torch.full((lengths.shape[0], num_next), -1, device=lengths.device) if num_next else None
        self._decode = self._all, following
        return self._decode

    def chunk(self, layer: int, chunk: int, index_q: torch.Tensor | None, index_w: torch.Tensor | None,
              slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Selected positions [T, K] of the queries of prompt chunk number `chunk` of the step."""
        if self.sparse.shares_selection(layer):
            return self._shared(layer, self._chunks.get(chunk))
        self._chunks[chunk] = self.selector.select_chunk(layer, index_q, index_w, slots, positions,
                                                         self.sparse.top_k)
        return self._chunks[chunk]
