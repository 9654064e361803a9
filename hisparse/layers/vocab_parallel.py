"""An embedding split over tensor-parallel ranks by vocabulary rows (Megatron's split): each rank looks up the
tokens of its slice of the vocabulary (zeros for the others), and the all-reduced sum is every token's row."""

from __future__ import annotations

import torch
from torch import nn

from hisparse.distributed.tensor_parallel import TensorParallel


def embed_vocab_share(table: nn.Embedding, ids: torch.Tensor, start: int, tp: TensorParallel) -> torch.Tensor:
    """ids' rows, `table` holding rows [start, start + its rows) of the vocabulary on rank `tp.rank`."""
    if tp.size == 1:
        return table(ids)
    local = ids - start
    mine = (local >= 0) & (local < table.num_embeddings)
    return tp.all_reduce(table(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(table.weight.dtype))
