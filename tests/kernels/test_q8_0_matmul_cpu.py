"""The Q8_0 kernel computes x rounded per block to int8 times the Q8_0 weights, and Q8_0 blocks survive a round trip."""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels import q8_0_matmul_cpu
from hisparse.kernels.q8_0_matmul_cpu import q8_0_matmul, q8_0_matmul_reference, quantize_q8_0
from hisparse.layers.linear import InferenceWeight

needs_kernel = pytest.mark.skipif(not q8_0_matmul_cpu.available(), reason="no gcc or no AVX-512 VNNI here")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_quantizing_q8_0_weights_gives_back_their_blocks():
    """A weight dequantized from Q8_0 blocks (fp16 scales, as a GGUF stores them) comes back as the same blocks."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (8, 3, 32), generator=gen, dtype=torch.int8)
    q[:, :, 0] = 127  # every block reaches the largest magnitude, as the quantizer leaves it
    scales = (torch.rand(8, 3, generator=gen) * 0.01).half().float()
    weight = (q.float() * scales[..., None]).view(8, 96)
    blocks = quantize_q8_0(weight)
    assert torch.equal(blocks.q, q) and torch.equal(blocks.scales, scales)
    assert torch.equal(blocks.dequantize(), weight)


@needs_kernel
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
@pytest.mark.parametrize("width", [96, 576])  # an odd count of blocks (the masked last step) and the model's
def test_matches_the_reference(batch, width):
    gen = torch.Generator().manual_seed(batch * width)
    weight = quantize_q8_0(torch.randn(64, width, generator=gen) * 0.05)
    x = torch.randn(batch, width, generator=gen) * 3
    x[0, :32] = 0  # a block of zeros: no scale, zero products
    want = q8_0_matmul_reference(x, weight)
    torch.testing.assert_close(q8_0_matmul(x, weight), want, rtol=1e-4, atol=1e-4)
    got = q8_0_matmul(x.bfloat16(), weight)  # the bfloat16 inputs, rounded once to bfloat16 at the end
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), q8_0_matmul_reference(x.bfloat16().float(), weight), rtol=1e-2,
                               atol=1e-2)


@needs_kernel
def test_within_a_percent_of_the_exact_product():
    """The only rounding is x's, to int8 per block: a percent of the product's size at most on random inputs."""
    gen = torch.Generator().manual_seed(3)
    weight = quantize_q8_0(torch.randn(256, 576, generator=gen) * 0.05)
    x = torch.randn(2, 576, generator=gen)
    assert relative_error(q8_0_matmul(x, weight), x @ weight.dequantize().t()) < 0.01


@needs_kernel
def test_a_nan_input_gives_nan_outputs_as_a_dense_product_would():
    weight = quantize_q8_0(torch.randn(8, 64))
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")
    out = q8_0_matmul(x, weight)
    assert out[1].isnan().all() and not out[0].isnan().any()


@needs_kernel
def test_refusals():
    weight = quantize_q8_0(torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"x must be \[0..4, 64\]"):
        q8_0_matmul(torch.randn(5, 64), weight)
    with pytest.raises(ValueError, match=r"x must be \[0..4, 64\]"):
        q8_0_matmul(torch.randn(1, 32), weight)
    with pytest.raises(ValueError, match="multiple of 4 rows"):
        quantize_q8_0(torch.randn(6, 64))
    with pytest.raises(ValueError, match="contiguous int8 q"):
        q8_0_matmul_cpu.Q8_0Weight(weight.q.float(), weight.scales, weight.offsets)


def test_a_head_without_the_kernel_falls_back_to_per_row_int8(monkeypatch):
    monkeypatch.setattr(q8_0_matmul_cpu, "available", lambda: False)
    head = InferenceWeight(torch.randn(64, 96).bfloat16(), "q8_0")
    assert head.kind == "int8"
    x = torch.randn(1, 96).bfloat16()
    assert relative_error(head(x), x.float() @ head.t.float()) < 1e-2


@needs_kernel
def test_a_q8_0_weight_serves_small_batches_from_its_blocks_and_larger_ones_dense():
    """Both forms hold the same numbers: the dense copy is the blocks dequantized."""
    weight = torch.randn(64, 96).bfloat16()
    head = InferenceWeight(weight, "q8_0")
    assert head.kind == "q8_0" and head.dense_from == q8_0_matmul_cpu.MAX_BATCH + 1
    assert torch.equal(head.t.t(), head.quantized.dequantize().bfloat16())
    x = torch.randn(6, 96).bfloat16()
    small, large = head(x[:1]), head(x)  # x rounded to int8 per block, and x as it is
    assert relative_error(small, large[:1]) < 2e-2
    # a step of prompt chunks that samples nothing asks the head for no rows (a long prompt's first chunks)
    assert head(x[:0]).shape == (0, 64)
