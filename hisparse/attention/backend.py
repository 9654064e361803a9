"""The contract between a model's attention layers and the KV cache.

A model computes q, k and v and hands them to an `AttentionBackend`; the backend alone knows where the
cache lives (a paged device pool, a host pool behind hot buffers), how a token's row is stored (the
cache's `RowLayout`) and which past tokens a query may see (all of them, or the top-k its indexer picked).
That keeps the model code free of the memory hierarchy, and lets the engine swap dense, sparse and
offloaded attention without touching the model. Every architecture uses the same contract: a Llama layer
passes its K and V heads; an MLA layer passes its absorbed query and its latent row as the single K head
(V is the latent's first kv_lora_rank dims, so it passes none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class AttentionBackend(Protocol):
    # Whether this step's attention reads the indexer's queries and head weights (a selecting prompt chunk, or a
    # decode context longer than top_k). When False a model passes index_k alone (later steps read the keys)
    # and skips the rest of its indexer.
    reads_index_queries: bool
    # The rows whose indexer queries and head weights it reads, when it reads any: None for every row, or (a step
    # of dense prompt chunks and decodes) the decode rows alone; index_q and index_w then hold these rows only.
    index_query_rows: torch.Tensor | None
    # Whether every token of this step is one request's decode query, in the order of the step's requests (no
    # prompt chunk): a model may then run a decode-only path (`models.llama_decode`).
    decode_only: bool

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               index_q: torch.Tensor | None = None, index_k: torch.Tensor | None = None,
               index_w: torch.Tensor | None = None) -> torch.Tensor:
        """q: [N, Hq, Dk]; k: [N, Hkv, Dk], v: [N, Hkv, Dv] (or None where the layout derives it from k) for
        the N new tokens of the batch, already rotated.

        index_*: the layer's lightning-indexer query [N, H_I, d_I], key [N, d_I] and per-head weights
        [N, H_I] for the same tokens, when the layer has an indexer of its own. Returns [N, Hq, Dv].
        """
        ...

    def bind_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, index_q: torch.Tensor | None,
                    index_k: torch.Tensor | None, index_w: torch.Tensor | None,
                    out: torch.Tensor) -> Callable[[int], None] | None:
        """For a decode-only step run on buffers the model keeps (`models.llama_decode`): `attend` of every layer
        as one call, `call(layer)`, reading these tensors as they will be then and writing out [N, Hq, Dv], its
        kernels checked and bound once for the step; None where the backend has no such call for this step (the
        model then calls `attend`). A decode step at batch 1 spent more time in `attend`'s checks, allocations and
        dispatch than in its kernels."""
        ...
