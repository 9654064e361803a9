"""Matrix multiplies whose weights are stored in 8 or 4 bits and widened inside the kernel.

A decode step at small batch reads every weight once and does little else with it, so on a CPU its time is
the weights' bytes over the memory bandwidth: 4-bit weights are read in a quarter of bfloat16's time. int8's
kernel, and int4's where AVX-512 VNNI is missing, are PyTorch's own CPU weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`, what torchao and gpt-fast run on a CPU); they dequantize in registers, so
their arithmetic grows with the batch while a dense matmul's does not, which is why a caller keeps the dense
weights for large batches (`layers.linear.InferenceWeight`).

- int8: one scale per output channel, w = q * scale, q in [-127, 127].
- q8_0: llama.cpp's blocks of 32 inputs, one scale each (the default model's LM head, as its GGUF stores it),
  multiplied by `kernels.block_matmul_cpu` (x rounded per block to int8); made only where that kernel runs.
- int4: groups of `INT4_GROUP` consecutive inputs, w = q * scale + min, q in [0, 15]: llama.cpp's Q4_1 block.
  A GGUF file's Q4_1 weights (the default model's) come back as the same q, scale and min, so int4 holds
  them as the file does. Where AVX-512 VNNI is, `kernels.block_matmul_cpu` multiplies them as llama.cpp does, x
  rounded per block to int8 (0.57x PyTorch's int4 kernel's time at batch 1, 0.37x at batch 8).

`weight_only_matmul_reference` is the plain-PyTorch reference (dequantize, then multiply).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hisparse.kernels import block_matmul_cpu
from hisparse.kernels.block_matmul_cpu import (
    BLOCK,
    bind_block_matmul,
    block_matmul,
    pack_q4_1,
    pack_q8_0,
    round_per_block,
    unpack_q8_0,
)

INT4_GROUP = BLOCK  # inputs per int4 group, Q4_1's block
INT4_ROWS = 16  # PyTorch's int4 packing, and the block kernel's, want a multiple of this many output rows


@dataclass(frozen=True)
class Int8Weight:
    """values int8 [out, in], scales [out] in the activations' dtype (the kernel's contract)."""

    values: torch.Tensor
    scales: torch.Tensor
    rounds_x = False  # PyTorch's kernel multiplies x as it is

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales.float()[:, None]


@dataclass(frozen=True)
class Int4Weight:
    """q uint8 [out, in] in [0, 15]; scales_and_zeros [in / group, out, 2] in the activations' dtype: per group a
    scale and a zero, w = (q - 8) * scale + zero (PyTorch's int4 contract; zero = min + 8 scale). `packed` is the
    weight in its kernel's layout: `block_matmul_cpu`'s nibbles, with `packed_scales` its scales, where that kernel
    runs; else PyTorch's int4pack, and no packed_scales."""

    q: torch.Tensor
    scales_and_zeros: torch.Tensor
    packed: torch.Tensor
    packed_scales: torch.Tensor | None = None

    @property
    def rounds_x(self) -> bool:
        """Whether its kernel rounds x to int8 per block: the block kernel's, not PyTorch's."""
        return self.packed_scales is not None

    def dequantize(self) -> torch.Tensor:
        out, width = self.q.shape
        scales, zeros = self.scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [out, groups] each
        grouped = (self.q.view(out, -1, INT4_GROUP).float() - 8) * scales[..., None] + zeros[..., None]
        return grouped.view(out, width)


@dataclass(frozen=True)
class Q8_0Weight:
    """llama.cpp's Q8_0, w = q * scale per block of 32 inputs, held in `block_matmul_cpu`'s layout: `packed` the
    bytes q + 128, `scales` float32 (`pack_q8_0`)."""

    packed: torch.Tensor
    scales: torch.Tensor
    rounds_x = True  # made only where the block kernel runs

    @property
    def shape(self) -> tuple[int, int]:
        groups, blocks, _ = self.packed.shape
        return groups * block_matmul_cpu.ROWS, blocks * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The weights [N, K] float32 these blocks hold."""
        n, k = self.shape
        q, scales = unpack_q8_0(self.packed, self.scales)
        return (q.view(n, -1, BLOCK).float() * scales[..., None]).view(n, k)


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """Symmetric per output channel: the largest magnitude of each row maps to 127."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    values = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(values, scales.to(dtype))


def int4_fits(weight: torch.Tensor) -> bool:
    out, width = weight.shape
    return out % INT4_ROWS == 0 and width % INT4_GROUP == 0


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """Asymmetric per group of INT4_GROUP inputs: each group's minimum maps to 0 and its maximum to 15, as
    llama.cpp's Q4_1 quantizer does (so its blocks come back unchanged)."""
    if not int4_fits(weight):
        raise ValueError(f"an int4 weight needs a multiple of {INT4_ROWS} rows and of {INT4_GROUP} columns, got "
                         f"{tuple(weight.shape)}")
    out, width = weight.shape
    grouped = weight.float().view(out, width // INT4_GROUP, INT4_GROUP)
    mins, maxs = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = (maxs - mins) / 15
    safe = torch.where(scales > 0, scales, 1.0)
    q = torch.round((grouped - mins[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8).view(out, width)
    scales_and_zeros = torch.stack([scales, mins + 8 * scales], dim=-1).transpose(0, 1).contiguous().to(dtype)
    if weight.device.type == "cpu" and block_matmul_cpu.available():
        return Int4Weight(q, scales_and_zeros, *pack_q4_1(q, scales_and_zeros))
    return Int4Weight(q, scales_and_zeros, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))


def quantize_q8_0(weight: torch.Tensor) -> Q8_0Weight:
    """llama.cpp's Q8_0 quantizer: per block of 32 inputs the largest magnitude maps to 127. A float32 weight
    dequantized from a GGUF file's Q8_0 tensor comes back as its own blocks (a bfloat16 one near them: q * scale
    needs up to 18 bits)."""
    if not block_matmul_cpu.fits(*weight.shape):
        raise ValueError(f"a Q8_0 weight needs a multiple of {block_matmul_cpu.ROWS} rows and of {BLOCK} columns, "
                         f"got {tuple(weight.shape)}")
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127
    q = torch.round(blocks / torch.where(scales > 0, scales, 1.0)[..., None]).clamp_(-127, 127).to(torch.int8)
    return Q8_0Weight(*pack_q8_0(q.view(n, k), scales))


def quantize(weight: torch.Tensor, kind: str) -> Int8Weight | Int4Weight | Q8_0Weight:
    """`weight` [out, in] as `kind` ("int8", "int4" or "q8_0") for activations of its dtype."""
    if kind == "q8_0":
        return quantize_q8_0(weight)
    return (quantize_int4 if kind == "int4" else quantize_int8)(weight, weight.dtype)


def block_form(weight: Int8Weight | Int4Weight | Q8_0Weight) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """(packed, scales, format) as `block_matmul` takes them, for a weight the block kernel multiplies; else None
    (PyTorch's int8 and int4 kernels)."""
    if isinstance(weight, Q8_0Weight):
        return weight.packed, weight.scales, "q8_0"
    if isinstance(weight, Int4Weight) and weight.rounds_x:
        return weight.packed, weight.packed_scales, "q4_1"
    return None


def weight_only_matmul(x: torch.Tensor, weight: Int8Weight | Int4Weight | Q8_0Weight,
                       round_x_twice: bool = False) -> torch.Tensor:
    """x [N, in] @ weight.T -> [N, out] in x's dtype (float32 or bfloat16, as the weight was quantized for).
    round_x_twice: where the kernel rounds x, the rounding's residual rounded and multiplied too (`block_matmul`)."""
    block = block_form(weight)
    if block is not None:
        return block_matmul(x, *block, round_x_twice)
    if isinstance(weight, Int8Weight):
        return torch.ops.aten._weight_int8pack_mm(x, weight.values, weight.scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight.packed, INT4_GROUP, weight.scales_and_zeros)


def bind_weight_only_matmul(x: torch.Tensor, weight: Int8Weight | Int4Weight | Q8_0Weight, out: torch.Tensor,
                            round_x_twice: bool = False) -> Callable[[], None]:
    """`weight_only_matmul` of x into out as a call, for a caller that multiplies the same buffers every step: the
    block kernel's checked once and writing into out; PyTorch's kernels allocate their own output, copied."""
    block = block_form(weight)
    if block is not None:
        return bind_block_matmul(x, *block, out, round_x_twice)
    return lambda: out.copy_(weight_only_matmul(x, weight, round_x_twice))


def weight_only_matmul_reference(x: torch.Tensor, weight: Int8Weight | Int4Weight | Q8_0Weight,
                                 round_x_twice: bool = False) -> torch.Tensor:
    """`weight_only_matmul` in plain PyTorch: the weight dequantized, then one float64 matmul, x rounded per block
    first where the weight's kernel rounds it (Q8_0, and int4 on the block kernel)."""
    xs = round_per_block(x, round_x_twice) if weight.rounds_x else x.double()
    return (xs @ weight.dequantize().double().t()).to(x.dtype)
