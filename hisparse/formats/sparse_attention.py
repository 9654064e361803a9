"""How a model's attention uses its lightning indexers: what the model declares, and what a step runs with."""

from __future__ import annotations

from dataclasses import dataclass

from hisparse.formats.index_key import IndexKeyFormat

# Runners-up a recorded decode step keeps per top_k position: score_lru reads 2 per spare slot, which is
# 4 x top_k at a buffer of 3 x top_k, the largest the miss-rate benchmark replays.
TRACE_NEXT_PER_TOP_K = 4


@dataclass(frozen=True)
class IndexerSpec:
    """What a model says of its indexers, read from its files before any weight loads.

    - top_k: the model's own (DSA's index_topk, which wins over the engine's); None takes the engine's;
    - dense_layers: layers the indexers' authors left dense at decode (the engine may override);
    - shared_layers: layers with no indexer that reuse the previous layer's top-k (GLM's "shared");
    - sparse_prefill: prompt tokens attend to their own top-k too (DSA); else prefill is dense and causal
      (the retrofit default model, whose indexers were fitted to decode);
    - select_newest: the newest token is always selected (see `attention.index_selection`).
    """

    key_format: IndexKeyFormat
    top_k: int | None = None
    dense_layers: tuple[int, ...] = ()
    shared_layers: tuple[int, ...] = ()
    sparse_prefill: bool = False
    select_newest: bool = True


@dataclass
class SparseAttention:
    """What a step runs with: top_k positions per query, except in `dense_layers` or when off."""

    index_key: IndexKeyFormat
    enabled: bool = True
    top_k: int = 256
    dense_layers: tuple[int, ...] = ()
    shared_layers: tuple[int, ...] = ()
    sparse_prefill: bool = False
    select_newest: bool = True
    trace_next_ranks: int | None = None  # runners-up a recorded step keeps; None: TRACE_NEXT_PER_TOP_K x top_k

    @classmethod
    def from_spec(cls, spec: IndexerSpec, enabled: bool = True, top_k: int = 256,
                  dense_layers: tuple[int, ...] | None = None) -> SparseAttention:
        """How a step runs the model's indexers: the model's own top_k wins over `top_k`; `dense_layers` None
        keeps the indexers' own choice."""
        dense = spec.dense_layers if dense_layers is None else tuple(dense_layers)
        return cls(spec.key_format, enabled, top_k if spec.top_k is None else spec.top_k, dense, spec.shared_layers,
                   spec.sparse_prefill, spec.select_newest)

    def selecting_layer(self, layer: int) -> int:
        """The layer whose top-k `layer` attends with: itself, or for a shared layer the last one before it that
        selects (-1: none)."""
        while layer >= 0 and self.shares_selection(layer):
            layer -= 1
        return layer

    @property
    def recorded_next_ranks(self) -> int:
        return TRACE_NEXT_PER_TOP_K * self.top_k if self.trace_next_ranks is None else self.trace_next_ranks

    @property
    def decode_matches_prefill(self) -> bool:
        """A decoded token's cached row is the one a prompt of the same tokens would leave: decode attends as
        prefill does (dense decode, or DSA's sparse prefill). Else (the retrofit model: dense prefill, sparse
        decode) prefix reuse shares prompt rows only, so that reuse never changes what a prompt computes."""
        return not self.enabled or self.sparse_prefill

    def sparse_in(self, layer: int) -> bool:
        return self.enabled and layer not in self.dense_layers

    def sparse_prefill_in(self, layer: int) -> bool:
        return self.sparse_prefill and self.sparse_in(layer)

    def shares_selection(self, layer: int) -> bool:
        """The layer has no indexer of its own: it reuses the previous layer's top-k."""
        return layer in self.shared_layers
