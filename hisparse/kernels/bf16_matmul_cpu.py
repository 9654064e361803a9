"""bfloat16 matmuls where AMX is missing: AVX512-BF16 dot products over a layout of the weight that streams
(`bf16_matmul_cpu.c`).

A decode step reads every weight once, so at small batches its time is the weights' bytes over the memory bandwidth.
On an AMD EPYC without AMX, oneDNN's packed bfloat16 kernels read them at about half the bandwidth this machine has
(the default model's 30 layers of linears, weights cold in cache: 8.7-10.1 ms at batch 1 against 4.0-5.9 here,
about 45 GB/s), and from batch 8 on, where arithmetic counts, they stay slower (batch 16: 14.4 against 11.1 ms,
64: 39.7 against 33.7, 256: 129 against 122). Here each group of 16 rows of W is one stream of 64-byte vectors, a
pair of inputs of all 16 rows each, multiplied by a broadcast pair of x with vdpbf16ps: one product instruction per
vector and row of x, in float32 accumulators that stay in registers over the whole row. Every output sums its pairs
in order in one accumulator, so a row of x gets the same bits at any batch size.

Layout (`pack_bf16`): [(N + 15) / 16, K / 2, 16, 2] bfloat16, group, pair of inputs, row within the group, the pair;
the last group padded with zero rows. Built on first use (`kernels.c_library`); without gcc, on a CPU without
AVX512-BF16, or with HISPARSE_DISABLE_BF16_MATMUL=1, `available()` is False and callers keep oneDNN's kernels.
The reference is the plain matmul (its float32 sums run in another order).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary

ROWS = 16  # rows of W a vector of products holds
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
# Weights from which the rows run on the OpenMP team: an indexer key's 64 x 576 alone is done before a thread wakes.
PARALLEL_MIN_WEIGHTS = 1 << 17

_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"bf16_matmul": (INT, [POINTER, INT64, INT64, POINTER, INT64, POINTER, INT])},
    "bfloat16 weights multiply with oneDNN's kernels", REQUIRED_FLAGS, "HISPARSE_DISABLE_BF16_MATMUL")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def fits(weight: torch.Tensor) -> bool:
    """Whether `pack_bf16` takes this weight: bfloat16 [N, K] in CPU memory with K even."""
    return weight.dtype == torch.bfloat16 and weight.is_cpu and weight.dim() == 2 and weight.shape[1] % 2 == 0


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (`fits`) -> the kernel's layout [(N + 15) / 16, K / 2, 16, 2], zero rows padding the last group."""
    n, k = weight.shape
    groups = -(-n // ROWS)
    padded = torch.zeros(groups * ROWS, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(groups, ROWS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [B, K] bfloat16 @ W.T -> [B, N] bfloat16, W [N, K] as `pack_bf16` packed it."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    bind_bf16_matmul(x, packed, out)()
    return out


def bind_bf16_matmul(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """`bf16_matmul` into out [B, N] as a call checked once, for a caller that multiplies the same buffers every step;
    x [B, K] and out contiguous bfloat16 in CPU memory."""
    library = _LIBRARY.load()
    if library is None:
        raise RuntimeError("the bfloat16 matmul kernel is not available here (see bf16_matmul_cpu.available)")
    groups, pairs = packed.shape[:2]
    k = 2 * pairs
    if packed.shape[2:] != (ROWS, 2) or packed.dtype != torch.bfloat16 or not packed.is_contiguous():
        raise ValueError(f"a packed weight is contiguous bfloat16 [N / {ROWS}, K / 2, {ROWS}, 2], as pack_bf16 makes "
                         f"it; got {tuple(packed.shape)} {packed.dtype}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16 or not x.is_contiguous() or not x.is_cpu:
        raise ValueError(f"x must be contiguous bfloat16 [B, {k}] in CPU memory, got {tuple(x.shape)} {x.dtype}")
    n = out.shape[-1]
    if (out.shape != (x.shape[0], n) or -(-n // ROWS) != groups or out.dtype != torch.bfloat16
            or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous bfloat16 [{x.shape[0]}, N] with N in ({(groups - 1) * ROWS}, "
                         f"{groups * ROWS}], got {tuple(out.shape)} {out.dtype}")
    return partial(library.bf16_matmul, x.data_ptr(), x.shape[0], k, packed.data_ptr(), n, out.data_ptr(),
                   n * k >= PARALLEL_MIN_WEIGHTS)
