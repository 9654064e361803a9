"""How a lightning indexer's key is stored: one row of bytes per token per layer.

The key cache of the indexer is what stays on the device for every token under HiSparse, so it is
stored as DeepSeek does: a Hadamard rotation (which spreads outliers over all dims and leaves dot
products unchanged) and then e4m3 with one fp32 scale, 132 bytes for 128 dims. The query goes
through the same rotation and quantization, as in the reference's fp8_index kernel. The int8 layout
(one int8 per dim and one fp32 scale, the same 4 + head_dim bytes) is for the CPU, where torch widens
e4m3 one element at a time (about 20x the cost of widening int8).
"""

from __future__ import annotations

import functools

import torch

from hisparse.formats import fp8

INDEX_KEY_KINDS = ("float32", "int8", "fp8")


@functools.lru_cache(maxsize=16)
def _hadamard_matrix(dim: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """Built once per dim and device: on a GPU a copy per call would be one per layer per step."""
    if device.type != "cpu":
        return _hadamard_matrix(dim).to(device)
    if dim & (dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head dim, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / dim**0.5).float()


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Hadamard rotation of the last dim (the reference's `rotate_activation`)."""
    return x.float() @ _hadamard_matrix(x.shape[-1], x.device)


class IndexKeyFormat:
    """How an indexer key row is stored: float32 (exact), int8 or fp8 (head_dim int8 / e4m3 values and one
    fp32 scale for the key)."""

    def __init__(self, kind: str, head_dim: int = 128) -> None:
        if kind not in INDEX_KEY_KINDS:
            raise ValueError(f"unknown indexer key format {kind!r}; expected one of {INDEX_KEY_KINDS}")
        if kind == "fp8" and (head_dim < 1 or head_dim & (head_dim - 1)):
            raise ValueError(f"the FP8 indexer key rotates its {head_dim} dims by a Hadamard matrix, which needs a "
                             "power of two (DSA's is 128)")
        self.kind = kind
        self.head_dim = head_dim
        self.row_bytes = 4 * head_dim if kind == "float32" else fp8.index_k_fp8_row_bytes(head_dim)

    def pack(self, k: torch.Tensor) -> torch.Tensor:
        """k [N, head_dim] -> uint8 [N, row_bytes] (fp8 rows hold the Hadamard-rotated key)."""
        if self.kind == "fp8":
            return fp8.pack_index_k_fp8(hadamard(k))
        if self.kind == "int8":
            k = k.float()
            scale = k.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
            rows = torch.empty(k.shape[0], self.row_bytes, dtype=torch.uint8, device=k.device)
            rows[:, :self.head_dim] = (k / scale).round_().to(torch.int8).view(torch.uint8)
            rows[:, self.head_dim:] = scale.view(torch.uint8)
            return rows
        return k.float().contiguous().view(torch.uint8)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 rows [..., row_bytes] -> float32 keys [..., head_dim]."""
        values, scale = self.unpack_unscaled(rows)
        return values if scale is None else values * scale.unsqueeze(-1)

    def unpack_unscaled(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values [..., head_dim], scale [...] or None): key = values x scale. Scoring applies the scale
        to the scores, since ReLU(q . s v) = s ReLU(q . v) for s >= 0: one multiply per key, not per dim."""
        if self.kind == "int8":
            values = rows[..., :self.head_dim].view(torch.int8).float()
            if self.head_dim % 4 == 0 and rows.is_contiguous() and rows.data_ptr() % 4 == 0:  # scale read in place
                return values, rows.view(torch.float32)[..., self.head_dim // 4]
            return values, rows[..., self.head_dim:].contiguous().view(torch.float32).squeeze(-1)
        if self.kind == "fp8":
            return fp8.unpack_index_k_fp8(rows), None
        return rows.contiguous().view(torch.float32), None

    def prepare_query(self, q: torch.Tensor) -> torch.Tensor:
        """Put the query in the same basis and precision as the stored keys."""
        if self.kind == "fp8":
            return fp8.fake_quant_fp8(hadamard(q))
        return q.float()
