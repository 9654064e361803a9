"""The simplest backend: one sequence, its K/V appended to growing tensors, dense causal attention.

Used by tests and by training, where no engine is present.
"""

from __future__ import annotations

import torch

from hisparse.attention.functional import causal_attention


class SingleSequenceCache:
    reads_index_queries = False  # dense attention: an indexer's keys are all it needs, and it stores none
    index_query_rows = None
    decode_only = False  # its queries attend causally among themselves

    def __init__(self, num_layers: int, scale: float) -> None:
        self.scale = scale
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer, q, k, v, index_q=None, index_k=None, index_w=None):
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k])
            v = torch.cat([self.v[layer], v])
        self.k[layer], self.v[layer] = k, v
        return causal_attention(q, k, v, self.scale)
