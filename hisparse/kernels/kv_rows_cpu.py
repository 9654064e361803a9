"""Writing a step's new K/V rows into a CPU pool in one compiled call (`kv_rows_cpu.c`).

Every layer of every step stores its new tokens' K and V: PyTorch's way is a cat of the two into rows and an
index_copy_, two ops and a temporary. Here each row's two halves are copied where they go, read from the slices
of the projection they lie in. Built on first use (`kernels.c_library`); where it cannot be (no gcc),
`available()` is False and the cache keeps PyTorch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary, LayerAddresses

_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"write_kv_rows": (INT, [POINTER, INT64, INT64, POINTER, INT64, POINTER, INT64, POINTER, INT64, INT64])},
    "the K/V rows are written by PyTorch's ops")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def takes(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `write_kv_rows` takes these as they lie: all on the CPU in the pool's dtype, the pool contiguous,
    each token's K heads and V heads contiguous."""
    return (pool.is_cpu and k.is_cpu and v.is_cpu and k.dtype == pool.dtype and v.dtype == pool.dtype
            and pool.is_contiguous() and k.dim() == 3 and v.shape == k.shape and k.stride(2) == 1
            and v.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2])


def write_kv_rows(pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """pool[slots[i]] <- K then V of token i, for pool [S, 2 * H * D] and k, v [N, H, D]; slots int64 [N], each
    in [0, S) (else ValueError, and nothing is written)."""
    bind_write_kv_rows(pool.unsqueeze(0), slots.contiguous(), k, v)(0)


def bind_write_kv_rows(pools: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> Callable[[int], None]:
    """`write_kv_rows` into layer l of pools [L, S, 2 * H * D] as a call checked once, `call(l)`, for a caller that
    writes the same rows of every layer (a decode step); slots contiguous. The call keeps the tensors it reads by
    address alive."""
    n, heads, dim = k.shape if k.dim() == 3 else (-1, -1, -1)
    if (pools.dim() != 3 or not takes(pools, k, v) or pools.shape[2] != 2 * heads * dim or slots.shape != (n,)
            or slots.dtype != torch.int64 or not slots.is_cpu or not slots.is_contiguous()):
        raise ValueError(f"write_kv_rows takes a contiguous pool [S, 2 H D], int64 slots [N] and K, V [N, H, D] of "
                         f"the pool's dtype with each token's heads contiguous, in CPU memory; got pool "
                         f"{tuple(pools.shape[1:])} {pools.dtype}, slots {tuple(slots.shape)}, K {tuple(k.shape)} "
                         f"{k.dtype}")
    size, layers = pools.element_size(), LayerAddresses(pools)
    function = _LIBRARY.load().write_kv_rows
    arguments = (pools.shape[1], pools.shape[2] * size, slots.data_ptr(), n, k.data_ptr(), k.stride(0) * size,
                 v.data_ptr(), v.stride(0) * size, heads * dim * size)

    def write(layer: int) -> None:
        if function(layers.address(layer), *arguments):
            raise ValueError(f"write_kv_rows: a slot is outside the pool's {pools.shape[1]} rows")
    write.tensors = (pools, slots, k, v)
    return write
