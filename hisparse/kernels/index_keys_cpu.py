"""Writing int8 indexer keys into their cache rows in one compiled call per layer (`index_keys_cpu.c`).

Every layer of a decode step quantizes its new tokens' indexer keys (one fp32 scale per key, the largest
magnitude mapping to 127) and copies the rows into the key cache. In PyTorch that is a dozen small ops and a
scatter, each a few microseconds of dispatch at one token; here one loop does it in place. The reference is
`IndexKeyFormat.pack` followed by `index_copy_` (`memory.indexer_cache.IndexerKeyCache.write`): the same
bytes. Built on first use (`kernels.c_library`); where it cannot be (no gcc), `available()` is False and the
cache writes with PyTorch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary, LayerAddresses

_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"write_int8_keys": (INT, [POINTER, INT64, POINTER, POINTER, INT64, INT64])},
    "the indexer keys are written by PyTorch's ops")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def write_int8_keys(rows: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """rows uint8 [S, head_dim + 4] (head_dim int8 values, then the fp32 scale); slots int64 [N]; keys float
    [N, head_dim]; all in CPU memory. Row slots[i] <- key i, quantized; a slot outside the rows writes nothing
    and raises ValueError."""
    bind_write_int8_keys(rows.unsqueeze(0), slots.contiguous(), keys.float().contiguous())(0)


def bind_write_int8_keys(rows: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> Callable[[int], None]:
    """`write_int8_keys` into layer l of rows [L, S, head_dim + 4] as a call checked once, `call(l)`, for a caller
    that writes the same keys (float32, contiguous) of every layer; it keeps the tensors it reads alive."""
    n, head_dim = keys.shape
    if (rows.dtype != torch.uint8 or rows.dim() != 3 or rows.shape[2] != head_dim + 4 or not rows.is_contiguous()
            or not (rows.is_cpu and keys.is_cpu and slots.is_cpu)):
        raise ValueError(f"rows must be contiguous uint8 [S, {head_dim + 4}] in CPU memory, got "
                         f"{tuple(rows.shape[1:])} {rows.dtype}")
    if slots.shape != (n,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"slots must be {n} int64 rows in [0, {rows.shape[1]})")
    if keys.dtype != torch.float32 or not keys.is_contiguous():
        raise ValueError("the keys must be contiguous float32")
    layers, function = LayerAddresses(rows), _LIBRARY.load().write_int8_keys
    arguments = (rows.shape[1], slots.data_ptr(), keys.data_ptr(), n, head_dim)

    def write(layer: int) -> None:
        if function(layers.address(layer), *arguments):
            raise ValueError(f"slots must be {n} int64 rows in [0, {rows.shape[1]})")
    write.tensors = (rows, slots, keys)
    return write
