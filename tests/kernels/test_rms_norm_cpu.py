"""The compiled RMSNorm gives PyTorch's bfloat16 RMSNorm (its roundings in its order), with the residual add."""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels import rms_norm_cpu
from hisparse.layers.norm import RMSNorm

needs_kernel = pytest.mark.skipif(not rms_norm_cpu.available(), reason="no gcc here")


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's PyTorch path in bfloat16: normalised in float32 and rounded, then weighted and rounded."""
    return weight * torch.nn.functional.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def norm(dim: int = 576, eps: float = 1e-5) -> RMSNorm:
    module = RMSNorm(dim, eps).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(torch.randn(dim) * 0.5 + 1)
    return module


@needs_kernel
def test_the_kernel_gives_pytorchs_bits_and_the_rounded_residual_sum():
    torch.manual_seed(0)
    module = norm()
    x, delta = (torch.randn(2, 33, 576) * 3).bfloat16(), torch.randn(2, 33, 576).bfloat16()
    weight = module.weight.detach()
    total, out = rms_norm_cpu.rms_norm(x, weight, module.eps, delta)
    assert torch.equal(total, x + delta)
    want = torch_rms_norm(x + delta, weight, module.eps)
    # only the sum of squares is added up in another order: at most one bfloat16 step, rarely
    assert (out != want).float().mean() < 1e-3
    assert torch.allclose(out.float(), want.float(), rtol=2**-7, atol=0)
    alone, out_alone = rms_norm_cpu.rms_norm(x, weight, module.eps)
    assert alone is x
    assert (out_alone != torch_rms_norm(x, weight, module.eps)).float().mean() < 1e-3


@needs_kernel
def test_the_module_uses_the_kernel_without_gradients_and_pytorch_with_them(monkeypatch):
    torch.manual_seed(1)
    module = norm(64)
    x, delta = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    calls = []
    original = rms_norm_cpu.rms_norm
    monkeypatch.setattr(rms_norm_cpu, "rms_norm", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        total, out = module.add_and_norm(x, delta)
        assert torch.equal(total, x + delta) and torch.equal(out, module(total))
    assert len(calls) == 2
    x.requires_grad_(True)
    module(x).float().sum().backward()  # the PyTorch path: gradients flow
    assert x.grad is not None and module.weight.grad is not None and len(calls) == 2


@needs_kernel
def test_refusals():
    weight = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bfloat16 rows \[\.\.\., 64\]"):
        rms_norm_cpu.rms_norm(torch.randn(2, 64), weight, 1e-5)
    with pytest.raises(ValueError, match=r"bfloat16 rows \[\.\.\., 64\]"):
        rms_norm_cpu.rms_norm(torch.randn(2, 32).bfloat16(), weight, 1e-5)
    with pytest.raises(ValueError, match="a delta shaped alike"):
        rms_norm_cpu.rms_norm(torch.randn(2, 64).bfloat16(), weight, 1e-5, torch.randn(1, 64).bfloat16())
    x = torch.randn(2, 64).bfloat16()
    for out in (torch.empty(1, 64).bfloat16(), torch.empty(64, 2).bfloat16().t(), torch.empty(2, 64)):
        with pytest.raises(ValueError, match=r"bfloat16 rows \[\.\.\., 64\]"):  # where a bound call would write
            rms_norm_cpu.bind_rms_norm(x, weight, 1e-5, out)
    with pytest.raises(ValueError, match="its total"):
        rms_norm_cpu.bind_rms_norm(x, weight, 1e-5, torch.empty_like(x), x, torch.empty(1, 64).bfloat16())


def test_a_delta_that_wants_gradients_takes_pytorchs_path():
    module = norm(64).requires_grad_(False)
    x, delta = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16().requires_grad_(True)
    total, out = module.add_and_norm(x, delta)
    out.float().sum().backward()
    assert total.grad_fn is not None and delta.grad is not None
