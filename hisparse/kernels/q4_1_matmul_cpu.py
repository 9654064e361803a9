"""Small-batch matmuls over Q4_1 weights with AVX-512 VNNI int8 dot products (llama.cpp's Q4_1 x Q8_1 scheme).

An int4 decode step reads every weight once, so its time is the weights' bytes over the memory bandwidth.
PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) widens each 4-bit weight to a float lane and multiplies
in floats. `q4_1_matmul_cpu.c` keeps them as nibbles, as llama.cpp does: x is rounded to int8 per block of 32 (one
scale per block) and vpdpbusd multiplies 4 of its bytes by 4 weights of each of 16 rows; the blocks' scales and
zeros are the weight's own (`weight_only_matmul.Int4Weight`), so only the products see x's rounding. The default
model's 30 layers of int4 linears, weights cold in cache: 2.7 ms against PyTorch's 4.8 at batch 1 (24 GB/s, the
machine's read bandwidth), 4.9 against 13.2 at batch 8, and faster than the packed bfloat16 weights (12.3-15.7 ms)
up to batch 32 (`layers.linear.INT4_VNNI_DENSE_FROM`). Decode perplexity over six held-out texts (6 x 255
tokens, batch 1): +0.90% against bfloat16, +0.55% with PyTorch's kernel.

Layout (the C file draws it): rows in groups of 16, one per 32-bit lane of a vpdpbusd. `nibbles` uint8
[N / 16, K / 32, 256]: per group and block four 64-byte vectors, vector c holding inputs 4c .. 4c + 3 of the 16
rows in its low nibbles and inputs 16 + 4c .. 19 + 4c in its high ones; `scales` [N / 16, K / 32, 2, 16] the
16 rows' scales, then zeros, in x's dtype. `pack` writes both from an `Int4Weight`'s q and scales.

The C file is built on first use (`kernels.c_library`). Without gcc, on a CPU without AVX-512 VNNI, or with
HISPARSE_DISABLE_VNNI=1, `available()` is False and callers keep PyTorch's kernel.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary
from hisparse.kernels.q8_0_matmul_cpu import REQUIRED_FLAGS

SOURCE = Path(__file__).with_suffix(".c")
BLOCK = 32  # inputs per block
ROWS = 16  # rows a vector of dot products holds: N must be a multiple

_LIBRARY = CLibrary(
    SOURCE,
    {"q4_1_matmul": (INT, [POINTER, INT64, INT64, POINTER, POINTER, INT64, POINTER, INT])},
    "int4 weights multiply with PyTorch's int4 kernel", REQUIRED_FLAGS, "HISPARSE_DISABLE_VNNI")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def fits(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape: whole blocks of inputs, whole groups of rows."""
    return out_features % ROWS == 0 and in_features % BLOCK == 0


def pack(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8 [N, K] in [0, 15] and scales_and_zeros [K / 32, N, 2] (`Int4Weight`'s) -> the kernel's nibbles
    [N / 16, K / 32, 256] and scales [N / 16, K / 32, 2, 16] (see the module's layout)."""
    n, k = q.shape
    # [group, row i, block, half, c, j] -> low | high << 4 as [group, block, c, row i, j]
    halves = q.view(n // ROWS, ROWS, k // BLOCK, 2, 4, 4)
    nibbles = (halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
    scales = scales_and_zeros.view(k // BLOCK, n // ROWS, ROWS, 2).permute(1, 0, 3, 2)
    return nibbles.reshape(n // ROWS, k // BLOCK, 4 * ROWS * 4).contiguous(), scales.contiguous()


def q4_1_matmul(x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [B, K] (float32 or bfloat16) @ W.T -> [B, N] in x's dtype, x rounded per block; W is
    `nibbles` and `scales` (in x's dtype) as `pack` makes them."""
    library = _LIBRARY.load()
    if library is None:
        raise RuntimeError("the Q4_1 kernel is not available on this machine (see q4_1_matmul_cpu.available)")
    groups, blocks, _ = nibbles.shape
    n, k = groups * ROWS, blocks * BLOCK
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be [B, {k}] float32 or bfloat16, got {tuple(x.shape)} {x.dtype}")
    if (nibbles.shape[2] != 4 * ROWS * 4 or nibbles.dtype != torch.uint8 or not nibbles.is_contiguous()
            or scales.shape != (groups, blocks, 2, ROWS) or scales.dtype != x.dtype or not scales.is_contiguous()):
        raise ValueError(f"a Q4_1 weight is contiguous uint8 nibbles [N / {ROWS}, K / {BLOCK}, {4 * ROWS * 4}] and "
                         f"scales [N / {ROWS}, K / {BLOCK}, 2, {ROWS}] in x's dtype, as `pack` makes them")
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    if library.q4_1_matmul(x.data_ptr(), x.shape[0], k, nibbles.data_ptr(), scales.data_ptr(), n, out.data_ptr(),
                           x.dtype == torch.bfloat16):
        raise MemoryError("the Q4_1 kernel could not allocate its rounded copy of x")
    return out
