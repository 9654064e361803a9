"""The compiled K/V row writer stores what PyTorch's cat and index_copy_ store, and refuses slots outside the pool."""

from __future__ import annotations

import pytest
import torch

from hisparse.formats.kv_layout import KVLayout
from hisparse.kernels import kv_rows_cpu

needs_kernel = pytest.mark.skipif(not kv_rows_cpu.available(), reason="no gcc here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_stores_pytorchs_rows(dtype):
    torch.manual_seed(0)
    layout = KVLayout(num_layers=1, num_kv_heads=3, head_dim=16, dtype=dtype)
    qkv = torch.randn(5, 9 * 16 + 2 * 3 * 16).to(dtype)  # K and V as slices of a projection's rows
    k, v = qkv[:, 9 * 16:12 * 16].view(5, 3, 16), qkv[:, 12 * 16:].view(5, 3, 16)
    slots = torch.tensor([7, 2, 11, 0, 5])
    pool = torch.randn(12, layout.row_width).to(dtype)
    want = pool.clone().index_copy_(0, slots, layout.pack(k, v))
    kv_rows_cpu.write_kv_rows(pool, slots, k, v)
    assert torch.equal(pool, want)


@needs_kernel
def test_a_slot_outside_the_pool_is_refused_and_nothing_is_written():
    pool = torch.zeros(4, 2 * 2 * 8)
    k = v = torch.ones(2, 2, 8)
    for slots in (torch.tensor([1, 4]), torch.tensor([-1, 2])):
        with pytest.raises(ValueError, match="outside the pool's 4 rows"):
            kv_rows_cpu.write_kv_rows(pool, slots, k, v)
        assert not pool.any()
    with pytest.raises(ValueError, match="of the pool's dtype"):
        kv_rows_cpu.write_kv_rows(pool, torch.tensor([0, 1]), k.bfloat16(), v.bfloat16())
