"""The model in bfloat16 (the "auto" dtype on CPUs that multiply in it natively): same model, within
bfloat16's rounding; weights in the layout its kernels want; the indexer left in float32."""

from __future__ import annotations

import pytest
import torch

from hisparse.attention.single_sequence import SingleSequenceCache
from hisparse.engine import engine_config
from hisparse.engine.engine_config import EngineConfig
from hisparse.models.loader import load_llama


@pytest.fixture(scope="module")
def text_ids(tokenizer):
    import pydoc_data.topics

    return tokenizer.encode(pydoc_data.topics.topics["for"])[:256]


def logits(model, ids):
    cache = SingleSequenceCache(model.config.num_layers, model.attention_scale)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache)).float()


def test_bfloat16_model_tracks_the_float32_model(llama, llama_bf16, text_ids):
    full, half = logits(llama, text_ids), logits(llama_bf16, text_ids)
    assert ((full - half).norm() / full.norm()).item() < 0.03  # measured 0.012
    assert (full.argmax(-1) == half.argmax(-1)).float().mean().item() > 0.95  # measured 0.98
    targets = torch.tensor(text_ids[1:])
    nll = [torch.nn.functional.cross_entropy(x[:-1], targets).item() for x in (full, half)]
    assert abs(nll[1] - nll[0]) < 0.01 * nll[0]  # measured +0.1%


def test_weights_are_laid_out_for_their_dtype(llama, llama_bf16):
    # float32: [in, out] row-major for BLAS; bfloat16: a view of [out, in] row-major for oneDNN.
    for attn in (llama.layers[0].attn, llama_bf16.layers[0].attn):
        assert attn.qkv.t.shape == (llama.config.hidden_size, attn.q_proj.out_features + 2 * attn.k_proj.out_features)
    assert llama.layers[3].mlp.gate_up.t.is_contiguous() and llama.lm_head_weight.t.is_contiguous()
    assert llama_bf16.layers[3].mlp.gate_up.t.t().is_contiguous() and llama_bf16.lm_head_weight.t.t().is_contiguous()
    assert llama_bf16.layers[3].mlp.gate_up.t.dtype == torch.bfloat16
    # the Linear modules still see their own weights, inside the fused copy
    assert torch.equal(llama_bf16.layers[3].mlp.up_proj.weight.t(),
                       llama_bf16.layers[3].mlp.gate_up.t[:, llama_bf16.config.intermediate_size:])


def test_the_indexer_stays_float32(llama_bf16):
    indexer = llama_bf16.layers[5].attn.indexer
    assert all(p.dtype == torch.float32 for p in indexer.parameters())
    x = torch.randn(3, llama_bf16.config.hidden_size, dtype=torch.bfloat16)
    cos, sin = llama_bf16.rotary.cos_sin(torch.arange(3))
    q, k, w = indexer(x, cos, sin)
    assert q.dtype == k.dtype == w.dtype == torch.float32


def test_the_fused_indexer_projection_gives_the_indexers_outputs(llama, llama_bf16):
    """Inference runs the three projections as one matmul in the model's dtype: exact in float32, within
    bfloat16's rounding of the projections in bfloat16 (the shipped weights are bfloat16 numbers)."""
    for model, tolerance in ((llama, 1e-5), (llama_bf16, 2e-2)):
        attn = model.layers[5].attn
        x = torch.randn(7, model.config.hidden_size).to(model.dtype)
        cos, sin = model.rotary.cos_sin(torch.arange(7))
        fused = attn.indexer.from_projection(attn.index_proj(x), attn.indexer.rotation(cos, sin))
        for got, want in zip(fused, attn.indexer(x, cos, sin), strict=True):
            assert got.dtype == torch.float32
            assert ((got - want).norm() / want.norm()).item() < tolerance


def test_other_dtypes_are_refused(model_path, forbid):
    from hisparse.models import loader

    forbid(loader, "open_model")  # refused before the file is read
    with pytest.raises(ValueError, match="dtype"):
        load_llama(model_path, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(dtype="float16")


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_follows_the_cpu(monkeypatch, native, expected):
    monkeypatch.setattr(engine_config, "native_cpu_bfloat16", lambda: native)
    assert EngineConfig().model_dtype == expected
    assert EngineConfig(dtype="float32").model_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").model_dtype == torch.bfloat16


@pytest.mark.parametrize("hisparse", [False, True])
def test_the_kv_cache_follows_the_model_unless_told(llama, llama_bf16, tokenizer, hisparse):
    """"auto" stores K/V in the dtype of the model the engine runs (given, not loaded, here); an explicit
    kv_cache_dtype wins. With HiSparse both the host pool and the hot buffers follow."""
    from hisparse.engine.llm_engine import LLMEngine

    extra = {"enable_hisparse": True} if hisparse else {}
    for model, kv_cache_dtype, expected in [(llama_bf16, "auto", torch.bfloat16), (llama, "auto", torch.float32),
                                            (llama_bf16, "float32", torch.float32),
                                            (llama, "bfloat16", torch.bfloat16)]:
        engine = LLMEngine(EngineConfig(kv_cache_dtype=kv_cache_dtype, device_kv_budget=64 << 20, **extra),
                           model=model, tokenizer=tokenizer)
        pools = (engine.cache.host_kv, engine.cache.device_kv) if hisparse else (engine.cache.kv,)
        assert all(pool.dtype == expected for pool in pools)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, fp8_e4m3, got"):
        EngineConfig(kv_cache_dtype="float16")
