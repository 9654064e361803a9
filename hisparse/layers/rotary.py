"""Rotary position embeddings in the two layouts the field uses.

Llama and the DSA indexer of DeepSeek-V3.2 rotate the two halves of a head ("half-split"); MLA and
GLM-5's indexer rotate adjacent pairs ("interleaved"). Both read the same cos/sin table, indexed by
absolute position, so a token's rotation never depends on where its K/V row is stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hisparse.kernels import rotary_cpu
from hisparse.kernels.c_library import autograd_records


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))


class RotaryEmbedding:
    """cos/sin table for positions [0, max_positions), built once in float64 then cast; copied once to each
    device that asks for positions there."""

    def __init__(self, dim: int, max_positions: int, theta: float, inv_freq: torch.Tensor | None = None,
                 attention_scale: float = 1.0) -> None:
        self.dim = dim
        inv = rope_inv_freq(dim, theta) if inv_freq is None else inv_freq.double()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64, device="cpu"), inv.cpu())
        self.cos = (freqs.cos() * attention_scale).float()
        self.sin = (freqs.sin() * attention_scale).float()
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [*positions.shape, dim/2], on the positions' device."""
        if positions.device.type == "cpu":
            return self.cos[positions], self.sin[positions]
        tables = self._on_device.get(positions.device)
        if tables is None:
            tables = self._on_device[positions.device] = (self.cos.to(positions.device), self.sin.to(positions.device))
        return tables[0][positions], tables[1][positions]


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


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 for scale > 1, else 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_positions: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """YaRN inverse frequencies (DeepSeek-V3 / HF convention).

    High-frequency pairs (more than `beta_fast` rotations over the original context) keep their
    frequency; low-frequency pairs (fewer than `beta_slow`) are divided by `factor`; a linear ramp
    blends the pairs in between. The cos/sin attention factor and the softmax mscale are separate
    (see `yarn_get_mscale`) because checkpoints configure them separately.
    """

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max_positions / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = rope_inv_freq(dim, theta)
    interpolation = extrapolation / factor
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


@dataclass(frozen=True)
class HalfSplitRotation:
    """One batch's half-split RoPE, built once and applied by every layer as one multiply-add (the same numbers as
    `apply_rope_half`, in a third of the ops: a decode step at small batch is bound by their count).

    x * cos + swap(x) * sin, with cos = [c, c, 1...] and sin = [-s, s, 0...] over the first `2 * half` dims
    (the rest pass through unchanged) and swap exchanging those dims' two halves. cos, sin: [N, 1, head_dim]."""

    cos: torch.Tensor
    sin: torch.Tensor
    half: int

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, head_dim: int | None = None):
        """cos, sin [N, half] (a `RotaryEmbedding.cos_sin`); head_dim: the heads' dims, when more are rotated."""
        half = cos.shape[-1]
        c, s = cos.to(dtype).unsqueeze(-2), sin.to(dtype).unsqueeze(-2)
        rest = (head_dim or 2 * half) - 2 * half
        keep, drop = c.new_ones(*c.shape[:-1], rest), c.new_zeros(*c.shape[:-1], rest)
        return cls(torch.cat([c, c, keep], -1), torch.cat([-s, s, drop], -1), half)

    def _compiled(self) -> rotary_cpu.RotationTables:
        """The tables as the C kernel reads them, checked on the first layer's call and kept for the others."""
        tables = self.__dict__.get("_tables")
        if tables is None:
            tables = rotary_cpu.RotationTables(self.cos.contiguous(), self.sin.contiguous(), self.half)
            object.__setattr__(self, "_tables", tables)  # a frozen dataclass: a cache, not a field
        return tables

    def rows(self, rows: torch.Tensor) -> HalfSplitRotation:
        """The rotation of these rows of the batch alone; built once for the same `rows` tensor (every layer of a
        step asks with the backend's)."""
        cached = self.__dict__.get("_rows")
        if cached is None or cached[0] is not rows:
            cached = (rows, HalfSplitRotation(self.cos[rows], self.sin[rows], self.half))
            object.__setattr__(self, "_rows", cached)  # a cache, as `_tables`
        return cached[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H, head_dim] -> rotated, the same shape and dtype."""
        if rotary_cpu.takes(x, self.cos) and not autograd_records(x) and rotary_cpu.available():
            return self._compiled().rotate(x)
        h = self.half
        if 2 * h == x.shape[-1]:  # every dim rotates: the swap is a roll, one op instead of three slices and a cat
            swapped = x.roll(h, -1)
        else:
            swapped = torch.cat([x[..., h:2 * h], x[..., :h], x[..., 2 * h:]], dim=-1)
        return x * self.cos + swapped * self.sin
