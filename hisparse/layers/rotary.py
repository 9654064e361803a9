"""Rotary position embeddings in the two layouts the field uses.

Llama and the DSA indexer of DeepSeek-V3.2 rotate the two halves of a head ("half-split"); MLA and
GLM-5's indexer rotate adjacent pairs ("interleaved"). Both read the same cos/sin table, indexed by
absolute position, so a token's rotation never depends on where its K/V row is stored.
"""

from __future__ import annotations

import torch


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


class RotaryEmbedding:
    """cos/sin table for positions [0, max_positions), built once in float64 then cast."""

    def __init__(self, dim: int, max_positions: int, theta: float, inv_freq: torch.Tensor | None = None,
                 attention_scale: float = 1.0) -> None:
        self.dim = dim
        inv = rope_inv_freq(dim, theta) if inv_freq is None else inv_freq.double()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        self.cos = (freqs.cos() * attention_scale).float()
        self.sin = (freqs.sin() * attention_scale).float()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [*positions.shape, dim/2]."""
        return self.cos[positions], self.sin[positions]


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split layout. x: [..., T, H, dim]; cos/sin: [..., T, dim/2]."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved layout: pairs (0,1), (2,3), ... rotate together. Shapes as apply_rope_half."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
