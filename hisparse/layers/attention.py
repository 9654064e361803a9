"""The one door through which every attention layer reads and writes the KV cache.

A model computes q, k and v and hands them to an `AttentionBackend`; the backend alone knows where
the cache lives (a plain tensor, a paged device pool, a host pool behind a hot buffer) and which past
tokens a query may see (all of them, or the top-k its indexer picked). That keeps the model code free
of the memory hierarchy, and lets the engine swap dense, sparse and offloaded attention without touching
the model.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               index_q: torch.Tensor | None = None, index_k: torch.Tensor | None = None,
               index_w: torch.Tensor | None = None) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] for the N new tokens of the batch (already rotated).

        index_*: the layer's lightning-indexer query [N, H_I, d_I], key [N, d_I] and per-head weights
        [N, H_I] for the same tokens, when the model has an indexer. Returns [N, Hq, D].
        """
        ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q over k/v where q are the last q.shape[0] of k's tokens. [T, H, D] layouts.

    Tensors go to SDPA as 4-D: on the CPU its 3-D path is an order of magnitude slower. K/V come in the
    cache's dtype and are read in the query's (the model's): a bfloat16 model's K/V were bfloat16 before a
    float32 cache stored them, so the round trip is exact.
    """
    tq, tk = q.shape[0], k.shape[0]
    k, v = k.to(q.dtype), v.to(q.dtype)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if tq == tk:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(tk - tq, tk).unsqueeze(1)
        mask = torch.arange(tk).unsqueeze(0) <= rows
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """One query per request over its own rows. q [B, Hq, D]; k, v [B, L, Hkv, D]; mask [B, L] or None.

    The query heads that share a KV head go in SDPA's query-length axis, so K/V are read once per KV head
    and never expanded. Unlike prefill, decode is bound by reading K/V, so it runs in the wider of the two
    dtypes: narrowing a float32 cache's rows for a bfloat16 model cost more than the attention itself
    (batch 16: 35 ms of a 220 ms step).
    """
    b, hq, d = q.shape
    hkv = k.shape[2]
    dtype = torch.promote_types(q.dtype, k.dtype)
    k, v = k.to(dtype), v.to(dtype)
    qg = q.to(dtype).view(b, hkv, hq // hkv, d)
    # An all-true mask (equal lengths, or a full top-k) is dropped: SDPA turns a boolean mask into an additive
    # float one on every call.
    attn_mask = None if mask is None or bool(mask.all()) else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
                                         scale=scale)
    return out.reshape(b, hq, d).to(q.dtype)


class SingleSequenceCache:
    """The simplest backend: one sequence, its K/V appended to growing tensors, dense causal attention.

    Used by tests and by training, where no engine is present.
    """

    def __init__(self, num_layers: int, scale: float) -> None:
        self.scale = scale
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer, q, k, v, index_q=None, index_k=None, index_w=None):
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k])
            v = torch.cat([self.v[layer], v])
        self.k[layer], self.v[layer] = k, v
        return causal_attention(q, k, v, self.scale)
