"""The bfloat16 kernel multiplies x by W in its 16-row layout at any batch and width, each row of x to the same bits
whatever batch it comes in, writes no output past its N columns, refuses buffers it cannot fill, and serves the
linears' bfloat16 weights where AMX is missing."""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels import bf16_matmul_cpu, c_library
from hisparse.kernels.bf16_matmul_cpu import bf16_matmul, bind_bf16_matmul, pack_bf16
from hisparse.layers import linear
from hisparse.layers.linear import InferenceWeight

needs_kernel = pytest.mark.skipif(not bf16_matmul_cpu.available(), reason="no gcc or no AVX512-BF16 here")


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's bfloat16 spacing (float32 sums in another order differ by rounding only)."""
    spacing = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=1e-3)
    return (got.float() - want.float()).abs() / spacing


@needs_kernel
@pytest.mark.parametrize("batch", [1, 3, 4, 5, 8, 13, 20])  # each tile shape, passes of 8 and what they leave
@pytest.mark.parametrize("out_features", [16, 64, 324, 3 * 16 + 5])  # whole groups, a padded last group
def test_matches_float32_products(batch, out_features):
    gen = torch.Generator().manual_seed(batch * out_features)
    x = torch.randn(batch, 576, generator=gen).bfloat16()
    weight = (torch.randn(out_features, 576, generator=gen) * 0.05).bfloat16()
    got = bf16_matmul(x, pack_bf16(weight), out_features)
    assert got.shape == (batch, out_features) and got.dtype == torch.bfloat16
    want = x.double() @ weight.double().t()
    assert bf16_ulps(got, want).max() <= 2  # the float32 sum, then one rounding to bfloat16


@needs_kernel
def test_a_row_gets_the_same_bits_at_any_batch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(21, 1536, generator=gen).bfloat16()
    weight = torch.randn(100, 1536, generator=gen).bfloat16()
    packed = pack_bf16(weight)
    whole = bf16_matmul(x, packed, 100)
    for start, stop in ((0, 1), (3, 7), (5, 17), (0, 9), (20, 21)):
        assert torch.equal(bf16_matmul(x[start:stop], packed, 100), whole[start:stop])


@needs_kernel
def test_writes_nothing_past_the_outputs():
    """A padded group's zero rows are computed but never stored: the memory after out stays as it was."""
    x = torch.randn(3, 64).bfloat16()
    weight = torch.randn(20, 64).bfloat16()
    memory = torch.full((3 * 20 + 32,), 7.0, dtype=torch.bfloat16)
    out = memory[:60].view(3, 20)
    packed = pack_bf16(weight)  # alive while the call runs: a bound call holds addresses alone
    bind_bf16_matmul(x, packed, out)()
    assert torch.all(memory[60:] == 7.0)
    assert bf16_ulps(out, x.double() @ weight.double().t()).max() <= 2


@needs_kernel
def test_nan_and_infinity_propagate():
    x = torch.randn(2, 32).bfloat16()
    x[0, 5] = float("nan")
    x[1, 0] = float("inf")
    weight = torch.ones(16, 32).bfloat16()
    got = bf16_matmul(x, pack_bf16(weight), 16)
    assert torch.isnan(got[0]).all() and torch.isposinf(got[1]).all()


@needs_kernel
def test_refuses_what_it_cannot_fill():
    weight = pack_bf16(torch.randn(32, 64).bfloat16())
    x, out = torch.randn(2, 64).bfloat16(), torch.empty(2, 32, dtype=torch.bfloat16)
    bind_bf16_matmul(x, weight, out)  # the right buffers bind
    for bad_x, bad_out, bad_weight, words in [
        (x.float(), out, weight, "x must be"),
        (torch.randn(2, 62).bfloat16(), out, weight, "x must be"),
        (torch.randn(2, 128).bfloat16()[:, ::2], out, weight, "x must be"),  # not contiguous
        (x, torch.empty(2, 33, dtype=torch.bfloat16), weight, "out must be"),  # a 17th row: a third group
        (x, torch.empty(3, 32, dtype=torch.bfloat16), weight, "out must be"),
        (x, out.float(), weight, "out must be"),
        (x, out, weight.float(), "packed weight"),
        (x, out, weight[:, :, :8], "packed weight"),
    ]:
        with pytest.raises(ValueError, match=words):
            bind_bf16_matmul(bad_x, bad_weight, bad_out)


@needs_kernel
def test_the_linears_take_it_without_amx(monkeypatch):
    monkeypatch.setattr(linear, "STREAMED_BF16", True)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 576, generator=gen).bfloat16()
    prepared = InferenceWeight(weight)
    assert prepared.streamed is not None and prepared.packed is None  # one packed copy, not two
    for batch in (1, 16, linear.PACKED_UP_TO_BATCH[torch.bfloat16] + 1):  # decode, a short chunk, a long one
        x = torch.randn(batch, 576, generator=gen).bfloat16()
        assert bf16_ulps(prepared(x), x.double() @ weight.double().t()).max() <= 2
        out = torch.empty(batch, 96, dtype=torch.bfloat16)
        prepared.bind(x, out)()
        assert torch.equal(out, prepared(x))
    with torch.enable_grad():  # the kernel has no backward: a recording input multiplies by the plain tensor
        x = torch.randn(2, 576, requires_grad=True).bfloat16()
        assert prepared(x).requires_grad
    with c_library.eager():  # the kernels off: the plain tensor, as the eager model multiplies
        x = torch.randn(2, 576, generator=gen).bfloat16()
        assert torch.equal(prepared(x), x @ prepared.t)
    monkeypatch.setattr(linear, "STREAMED_BF16", False)
    assert InferenceWeight(weight).streamed is None
