"""Writing int8 indexer keys into their cache rows, on the CPU with numba: one call per layer.

Every layer of a decode step quantizes its new tokens' indexer keys (one fp32 scale per key, the largest
magnitude mapping to 127) and copies the rows into the key cache. In PyTorch that is a dozen small ops and a
scatter, each a few microseconds of dispatch at one token; here one loop does it in place. The reference is
`IndexKeyFormat.pack` followed by `index_copy_` (`memory.indexer_cache.IndexerKeyCache.write`): the same
bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit


def write_int8_keys(rows: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """rows uint8 [S, head_dim + 4] (head_dim int8 values, then the fp32 scale); slots int64 [N]; keys float32
    [N, head_dim]. Row slots[i] <- key i, quantized. The compiled loop checks the slots first (every layer of a
    step writes the same ones: at one token numpy's min and max of them cost more than the write)."""
    n, head_dim = keys.shape
    if rows.dtype != torch.uint8 or rows.shape[1] != head_dim + 4 or not rows.is_contiguous():
        raise ValueError(f"rows must be contiguous uint8 [S, {head_dim + 4}], got {tuple(rows.shape)} {rows.dtype}")
    index = slots.numpy()
    if index.shape != (n,) or not _write(rows.numpy(), index, keys.float().contiguous().numpy()):
        raise ValueError(f"slots must be {n} rows in [0, {rows.shape[0]})")


@njit(cache=True)
def _write(rows, slots, keys):
    """False, writing nothing, when a slot is out of range."""
    for i in range(slots.shape[0]):
        if slots[i] < 0 or slots[i] >= rows.shape[0]:
            return False
    head_dim = keys.shape[1]
    scale_bytes = np.empty(1, np.float32)
    for i in range(keys.shape[0]):
        top = np.float32(0.0)
        for d in range(head_dim):
            top = max(top, abs(keys[i, d]))
        scale = max(top, np.float32(1e-12)) / np.float32(127.0)
        row = rows[slots[i]]
        for d in range(head_dim):
            row[d] = np.uint8(np.int8(np.rint(keys[i, d] / scale)) & 0xFF)
        scale_bytes[0] = scale
        row[head_dim:head_dim + 4] = scale_bytes.view(np.uint8)
    return True
