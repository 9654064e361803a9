"""Half-split RoPE of a batch's heads in one compiled call (`rotary_cpu.c`).

`HalfSplitRotation` is x * cos + swap(x) * sin: a roll, two products and a sum, four PyTorch ops of a few
microseconds each at one token, in every layer. Here one loop does them, each product and the sum rounded to the
rows' dtype as PyTorch's ops round them: the same bits. Built on first use (`kernels.c_library`); where it cannot
be (no gcc), `available()` is False and the rotation keeps PyTorch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary

_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"rotate_half_split": (None, [POINTER, INT64, INT64, INT64, INT64, POINTER, POINTER, INT64, POINTER, INT])},
    "RoPE keeps PyTorch's ops")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)
_DTYPES = (torch.bfloat16, torch.float32)
_FLOAT32, _BFLOAT16, _WIDENED = 0, 1, 2  # the C file's kinds


def takes(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rotate_half_split` reads heads x [N, H, D] as they lie: on the CPU, in cos's dtype (bfloat16 or
    float32), each token's heads contiguous (a slice of a wider row is fine)."""
    return x.dtype == cos.dtype and x.dtype in _DTYPES and _heads_contiguous(x)


def _heads_contiguous(x: torch.Tensor) -> bool:
    """x [N, H, D] on the CPU with each token's heads contiguous (a slice of a wider row is fine)."""
    return x.is_cpu and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """x * cos + swap(x) * sin [N, H, D] (contiguous), swap exchanging the first 2 * half dims' halves; cos, sin
    [N, 1, D] in x's dtype."""
    if not takes(x, cos):
        raise ValueError(f"rotate_half_split takes heads [N, H, D] with each token's heads contiguous, in CPU memory "
                         f"in cos's dtype (bfloat16 or float32); got {tuple(x.shape)} {x.dtype}, cos {cos.dtype}")
    return RotationTables(cos.contiguous(), sin.contiguous(), half).rotate(x)


class RotationTables:
    """One batch's cos and sin, checked once: a model applies them in every layer, and in a decode step each layer's
    checks of them cost more than the rotation (a batch-1 step, ad-hoc, checks of x alone against all per call:
    0.957x the time). Then `rotate` takes heads x for which `takes(x, cos)` holds."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, half: int) -> None:
        n, _, dim = cos.shape if cos.dim() == 3 else (-1, -1, -1)
        if (cos.shape != (n, 1, dim) or sin.shape != cos.shape or sin.dtype != cos.dtype or cos.dtype not in _DTYPES
                or not (cos.is_cpu and sin.is_cpu and cos.is_contiguous() and sin.is_contiguous())
                or not 0 <= 2 * half <= dim):
            raise ValueError(f"rotation tables are contiguous cos, sin [N, 1, D] of one dtype (bfloat16 or float32) "
                             f"rotating at most D dims, in CPU memory; got cos {tuple(cos.shape)} {cos.dtype}, sin "
                             f"{tuple(sin.shape)} {sin.dtype}, half {half}")
        self.cos, self.sin, self.half = cos, sin, half  # kept alive: the C call reads them
        self.tokens, self.dim, self.dtype = n, dim, cos.dtype
        self._pointers = (cos.data_ptr(), sin.data_ptr())

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """The rotated heads [N, H, D] (contiguous) of x [N, H, D], `takes(x, cos)` true of it."""
        out = torch.empty(x.shape, dtype=self.dtype)
        call = self.bind_rotate(x, out)
        if x.shape[0]:
            call()
        return out

    def bind_rotate(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """`rotate` into out [N, H, D] (contiguous, the tables' dtype) as a call checked once, for a caller that
        rotates the same buffers every step (the tables' contents may change between calls, not their tensors). x
        may also be bfloat16 heads over float32 tables: widened as they are read, as `x.float()` would (the indexer's
        queries, straight from a projection's rows)."""
        n, heads, dim = x.shape
        widened = x.dtype == torch.bfloat16 and self.dtype == torch.float32 and _heads_contiguous(x)
        if n != self.tokens or dim != self.dim or not (takes(x, self.cos) or widened):
            raise ValueError(f"heads {tuple(x.shape)} {x.dtype} do not fit rotation tables of {self.tokens} tokens x "
                             f"{self.dim} {self.dtype} (each token's heads contiguous, in CPU memory)")
        if out.shape != x.shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"out must be contiguous {tuple(x.shape)} {self.dtype}, got {tuple(out.shape)} "
                             f"{out.dtype}")
        kind = _WIDENED if widened else _BFLOAT16 if self.dtype == torch.bfloat16 else _FLOAT32
        return partial(_LIBRARY.load().rotate_half_split, x.data_ptr(), x.stride(0), n, heads, dim, *self._pointers,
                       self.half, out.data_ptr(), kind)
