"""A linear layer's weight as inference multiplies by it: dense, or weight-only quantized (`--quantization`).

Three forms of the same numbers, each where it is fastest on a CPU:
- the plain dense tensor, used as `x @ w` with w [in, out] (in float32 stored [in, out] row-major; in bfloat16 a
  transposed view of an [out, in] row-major tensor, the layout oneDNN's bfloat16 kernels want), for long bfloat16
  prompt chunks and for inputs that record gradients; the nn.Linear parameters are views of it, so training and
  tests still see ordinary modules;
- the same weights prepacked once for oneDNN (`kernels.packed_matmul`), for everything else: decode batches and
  short chunks in bfloat16, every batch in float32; where AMX is missing, bfloat16 weights are packed for our own
  kernel instead (`kernels.bf16_matmul_cpu`), which serves every batch that records no gradient (it reads the
  weights twice as fast at small batches, and multiplies a little faster at large ones);
- quantized (`kernels.weight_only_matmul`), for batches below `DENSE_FROM_BATCH` / `VNNI_DENSE_FROM`, where
  reading 8 or 4 bits instead of 16 is what counts; from there on the kernel's in-register dequantization costs
  more than the bytes it saves (without AMX, the block kernel's int8 products outrun bfloat16 at any batch for the
  weights that round x once). The dense forms then hold the *dequantized* weights, so every path multiplies by
  the same numbers. Quantization trades memory for speed here: the dense forms stay.

"q8_0" keeps llama.cpp's blocks of 32 with one scale each and multiplies them with int8 dot products, x rounded per
block (`kernels.block_matmul_cpu`); where that kernel cannot run it is per-row "int8". The LM head takes it under
either quantization, and a model's linears under `--quantization int8` (`linear_kind`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from hisparse.kernels import bf16_matmul_cpu, block_matmul_cpu
from hisparse.kernels.bf16_matmul_cpu import bf16_matmul, bind_bf16_matmul, pack_bf16
from hisparse.kernels.c_library import autograd_records, cpu_flags
from hisparse.kernels.packed_matmul import pack_weight, packed_matmul, packing_available
from hisparse.kernels.weight_only_matmul import (
    Int4Weight,
    Int8Weight,
    Q8_0Weight,
    bind_weight_only_matmul,
    int4_fits,
    quantize,
    weight_only_matmul,
)

QUANTIZATIONS = ("none", "int8", "int4")
# The batch from which the packed bfloat16 weights beat each weight-only kernel, over the default model's whole
# stack of linears (2-core Xeon with AMX): PyTorch's int8 and int4 kernels by kind; the block kernel
# (`kernels.block_matmul_cpu`: int4 where AVX-512 VNNI is, and Q8_0) in VNNI_DENSE_FROM.
DENSE_FROM_BATCH = {"int8": 3, "int4": 10}
# The same for the block kernel, by whether the weight rounds x twice (`round_x_twice`: twice the products). With
# AMX, 32 for every weight: int4 engine decode steps at batch 12 / 16 / 24 / 32 took 21-22 / 24-26 / 32-35 / 39-41
# ms against 28 / 30 / 36 / 41-42 on the packed weights; the Q8_0 head alone, caches flushed, 0.94 / 1.21 / 1.86 /
# 2.46 / 3.28 ms at batch 1 / 8 / 16 / 24 / 32 against 2.31 / 2.46 / 2.49 / 2.98 / 3.47. Without AMX (AMD EPYC,
# bfloat16 in AVX512-BF16) bfloat16 multiplies at half the rate of the kernel's int8 dot products: a weight that
# rounds x once stays on the block kernel at every batch (one 1536-token prefill with the MLPs on it, medians of 3:
# int4 1.27 -> 1.08 s, int8 1.40 -> 1.25 s; 512 rows of x: int4 gate_up 3.35 against 4.42 ms, down 2.32 against
# 2.10), one that rounds it twice up to 128 (the int4 / Q8_0 stacks took 0.87 / 0.81x the packed weights' time
# at batch 32, 0.91 / 0.85x at 64 and 0.97 / 0.89x at 128).
AMX = {"amx_tile", "amx_bf16"} <= cpu_flags()
VNNI_DENSE_FROM = {False: 32, True: 32} if AMX else {False: math.inf, True: 128}
# A small weight (the indexer's projections, a third of a megabyte) pays the dense path's fixed cost per call more
# than its bytes: the int8 kernel stays faster up to batch 16 (engine step at batch 8: 33.6 against 35.6 ms).
SMALL_WEIGHT_DENSE_FROM = 17
# On oneDNN, larger bfloat16 batches (long prompt chunks) multiply by the plain tensor (`kernels.packed_matmul`);
# float32 ones stay packed, MKL's sgemm being the slower at every batch measured (a 1536-token prefill on an AMD
# EPYC: 2.92 against 3.48 s).
PACKED_UP_TO_BATCH = {torch.bfloat16: 320, torch.float32: None}
# Without AMX, bfloat16 weights are packed for `kernels.bf16_matmul_cpu` rather than for oneDNN, and it multiplies
# every batch: faster than both oneDNN forms at every batch measured (the default model's stack of linears, packed
# / ours: 8.7-10.1 / 4.0-5.9 ms at batch 1, 14.4 / 11.1 at 16, 129 / 122 at 256; plain / ours: 269 / 247 at 512,
# 576 / 490 at 1024). With AMX, oneDNN multiplies in tiles and its forms stay.
STREAMED_BF16 = not AMX


def linear_kind(quantization: str) -> str:
    """The weight kind a model's linears take for `--quantization`: int8 as Q8_0 blocks where the block kernel runs
    (per-row int8 elsewhere: `InferenceWeight` falls back), the others as named. The blocks' scales hold the weights
    closer than one scale a row, and the block kernel reads them at the memory's speed to batch 31 (PyTorch's per-row
    int8 kernel lost to the dense weights from batch 3): int8 batch-1 engine step 16.3-17.7 -> 11.6-13.4 ms, decode
    perplexity +0.10% against bfloat16 over six held-out texts (per row, x exact: -0.07%)."""
    return "q8_0" if quantization == "int8" else quantization


class InferenceWeight:
    """x @ W.T for a weight W [out, in] (the model's dtype).

    quantization: "none", "int8" (per output channel), "int4" (Q4_1's groups of 32; a shape the int4 kernel
    cannot pack falls back to int8) or "q8_0" (see above). Batches from `dense_from` on multiply by the dense
    weights, prepacked where it can be: bfloat16 for our kernel where AMX is missing (`streamed`, every batch), else
    bfloat16 or float32 for oneDNN on a CPU (`packed`; bfloat16 up to PACKED_UP_TO_BATCH)."""

    def __init__(self, weight: torch.Tensor, quantization: str = "none", dense_from: int | None = None,
                 round_x_twice: bool = False) -> None:
        """dense_from: the batch from which the dense weights serve, when not the quantization's own. round_x_twice:
        where the weight-only kernel rounds x to int8, it rounds the residual too (`kernels.block_matmul_cpu`)."""
        if quantization not in (*QUANTIZATIONS, "q8_0"):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        weight = weight.detach()
        self.round_x_twice = round_x_twice
        self.kind = quantization if quantization != "int4" or int4_fits(weight) else "int8"
        if self.kind == "q8_0" and not (weight.device.type == "cpu" and block_matmul_cpu.fits(*weight.shape)
                                        and block_matmul_cpu.available()):
            self.kind = "int8"  # PyTorch's int8 kernel instead, one scale per row
        self.quantized: Int8Weight | Int4Weight | Q8_0Weight | None = None
        if self.kind != "none":
            self.quantized = quantize(weight, self.kind)
            weight = self.quantized.dequantize().to(weight.dtype)
        if self.kind == "none":
            self.dense_from = 0
        else:
            own = VNNI_DENSE_FROM[round_x_twice] if self.quantized.rounds_x else DENSE_FROM_BATCH[self.kind]
            self.dense_from = dense_from or own
        self.t = weight.t() if weight.dtype == torch.bfloat16 else weight.t().contiguous()
        # The packed form: for our bfloat16 kernel, else for oneDNN's.
        self.streamed = (pack_bf16(weight) if STREAMED_BF16 and bf16_matmul_cpu.fits(weight)
                         and bf16_matmul_cpu.available() else None)
        self.packed = pack_weight(weight) if self.streamed is None and packing_available(weight) else None
        self.packed_up_to = PACKED_UP_TO_BATCH.get(weight.dtype)

    @classmethod
    def fused(cls, *linears: nn.Linear, quantization: str = "none", round_x_twice: bool = False) -> InferenceWeight:
        """The weights of `linears` concatenated on the output axis ([q; k; v], [gate; up]); each linear's
        weight becomes a view into the plain copy."""
        fused = cls(torch.cat([lin.weight.detach() for lin in linears]), quantization, round_x_twice=round_x_twice)
        start = 0
        for lin in linears:
            width = lin.weight.shape[0]
            lin.weight.data = fused.t[:, start:start + width].t()
            start += width
        return fused

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        if batch < self.dense_from:
            return weight_only_matmul(x, self.quantized, self.round_x_twice)
        if self._streams(x):
            return bf16_matmul(x, self.streamed, self.t.shape[1])
        if self.packed is not None and self._packed_takes(x):
            return packed_matmul(x, self.packed)
        return x @ self.t

    def _packed_takes(self, x: torch.Tensor) -> bool:
        """Whether oneDNN's packed form may multiply this x of at least `dense_from` rows: up to `packed_up_to` of
        them, recording no gradient (the packed matmul has no backward)."""
        return (self.packed_up_to is None or x.shape[0] <= self.packed_up_to) and not autograd_records(x)

    def _streams(self, x: torch.Tensor) -> bool:
        """Whether our bfloat16 kernel multiplies this x, at any batch: packed for it, x in bfloat16 recording no
        gradient, the kernel loaded (not under `c_library.eager()`, where the plain tensor serves)."""
        return (self.streamed is not None and x.dtype == torch.bfloat16 and not autograd_records(x)
                and bf16_matmul_cpu.available())

    def bind(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """`self(x)` into out as a call, for a caller that multiplies the same buffers every step (a decode step's,
        `models.llama_decode`): the block kernel and our bfloat16 kernel checked once; oneDNN's outputs copied into
        out."""
        if x.shape[0] < self.dense_from:
            return bind_weight_only_matmul(x, self.quantized, out, self.round_x_twice)
        if self._streams(x):
            return bind_bf16_matmul(x, self.streamed, out)
        return lambda: out.copy_(self(x))
