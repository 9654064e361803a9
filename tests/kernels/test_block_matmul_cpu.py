"""The block kernel computes x rounded per block to int8 times Q4_1 or Q8_0 weights, in its 16-row layout, at any
batch; the formats' blocks survive quantizing, and the linears pick the kernel where it runs."""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels import block_matmul_cpu
from hisparse.kernels.block_matmul_cpu import bind_block_matmul, block_matmul, pack_q4_1, pack_q8_0, round_per_block
from hisparse.kernels.weight_only_matmul import (
    quantize_int4,
    quantize_q8_0,
    weight_only_matmul,
    weight_only_matmul_reference,
)
from hisparse.layers.linear import VNNI_DENSE_FROM, InferenceWeight

needs_kernel = pytest.mark.skipif(not block_matmul_cpu.available(), reason="no gcc or no AVX-512 VNNI here")
QUANTIZERS = {"q4_1": lambda w, dtype: quantize_int4(w, dtype), "q8_0": lambda w, dtype: quantize_q8_0(w)}


def exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it, times the dequantized weight, in float64."""
    return round_per_block(x) @ weight.double().t()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@needs_kernel
@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
@pytest.mark.parametrize("batch", [1, 3, 8, 9, 20])  # one pass, a partial pass, passes of 8 and a remainder
@pytest.mark.parametrize("width", [96, 576])  # an odd count of blocks, and the model's
def test_matches_the_reference(format, batch, width):
    gen = torch.Generator().manual_seed(batch * width)
    x = torch.randn(batch, width, generator=gen) * 3
    x[0, :32] = 0  # a block of zeros: no scale, zero products
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16: rounded once to bfloat16 at the end
        weight = QUANTIZERS[format](torch.randn(48, width, generator=gen) * 0.05, dtype)
        got = weight_only_matmul(x.to(dtype), weight)
        assert got.dtype == dtype
        want = exact(x.to(dtype), weight.dequantize())
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(got, weight_only_matmul_reference(x.to(dtype), weight), rtol=tolerance,
                                   atol=tolerance)


@needs_kernel
@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
def test_each_row_reads_its_own_weights(format):
    """Row r of the weight one-hot at input r % width: the product picks each x element out, so a layout that
    mixed rows, blocks or halves up would put them in the wrong columns."""
    rows, width = 64, 64
    q = torch.zeros(rows, width, dtype=torch.uint8 if format == "q4_1" else torch.int8)
    q[torch.arange(rows), torch.arange(rows) % width] = 1
    if format == "q4_1":  # w = (q - 8) scale + zero with scale 1, zero 8: w = q
        packed, scales = pack_q4_1(q, torch.tensor([1.0, 8.0]).expand(width // 32, rows, 2).contiguous())
    else:
        packed, scales = pack_q8_0(q, torch.ones(rows, width // 32))
    # exact in int8: block g holds (96 .. 127) (g + 1), so its scale is g + 1 and its qx 96 .. 127
    x = ((torch.arange(width) % 32 + 96) * (torch.arange(width) // 32 + 1)).float()[None]
    got = block_matmul(x, packed, scales, format)
    torch.testing.assert_close(got[0], x[0, torch.arange(rows) % width], rtol=1e-6, atol=1e-5)


def test_quantizing_q8_0_weights_gives_back_their_blocks():
    """A weight dequantized from Q8_0 blocks (fp16 scales, as a GGUF stores them) comes back as the same numbers."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (16, 3, 32), generator=gen, dtype=torch.int8)
    q[:, :, 0] = 127  # every block reaches the largest magnitude, as the quantizer leaves it
    scales = (torch.rand(16, 3, generator=gen) * 0.01).half().float()
    weight = (q.float() * scales[..., None]).view(16, 96)
    assert torch.equal(quantize_q8_0(weight).dequantize(), weight)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        quantize_q8_0(torch.randn(8, 64))


@needs_kernel
@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
def test_within_a_percent_of_the_exact_product(format):
    """The only rounding is x's, to int8 per block: a percent of the product's size at most on random inputs."""
    gen = torch.Generator().manual_seed(3)
    weight = QUANTIZERS[format](torch.randn(256, 576, generator=gen) * 0.05, torch.float32)
    x = torch.randn(2, 576, generator=gen)
    assert relative_error(weight_only_matmul(x, weight), x @ weight.dequantize().t()) < 0.01


@needs_kernel
@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
def test_a_nan_input_gives_nan_outputs_as_a_dense_product_would(format):
    weight = QUANTIZERS[format](torch.randn(16, 64), torch.float32)
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")
    out = weight_only_matmul(x, weight)
    assert out[1].isnan().all() and not out[0].isnan().any()
    assert weight_only_matmul(x[:0], weight).shape == (0, 16)


@needs_kernel
def test_refusals():
    weight = quantize_int4(torch.randn(16, 64), torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[B, 64\]"):
        block_matmul(torch.randn(1, 32), weight.packed, weight.packed_scales, "q4_1")
    with pytest.raises(ValueError, match="a q4_1 weight is contiguous uint8"):
        block_matmul(torch.randn(1, 64).bfloat16(), weight.packed, weight.packed_scales, "q4_1")
    with pytest.raises(ValueError, match="a q8_0 weight is contiguous uint8"):
        block_matmul(torch.randn(1, 64), weight.packed, weight.packed_scales, "q8_0")
    # a bound call writes where it was told, so where it is told must hold its output
    for out in (torch.empty(1, 8), torch.empty(2, 16), torch.empty(1, 16).bfloat16(), torch.empty(1, 32)[:, ::2]):
        with pytest.raises(ValueError, match=r"out must be contiguous \[1, 16\]"):
            bind_block_matmul(torch.randn(1, 64), weight.packed, weight.packed_scales, "q4_1", out)


def test_without_the_kernel_int4_keeps_pytorchs_and_the_head_falls_back_to_per_row_int8(monkeypatch):
    monkeypatch.setattr(block_matmul_cpu, "available", lambda: False)
    weight = quantize_int4(torch.randn(32, 64) * 0.05, torch.float32)
    assert not weight.rounds_x and weight.packed_scales is None
    x = torch.randn(3, 64)
    torch.testing.assert_close(weight_only_matmul(x, weight), x @ weight.dequantize().t(), rtol=1e-4, atol=1e-4)
    head = InferenceWeight(torch.randn(64, 96).bfloat16(), "q8_0")
    assert head.kind == "int8"
    x = torch.randn(1, 96).bfloat16()
    assert relative_error(head(x), x.float() @ head.t.float()) < 1e-2


@needs_kernel
def test_a_q8_0_weight_serves_small_batches_from_its_blocks_and_larger_ones_dense():
    """Both forms hold the same numbers: the dense copy is the blocks dequantized."""
    weight = torch.randn(64, 96).bfloat16()
    assert InferenceWeight(weight, "q8_0").dense_from == VNNI_DENSE_FROM[False]  # math.inf without AMX
    head = InferenceWeight(weight, "q8_0", dense_from=8)
    assert head.kind == "q8_0"
    assert torch.equal(head.t.t(), head.quantized.dequantize().bfloat16())
    x = torch.randn(8, 96).bfloat16()
    small, large = head(x[:1]), head(x)  # x rounded to int8 per block, and x as it is
    assert relative_error(small, large[:1]) < 2e-2
    # a step of prompt chunks that samples nothing asks the head for no rows (a long prompt's first chunks)
    assert head(x[:0]).shape == (0, 64)


@needs_kernel
@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
@pytest.mark.parametrize("batch", [1, 4, 5, 9])  # pairs within one pass, across passes and in a partial one
def test_x_rounded_twice_matches_its_reference_and_nears_the_exact_product(format, batch):
    gen = torch.Generator().manual_seed(7 * batch)
    weight = QUANTIZERS[format](torch.randn(32, 576, generator=gen) * 0.05, torch.float32)
    x = torch.randn(batch, 576, generator=gen) * 3
    x[-1, 64:96] *= 1000  # a block with an outlier's scale
    twice = weight_only_matmul(x, weight, round_x_twice=True)
    torch.testing.assert_close(twice, weight_only_matmul_reference(x, weight, round_x_twice=True), rtol=1e-5,
                               atol=1e-4)
    exact_product = x.double() @ weight.dequantize().double().t()
    assert relative_error(twice, exact_product) < 1e-4 < relative_error(weight_only_matmul(x, weight), exact_product)
