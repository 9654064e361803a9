"""The MLA latent row: what a DSA model (DeepSeek-V3.2, GLM-5) caches per token per layer.

One row holds c_kv (kv_lora_rank, 512) then the roped shared key k_pe (64). Attention in the absorbed form
reads it as a single K head of 576 dims whose first 512 are also the V (`LatentLayout`), so the caches and
backends treat it as any other row. Rows are uint8 bytes whatever the format, so a memory hierarchy copies
them host <-> device without knowing it: float32 (exact, for parity tests), bfloat16 (1152 bytes for DSA)
or the FP8 sparse layout (656 bytes: 512 e4m3, four fp32 tile scales, 64 bf16 rope dims).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse.formats import fp8
from hisparse.formats.kv_layout import RowBytes

LATENT_KINDS = ("float32", "bfloat16", "fp8")


class LatentFormat:
    """How one latent row is stored: float32 (exact, for parity tests), bfloat16 (1152 bytes for
    DSA) or the FP8 sparse layout (656 bytes). Rows are always uint8 so that a memory hierarchy can
    copy them host<->device without knowing the format."""

    def __init__(self, kind: str, kv_lora_rank: int = 512, rope_dim: int = 64) -> None:
        if kind not in LATENT_KINDS:
            raise ValueError(f"unknown latent format {kind!r}; expected one of {LATENT_KINDS}")
        self.kind = kind
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        width = kv_lora_rank + rope_dim
        if kind == "float32":
            self.row_bytes = 4 * width
        elif kind == "bfloat16":
            self.row_bytes = 2 * width
        else:
            self.row_bytes = fp8.mla_fp8_row_bytes(kv_lora_rank, rope_dim)

    def pack(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [N, kv_lora_rank + rope_dim] -> uint8 [N, row_bytes]."""
        if self.kind == "fp8":
            return fp8.pack_mla_fp8(latent, self.kv_lora_rank)
        dtype = torch.float32 if self.kind == "float32" else torch.bfloat16
        return latent.to(dtype).contiguous().view(torch.uint8)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [..., row_bytes] -> float32 [..., kv_lora_rank + rope_dim]."""
        if self.kind == "fp8":
            return fp8.unpack_mla_fp8(rows, self.kv_lora_rank)
        dtype = torch.float32 if self.kind == "float32" else torch.bfloat16
        return rows.contiguous().view(dtype).float()


@dataclass
class LatentLayout(RowBytes):
    """Rows of a `LatentFormat` in every layer, read by attention as one K head (the whole latent) whose first
    kv_lora_rank dims are the V."""

    num_layers: int
    format: LatentFormat

    @property
    def row_width(self) -> int:
        return self.format.row_bytes

    @property
    def row_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def v_dim(self) -> int:
        return self.format.kv_lora_rank

    def pack(self, k: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        """k [N, 1, kv_lora_rank + rope_dim] (the latent; v is its prefix and not passed) -> uint8 rows."""
        return self.format.pack(k.flatten(1))

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 rows [..., row_bytes] -> K [..., 1, C + R] and V [..., 1, C] float32 (V a view of K)."""
        k = self.format.unpack(rows).unsqueeze(-2)
        return k, k[..., :self.format.kv_lora_rank]
