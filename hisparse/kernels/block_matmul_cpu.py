"""Small-batch matmuls over llama.cpp's block-quantized weights (Q4_1, Q8_0) with AVX-512 VNNI int8 dot products.

A decode step reads every weight once, so its time is the weights' bytes over the memory bandwidth. PyTorch's CPU
weight-only kernels widen each weight to a float lane and multiply in floats. `block_matmul_cpu.c` keeps them as
nibbles or bytes, as llama.cpp does: x is rounded to int8 per block of 32 (one scale per block, `round_per_block`)
and vpdpbusd multiplies 4 of its bytes by 4 weights of each of 16 rows; the blocks' scales (and Q4_1's zeros) are
the weight's own, so only the products see x's rounding. Batches of any size go 8 rows of x at a time. Where that
rounding costs too much, what it left is rounded and multiplied too (`round_x_twice`: x to within a 32000th of its
block's largest, for twice the products; the weights are read once either way).

- Q4_1 (`--quantization int4`, `weight_only_matmul.Int4Weight`): the default model's 30 layers of int4 linears,
  weights cold in cache: 2.7 ms against PyTorch's int4 kernel's 4.8 at batch 1 (24 GB/s, the machine's read
  bandwidth), 4.9 against 13.2 at batch 8, and faster than the packed bfloat16 weights (12.3-15.7 ms) up to batch
  32 with AMX, at every batch without it (`layers.linear.VNNI_DENSE_FROM`). Decode perplexity over six held-out
  texts (6 x 255 tokens, batch 1) against bfloat16: +0.90% with x rounded once, +0.16% with the attention's
  projections rounding it twice (the engine's choice, `models.llama`), +0.55% on PyTorch's int4 kernel.
- Q8_0 (the LM head as the GGUF stores it, `weight_only_matmul.Q8_0Weight`): the 49152 x 576 head, caches flushed,
  0.94 ms at batch 1 (the kernel before, with llama.cpp's row-major blocks: 1.2) and 1.21 at batch 8, against 2.3-2.5
  for the packed bfloat16 head.

Layout (the C file draws it): rows in groups of 16, one per 32-bit lane. Q8_0: bytes q + 128 [N / 16, K / 32,
512], per group and block eight 64-byte vectors, vector v holding inputs 4v .. 4v + 3 of the 16 rows (row i at
bytes 4i .. 4i + 3); scales float32 [N / 16, K / 32, 16]. Q4_1: vectors v and v + 4 as the low and high nibbles of
one, [N / 16, K / 32, 256]; scales and zeros [N / 16, K / 32, 2, 16] in x's dtype. `pack_q4_1` and `pack_q8_0`
write them.

The C file is built on first use (`kernels.c_library`). Without gcc, on a CPU without AVX-512 VNNI, or with
HISPARSE_DISABLE_VNNI=1, `available()` is False and callers keep PyTorch's kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary

SOURCE = Path(__file__).with_suffix(".c")
BLOCK = 32  # inputs per block
ROWS = 16  # rows a vector of dot products holds: N must be a multiple
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
FORMATS = {"q4_1": 0, "q8_0": 1}  # the C file's

_LIBRARY = CLibrary(
    SOURCE,
    {"block_matmul": (INT, [POINTER, INT64, INT64, POINTER, POINTER, INT64, POINTER, INT, INT, INT])},
    "block-quantized weights multiply with PyTorch's kernels", REQUIRED_FLAGS, "HISPARSE_DISABLE_VNNI")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def fits(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape: whole blocks of inputs, whole groups of rows."""
    return out_features % ROWS == 0 and in_features % BLOCK == 0


def _vectors(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] -> [N / 16, K / 32, 8, 16, 4]: per group and block, vector v's row i holds inputs 4v .. 4v + 3."""
    n, k = q.shape
    return q.view(n // ROWS, ROWS, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)


def pack_q4_1(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8 [N, K] in [0, 15] and scales_and_zeros [K / 32, N, 2] (`Int4Weight`'s) -> the kernel's nibbles
    [N / 16, K / 32, 256] and scales [N / 16, K / 32, 2, 16]."""
    n, k = q.shape
    vectors = _vectors(q)
    nibbles = vectors[:, :, :4] | (vectors[:, :, 4:] << 4)
    scales = scales_and_zeros.view(k // BLOCK, n // ROWS, ROWS, 2).permute(1, 0, 3, 2)
    return nibbles.reshape(n // ROWS, k // BLOCK, 4 * ROWS * 4).contiguous(), scales.contiguous()


def pack_q8_0(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int8 [N, K] and scales float32 [N, K / 32] -> the kernel's bytes q + 128 [N / 16, K / 32, 512] and scales
    [N / 16, K / 32, 16]."""
    n, k = q.shape
    shifted = (q.to(torch.int16) + 128).to(torch.uint8)
    packed = _vectors(shifted).reshape(n // ROWS, k // BLOCK, 8 * ROWS * 4).contiguous()
    return packed, scales.view(n // ROWS, ROWS, k // BLOCK).transpose(1, 2).contiguous()


def unpack_q8_0(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_q8_0` undone: q int8 [N, K], scales [N, K / 32]."""
    groups, blocks, _ = packed.shape
    n, k = groups * ROWS, blocks * BLOCK
    q = packed.view(groups, blocks, 8, ROWS, 4).permute(0, 3, 1, 2, 4).reshape(n, k)
    return (q.to(torch.int16) - 128).to(torch.int8), scales.transpose(1, 2).reshape(n, blocks)


def block_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, format: str,
                 round_x_twice: bool = False) -> torch.Tensor:
    """x [B, K] (float32 or bfloat16) @ W.T -> [B, N] in x's dtype, x rounded per block (`round_per_block`); W is
    `packed` and `scales` as `pack_q4_1` (scales in x's dtype) or `pack_q8_0` (float32) made them, `format` "q4_1" or
    "q8_0". round_x_twice: what the rounding left of x is rounded and multiplied too, for twice the products."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], packed.shape[0] * ROWS, dtype=x.dtype)
    call = bind_block_matmul(x, packed, scales, format, out, round_x_twice)
    if x.shape[0]:
        call()
    return out


def bind_block_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, format: str, out: torch.Tensor,
                      round_x_twice: bool = False) -> Callable[[], None]:
    """`block_matmul` into out [B, N] as a call checked once, for a caller that multiplies the same buffers every
    step; x [B, K] and out contiguous, in x's dtype."""
    library = _LIBRARY.load()
    if library is None:
        raise RuntimeError("the block matmul kernel is not available on this machine (see block_matmul_cpu.available)")
    groups, blocks, width = packed.shape
    n, k = groups * ROWS, blocks * BLOCK
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"x must be [B, {k}] float32 or bfloat16, contiguous, got {tuple(x.shape)} {x.dtype}")
    if out.shape != (x.shape[0], n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [{x.shape[0]}, {n}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    q4_1 = format == "q4_1"
    want = ((groups, blocks, 2, ROWS), x.dtype, 4 * ROWS * 4) if q4_1 else ((groups, blocks, ROWS), torch.float32,
                                                                           8 * ROWS * 4)
    if (format not in FORMATS or width != want[2] or packed.dtype != torch.uint8 or not packed.is_contiguous()
            or scales.shape != want[0] or scales.dtype != want[1] or not scales.is_contiguous()):
        raise ValueError(f"a {format} weight is contiguous uint8 [N / {ROWS}, K / {BLOCK}, {want[2]}] with scales "
                         f"{list(want[0])} {want[1]}, as its pack function makes them")
    arguments = (x.data_ptr(), x.shape[0], k, packed.data_ptr(), scales.data_ptr(), n, out.data_ptr(),
                 x.dtype == torch.bfloat16, FORMATS[format], round_x_twice)
    function = library.block_matmul

    def call() -> None:
        if function(*arguments):
            raise MemoryError("the block matmul kernel could not allocate its rounded copy of x")
    return call


def round_per_block(x: torch.Tensor, twice: bool = False) -> torch.Tensor:
    """x [B, K] as the kernel rounds it, float64: per block of 32, qx = x 127 / max |x| to the nearest (in float32,
    127 / max |x| divided as C divides it), times max |x| / 127; twice: plus what that left, rounded the same way."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    q = torch.round(blocks * torch.where(top > 0, top.new_tensor(127.0) / top, 0.0))
    rounded = (q.double() * (top / 127).double()).view(x.shape)
    if twice:
        rounded = rounded + round_per_block((blocks - q * (top / 127)).view(x.shape))
    return rounded
