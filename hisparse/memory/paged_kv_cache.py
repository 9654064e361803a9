"""The baseline: every token's K/V on the device, in a token-granular pool behind per-request page tables.

This is what HiSparse is measured against under the same device budget. One pool row holds one token's
K and V of one layer, side by side, so a token moves between pools as a single row copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hisparse.engine.forward_batch import ForwardBatch
from hisparse.engine.request import Request
from hisparse.layers.attention import causal_attention, decode_attention
from hisparse.memory.slot_allocator import SlotAllocator


@dataclass
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @property
    def row_size(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """Device bytes of one token's K/V across all layers."""
        return self.num_layers * self.row_size * torch.tensor([], dtype=self.dtype).element_size()


@dataclass
class PagedAllocation:
    slots: torch.Tensor  # int64 [max_total_tokens]: pool row of each position


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_slots: int, scale: float, device: str = "cpu") -> None:
        self.layout = layout
        self.scale = scale
        self.kv = torch.zeros(layout.num_layers, num_slots, layout.row_size, dtype=layout.dtype, device=device)
        self.allocator = SlotAllocator(num_slots)

    @classmethod
    def from_budget(cls, layout: KVLayout, budget_bytes: int, scale: float, device: str = "cpu"):
        return cls(layout, budget_bytes // layout.bytes_per_token, scale, device)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_slots

    def can_admit(self, request: Request) -> bool:
        return request.max_total_tokens <= self.allocator.num_free

    def admit(self, request: Request) -> None:
        request.kv = PagedAllocation(torch.from_numpy(self.allocator.allocate(request.max_total_tokens)))

    def release(self, request: Request) -> None:
        if request.kv is not None:
            self.allocator.free(request.kv.slots.numpy())
            request.kv = None

    def bind(self, batch: ForwardBatch) -> PagedAttention:
        return PagedAttention(self, batch)

    def usage(self) -> dict[str, int]:
        return {"device_slots_total": self.allocator.num_slots, "device_slots_used": self.allocator.num_used}


def split_kv(rows: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2 * Hkv * D] pool rows -> K, V of shape [..., Hkv, D] each (float32 for the math)."""
    k, v = rows.float().unflatten(-1, (2, num_kv_heads, head_dim)).unbind(-3)
    return k, v


class PagedAttention:
    """The attention backend for one step over a PagedKVCache."""

    def __init__(self, cache: PagedKVCache, batch: ForwardBatch) -> None:
        self.cache = cache
        self.batch = batch
        self.write_rows = torch.cat([s.request.kv.slots[s.start:s.end] for s in batch.spans])
        self.prefill = batch.prefill_spans
        self.decode = batch.decode_spans
        if self.decode:
            lengths = torch.tensor([s.end for s in self.decode])
            width = int(lengths.max())
            self.decode_rows = torch.stack([
                F.pad(s.request.kv.slots[:s.end], (0, width - s.end)) for s in self.decode])
            self.decode_mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
            self.decode_offsets = torch.tensor([s.offset for s in self.decode])

    def attend(self, layer, q, k, v, index_q=None, index_k=None, index_w=None):
        layout = self.cache.layout
        pool = self.cache.kv[layer]
        pool.index_copy_(0, self.write_rows, torch.cat([k.flatten(1), v.flatten(1)], 1).to(pool.dtype))
        out = torch.empty_like(q)
        for span in self.prefill:
            rows = pool[span.request.kv.slots[:span.end]]
            ks, vs = split_kv(rows, layout.num_kv_heads, layout.head_dim)
            sl = slice(span.offset, span.offset + span.length)
            out[sl] = causal_attention(q[sl], ks, vs, self.cache.scale)
        if self.decode:
            ks, vs = split_kv(pool[self.decode_rows], layout.num_kv_heads, layout.head_dim)
            out[self.decode_offsets] = decode_attention(q[self.decode_offsets], ks, vs, self.decode_mask,
                                                        self.cache.scale)
        return out
