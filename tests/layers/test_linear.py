"""InferenceWeight: the layout and kernel a linear layer's weight is multiplied with."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from torch import nn

from hisparse.layers import linear as linear_module
from hisparse.layers.linear import InferenceWeight


def linears(dtype):
    torch.manual_seed(0)
    return [nn.Linear(64, width, bias=False).to(dtype) for width in (32, 48)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_weight_multiplies_as_the_linears_and_they_view_it(dtype):
    a, b = linears(dtype)
    x = torch.randn(3, 64).to(dtype)
    want = torch.cat([a(x), b(x)], dim=-1)
    fused = InferenceWeight.fused(a, b)
    assert torch.allclose(fused(x).float(), want.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert a.weight.data_ptr() == fused.t.data_ptr()  # one copy: the linears are views into it


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_and_dense_paths_use_the_same_weights(kind):
    a, b = linears(torch.bfloat16)
    fused = InferenceWeight.fused(a, b, quantization=kind)
    assert fused.kind == kind
    fused.dense_from = 4  # the block kernel's own limit may be no batch at all (layers.linear.VNNI_DENSE_FROM)
    small = torch.randn(1, 64).to(torch.bfloat16)
    large = torch.cat([small] * 4)  # served by the dense copy
    assert torch.allclose(fused(small).float(), fused(large)[:1].float(), rtol=0.02, atol=0.02)
    # the linears now hold the dequantized weights the dense path uses
    assert torch.equal(a.weight, fused.quantized.dequantize()[:32].to(torch.bfloat16))


def test_int4_falls_back_to_int8_where_it_cannot_pack_and_bad_kinds_are_refused():
    odd = nn.Linear(64, 24, bias=False)  # 24 rows: not a multiple of 16
    assert InferenceWeight(odd.weight, "int4").kind == "int8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        InferenceWeight(odd.weight, "int3")


def test_inputs_that_record_gradients_take_the_plain_weights():
    """oneDNN's packed matmul has no backward: where autograd records, the plain tensor multiplies, and gradients
    reach x; without it the packed weights serve (float32 at any batch)."""
    weight = torch.randn(32, 64)
    linear = InferenceWeight(weight)
    if linear.packed is None:
        pytest.skip("oneDNN's packing is not available here")
    x = torch.randn(3, 64, requires_grad=True)
    linear(x).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(3, -1))
    calls = []
    with torch.no_grad(), patch.object(linear_module, "packed_matmul", lambda *a: calls.append(1) or torch.zeros(1)):
        linear(torch.randn(1000, 64))
    assert calls == [1]
