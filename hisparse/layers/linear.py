"""A linear layer's weight as inference multiplies by it: dense, or weight-only quantized (`--quantization`).

Dense weights are used as `x @ w` with w [in, out]. In float32 w is stored transposed, [in, out] row-major: on a
CPU, decode is bound by reading weights, and BLAS runs that layout up to twice as fast as `F.linear`'s `x @ W.T`
at batch 8-32. In bfloat16 w is a transposed view of an [out, in] row-major tensor, the layout oneDNN's
bfloat16 kernels want. The nn.Linear parameters become views of the same memory, so the model holds one copy.

Quantized (`kernels.weight_only_matmul`): the weight-only kernel serves batches below `DENSE_FROM_BATCH`, where
reading 8 or 4 bits instead of 16 is what counts; from there on its in-register dequantization costs more than
the bytes it saves, and a dense copy of the *dequantized* weights serves, so both paths multiply by the same
numbers. Quantization trades memory for speed here: the dense copy stays.
"""

from __future__ import annotations

import torch
from torch import nn

from hisparse.kernels.weight_only_matmul import (
    Int4Weight,
    Int8Weight,
    int4_fits,
    quantize_int4,
    quantize_int8,
    weight_only_matmul,
)

QUANTIZATIONS = ("none", "int8", "int4")
# The batch from which the dense bfloat16 weights beat each kernel, over the default model's whole stack of
# linears (2-core Xeon with AMX): the int8 kernel's time grows ~2.5x from batch 1 to 8, int4's ~3x.
DENSE_FROM_BATCH = {"int8": 5, "int4": 12}


class InferenceWeight:
    """x @ W.T for a weight W [out, in] (the model's dtype).

    quantization: "none", "int8" (per output channel) or "int4" (Q4_1's groups of 32; a shape the int4 kernel
    cannot pack falls back to int8)."""

    def __init__(self, weight: torch.Tensor, quantization: str = "none") -> None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        weight = weight.detach()
        self.kind = quantization if quantization != "int4" or int4_fits(weight) else "int8"
        self.quantized: Int8Weight | Int4Weight | None = None
        if self.kind != "none":
            self.quantized = (quantize_int4 if self.kind == "int4" else quantize_int8)(weight, weight.dtype)
            weight = self.quantized.dequantize().to(weight.dtype)
        self.dense_from = DENSE_FROM_BATCH.get(self.kind, 0)
        self.t = weight.t() if weight.dtype == torch.bfloat16 else weight.t().contiguous()

    @classmethod
    def fused(cls, *linears: nn.Linear, quantization: str = "none") -> InferenceWeight:
        """The weights of `linears` concatenated on the output axis ([q; k; v], [gate; up]); each linear's
        weight becomes a view into it, so the model holds one copy."""
        fused = cls(torch.cat([lin.weight.detach() for lin in linears]), quantization)
        start = 0
        for lin in linears:
            width = lin.weight.shape[0]
            lin.weight.data = fused.t[:, start:start + width].t()
            start += width
        return fused

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and x.shape[0] < self.dense_from:
            return weight_only_matmul(x, self.quantized)
        return x @ self.t
