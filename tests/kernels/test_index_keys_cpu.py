"""The compiled int8 key writer against its reference: IndexKeyFormat.pack, then index_copy_."""

from __future__ import annotations

import pytest
import torch

from hisparse.formats.index_key import IndexKeyFormat
from hisparse.kernels import index_keys_cpu
from hisparse.kernels.index_keys_cpu import write_int8_keys

pytestmark = pytest.mark.skipif(not index_keys_cpu.available(), reason="no gcc here")


@pytest.mark.parametrize("n", [1, 7, 300])
def test_same_bytes_as_the_reference(n):
    generator = torch.Generator().manual_seed(n)
    keys = torch.randn(n, 64, generator=generator) * 4
    keys[0] = 0.0  # an all-zero key: the scale's floor
    if n > 1:  # halves (the scale is 1): rounded to even, as torch.round does
        keys[1, :5] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5])
        keys[1, 5:] = 0.0
    slots = torch.randperm(512, generator=generator)[:n]
    want = torch.zeros(512, 68, dtype=torch.uint8)
    want.index_copy_(0, slots, IndexKeyFormat("int8", 64).pack(keys))
    got = torch.zeros_like(want)
    write_int8_keys(got, slots, keys)
    assert torch.equal(got, want)


def test_out_of_range_slots_are_refused_and_nothing_is_written():
    rows = torch.zeros(4, 68, dtype=torch.uint8)
    for slots in (torch.tensor([0, 4]), torch.tensor([-1, 0])):
        with pytest.raises(ValueError, match="slots must be"):
            write_int8_keys(rows, slots, torch.ones(2, 64))
        assert not rows.any()


def test_a_nan_key_is_stored_with_a_nan_scale_and_zero_values():
    rows = torch.zeros(3, 68, dtype=torch.uint8)
    keys = torch.randn(2, 64)
    keys[1, 7] = float("nan")
    write_int8_keys(rows, torch.tensor([0, 2]), keys)
    assert torch.isnan(rows[2, 64:].view(torch.float32)).all() and not rows[2, :64].any()
    assert torch.isfinite(rows[0, 64:].view(torch.float32)).all()
