"""The compiled SwiGLU gives PyTorch's bfloat16 silu(gate) * up (its roundings in its order), on one thread or
the team, and the MLP runs it where it can."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hisparse.kernels import swiglu_cpu
from hisparse.layers.linear import PACKED_UP_TO_BATCH

needs_kernel = pytest.mark.skipif(not swiglu_cpu.available(), reason="no gcc here")


def torch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@needs_kernel
@pytest.mark.parametrize("rows, width", [(1, 1536), (7, 40), (3, 17), (600, 1536)])
def test_the_kernel_gives_pytorchs_bits_but_at_a_rounding_boundary(rows, width, monkeypatch):
    """Widths past and short of the vector paths' 16, rows on one thread and on the team: its exponential is not
    Sleef's, so a silu on a bfloat16 rounding boundary may round the other way, rarely and by one step."""
    torch.manual_seed(rows * 100 + width)
    gate_up = (torch.randn(rows, 2 * width) * 4).bfloat16()
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, -120.0, 1e-3])  # 0, large, e^-g past float32's range
    want = torch_swiglu(gate_up)
    got = swiglu_cpu.swiglu(gate_up)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, width)
    assert (got != want).float().mean() < 1e-3
    assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)
    monkeypatch.setattr(swiglu_cpu, "PARALLEL_MIN_VALUES", 0 if rows * width < 16384 else 1 << 62)
    assert torch.equal(swiglu_cpu.swiglu(gate_up), got)  # the team's split changes no bits


@needs_kernel
def test_rows_it_cannot_read_are_refused():
    for bad in (torch.zeros(2, 8), torch.zeros(2, 7, dtype=torch.bfloat16), torch.zeros(4, 8).bfloat16().t(),
                torch.zeros(8, dtype=torch.bfloat16)):
        assert not swiglu_cpu.takes(bad)
        with pytest.raises(ValueError, match="swiglu takes contiguous bfloat16 rows"):
            swiglu_cpu.swiglu(bad)
    assert swiglu_cpu.swiglu(torch.zeros(0, 8, dtype=torch.bfloat16)).shape == (0, 4)


@needs_kernel
def test_the_mlp_uses_the_kernel_where_nothing_records_gradients(llama_bf16, monkeypatch):
    mlp = llama_bf16.layers[3].mlp
    x = torch.randn(5, mlp.gate_proj.in_features).bfloat16()
    calls = []
    original = swiglu_cpu.swiglu
    monkeypatch.setattr(swiglu_cpu, "swiglu", lambda g: calls.append(1) or original(g))
    with torch.no_grad():
        out = mlp(x)
        want = mlp.down_proj(torch_swiglu(torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1)))
    assert len(calls) == 1
    # Within bfloat16's rounding of the activations, whose largest are in the hundreds in this layer: an output near 0
    # may sum them in another order (the fused gate_up's kernel against two matmuls) and differ by one of their steps
    scale = float(want.float().abs().max())
    torch.testing.assert_close(out.float(), want.float(), rtol=0.02, atol=0.01 * scale)
    long = torch.randn(PACKED_UP_TO_BATCH[torch.bfloat16] + 1, mlp.gate_proj.in_features).bfloat16()
    long.requires_grad_(True)
    mlp(long).float().sum().backward()  # the plain weights' matmul records: PyTorch's path, gradients flow
    assert long.grad is not None and len(calls) == 1
