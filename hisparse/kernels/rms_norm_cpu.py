"""RMSNorm of bfloat16 rows, with the residual add before it, in one compiled call (`rms_norm_cpu.c`).

On a CPU decode step every small PyTorch op costs a few microseconds of dispatch whatever its size, and an
RMSNorm in bfloat16 is eight of them (~17 us for one row of 576 against ~5 us here); the default model runs 61
norms a token. The results are PyTorch's roundings in PyTorch's order: the residual sum rounded to bfloat16, the
row normalised in float32 and rounded, then weighted and rounded. Only the sum of squares is added up another
way (in float64 here, a float32 tree in PyTorch), so the norm's scale can differ in its last float32 bit and an
output now and then by one bfloat16 step.

Built on first use (`kernels.c_library`); where it cannot be (no gcc), `available()` is False and RMSNorm keeps
PyTorch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from hisparse.kernels.c_library import FLOAT, INT64, POINTER, CLibrary

_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"rms_norm": (None, [POINTER, POINTER, POINTER, POINTER, POINTER, INT64, INT64, FLOAT])},
    "RMSNorm keeps PyTorch's ops")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, weight * s / rms(s)) for bfloat16 rows x [..., D] in CPU memory and a bfloat16 weight [D], where
    s = x, or x + delta rounded to bfloat16 (delta shaped as x)."""
    x, weight = x.contiguous(), weight.contiguous()
    delta = None if delta is None else delta.contiguous()
    out = torch.empty_like(x)
    total = x if delta is None else torch.empty_like(x)
    bind_rms_norm(x, weight, eps, out, delta, total)()
    return total, out


def bind_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                  delta: torch.Tensor | None = None, total: torch.Tensor | None = None) -> Callable[[], None]:
    """`rms_norm` of these tensors as a call checked once, for a caller that runs it on the same buffers every step:
    out <- the norm of s; with delta, total <- s = x + delta (total may be x itself). All contiguous bfloat16 rows
    [..., D] (weight [D]) in CPU memory."""
    dim = weight.shape[0]
    rows = [x, out] + ([] if delta is None else [delta, total])
    if (x.shape[-1] != dim or weight.dtype != torch.bfloat16 or not weight.is_cpu or not weight.is_contiguous()
            or any(t is None or t.shape != x.shape or t.dtype != torch.bfloat16 or not t.is_cpu
                   or not t.is_contiguous() for t in rows)):
        raise ValueError(f"rms_norm takes contiguous bfloat16 rows [..., {dim}] (and a delta shaped alike, and its "
                         f"total) and a bfloat16 weight [{dim}], all in CPU memory")
    delta_at, total_at = (None, x.data_ptr()) if delta is None else (delta.data_ptr(), total.data_ptr())
    return partial(_LIBRARY.load().rms_norm, x.data_ptr(), delta_at, total_at, weight.data_ptr(), out.data_ptr(),
                   x.numel() // max(dim, 1), dim, eps)
