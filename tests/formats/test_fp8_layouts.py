"""FP8 byte layouts of the KV cache rows and the block-FP8 weight format."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse.formats import fp8
from hisparse.formats.index_key import IndexKeyFormat, hadamard
from hisparse.formats.latent import LatentFormat

E4M3_REL = 2.0**-4  # 3 mantissa bits: round-to-nearest error of a normal number
E4M3_SUBNORMAL_STEP = 2.0**-9  # spacing below 2^-6, in units of the scale


def _e4m3_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest error of one quantize-dequantize: relative for normals, half a step for subnormals."""
    return torch.maximum(x.abs() * E4M3_REL, scale * E4M3_SUBNORMAL_STEP / 2) * 1.0001


def test_row_sizes_are_the_ones_real_systems_keep():
    assert fp8.mla_fp8_row_bytes(512, 64) == 656
    assert fp8.index_k_fp8_row_bytes(128) == 132
    assert LatentFormat("bfloat16", 512, 64).row_bytes == 1152
    assert LatentFormat("fp8", 512, 64).row_bytes == 656
    assert LatentFormat("float32", 512, 64).row_bytes == 2304
    assert IndexKeyFormat("fp8", 128).row_bytes == 132
    rows = fp8.pack_mla_fp8(torch.randn(5, 576))
    assert rows.dtype == torch.uint8 and rows.shape == (5, 656)
    assert fp8.pack_index_k_fp8(torch.randn(5, 128)).shape == (5, 132)


def test_mla_fp8_row_layout_is_values_then_tile_scales_then_bf16_rope():
    torch.manual_seed(0)
    latent = torch.randn(7, 576)
    latent[:, :512] *= torch.tensor([0.01, 1.0, 30.0, 300.0]).repeat_interleave(128)
    rows = fp8.pack_mla_fp8(latent)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    expected = latent[:, :512].view(7, 4, 128).abs().amax(-1) / fp8.FP8_E4M3_MAX
    assert torch.equal(scales, expected)
    rope = rows[:, 528:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope, latent[:, 512:].to(torch.bfloat16))
    values = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(7, 4, 128)
    assert values.abs().amax(-1).eq(fp8.FP8_E4M3_MAX).all()  # each tile's largest value is exact


def test_mla_fp8_round_trip_error_bound():
    torch.manual_seed(1)
    latent = torch.randn(64, 576) * 3
    back = fp8.unpack_mla_fp8(fp8.pack_mla_fp8(latent))
    scale = latent[:, :512].view(64, 4, 128).abs().amax(-1, keepdim=True) / fp8.FP8_E4M3_MAX
    bound = _e4m3_bound(latent[:, :512].view(64, 4, 128), scale).view(64, 512)
    assert ((back[:, :512] - latent[:, :512]).abs() <= bound).all()
    assert ((back[:, 512:] - latent[:, 512:]).abs() <= latent[:, 512:].abs() * 2.0**-8 + 1e-30).all()
    # and through the format object, with leading dims kept
    fmt = LatentFormat("fp8", 512, 64)
    assert fmt.unpack(fmt.pack(latent).view(8, 8, 656)).shape == (8, 8, 576)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(1e-3, 1e3))
def test_index_key_fp8_round_trip_error_bound(seed, magnitude):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(16, 128, generator=g) * magnitude
    back = fp8.unpack_index_k_fp8(fp8.pack_index_k_fp8(k))
    scale = k.abs().amax(-1, keepdim=True) / fp8.FP8_E4M3_MAX
    assert ((back - k).abs() <= _e4m3_bound(k, scale)).all()


def test_zero_rows_round_trip_without_nan():
    assert torch.equal(fp8.unpack_mla_fp8(fp8.pack_mla_fp8(torch.zeros(2, 576))), torch.zeros(2, 576))
    assert torch.equal(fp8.unpack_index_k_fp8(fp8.pack_index_k_fp8(torch.zeros(2, 128))), torch.zeros(2, 128))


def test_hadamard_keeps_indexer_dot_products():
    """The fp8 index format stores rotated keys; rotated queries see the same logits, up to fp8 error."""
    torch.manual_seed(2)
    q, k = torch.randn(4, 8, 128), torch.randn(32, 128)
    assert torch.allclose(hadamard(hadamard(k)), k, atol=1e-5)  # orthonormal and symmetric
    fmt = IndexKeyFormat("fp8", 128)
    approx = torch.einsum("thd,sd->ths", fmt.prepare_query(q), fmt.unpack(fmt.pack(k)))
    exact = torch.einsum("thd,sd->ths", q, k)
    assert (approx - exact).abs().max() < 0.1 * exact.abs().max()


def test_block_dequant_inverts_block_quant_with_partial_edge_blocks():
    torch.manual_seed(3)
    w = torch.randn(300, 260) * torch.logspace(-2, 1, 300)[:, None]
    q, scale = fp8.block_quant(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 3)
    back = fp8.block_dequant(q, scale)
    block_scale = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    assert ((back - w).abs() <= _e4m3_bound(w, block_scale)).all()
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        fp8.block_dequant(q, scale[:2])
