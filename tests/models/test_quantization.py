"""Weight-only quantization of the default model: int4 holds its own Q4_1 weights, int8 rounds them once more (in
Q8_0 blocks where the block kernel runs); either stays within a percent of the unquantized model's perplexity, and a
DSA model is refused it."""

from __future__ import annotations

import pytest
import torch
from index_key_rows import assert_within_a_rounding_step

from hisparse.attention.single_sequence import SingleSequenceCache
from hisparse.engine.engine_config import EngineConfig
from hisparse.kernels import block_matmul_cpu
from hisparse.models.loader import load_llama


@pytest.fixture(scope="module")
def text_ids(tokenizer):
    import pydoc_data.topics

    return tokenizer.encode(pydoc_data.topics.topics["if"] + pydoc_data.topics.topics["while"])[:384]


def nll(model, ids) -> float:
    """Mean next-token negative log-likelihood over `ids`, through the batched forward and the LM head."""
    cache = SingleSequenceCache(model.config.num_layers, model.attention_scale)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache)).float()
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()


@pytest.fixture(scope="module")
def quantized(model_files):
    return {kind: load_llama(model_files, dtype=torch.bfloat16, quantization=kind) for kind in ("int8", "int4")}


def test_int4_keeps_the_gguf_weights(llama, quantized):
    """The file's Q4_1 blocks come back as they are: the int4 model's dense copy is the float32 model's weights
    within the rounding of bfloat16 scales."""
    for got, want in ((quantized["int4"].layers[4].mlp.gate_proj.weight, llama.layers[4].mlp.gate_proj.weight),
                      (quantized["int4"].layers[9].attn.q_proj.weight, llama.layers[9].attn.q_proj.weight)):
        assert ((got.float() - want).norm() / want.norm()).item() < 5e-3
    assert quantized["int4"].layers[0].mlp.gate_up.kind == "int4"


def test_the_head_and_int8s_linears_are_q8_0_and_the_attention_rounds_x_twice(quantized):
    # The LM head (Q8_0 in the file) is read in 8 bits under either quantization, and int8's linears too: as Q8_0
    # blocks where the int8 dot-product kernel runs, else one scale per row. The attention's projections round x twice.
    blocks = "q8_0" if block_matmul_cpu.available() else "int8"
    assert quantized["int4"].lm_head_weight.kind == quantized["int8"].lm_head_weight.kind == blocks
    assert quantized["int8"].layers[0].mlp.down.kind == quantized["int8"].layers[0].attn.qkv.kind == blocks
    attn, mlp = quantized["int4"].layers[0].attn, quantized["int4"].layers[0].mlp
    assert attn.qkv.round_x_twice and attn.o.round_x_twice and not mlp.gate_up.round_x_twice


def test_perplexity_within_a_percent_of_the_bfloat16_model(llama_bf16, quantized, text_ids):
    base = nll(llama_bf16, text_ids)
    for kind, model in quantized.items():
        assert abs(nll(model, text_ids) - base) < 0.01 * base, kind


def decode_nll(model, ids) -> float:
    """`nll` with the tokens fed one at a time, as a batch-1 decode step runs them: the small-batch kernels (the
    int4 weights, the Q8_0 head with x rounded to int8) instead of the dense copies a long prompt reads."""
    cache = SingleSequenceCache(model.config.num_layers, model.attention_scale)
    with torch.no_grad():
        logits = torch.cat([model.compute_logits(model(torch.tensor([token]), torch.tensor([t]), cache))
                            for t, token in enumerate(ids)]).float()
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()


def test_decode_perplexity_within_a_percent_of_the_bfloat16_model(llama_bf16, quantized, text_ids):
    ids = text_ids[:128]
    base = decode_nll(llama_bf16, ids)
    for kind, model in quantized.items():
        assert abs(decode_nll(model, ids) - base) < 0.01 * base, kind


def test_an_int4_engine_serves_a_prompt_longer_than_a_chunk(quantized, tokenizer, text_ids):
    """A step of prompt chunks that samples nothing asks the LM head for no rows (the Q8_0 kernel's case too)."""
    from hisparse import SamplingParams
    from hisparse.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(chunked_prefill_size=64, quantization="int4"), model=quantized["int4"],
                       tokenizer=tokenizer)
    request = engine.add_request(text_ids[:150], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while not request.finished:
        engine.step()
    assert len(request.output_token_ids) == 3 and request.finish_reason == "length"


def test_small_batches_take_the_quantized_kernel(quantized, monkeypatch):
    """Below the crossover the packed weights are read, not the dense copy."""
    from hisparse.layers import linear

    calls = []
    monkeypatch.setattr(linear, "weight_only_matmul",
                        lambda x, w, *_: calls.append(x.shape[0]) or x @ w.dequantize().t().to(x.dtype))
    model = quantized["int4"]
    cache = SingleSequenceCache(model.config.num_layers, model.attention_scale)
    with torch.no_grad():
        model(torch.tensor([1, 2]), torch.arange(2), cache)
    assert calls and set(calls) == {2}


def test_refusals(tmp_path, forbid):
    from dsa_checkpoints import build_checkpoint

    from hisparse.engine.llm_engine import LLMEngine
    from hisparse.models import loader

    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4"):
        EngineConfig(quantization="int2")
    build_checkpoint("glm_moe_dsa", tmp_path)
    forbid(loader, "load_dsa_model")  # refused before the weights load
    with pytest.raises(ValueError, match="quantization 'int4' is not available for GlmMoeDsaForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path), quantization="int4"))


@pytest.mark.parametrize("quantization", ["int4", "int8", "none"])
def test_steps_that_score_nothing_project_the_index_keys_rows_alone(quantization, quantized, llama_bf16, tokenizer,
                                                                    text_ids, monkeypatch):
    """A step that scores nothing multiplies by the index key's rows alone: the tokens are those of the full
    projection. With the projection in int8 (one scale per output row) so are the stored key bytes; in bfloat16
    the two matmuls may sum in another order, so a byte may differ by a rounding step."""
    from hisparse import SamplingParams
    from hisparse.engine.llm_engine import LLMEngine
    from hisparse.layers.indexer import LlamaIndexer

    model = quantized[quantization] if quantization != "none" else llama_bf16
    key_weights = [layer.attn.index_key_proj for layer in model.layers]
    assert all(w is not None and w.kind == ("none" if quantization == "none" else "int8") for w in key_weights)

    def run(key_rows_alone: bool):
        for layer, weight in zip(model.layers, key_weights, strict=True):
            layer.attn.index_key_proj = weight if key_rows_alone else None
        starts = []
        original = LlamaIndexer.key_from_projection
        monkeypatch.setattr(LlamaIndexer, "key_from_projection",
                            lambda self, p, r, start=None: starts.append(start) or original(self, p, r, start))
        engine = LLMEngine(EngineConfig(quantization=quantization), model=model, tokenizer=tokenizer)
        request = engine.add_request(text_ids[:12], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        engine.step()
        slots = torch.as_tensor(request.kv.index_slots[:12 + 19]).clone()
        while not request.finished:
            engine.step()
        monkeypatch.undo()
        return request.output_token_ids, engine.cache.index_cache.rows[:, slots].clone(), starts

    try:
        tokens, keys, starts = run(key_rows_alone=True)
        full_tokens, full_keys, full_starts = run(key_rows_alone=False)
    finally:
        for layer, weight in zip(model.layers, key_weights, strict=True):
            layer.attn.index_key_proj = weight
    assert set(starts) == {0} and None in full_starts and 0 not in full_starts
    assert tokens == full_tokens
    if quantization != "none":  # per-row int8 projections: the same key bytes
        assert torch.equal(keys, full_keys)
    else:
        assert_within_a_rounding_step(keys, full_keys)
