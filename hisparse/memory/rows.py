"""Reading token rows out of a pool, and decode attention over them: the one way every cache does it."""

from __future__ import annotations

import torch


def gather_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pool[index] for a [rows, W] pool and an index of any shape. Always through index_select: torch's
    advanced indexing on a large CPU pool costs milliseconds however few rows it reads."""
    return pool.index_select(0, index.reshape(-1)).view(*index.shape, pool.shape[1])


def split_kv(rows: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2 * Hkv * D] pool rows -> K, V of shape [..., Hkv, D] each, in the pool's dtype (attention reads
    them in the model's)."""
    k, v = rows.unflatten(-1, (2, num_kv_heads, head_dim)).unbind(-3)
    return k, v


def attend_rows(pool: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, scale: float, num_kv_heads: int,
                head_dim: int) -> torch.Tensor:
    """Decode attention of q [B, Hq, D], one query per request, over the pool rows rows [B, L] (-1: none).
    On the CPU the rows are read where they lie (`kernels.decode_attention_cpu`); elsewhere, and for pool
    dtypes the kernel does not read, they are gathered for SDPA (`layers.attention.decode_attention`)."""
    if pool.device.type == "cpu" and pool.dtype in (torch.float32, torch.bfloat16):
        from hisparse.kernels.decode_attention_cpu import sparse_decode_attention

        return sparse_decode_attention(pool, rows, q, scale, num_kv_heads, head_dim)
    from hisparse.layers.attention import decode_attention

    ks, vs = split_kv(gather_rows(pool, rows.clamp(min=0)), num_kv_heads, head_dim)
    return decode_attention(q, ks, vs, rows >= 0, scale)
