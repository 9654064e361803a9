"""What one token caches in one layer, as a row of a pool: the contract every cache and backend shares.

A pool is [rows, row_width] of `row_dtype`; one row is one token of one layer, so a token moves between
pools (device, host, hot buffer) as a single row copy, whatever the model. A layout says how to write a
row from a layer's K and V (`pack`) and how attention reads K and V back out of rows (`unpack`):

- `KVLayout` (Llama-family models): the token's K of every KV head, then its V, in the cache dtype;
- `LatentLayout` (`formats.latent`, MLA): one latent row c_kv + k_pe, read as one K head of
  kv_lora_rank + rope dims whose first kv_lora_rank dims are also the V (absorbed multi-query attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hisparse.formats.index_key import IndexKeyFormat


class RowLayout(Protocol):
    num_layers: int

    @property
    def row_width(self) -> int: ...  # elements of row_dtype per row
    @property
    def row_dtype(self) -> torch.dtype: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def v_dim(self) -> int: ...  # per head, what attention returns
    def pack(self, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor: ...
    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class RowBytes:
    """Byte counts every layout derives from its row."""

    num_layers: int

    @property
    def row_bytes(self) -> int:
        """One token's row in one layer."""
        return self.row_width * self.row_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """One token's rows across all layers."""
        return self.num_layers * self.row_bytes

    def baseline_bytes_per_token(self, index_key: IndexKeyFormat | None = None) -> int:
        """What one token costs the baseline's device pool: its row in every layer plus, with an indexer,
        its index key row in every layer."""
        return self.bytes_per_token + (0 if index_key is None else self.num_layers * index_key.row_bytes)


@dataclass
class KVLayout(RowBytes):
    """K then V of every KV head, `dtype` elements: [2 x num_kv_heads x head_dim] per row."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> KVLayout:
        """The K/V layout of a model with this config (a LlamaConfig: its weights need not be loaded)."""
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, dtype)

    @property
    def row_width(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def row_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def v_dim(self) -> int:
        return self.head_dim

    def pack(self, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """k, v [N, Hkv, D] -> rows [N, row_width]."""
        return torch.cat([k.flatten(1), v.flatten(1)], 1).to(self.dtype)

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [..., row_width] -> K, V [..., Hkv, D] each, views in the pool's dtype (attention reads them in
        the model's)."""
        k, v = rows.unflatten(-1, (2, self.num_kv_heads, self.head_dim)).unbind(-3)
        return k, v
