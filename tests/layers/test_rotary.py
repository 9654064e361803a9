"""HalfSplitRotation: one batch's rotation applied by every layer gives apply_rope_half's numbers."""

from __future__ import annotations

import pytest
import torch

from hisparse.layers.rotary import HalfSplitRotation, RotaryEmbedding, apply_rope_half


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_apply_rope_half_bit_for_bit(dtype):
    cos, sin = RotaryEmbedding(64, 512, 1e5).cos_sin(torch.tensor([0, 7, 300, 511]))
    x = torch.randn(4, 12, 64).to(dtype)
    assert torch.equal(HalfSplitRotation.of(cos, sin, dtype)(x), apply_rope_half(x, cos, sin))


def test_a_partial_rotation_leaves_the_other_dims_alone():
    """The indexer rotates its first 32 of 64 dims (every other frequency of the model's table)."""
    cos, sin = RotaryEmbedding(64, 512, 1e5).cos_sin(torch.tensor([3, 9]))
    cos, sin = cos[..., ::2], sin[..., ::2]
    x = torch.randn(2, 5, 64)
    got = HalfSplitRotation.of(cos, sin, torch.float32, head_dim=64)(x)
    assert torch.equal(got[..., :32], apply_rope_half(x[..., :32], cos, sin))
    assert torch.equal(got[..., 32:], x[..., 32:])
