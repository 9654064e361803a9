"""Reading token rows out of a pool: the one way every cache does it."""

from __future__ import annotations

import torch


def gather_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pool[index] for a [rows, W] pool and an index of any shape. Always through index_select: torch's
    advanced indexing on a large CPU pool costs milliseconds however few rows it reads."""
    return pool.index_select(0, index.reshape(-1)).view(*index.shape, pool.shape[1])
