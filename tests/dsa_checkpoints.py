"""Tiny random DSA checkpoints written by transformers, and ways to run our model over them.

Each checkpoint is built by transformers from a fixed seed, perturbed so that no weight keeps its neat
initial value (norm weights of exactly 1, zero routing bias), saved as safetensors and read back by our
loader: a test over one covers config parsing and weight names as well as the math.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from hisparse.attention.paged import PagedKVCache
from hisparse.engine.request import Request
from hisparse.engine.sampling_params import SamplingParams
from hisparse.formats.forward_batch import ForwardBatch
from hisparse.formats.sparse_attention import SparseAttention

TOP_K = 16
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=24, index_topk=TOP_K, index_head_dim=32, index_n_heads=16, first_k_dense_replace=1,
    max_position_embeddings=256,
)
ARCHS = {
    "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM, dict(kv_lora_rank=128)),
    "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, dict(kv_lora_rank=32)),
    # GLM's cross-layer sharing: layer 1 reuses layer 0's top-k instead of running an indexer
    "glm_shared": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM,
                   dict(kv_lora_rank=32, indexer_types=["full", "shared", "full"])),
    # YaRN with a short original context so that the ramp actually moves frequencies
    "deepseek_v32_yarn": (DeepseekV32Config, DeepseekV32ForCausalLM, dict(
        kv_lora_rank=32, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                              original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
                                              mscale=1.0, mscale_all_dim=1.0))),
}


def build_checkpoint(name: str, path, **overrides) -> torch.nn.Module:
    """Save the tiny `name` checkpoint (config fields in `overrides` replace TINY's) to `path`; return
    transformers' model of it."""
    config_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def baseline_cache(model, capacity: int, rows: str = "float32", keys: str = "float32") -> PagedKVCache:
    """The engine's baseline cache for `model`, its rows and index keys in these kinds, sparse as the model
    says (its index_topk, in prefill and decode)."""
    sparse = SparseAttention.from_spec(model.indexer_spec(keys))
    return PagedKVCache(model.config.row_layout(rows), capacity, model.config.attention_scale, sparse=sparse)


def sequence_logits(model, ids: torch.Tensor, prompt_len: int, cache: PagedKVCache,
                    chunk: int | None = None) -> torch.Tensor:
    """Logits [T, vocab] of every position of `ids` through `cache`, as the engine runs one request: its
    first `prompt_len` tokens as prompt chunks of `chunk` (default: all at once), then one decode step each."""
    request = Request(ids[:prompt_len].tolist(), SamplingParams(max_tokens=max(1, len(ids) - prompt_len)))
    cache.admit(request)
    out = []
    try:
        while request.num_computed_tokens < len(ids):
            done = request.num_computed_tokens
            if done >= prompt_len:  # decode: the next token arrives as output
                request.output_token_ids.append(int(ids[done]))
                n = 1
            else:
                n = min(chunk or prompt_len, prompt_len - done)
            batch = ForwardBatch.build([(request, n)])
            with torch.no_grad():
                out.append(model.compute_logits(model(batch.input_ids, batch.positions, cache.bind(batch))))
            request.num_computed_tokens += n
    finally:
        cache.release(request)
    return torch.cat(out)


def record_chunk_selections(monkeypatch) -> dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """From now on in the test, every prompt chunk's top-k per layer: {layer: [(selected [T, K], scores [T, S],
    positions [T])]}, the scores recomputed from the stored keys as the selection sees them."""
    from hisparse.attention import index_selection

    chosen: dict[int, list] = {}
    real = index_selection.IndexSelector.select_chunk

    def spy(selector, layer, index_q, index_w, slots, positions, top_k):
        picked = real(selector, layer, index_q, index_w, slots, positions, top_k)
        keys = selector.keys.keys(layer, slots)
        scores = index_selection.index_scores(selector.format.prepare_query(index_q), index_w, keys)
        chosen.setdefault(layer, []).append((picked, scores, positions))
        return picked

    monkeypatch.setattr(index_selection.IndexSelector, "select_chunk", spy)
    return chosen
