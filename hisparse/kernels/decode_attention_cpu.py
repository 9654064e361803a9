"""Decode attention straight from a pool of K/V rows, in C (`decode_attention_cpu.c`): one query per request over
its own rows.

A decode step's attention reads a few hundred rows per request (the top-k selection) scattered over the
pool. Gathering them into a dense tensor for SDPA writes them once more, and SDPA's CPU kernel is made for
long queries, not one query per request (isolated, with the caches flushed, gather + SDPA took 1.7-1.8 ms
for 16 requests x 257 bfloat16 rows, the first version of this kernel 0.9; gather + two batched matmuls,
39.6 ms for 30 layers against that version's 25.1). Here each row is read where it lies, prefetched a few
rows ahead. Scores: with AVX512-BF16, bfloat16 queries and rows multiply in vdpbf16ps pairs where they lie, four
rows at a time per query head, their four dot products summed across lanes together (a horizontal sum per dot
product costs as much as the products); else each row's K half is widened to float32 once (a bfloat16 is the top
16 bits of a float32) and scored by four query heads at a time. The softmax's exponential is a vectorized
polynomial. Values: with head dims of 64, the query heads of a KV head keep their accumulators in registers over
all the rows, each V half widened once into them. 8 requests x 256 bfloat16 rows x 30 layers on 2 threads (AMD
EPYC): 1.45 ms with the rows cached, 4.53 ms from random rows of a 2 GB pool, against 2.48 and 12.87 when a row's
heads were scored four at a time and V weighted four rows at a time in memory.

With fewer requests than threads, each request's query heads are split between them (a head's arithmetic is the
same whichever heads share its call, so the split changes no output). Built on first use (`kernels.c_library`);
where it cannot be (no gcc), `available()` is False and `attend_rows` gathers the rows for SDPA.

Rows whose index is -1 take no part; a request with none gets zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hisparse.kernels.c_library import FLOAT, INT, INT64, POINTER, CLibrary, LayerAddresses
from hisparse.kernels.numba_threads import on_torch_team

# batch x rows from which the call runs on the thread team: requests in parallel, and a request's query heads split
# between threads when requests are fewer. On torch's own OpenMP team (numba_threads), whose threads are awake
# from the step's matmuls, int4 engine steps of 100-token prompts (contexts 100-240, the thresholds taking turns
# every 10 steps, medians of 70) took 0.971x / 0.922x / 0.919x as long at batch 1 / 2 / 4 with 64 as with 1024;
# with 600-token prompts (256 selected rows) 0.983x at batch 1. On TBB a parallel region costs a wake-up.
PARALLEL_MIN_ROWS = 64 if on_torch_team() else 4096
MAX_QUERY_HEADS = 64  # the C file's
MAX_HEAD_VALUES = 16384  # query heads x head dim, the C file's


_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"decode_attention": (INT, [POINTER, INT64, INT, POINTER, INT64, INT64, POINTER, INT64, INT, FLOAT, INT64, INT64,
                                INT64, POINTER, INT])},
    "decode attention gathers rows for SDPA")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)
_DTYPES = (torch.float32, torch.bfloat16)


def takes(pool: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether `sparse_decode_attention` reads this pool and these queries: CPU memory, float32 or bfloat16, query
    heads within what the C file keeps on its stack."""
    return (pool.is_cpu and q.is_cpu and pool.dtype in _DTYPES and q.dtype in _DTYPES and q.dim() == 3
            and q.shape[1] <= MAX_QUERY_HEADS and q.shape[1] * q.shape[2] <= MAX_HEAD_VALUES)


def sparse_decode_attention(pool: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, scale: float,
                            num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[B, Hq, D] in q's dtype: softmax((q . K) * scale) V over the pool rows rows[b, j] >= 0 of each request.

    pool [N, 2 * Hkv * D] float32 or bfloat16 (a row is K then V, heads in order, as the caches store
    them, contiguous); rows [B, L] int64, each -1 or a row of the pool; q [B, Hq, D] float32 or bfloat16 (each
    request's heads contiguous: the model's slice of its rotated heads is read in place) with Hq a multiple of
    Hkv (query head h reads KV head h // (Hq / Hkv)), at most 64 of them. A bfloat16 q is widened and the output
    rounded to bfloat16 (to nearest even, as `.to` does) inside the kernel: at one token the conversions around
    it cost more than the attention (over a bfloat16 pool with AVX512-BF16, multiplied as bfloat16 pairs, its
    products exact and summed in float32). A request without rows gets zeros.
    """
    if q.dim() == 3 and (q.stride(2) != 1 or q.stride(1) != q.shape[2]):
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    bind_sparse_decode_attention(pool.unsqueeze(0), rows.contiguous(), q, scale, num_kv_heads, head_dim, out)(0)
    return out


def bind_sparse_decode_attention(pools: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, scale: float,
                                 num_kv_heads: int, head_dim: int, out: torch.Tensor) -> Callable[[int], None]:
    """`sparse_decode_attention` over layer l of pools [L, N, 2 * Hkv * D] into out ([B, Hq, D] of q's dtype,
    contiguous) as a call checked once, `call(l)`, for a caller that attends with the same buffers in every layer
    (a decode step); rows contiguous, each request's query heads contiguous. The call keeps its tensors alive."""
    if not (pools.is_cpu and rows.is_cpu and q.is_cpu):
        raise ValueError("sparse_decode_attention reads CPU memory: pool, rows and q must be CPU tensors")
    if pools.dtype not in _DTYPES or pools.dim() != 3 or not pools.is_contiguous():
        raise ValueError(f"the pool must be a contiguous 2-d float32 or bfloat16 tensor, got {pools.dim() - 1}-d "
                         f"{pools.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    batch, num_heads, dim = q.shape
    if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[0] != batch or not rows.is_contiguous():
        raise ValueError(f"rows must be [{batch}, L] int64 (one row per query), got {tuple(rows.shape)} {rows.dtype}")
    if (dim != head_dim or num_heads % num_kv_heads or pools.shape[2] != 2 * num_kv_heads * head_dim
            or num_heads > MAX_QUERY_HEADS or num_heads * dim > MAX_HEAD_VALUES):
        raise ValueError(f"q {tuple(q.shape)} and pool rows of {pools.shape[2]} do not fit {num_kv_heads} KV heads "
                         f"of {head_dim} (at most {MAX_QUERY_HEADS} query heads, {MAX_HEAD_VALUES} values)")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    if q.stride(2) != 1 or q.stride(1) != dim:
        raise ValueError("each request's query heads must be contiguous")
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_cpu or not out.is_contiguous():
        raise ValueError(f"the output must be contiguous {tuple(q.shape)} {q.dtype} in CPU memory")
    layers, function = LayerAddresses(pools), _LIBRARY.load().decode_attention
    arguments = (pools.shape[1], pools.dtype == torch.bfloat16, rows.data_ptr(), batch, rows.shape[1], q.data_ptr(),
              q.stride(0), q.dtype == torch.bfloat16, scale, num_kv_heads, num_heads // num_kv_heads, dim,
              out.data_ptr(), rows.numel() >= PARALLEL_MIN_ROWS)

    def attend(layer: int) -> None:
        error = function(layers.address(layer), *arguments)
        if error == 1:
            raise ValueError(f"rows must be -1 or in [0, {pools.shape[1]}), got {int(rows.min())} .. "
                             f"{int(rows.max())}")
        if error:
            raise MemoryError("decode attention could not allocate its scores")
    attend.tensors = (pools, rows, q, out)
    return attend
