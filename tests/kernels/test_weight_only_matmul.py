"""The weight-only kernels against their reference (dequantize, then multiply), and the quantizers' rules."""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels.weight_only_matmul import (
    INT4_GROUP,
    quantize_int4,
    quantize_int8,
    weight_only_matmul,
    weight_only_matmul_reference,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
@pytest.mark.parametrize("batch", [1, 5, 33])
def test_kernel_matches_the_reference(dtype, quantize, batch):
    generator = torch.Generator().manual_seed(batch)
    weight = torch.randn(96, 128, generator=generator) * 0.05
    x = torch.randn(batch, 128, generator=generator).to(dtype)
    packed = quantize(weight, dtype)
    got, want = weight_only_matmul(x, packed), weight_only_matmul_reference(x, packed)
    assert got.dtype == dtype and got.shape == (batch, 96)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < tolerance


def test_int4_gives_back_q4_1_blocks_unchanged():
    """A weight made of Q4_1 blocks (w = q * d + m, q from 0 to 15 in each block, as llama.cpp's quantizer
    leaves them) comes back as the same numbers."""
    generator = torch.Generator().manual_seed(0)
    out, width = 32, 4 * INT4_GROUP
    q = torch.randint(0, 16, (out, width // INT4_GROUP, INT4_GROUP), generator=generator)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(out, width // INT4_GROUP, 1, generator=generator) * 0.01 + 0.001
    m = -torch.rand(out, width // INT4_GROUP, 1, generator=generator) * 0.1
    weight = (q * d + m).view(out, width)
    packed = quantize_int4(weight, torch.float32)
    assert torch.equal(packed.q.view_as(q).long(), q)
    assert torch.allclose(packed.dequantize(), weight, rtol=0, atol=1e-6)


def test_int8_rows_use_their_whole_range():
    weight = torch.tensor([[0.5, -1.0, 0.25, 0.0], [2.0, 1.0, -0.5, 0.0]]).repeat(4, 8)
    packed = quantize_int8(weight, torch.float32)
    assert packed.values.abs().amax(dim=1).tolist() == [127] * weight.shape[0]
    assert torch.allclose(packed.dequantize(), weight, atol=2.0 / 127 / 2)


def test_a_constant_group_and_an_unpackable_shape():
    constant = quantize_int4(torch.full((16, INT4_GROUP), 0.75), torch.float32)
    assert torch.equal(constant.dequantize(), torch.full((16, INT4_GROUP), 0.75))
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        quantize_int4(torch.zeros(10, INT4_GROUP), torch.float32)


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1e-2), (torch.float32, 1e-6)])
def test_packed_matmul_matches_the_plain_one(dtype, tolerance):
    from hisparse.kernels.packed_matmul import pack_weight, packed_matmul, packing_available

    weight = (torch.randn(96, 128) * 0.05).to(dtype)
    if not packing_available(weight):
        pytest.skip("oneDNN's packing is not available here")
    for batch in (1, 9, 200):
        x = torch.randn(batch, 128).to(dtype)
        got, want = packed_matmul(x, pack_weight(weight)), x @ weight.t()
        assert got.dtype == dtype and got.shape == (batch, 96)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < tolerance
