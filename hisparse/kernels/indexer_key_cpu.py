"""The indexer's key from its projection, LayerNorm then RoPE, in one compiled call (`indexer_key_cpu.c`).

Every layer of every step derives its new tokens' indexer keys; in PyTorch that is a slice, a cast, a LayerNorm
and a rotation of two products, a roll and a sum, ~37 us a layer at one token against ~4 us here. The rotation is
PyTorch's arithmetic (each product rounded, then the sum); the LayerNorm's mean and variance are summed in
float64, so a key can differ from `nn.LayerNorm`'s in the last float32 bits. Inference derives every key, of
prompts and of decode tokens alike, here (`LlamaIndexer.key_from_projection`), so the stored keys never depend on
which step computed them.

Built on first use (`kernels.c_library`); where it cannot be (no gcc), `available()` is False and the indexer
keeps PyTorch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from hisparse.kernels.c_library import FLOAT, INT, INT64, POINTER, CLibrary

_ROW_DTYPES = (torch.bfloat16, torch.float32)
MAX_DIM = 4096  # the C loop keeps a key's values on the stack
_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"indexer_key": (None, [POINTER, INT64, INT64, INT, POINTER, POINTER, FLOAT, POINTER, POINTER, INT64, POINTER,
                            INT64, INT64]),
     "indexer_weights": (None, [POINTER, INT64, INT64, INT, FLOAT, FLOAT, POINTER, INT64, INT64])},
    "the indexer keeps PyTorch's ops")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def indexer_key(projected: torch.Tensor, start: int, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """rope(LayerNorm(projected[:, start:start + D])) [N, D] float32.

    projected [N, W] bfloat16 or float32 rows; weight, bias [D] float32 (the LayerNorm's); cos, sin [N, 1, D]
    float32, a `HalfSplitRotation`'s factors over its 2 * half rotated dims. All in CPU memory."""
    projected, weight, bias, cos, sin = (t.contiguous() for t in (projected, weight, bias, cos, sin))
    out = torch.empty(projected.shape[0] if projected.dim() else 0, weight.shape[0])
    bind_indexer_key(projected, start, weight, bias, eps, cos, sin, half, out)()
    return out


def bind_indexer_key(projected: torch.Tensor, start: int, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, half: int, out: torch.Tensor) -> Callable[[], None]:
    """`indexer_key` into out [N, D] float32 as a call checked once, for a caller that runs it on the same buffers
    every step; every tensor contiguous."""
    dim, float32 = weight.shape[0], torch.float32
    n, width = projected.shape if projected.dim() == 2 else (-1, -1)
    tensors = (projected, weight, bias, cos, sin, out)
    if (width < 0 or not 0 < dim <= MAX_DIM or projected.dtype not in _ROW_DTYPES or start < 0 or start + dim > width
            or bias.shape != weight.shape or cos.shape != (n, 1, dim) or sin.shape != cos.shape
            or not 0 <= 2 * half <= dim or out.shape != (n, dim)
            or any(t.dtype != float32 for t in (weight, bias, cos, sin, out))
            or not all(t.is_cpu and t.is_contiguous() for t in tensors)):
        raise ValueError(f"indexer_key takes rows [N, >= {start + dim}] (bfloat16 or float32), a float32 LayerNorm "
                         f"of {dim} (1 to {MAX_DIM}) and float32 cos, sin [N, 1, {dim}] over at most {dim} rotated "
                         f"dims, writing float32 [N, {dim}], all contiguous in CPU memory")
    return partial(_LIBRARY.load().indexer_key, projected.data_ptr(), width, start, projected.dtype == torch.bfloat16,
                   weight.data_ptr(), bias.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), half, out.data_ptr(), n,
                   dim)


def bind_indexer_weights(projected: torch.Tensor, start: int, scales: tuple[float, float],
                         out: torch.Tensor) -> Callable[[], None]:
    """out [N, H] float32 <- (projected[:, start:start + H] * scales[0]) * scales[1], each product rounded to float32
    as `LightningIndexer.finish_weights` rounds them, as a call checked once for a caller that runs it on the same
    buffers every step; projected [N, W] bfloat16 or float32, both contiguous in CPU memory."""
    n, width = projected.shape if projected.dim() == 2 else (-1, -1)
    heads = out.shape[1] if out.dim() == 2 else -1
    if (width < 0 or projected.dtype not in _ROW_DTYPES or out.shape != (n, heads) or out.dtype != torch.float32
            or start < 0 or start + heads > width
            or not all(t.is_cpu and t.is_contiguous() for t in (projected, out))):
        raise ValueError(f"indexer_weights takes rows [N, >= start + H] (bfloat16 or float32) and writes float32 "
                         f"[N, H], both contiguous in CPU memory; got {tuple(projected.shape)} {projected.dtype}, out "
                         f"{tuple(out.shape)} {out.dtype}, start {start}")
    return partial(_LIBRARY.load().indexer_weights, projected.data_ptr(), width, start,
                   projected.dtype == torch.bfloat16, scales[0], scales[1], out.data_ptr(), n, heads)
