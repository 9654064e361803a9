"""The Q4_1 kernel computes x rounded per block to int8 times the int4 weights, in its 16-row layout, at any batch."""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels import q4_1_matmul_cpu
from hisparse.kernels.q4_1_matmul_cpu import pack, q4_1_matmul
from hisparse.kernels.q8_0_matmul_cpu import round_per_block
from hisparse.kernels.weight_only_matmul import quantize_int4, weight_only_matmul, weight_only_matmul_reference

needs_kernel = pytest.mark.skipif(not q4_1_matmul_cpu.available(), reason="no gcc or no AVX-512 VNNI here")


def exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it, times the dequantized weight, in float64."""
    return round_per_block(x) @ weight.double().t()


@needs_kernel
@pytest.mark.parametrize("batch", [1, 3, 8, 9, 20])  # one pass, a partial pass, passes of 8 and a remainder
@pytest.mark.parametrize("width", [96, 576])  # an odd count of blocks, and the model's
def test_matches_the_reference(batch, width):
    gen = torch.Generator().manual_seed(batch * width)
    weight = quantize_int4(torch.randn(48, width, generator=gen) * 0.05, torch.float32)
    assert weight.rounds_x
    x = torch.randn(batch, width, generator=gen) * 3
    x[0, :32] = 0  # a block of zeros: no scale, zero products
    got = q4_1_matmul(x, weight.packed, weight.packed_scales)
    torch.testing.assert_close(got.double(), exact(x, weight.dequantize()), rtol=1e-5, atol=1e-5)
    bf16 = quantize_int4(torch.randn(48, width, generator=gen) * 0.05, torch.bfloat16)
    got = q4_1_matmul(x.bfloat16(), bf16.packed, bf16.packed_scales)  # rounded once to bfloat16 at the end
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact(x.bfloat16(), bf16.dequantize()).float(), rtol=1e-2, atol=1e-2)


@needs_kernel
def test_each_row_reads_its_own_weights():
    """Row r of the weight one-hot at input r % width: the product picks each x element out, so a layout that
    mixed rows, blocks or halves up would put them in the wrong columns."""
    rows, width = 64, 64
    q = torch.zeros(rows, width, dtype=torch.uint8)
    q[torch.arange(rows), torch.arange(rows) % width] = 1
    # w = (q - 8) scale + zero with scale 1, zero 8: w = q
    scales_and_zeros = torch.tensor([1.0, 8.0]).expand(width // 32, rows, 2).contiguous()
    nibbles, scales = pack(q, scales_and_zeros)
    # exact in int8: block g holds (96 .. 127) (g + 1), so its scale is g + 1 and its qx 96 .. 127
    x = ((torch.arange(width) % 32 + 96) * (torch.arange(width) // 32 + 1)).float()[None]
    got = q4_1_matmul(x, nibbles, scales)
    torch.testing.assert_close(got[0], x[0, torch.arange(rows) % width], rtol=1e-6, atol=1e-5)


@needs_kernel
def test_within_a_percent_of_the_exact_product():
    """The only rounding is x's, to int8 per block: a percent of the product's size at most on random inputs."""
    gen = torch.Generator().manual_seed(3)
    weight = quantize_int4(torch.randn(256, 576, generator=gen) * 0.05, torch.float32)
    x = torch.randn(2, 576, generator=gen)
    got = weight_only_matmul(x, weight)
    want = x @ weight.dequantize().t()
    assert ((got - want).norm() / want.norm()).item() < 0.01
    torch.testing.assert_close(got, weight_only_matmul_reference(x, weight), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_nan_input_gives_nan_outputs_as_a_dense_product_would():
    weight = quantize_int4(torch.randn(16, 64), torch.float32)
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")
    out = q4_1_matmul(x, weight.packed, weight.packed_scales)
    assert out[1].isnan().all() and not out[0].isnan().any()
    assert q4_1_matmul(x[:0], weight.packed, weight.packed_scales).shape == (0, 16)


@needs_kernel
def test_refusals():
    weight = quantize_int4(torch.randn(16, 64), torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[B, 64\]"):
        q4_1_matmul(torch.randn(1, 32), weight.packed, weight.packed_scales)
    with pytest.raises(ValueError, match="in x's dtype"):
        q4_1_matmul(torch.randn(1, 64).bfloat16(), weight.packed, weight.packed_scales)


def test_without_the_kernel_int4_keeps_pytorchs(monkeypatch):
    monkeypatch.setattr(q4_1_matmul_cpu, "available", lambda: False)
    weight = quantize_int4(torch.randn(32, 64) * 0.05, torch.float32)
    assert not weight.rounds_x and weight.packed_scales is None
    x = torch.randn(3, 64)
    torch.testing.assert_close(weight_only_matmul(x, weight), x @ weight.dequantize().t(), rtol=1e-4, atol=1e-4)
