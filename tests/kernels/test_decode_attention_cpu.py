"""The compiled decode attention equals gather + SDPA (`attention.functional.decode_attention`) on random pools."""

from __future__ import annotations

from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse.attention.functional import attend_rows, decode_attention
from hisparse.formats.kv_layout import KVLayout
from hisparse.kernels import decode_attention_cpu
from hisparse.kernels.decode_attention_cpu import sparse_decode_attention
from hisparse.memory.rows import gather_rows

# (KV heads, query heads per KV head, head dim): the kernel is compiled for each, a few seconds apiece, so
# the property test draws from a few, the default model's among them.
HEAD_LAYOUTS = [(2, 3, 8), (3, 3, 64)]


def sdpa(pool, rows, q, scale, num_kv_heads, head_dim):
    ks, vs = KVLayout(1, num_kv_heads, head_dim).unpack(gather_rows(pool.float(), rows.clamp(min=0)))
    return decode_attention(q.float(), ks, vs, rows >= 0, scale)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 5), length=st.integers(1, 40), heads=st.sampled_from(HEAD_LAYOUTS),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       q_dtype=st.sampled_from([torch.float32, torch.bfloat16]), parallel=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_matches_gather_and_sdpa(batch, length, heads, dtype, q_dtype, parallel, seed):
    """Any batch, row count (tiles full and partial), head layout and -1 padding anywhere (at least one row
    per request), a cache in the model's dtype or wider: the same output as SDPA over the gathered rows,
    computed in float32 from the same (rounded) values."""
    num_kv_heads, group, head_dim = heads
    rng = np.random.default_rng(seed)
    pool = torch.from_numpy(rng.standard_normal((3 * batch * length + 1, 2 * num_kv_heads * head_dim),
                                                dtype=np.float32) * 3).to(dtype)
    rows = torch.from_numpy(rng.integers(0, pool.shape[0], (batch, length)))
    rows[torch.from_numpy(rng.random((batch, length)) < 0.3)] = -1
    rows[:, int(rng.integers(length))] = torch.from_numpy(rng.integers(0, pool.shape[0], batch))
    q = torch.from_numpy(rng.standard_normal((batch, num_kv_heads * group, head_dim), dtype=np.float32)).to(q_dtype)
    scale = head_dim ** -0.5
    with patch.object(decode_attention_cpu, "PARALLEL_MIN_ROWS", 0 if parallel else 1 << 60):
        got = sparse_decode_attention(pool, rows, q, scale, num_kv_heads, head_dim)
    assert got.dtype == q_dtype and got.shape == q.shape
    want = sdpa(pool, rows, q, scale, num_kv_heads, head_dim)
    if q_dtype == torch.float32:  # V's values reach 10 in size: sums of them in another order differ by ~1e-5
        torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-5)
    else:  # the kernel's one rounding to bfloat16 at the end
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("parallel", [False, True])
def test_a_bfloat16_query_is_read_in_place_and_rounded_as_to_does(parallel):
    """A bfloat16 q, a strided slice of the model's rotated heads as the model passes it: read in place, it gives
    the very bits of the same query made contiguous. Over a float32 pool the kernel's own widening and rounding
    give the very bits of widening first and rounding the float32 output with `.to`; over a bfloat16 pool (where
    AVX512-BF16 multiplies bfloat16 pairs) it stays within bfloat16's rounding of that."""
    torch.manual_seed(0)
    pool = torch.randn(300, 2 * 3 * 64)
    rows = torch.randint(0, 300, (4, 50))
    rows[1, ::3] = -1
    heads = torch.randn(4, 12, 64).bfloat16()  # 9 query heads, then 3 key heads, as the model rotates them
    q = heads[:, :9]
    assert not q.is_contiguous()
    with patch.object(decode_attention_cpu, "PARALLEL_MIN_ROWS", 0 if parallel else 1 << 60):
        for dtype in (torch.float32, torch.bfloat16):
            got = sparse_decode_attention(pool.to(dtype), rows, q, 0.125, 3, 64)
            contiguous = sparse_decode_attention(pool.to(dtype), rows, q.contiguous(), 0.125, 3, 64)
            widened = sparse_decode_attention(pool.to(dtype), rows, q.float(), 0.125, 3, 64).to(torch.bfloat16)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got.view(torch.int16), contiguous.view(torch.int16))
            if dtype == torch.float32:
                assert torch.equal(got.view(torch.int16), widened.view(torch.int16))
            else:
                torch.testing.assert_close(got.float(), widened.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("heads", [(3, 3, 64), (2, 3, 8), (1, 5, 16), (4, 1, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_split_between_threads_give_the_serial_bits(heads, dtype):
    """Fewer requests than threads split each request's query heads into parts, cut anywhere in a KV head's
    group: each head's output has the very bits of the serial call (4 threads: batch 1 in four parts, batch 3 in
    two; the parts never exceed the heads)."""
    num_kv_heads, group, head_dim = heads
    torch.manual_seed(1)
    pool = (torch.randn(500, 2 * num_kv_heads * head_dim) * 3).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for batch in (1, 3):
            rows = torch.randint(0, 500, (batch, 70))
            rows[0, ::5] = -1
            q = torch.randn(batch, num_kv_heads * group, head_dim).to(dtype)
            with patch.object(decode_attention_cpu, "PARALLEL_MIN_ROWS", 1 << 60):
                serial = sparse_decode_attention(pool, rows, q, 0.3, num_kv_heads, head_dim)
            with patch.object(decode_attention_cpu, "PARALLEL_MIN_ROWS", 0):
                split = sparse_decode_attention(pool, rows, q, 0.3, num_kv_heads, head_dim)
            assert torch.equal(split, serial)
    finally:
        torch.set_num_threads(threads)


def test_a_request_without_rows_gets_zeros_and_the_others_are_unaffected():
    pool = torch.randn(10, 2 * 2 * 8)
    rows = torch.tensor([[-1, -1, -1], [3, -1, 7]])
    q = torch.randn(2, 4, 8)
    got = sparse_decode_attention(pool, rows, q, 0.5, 2, 8)
    assert torch.equal(got[0], torch.zeros(4, 8))
    torch.testing.assert_close(got[1:], sdpa(pool, rows[1:], q[1:], 0.5, 2, 8), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_other_pool_dtypes_are_refused(dtype):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        sparse_decode_attention(torch.zeros(4, 8, dtype=dtype), torch.zeros(1, 2, dtype=torch.int64),
                                torch.zeros(1, 2, 2), 1.0, 2, 2)


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        sparse_decode_attention(torch.zeros(4, 12), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 3, 2),
                                1.0, 2, 2)


@pytest.mark.parametrize("rows, match", [
    (torch.zeros(2, 3, dtype=torch.int64), "one row per query"),
    (torch.zeros(1, 3, dtype=torch.int32), "int64"),
    (torch.tensor([[0, 4]]), r"in \[0, 4\)"),
    (torch.tensor([[0, -2]]), r"in \[0, 4\)"),
])
def test_rows_that_do_not_fit_are_refused(rows, match):
    """The compiled loops check no index: rows for another batch or past the pool would read or write
    memory that is not theirs."""
    with pytest.raises(ValueError, match=match):
        sparse_decode_attention(torch.zeros(4, 8), rows, torch.zeros(1, 2, 2), 1.0, 2, 2)


def test_attend_rows_falls_back_to_gather_and_sdpa_for_other_pools():
    """A float16 pool (which the kernel does not read) still gets its attention, through SDPA."""
    pool = torch.randn(10, 2 * 2 * 8).half()
    rows = torch.tensor([[3, -1, 7], [1, 2, -1]])
    q = torch.randn(2, 4, 8).half()
    got = attend_rows(pool, rows, q, 0.5, KVLayout(1, 2, 8, torch.float16))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), sdpa(pool, rows, q, 0.5, 2, 8), rtol=2e-3, atol=2e-3)


def test_tensors_outside_cpu_memory_are_refused():
    with pytest.raises(ValueError, match="CPU tensors"):
        sparse_decode_attention(torch.zeros(4, 8, device="meta"), torch.zeros(1, 2, dtype=torch.int64),
                                torch.zeros(1, 2, 2), 1.0, 2, 2)


def test_heads_too_wide_for_the_kernel_go_through_sdpa():
    """More query-head values than the kernel keeps on its stack: attend_rows gathers the rows for SDPA."""
    pool = torch.randn(6, 2 * 1 * 512)
    rows = torch.tensor([[0, 3, -1]])
    q = torch.randn(1, 40, 512)
    got = attend_rows(pool, rows, q, 0.05, KVLayout(1, 1, 512, torch.float32))
    torch.testing.assert_close(got, sdpa(pool, rows, q, 0.05, 1, 512), rtol=1e-5, atol=1e-5)
