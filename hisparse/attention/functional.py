"""Attention over rows of a pool, whatever the row layout: prefill (causal or masked) and decode."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hisparse.formats.kv_layout import KVLayout, RowLayout
from hisparse.kernels import decode_attention_cpu, kv_rows_cpu
from hisparse.memory.rows import gather_rows

_QUERY_CHUNK = 256  # bounds the [heads, chunk, context] scores of a masked prompt chunk
# Keys of a prompt chunk's causal attention are padded to a multiple of this (masked out): SDPA's CPU kernel took
# 1.25-1.35x as long over 497-1527 keys off a multiple of 16 as over the same keys padded (509 queries over 509 /
# 1018 / 1527 keys: 1.26 / 2.29 / 3.26 ms against 0.93 / 1.84 / 2.77 ms, bfloat16, 9 query heads over 3).
KEY_ALIGN = 16


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q over k/v where q are the last q.shape[0] of k's tokens. q [T, Hq, Dk], k [S, Hkv, Dk],
    v [S, Hkv, Dv] -> [T, Hq, Dv]. mask: `causal_mask(T, S, q.dtype)`, when the caller keeps one for many
    layers (else it is built here); with `causal_mask(T, S, q.dtype, width=W)`, k and v hold W rows, the last
    W - S of them padding the mask hides.

    Tensors go to SDPA as 4-D: on the CPU its 3-D path is an order of magnitude slower. K/V come in the
    cache's dtype and are read in the query's (the model's): a bfloat16 model's K/V were bfloat16 before a
    float32 cache stored them, so the round trip is exact.
    """
    tq, tk = q.shape[0], k.shape[0]
    if tq == tk:
        return _sdpa(q, k, v, None, scale, causal=True)
    return _sdpa(q, k, v, causal_mask(tq, tk, q.dtype, q.device) if mask is None else mask, scale)


def causal_mask(tq: int, tk: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                width: int | None = None) -> torch.Tensor:
    """The additive mask [tq, width] (0 or -inf) of the last tq of tk tokens attending causally; columns from tk
    to `width` (default tk: none), padding keys, are -inf. SDPA turns a boolean mask into this on every call (1.3
    of 4.3 ms for 512 bfloat16 queries over 1536 keys on our CPU)."""
    width = tk if width is None else width
    future = torch.arange(width, device=device).unsqueeze(0) > torch.arange(tk - tq, tk, device=device).unsqueeze(1)
    return torch.zeros(tq, width, dtype=dtype, device=device).masked_fill_(future, float("-inf"))


def aligned_key_count(count: int) -> int:
    """`count` keys rounded up to a multiple of KEY_ALIGN: how many a prompt chunk's causal attention reads."""
    return -(-count // KEY_ALIGN) * KEY_ALIGN


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of q [T, Hq, Dk] over k [S, Hkv, Dk] / v [S, Hkv, Dv] where allowed [T, S] (sparse prefill:
    each query over its own top-k). Queries go in chunks, so the scores never exceed [Hq, 256, S]."""
    return torch.cat([_sdpa(q[i:i + _QUERY_CHUNK], k, v, allowed[i:i + _QUERY_CHUNK], scale)
                      for i in range(0, q.shape[0], _QUERY_CHUNK)])


def _sdpa(q, k, v, mask, scale, causal=False):
    k, v = k.to(q.dtype), v.to(q.dtype)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """One query per request over its own rows. q [B, Hq, Dk]; k [B, L, Hkv, Dk]; v [B, L, Hkv, Dv]; mask
    [B, L] or None. Returns [B, Hq, Dv].

    The query heads that share a KV head go in SDPA's query-length axis, so K/V are read once per KV head
    and never expanded. Unlike prefill, decode is bound by reading K/V, so it runs in the wider of the two
    dtypes: narrowing a float32 cache's rows for a bfloat16 model cost more than the attention itself.
    """
    b, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    dtype = torch.promote_types(q.dtype, k.dtype)
    k, v = k.to(dtype), v.to(dtype)
    qg = q.to(dtype).view(b, hkv, hq // hkv, d)
    # On the CPU an all-true mask (equal lengths, or a full top-k) is dropped: SDPA turns a boolean mask into an
    # additive float one on every call. On a GPU finding out would wait for the device, once per layer.
    drop = mask is None or (mask.device.type == "cpu" and bool(mask.all()))
    attn_mask = None if drop else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
                                         scale=scale)
    return out.reshape(b, hq, dv).to(q.dtype)


def write_rows(pool: torch.Tensor, slots: torch.Tensor, layout: RowLayout, k: torch.Tensor,
               v: torch.Tensor | None) -> None:
    """pool[slots] <- the rows of the new tokens' k, v [N, Hkv, D]: one compiled copy where K/V rows lie on the CPU
    in the pool's dtype (`kernels.kv_rows_cpu`), else packed and copied by PyTorch."""
    if _writes_compiled(layout, pool, k, v):
        kv_rows_cpu.write_kv_rows(pool, slots, k, v)
    else:
        pool.index_copy_(0, slots, layout.pack(k, v).to(pool.device))


def _writes_compiled(layout: RowLayout, pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> bool:
    return isinstance(layout, KVLayout) and v is not None and kv_rows_cpu.takes(pool, k, v) and kv_rows_cpu.available()


def _attends_compiled(layout: RowLayout, pool: torch.Tensor, q: torch.Tensor) -> bool:
    return isinstance(layout, KVLayout) and decode_attention_cpu.takes(pool, q) and decode_attention_cpu.available()


def compiled_rows(layout: RowLayout, pool: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor | None) -> bool:
    """Whether `write_rows` and `attend_rows` run their C kernels on these (a pool of one layer, or of all): what a
    decode step binds once (`kernels.kv_rows_cpu.bind_write_kv_rows`, `decode_attention_cpu.bind_*`)."""
    return _writes_compiled(layout, pool, k, v) and _attends_compiled(layout, pool, q)


def attend_rows(pool: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, scale: float,
                layout: RowLayout) -> torch.Tensor:
    """Decode attention of q [B, Hq, Dk], one query per request, over the pool rows rows [B, L] (-1: none).
    On the CPU, K/V rows of float32 or bfloat16 are read where they lie (`kernels.decode_attention_cpu`);
    other layouts and devices gather and unpack the rows for SDPA."""
    if _attends_compiled(layout, pool, q):
        return decode_attention_cpu.sparse_decode_attention(pool, rows, q, scale, layout.num_kv_heads,
                                                            layout.head_dim)
    k, v = layout.unpack(gather_rows(pool, rows.clamp(min=0)))
    return decode_attention(q, k, v, rows >= 0, scale)


def attend_prompt(pool: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, scale: float, layout: RowLayout,
                  selection: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one request's prompt chunk q [T, Hq, Dk] (its last T positions) over the pool rows of its
    positions 0..S-1 (`slots` [S]): causal (with `mask`, a kept `causal_mask`; then `slots` may go on past S with
    padding rows that the mask hides), or each query over its own `selection` [T, K] (-1 padded)."""
    # The packed rows cross to the query's device, then unpack there: V is a view of K in the latent layout.
    k, v = layout.unpack(gather_rows(pool, slots.to(pool.device)).to(q.device))
    if selection is None:
        return causal_attention(q, k, v, scale, mask)
    s = slots.shape[0]
    # Padding (-1) scatters into a spare last column, which is then dropped.
    allowed = torch.zeros(q.shape[0], s + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(1, torch.where(selection >= 0, selection, s), True)
    return masked_attention(q, k, v, allowed[:, :s], scale)
