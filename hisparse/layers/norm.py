"""RMSNorm, the normalisation of every architecture we serve."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hisparse.kernels import rms_norm_cpu
from hisparse.kernels.c_library import autograd_records


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._compiled(x):
            return rms_norm_cpu.rms_norm(x, self.weight, self.eps)[1]
        if x.dtype == torch.float32:  # one fused op: on a CPU decode step, op count is what costs
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalised in float32 and rounded, then weighted in the model's dtype (transformers' order: the weight
        # applied in float32 before one rounding would give other bits).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of it): a residual stream's add and the norm that reads it, one call on the CPU."""
        if self._compiled(x) and delta.dtype == x.dtype and delta.is_cpu and not autograd_records(delta):
            return rms_norm_cpu.rms_norm(x, self.weight, self.eps, delta)
        x = x + delta
        return x, self(x)

    def _compiled(self, x: torch.Tensor) -> bool:
        """Whether `rms_norm_cpu` takes this call: bfloat16 on the CPU, no gradient wanted, the kernel built."""
        return (x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and x.is_cpu
                and not autograd_records(x, self.weight)
                and rms_norm_cpu.available())
