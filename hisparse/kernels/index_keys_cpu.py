"""Writing int8 indexer keys into their cache rows in one compiled call per layer (`index_keys_cpu.c`).

Every layer of a decode step quantizes its new tokens' indexer keys (one fp32 scale per key, the largest
magnitude mapping to 127) and copies the rows into the key cache. In PyTorch that is a dozen small ops and a
scatter, each a few microseconds of dispatch at one token; here one loop does it in place. The reference is
`IndexKeyFormat.pack` followed by `index_copy_` (`memory.indexer_cache.IndexerKeyCache.write`): the same
bytes. Built on first use (`kernels.c_library`); where it cannot be (no gcc), `available()` is False and the
cache writes with PyTorch's ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from hisparse.kernels.c_library import CLibrary


def _declare(library: ctypes.PyDLL) -> None:
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    library.write_int8_keys.restype = ctypes.c_int
    library.write_int8_keys.argtypes = [pointer, count, pointer, pointer, count, count]


_LIBRARY = CLibrary(Path(__file__).with_suffix(".c"), _declare, "the indexer keys are written by PyTorch's ops")


def available() -> bool:
    """Whether the compiled kernel is loaded (compiling it on first use)."""
    return _LIBRARY.load() is not None


def write_int8_keys(rows: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """rows uint8 [S, head_dim + 4] (head_dim int8 values, then the fp32 scale); slots int64 [N]; keys float
    [N, head_dim]; all in CPU memory. Row slots[i] <- key i, quantized; a slot outside the rows writes nothing
    and raises ValueError."""
    n, head_dim = keys.shape
    if (rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != head_dim + 4 or not rows.is_contiguous()
            or not (rows.is_cpu and keys.is_cpu and slots.is_cpu)):
        raise ValueError(f"rows must be contiguous uint8 [S, {head_dim + 4}] in CPU memory, got {tuple(rows.shape)} "
                         f"{rows.dtype}")
    if slots.shape != (n,) or slots.dtype != torch.int64:
        raise ValueError(f"slots must be {n} int64 rows in [0, {rows.shape[0]})")
    keys, slots = keys.float().contiguous(), slots.contiguous()
    if _LIBRARY.load().write_int8_keys(rows.data_ptr(), rows.shape[0], slots.data_ptr(), keys.data_ptr(), n,
                                       head_dim):
        raise ValueError(f"slots must be {n} int64 rows in [0, {rows.shape[0]})")
