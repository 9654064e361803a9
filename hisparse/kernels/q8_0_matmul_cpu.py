"""Small-batch matmuls over Q8_0 weights with AVX-512 VNNI int8 dot products (llama.cpp's scheme).

Q8_0 is llama.cpp's 8-bit format: blocks of 32 inputs, one scale each; the default model's GGUF stores its
LM head (the tied embedding) so. A batch-1 decode step reads the head's 49152 x 576 weights once, and PyTorch's
int8 kernel (one scale per row) widens every byte to a float lane on the way. `q8_0_matmul_cpu.c` keeps the
weights as bytes: x is rounded to int8 per block (one scale per block) and one vpdpbusd multiplies 64 weights
by 64 inputs. In the engine's step the head took 1.44 ms against 1.96 for the int8 kernel; alone with the
caches flushed, 1.2 / 1.6 / 1.5 / 1.7 ms at batch 1 / 2 / 3 / 4 against 2.2-2.6 for the prepacked bfloat16
head. The cost is that rounding of the activations (the weights are the blocks themselves), which llama.cpp
pays too.

The C file is built on first use (`kernels.c_library`). Without gcc, on a CPU without AVX-512 VNNI, or with
HISPARSE_DISABLE_VNNI=1, `available()` is False and callers keep PyTorch's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary

SOURCE = Path(__file__).with_suffix(".c")
BLOCK = 32  # inputs per block
MAX_BATCH = 4  # the C file's: from batch 5 the dense bfloat16 head is faster (2.4 against 2.5 ms at 6)
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")


_LIBRARY = CLibrary(
    SOURCE,
    {"q8_0_matmul": (INT, [POINTER, INT64, INT64, POINTER, POINTER, POINTER, INT64, POINTER, INT])},
    "the LM head reads per-row int8", REQUIRED_FLAGS, "HISPARSE_DISABLE_VNNI")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


@dataclass(frozen=True)
class Q8_0Weight:
    """q int8 [N, K / 32, 32] and scales [N, K / 32] float32: weight = q * scale. offsets = -128 scale sum(q) per
    block, the kernel's correction for reading x as unsigned bytes."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:  # the C kernel reads these as raw memory
        n, blocks, width = self.q.shape
        if (self.q.dtype != torch.int8 or width != BLOCK or n % 4 or not self.q.is_contiguous()
                or any(t.dtype != torch.float32 or t.shape != (n, blocks) or not t.is_contiguous()
                       for t in (self.scales, self.offsets))):
            raise ValueError(f"a Q8_0 weight is contiguous int8 q [N, K / {BLOCK}, {BLOCK}] with N a multiple of 4 "
                             f"and float32 scales and offsets [N, K / {BLOCK}]")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The weights [N, K] float32 these blocks hold."""
        return (self.q.float() * self.scales[..., None]).view(self.shape)


def quantize_q8_0(weight: torch.Tensor) -> Q8_0Weight:
    """llama.cpp's Q8_0 quantizer: per block of 32 inputs the largest magnitude maps to 127. A float32 weight
    dequantized from a GGUF file's Q8_0 tensor comes back as its own blocks (a bfloat16 one near them: q * scale
    needs up to 18 bits)."""
    if not fits(weight):
        raise ValueError(f"a Q8_0 weight needs a multiple of 4 rows and of {BLOCK} columns, got {tuple(weight.shape)}")
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127
    q = torch.round(blocks / torch.where(scales > 0, scales, 1.0)[..., None]).clamp_(-127, 127).to(torch.int8)
    offsets = -128 * scales * q.sum(dim=-1, dtype=torch.int32).float()
    return Q8_0Weight(q.contiguous(), scales.contiguous(), offsets.contiguous())


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes a weight of this shape: whole blocks of inputs, rows in fours."""
    out, width = weight.shape
    return out % 4 == 0 and width % BLOCK == 0


def q8_0_matmul(x: torch.Tensor, weight: Q8_0Weight) -> torch.Tensor:
    """x [B, K] (float32 or bfloat16, B <= MAX_BATCH) @ weight.T -> [B, N] in x's dtype, x rounded per block. No
    rows (a step of prompt chunks that samples nothing) give no rows."""
    library = _LIBRARY.load()
    if library is None:
        raise RuntimeError("the Q8_0 kernel is not available on this machine (see q8_0_matmul_cpu.available)")
    n, k = weight.shape
    if (x.dim() != 2 or x.shape[1] != k or x.shape[0] > MAX_BATCH
            or x.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"x must be [0..{MAX_BATCH}, {k}] float32 or bfloat16, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    if library.q8_0_matmul(x.data_ptr(), x.shape[0], k, weight.q.data_ptr(), weight.scales.data_ptr(),
                           weight.offsets.data_ptr(), n, out.data_ptr(), x.dtype == torch.bfloat16):
        raise MemoryError("the Q8_0 kernel could not allocate its rounded copy of x")
    return out


def round_per_block(x: torch.Tensor) -> torch.Tensor:
    """x [B, K] as the VNNI kernels round it (`rounded_x.h`), float64: per block of 32, qx = x 127 / max |x| to the
    nearest (in float32, 127 / max |x| divided as C divides it), times max |x| / 127."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    q = torch.round(blocks * torch.where(top > 0, top.new_tensor(127.0) / top, 0.0))
    return (q.double() * (top / 127).double()).view(x.shape)


def q8_0_matmul_reference(x: torch.Tensor, weight: Q8_0Weight) -> torch.Tensor:
    """What the kernel computes, in plain PyTorch: x rounded per block (`round_per_block`), then the products in
    float64."""
    return (round_per_block(x) @ weight.dequantize().double().t()).to(x.dtype)
