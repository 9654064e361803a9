"""The Llama lightning indexer: its scores against a plain float64 reference, its sizes, its weights file."""

from __future__ import annotations

import math

import torch

from hisparse.attention.index_selection import index_scores
from hisparse.layers.indexer import IndexerConfig, LlamaIndexer
from hisparse.layers.rotary import RotaryEmbedding

HIDDEN, MODEL_HEAD_DIM, THETA = 96, 64, 1e5


def reference_scores(indexer: LlamaIndexer, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """I[t, s] = sum_h w_h(x_t) ReLU(q_th . k_s) / sqrt(d), everything in float64, RoPE from its definition."""
    x = x.double()
    h, d, r = indexer.n_heads, indexer.head_dim, indexer.rope_dim
    wq, wk, ww = (m.weight.double() for m in (indexer.wq_b, indexer.wk, indexer.weights_proj))
    q = (x @ wq.T).view(-1, h, d)
    k = x @ wk.T
    k = (k - k.mean(-1, keepdim=True)) / torch.sqrt(k.var(-1, unbiased=False, keepdim=True) + 1e-6)
    k = k * indexer.k_norm.weight.double() + indexer.k_norm.bias.double()
    # RoPE of `r` dims, theta THETA, half-split: pair (i, i + r/2) rotates by position * THETA^(-2i/r).
    freq = THETA ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    angle = positions.double()[:, None] * freq[None, :]
    cos, sin = angle.cos(), angle.sin()

    def rope(v):  # v [T, ..., d]
        a, b, rest = v[..., :r // 2], v[..., r // 2:r], v[..., r:]
        c, s = (t.view(t.shape[0], *([1] * (v.dim() - 2)), -1) for t in (cos, sin))
        return torch.cat([a * c - b * s, b * c + a * s, rest], -1)

    q, k = rope(q), rope(k)
    w = (x @ ww.T) / math.sqrt(h)
    return torch.einsum("th,ths->ts", w, torch.einsum("thd,sd->ths", q, k).relu()) / math.sqrt(d)


def test_indexer_scores_match_a_float64_reference_on_random_inputs():
    torch.manual_seed(0)
    config = IndexerConfig(n_heads=4, head_dim=64, rope_dim=32)
    indexer = LlamaIndexer(HIDDEN, MODEL_HEAD_DIM, config)
    with torch.no_grad():
        indexer.k_norm.weight.uniform_(0.5, 1.5)
        indexer.k_norm.bias.normal_(0, 0.1)
    rotary = RotaryEmbedding(MODEL_HEAD_DIM, 4096, THETA)
    positions = torch.randint(0, 4096, (40,))
    x = torch.randn(40, HIDDEN)
    cos, sin = rotary.cos_sin(positions)
    q, k, w = indexer(x, cos, sin)
    assert q.shape == (40, 4, 64) and k.shape == (40, 64) and w.shape == (40, 4)
    got = index_scores(q, w, k)
    want = reference_scores(indexer, x, positions)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_rope_makes_scores_depend_on_relative_position_only():
    torch.manual_seed(1)
    indexer = LlamaIndexer(HIDDEN, MODEL_HEAD_DIM, IndexerConfig())
    rotary = RotaryEmbedding(MODEL_HEAD_DIM, 8192, THETA)
    x = torch.randn(6, HIDDEN)
    base = torch.arange(6) * 7
    a = index_scores(*_qwk(indexer, x, rotary, base))
    b = index_scores(*_qwk(indexer, x, rotary, base + 3000))
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def _qwk(indexer, x, rotary, positions):
    q, k, w = indexer(x, *rotary.cos_sin(positions))
    return q, w, k


def test_index_key_is_at_most_a_fifth_of_the_kv_bytes(llama):
    from hisparse.memory.indexer_cache import IndexerKeyCache

    mc = llama.config
    kv_bf16 = 2 * mc.num_kv_heads * mc.head_dim * 2  # 768 bytes per token per layer
    cache = IndexerKeyCache(mc.num_layers, 4, llama.indexer_config.key_layout)
    assert llama.indexer_config.key_format == "int8"
    assert cache.bytes_per_token == mc.num_layers * 68
    assert cache.bytes_per_token / mc.num_layers <= kv_bf16 / 5


def test_shipped_weights_load_with_the_default_model(llama):
    from hisparse.models.loader import load_llama

    assert all(isinstance(layer.attn.indexer, LlamaIndexer) for layer in llama.layers)
    assert llama.indexer_config.n_heads * llama.indexer_config.head_dim > 0
    assert llama.indexer_config.top_k == 256
    assert not any(p.requires_grad for layer in llama.layers for p in layer.attn.indexer.parameters())
    bare = load_llama(None, indexer=False)
    assert all(layer.attn.indexer is None for layer in bare.layers)
