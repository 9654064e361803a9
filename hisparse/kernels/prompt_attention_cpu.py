"""Causal attention of a prompt chunk over its context (`prompt_attention_cpu.c`): bfloat16 Q, K, V, head dim 64,
on CPUs with AVX512-BF16, its products in AMX tiles where the CPU has them (Sapphire Rapids on), else in
vdpbf16ps dot products (AMD Zen 4 on).

A 1536-token prompt's attention is a third to a half of its prefill, and PyTorch's CPU flash kernel spends much of
it outside its matrix products (the same scores over head dims 32 / 64 / 128 took 4.3 / 6.0 / 6.9 ms): the
softmax's exponentials and its bookkeeping, and with a mask every key block of every query. This kernel multiplies
16 queries by 32 keys at a time (QK^T in two AMX C tiles, or 8 queries x 32 keys in 16 registers), softmaxes up to
512 keys' scores at a time, online across blocks (flash attention's running maximum and sum), with a polynomial
exponential as precise as P's bfloat16 needs (to 4e-5), and accumulates P V in float32. The chunk's queries are
the last T of the S positions, each seeing the keys up to its own: no mask is built, none is read, and no block
past a query tile's last position is computed.

Products of bfloat16 values are exact and summed in float32; P is rounded to bfloat16 for its product with V, as
SDPA rounds it; the output is rounded once. K and V are repacked per call into the products' layouts.

Built on first use (`kernels.c_library`); `available()` is False without gcc, without the CPU's AVX-512 flags, or
where Linux refuses the process AMX state on a CPU that has it, and callers keep SDPA.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hisparse.kernels.c_library import FLOAT, INT, INT64, POINTER, CLibrary

HEAD_DIM = 64  # the C file's
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512_bf16")

_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"amx_permit": (INT, []),
     "prompt_attention": (INT, [POINTER, POINTER, INT64, POINTER, INT64, INT64, INT64, INT64, FLOAT, POINTER, INT])},
    "prompt attention runs SDPA", REQUIRED_FLAGS)
_permitted: bool | None = None


def available() -> bool:
    """Whether the kernel is built and loaded and, where it multiplies in AMX tiles, the process may use them
    (asked of Linux once)."""
    global _permitted
    library = _LIBRARY.load()
    if library is None:
        return False
    if _permitted is None:
        _permitted = library.amx_permit() == 0
    return _permitted


def takes(q: torch.Tensor, pool: torch.Tensor, kv_heads: int) -> bool:
    """Whether `prompt_attention` computes this attention: bfloat16 queries [T, Hq, 64] over a contiguous bfloat16
    pool of K/V rows [N, 2 * Hkv * 64], Hq a multiple of Hkv, in CPU memory."""
    return (q.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16 and q.is_cpu and pool.is_cpu and q.dim() == 3
            and q.shape[2] == HEAD_DIM and pool.dim() == 2 and pool.shape[1] == 2 * kv_heads * HEAD_DIM
            and q.shape[1] % kv_heads == 0 and pool.is_contiguous())


def prompt_attention(q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, kv_heads: int,
                     scale: float) -> torch.Tensor:
    """softmax(q K^T scale) V [T, Hq, 64] bfloat16 over the K/V of the pool rows `slots` [S] (int64, S >= T):
    query t is the (S - T + t)-th position and sees positions 0 .. S - T + t; query head h reads KV head
    h / (Hq / Hkv). See `takes` for q and the pool."""
    if not takes(q, pool, kv_heads) or slots.dim() != 1 or slots.dtype != torch.int64 or not slots.is_cpu \
            or not 0 < q.shape[0] <= slots.shape[0]:
        raise ValueError(f"prompt_attention takes bfloat16 q [T, Hq, {HEAD_DIM}] over a contiguous bfloat16 pool "
                         f"[N, 2 x {kv_heads} x {HEAD_DIM}] at int64 slots [S >= T], in CPU memory; got q "
                         f"{tuple(q.shape)} {q.dtype}, pool {tuple(pool.shape)} {pool.dtype}, slots "
                         f"{tuple(slots.shape)} {slots.dtype}")
    if not available():  # also asks Linux for any AMX state, without which the tiles' instructions fault
        raise RuntimeError("the compiled prompt attention is not available here (see prompt_attention_cpu.available)")
    q, slots = q.contiguous(), slots.contiguous()
    t, heads, _ = q.shape
    out = torch.empty_like(q)
    code = _LIBRARY.load().prompt_attention(q.data_ptr(), pool.data_ptr(), pool.shape[0], slots.data_ptr(), t,
                                            slots.shape[0], kv_heads, heads // kv_heads, scale, out.data_ptr(), True)
    if code == 1:
        raise ValueError(f"prompt_attention: a slot is outside the pool's {pool.shape[0]} rows")
    if code:
        raise MemoryError("prompt_attention could not allocate its packed K and V")
    return out
