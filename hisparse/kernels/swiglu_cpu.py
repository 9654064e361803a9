"""SwiGLU of bfloat16 rows, silu(gate) * up, in one compiled pass (`swiglu_cpu.c`).

PyTorch's silu and product read and write the MLP's widest activations twice (a 512-token prompt chunk's
1536 x 512 values per layer), and at a decode step each is a few microseconds of dispatch. Here one loop does
both, rounding as PyTorch does: silu in float32 rounded to bfloat16, then the product in float32 rounded. Its
exponential (a polynomial to 1.2e-7) is not PyTorch's (Sleef's), so a silu a hair from a bfloat16 rounding
boundary may round the other way: now and then an output one bfloat16 step apart.

Built on first use (`kernels.c_library`); where it cannot be (no gcc), `available()` is False and the MLP keeps
PyTorch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary

PARALLEL_MIN_VALUES = 16384  # outputs from which rows run on the OpenMP team (a decode step's few rows: one thread)

_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"swiglu": (None, [POINTER, INT64, INT64, POINTER, INT])},
    "SwiGLU keeps PyTorch's ops")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def takes(gate_up: torch.Tensor) -> bool:
    """Whether `swiglu` reads these rows: bfloat16 [N, 2 x n] in CPU memory, each row contiguous."""
    return (gate_up.dtype == torch.bfloat16 and gate_up.is_cpu and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0
            and gate_up.stride(1) == 1 and gate_up.stride(0) == gate_up.shape[1])


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [N, n] bfloat16 for rows gate_up = [gate | up] [N, 2 x n] (`takes`)."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[-1] // 2, dtype=torch.bfloat16)
    call = bind_swiglu(gate_up, out)
    if gate_up.shape[0]:
        call()
    return out


def bind_swiglu(gate_up: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """`swiglu` into out [N, n] (contiguous bfloat16) as a call checked once, for a caller that runs it on the same
    buffers every step."""
    if not takes(gate_up):
        raise ValueError(f"swiglu takes contiguous bfloat16 rows [N, 2 x n] in CPU memory; got "
                         f"{tuple(gate_up.shape)} {gate_up.dtype} on {gate_up.device}")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    if out.shape != (rows, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bfloat16 [{rows}, {n}], got {tuple(out.shape)} {out.dtype}")
    return partial(_LIBRARY.load().swiglu, gate_up.data_ptr(), rows, n, out.data_ptr(), rows * n >= PARALLEL_MIN_VALUES)
