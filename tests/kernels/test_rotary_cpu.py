"""The compiled half-split RoPE gives PyTorch's bits, reading heads from a slice of a wider row."""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels import rotary_cpu
from hisparse.layers.rotary import HalfSplitRotation, RotaryEmbedding

needs_kernel = pytest.mark.skipif(not rotary_cpu.available(), reason="no gcc here")


def pytorch_rotation(rotation: HalfSplitRotation, x: torch.Tensor) -> torch.Tensor:
    h = rotation.half
    swapped = torch.cat([x[..., h:2 * h], x[..., :h], x[..., 2 * h:]], dim=-1)
    return x * rotation.cos + swapped * rotation.sin


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 96])  # 96: the last 32 dims pass through
def test_the_kernel_gives_pytorchs_bits(dtype, head_dim):
    torch.manual_seed(0)
    cos, sin = RotaryEmbedding(64, 1024, 10000.0).cos_sin(torch.arange(300, 340))
    rotation = HalfSplitRotation.of(cos, sin, dtype, head_dim)
    row = (torch.randn(40, 5 * head_dim + 7) * 4).to(dtype)  # heads inside a wider row, as a projection's slice
    heads = row[:, :4 * head_dim].view(40, 4, head_dim)
    got = rotary_cpu.rotate_half_split(heads, rotation.cos, rotation.sin, rotation.half)
    assert got.is_contiguous() and torch.equal(got, pytorch_rotation(rotation, heads))
    with torch.no_grad():
        assert torch.equal(rotation(heads), got)  # what the model calls


@needs_kernel
def test_bfloat16_heads_over_float32_tables_are_widened_as_they_are_read():
    """The indexer's queries rotate in float32 straight from a bfloat16 projection: the bits of `x.float()`'s."""
    torch.manual_seed(0)
    cos, sin = RotaryEmbedding(64, 1024, 10000.0).cos_sin(torch.arange(300, 303))
    rotation = HalfSplitRotation.of(cos, sin, torch.float32, 64)
    row = (torch.randn(3, 4 * 64 + 7) * 4).bfloat16()
    heads = row[:, :4 * 64].view(3, 4, 64)
    out = torch.empty(3, 4, 64)
    rotary_cpu.RotationTables(rotation.cos, rotation.sin, rotation.half).bind_rotate(heads, out)()
    assert torch.equal(out, pytorch_rotation(rotation, heads.float()))


@needs_kernel
def test_the_rotation_keeps_pytorchs_ops_for_gradients_and_odd_strides():
    cos, sin = RotaryEmbedding(64, 64, 10000.0).cos_sin(torch.arange(3))
    rotation = HalfSplitRotation.of(cos, sin, torch.float32)
    x = torch.randn(3, 2, 64, requires_grad=True)
    rotation(x).sum().backward()
    assert x.grad is not None
    strided = torch.randn(3, 64, 2).transpose(1, 2)  # heads not contiguous: PyTorch's path
    assert not rotary_cpu.takes(strided, rotation.cos)
    assert torch.equal(rotation(strided), pytorch_rotation(rotation, strided))


@needs_kernel
def test_refusals():
    cos, sin = RotaryEmbedding(64, 64, 10000.0).cos_sin(torch.arange(3))
    rotation = HalfSplitRotation.of(cos, sin, torch.float32)
    with pytest.raises(ValueError, match="in cos's dtype|of their dtype"):
        rotary_cpu.rotate_half_split(torch.randn(3, 2, 64).bfloat16(), rotation.cos, rotation.sin, rotation.half)
    with pytest.raises(ValueError, match="do not fit rotation tables of 3 tokens"):
        rotary_cpu.rotate_half_split(torch.randn(4, 2, 64), rotation.cos, rotation.sin, rotation.half)
    with pytest.raises(ValueError, match=r"cos, sin \[N, 1, D\]"):
        rotary_cpu.RotationTables(rotation.cos, rotation.sin[:, :, :32].contiguous(), rotation.half)
    with pytest.raises(ValueError, match="rotating at most D dims"):
        rotary_cpu.RotationTables(rotation.cos, rotation.sin, 40)


def test_a_rotation_checks_its_tables_once_for_every_layer():
    cos, sin = RotaryEmbedding(64, 64, 10000.0).cos_sin(torch.arange(3))
    rotation = HalfSplitRotation.of(cos, sin, torch.bfloat16)
    x = torch.randn(3, 4, 64).bfloat16()
    first = rotation(x)
    tables = rotation._compiled()
    assert torch.equal(rotation(x), first) and rotation._compiled() is tables
