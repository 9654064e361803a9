"""RMSNorm, the normalisation of every architecture we serve."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op: on a CPU decode step, op count is what costs
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalised in float32 and rounded, then weighted in the model's dtype (transformers' order: the weight
        # applied in float32 before one rounding would give other bits).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
