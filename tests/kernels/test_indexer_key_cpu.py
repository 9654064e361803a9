"""The compiled indexer key is PyTorch's LayerNorm then RoPE, and inference derives every key with it."""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels import indexer_key_cpu
from hisparse.layers.indexer import IndexerConfig, LlamaIndexer
from hisparse.layers.rotary import RotaryEmbedding

needs_kernel = pytest.mark.skipif(not indexer_key_cpu.available(), reason="no gcc here")


def indexer_and_rotation(tokens: int):
    torch.manual_seed(0)
    indexer = LlamaIndexer(96, 64, IndexerConfig(n_heads=2, head_dim=64, rope_dim=32))
    with torch.no_grad():
        indexer.k_norm.weight.copy_(torch.randn(64))
        indexer.k_norm.bias.copy_(torch.randn(64))
    cos, sin = RotaryEmbedding(64, 512, 10000.0).cos_sin(torch.arange(100, 100 + tokens))
    return indexer, indexer.rotation(cos, sin)


def pytorch_key(indexer: LlamaIndexer, projected: torch.Tensor, rotation) -> torch.Tensor:
    start = indexer.n_heads * indexer.head_dim
    k = indexer.k_norm(projected[:, start:start + indexer.head_dim].float())
    return rotation(k.unsqueeze(1))[:, 0]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_gives_pytorchs_key(dtype):
    indexer, rotation = indexer_and_rotation(70)
    projected = (torch.randn(70, 2 * 64 + 64 + 2) * 3).to(dtype)
    with torch.no_grad():
        got, want = indexer.key_from_projection(projected, rotation), pytorch_key(indexer, projected, rotation)
    assert got.dtype == torch.float32 and got.shape == (70, 64)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    # past the rotated 32 dims the normalised key passes through
    normed = indexer.k_norm(projected[:, 128:192].float()).detach()
    assert torch.allclose(got[:, 32:], normed[:, 32:], rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_weights_kernel_gives_finish_weights_bits(dtype):
    indexer, _ = indexer_and_rotation(1)
    projected = (torch.randn(70, 2 * 64 + 64 + 2) * 30).to(dtype)
    out = torch.empty(70, 2)
    indexer_key_cpu.bind_indexer_weights(projected, 192, indexer.weight_scales, out)()
    assert torch.equal(out, indexer.finish_weights(projected[:, 192:]))
    with pytest.raises(ValueError, match="indexer_weights takes"):
        indexer_key_cpu.bind_indexer_weights(projected, 193, indexer.weight_scales, out)  # past the row


@needs_kernel
def test_every_path_of_inference_derives_the_same_key(monkeypatch):
    """The queries' path and the key-only path give the same bytes (a step's key never depends on which ran)."""
    indexer, rotation = indexer_and_rotation(5)
    projected = torch.randn(5, 2 * 64 + 64 + 2).bfloat16()
    calls = []
    original = indexer_key_cpu.indexer_key
    monkeypatch.setattr(indexer_key_cpu, "indexer_key", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        _, key, _ = indexer.from_projection(projected, rotation)
        assert torch.equal(key, indexer.key_from_projection(projected, rotation))
    assert len(calls) == 2


@needs_kernel
def test_refusals():
    indexer, rotation = indexer_and_rotation(3)
    norm = indexer.k_norm
    with pytest.raises(ValueError, match=r"rows \[N, >= 192\]"):
        indexer_key_cpu.indexer_key(torch.randn(3, 150), 128, norm.weight, norm.bias, 1e-6, rotation.cos,
                                    rotation.sin, rotation.half)
    with pytest.raises(ValueError, match=r"cos, sin \[N, 1, 64\]"):
        indexer_key_cpu.indexer_key(torch.randn(4, 194), 128, norm.weight, norm.bias, 1e-6, rotation.cos,
                                    rotation.sin, rotation.half)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        indexer_key_cpu.indexer_key(torch.randn(3, 194).half(), 128, norm.weight, norm.bias, 1e-6, rotation.cos,
                                    rotation.sin, rotation.half)


def test_a_projection_that_wants_gradients_takes_pytorchs_path():
    indexer, rotation = indexer_and_rotation(3)
    indexer.requires_grad_(False)
    projected = torch.randn(3, 2 * 64 + 64 + 2, requires_grad=True)
    indexer.key_from_projection(projected, rotation).sum().backward()
    assert projected.grad is not None
