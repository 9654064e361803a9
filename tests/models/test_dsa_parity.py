"""Parity of the DSA models with transformers on tiny random checkpoints (`dsa_checkpoints`), through the
engine's own cache and backends: one sequence position by position, and eight requests batched together.

Where transformers 5.24 and DeepSeek's reference (DeepSeek-V3.2-Exp inference/model.py) differ:
- indexer RoPE: the reference was fixed on 2025-11-17 to rotate the indexer half-split
  (non-interleaved) while MLA stays interleaved; transformers does the same for DeepSeek-V3.2, and
  GLM-5 (config indexer_rope_interleave=true) is interleaved in both. We agree with both.
- indexer key precision: the reference Hadamard-rotates q and k and scores them in FP8; transformers
  scores unrotated floats. We follow the reference for the stored key (fp8 rows, the engine's default);
  these parity tests store float32 keys (`index_key_format="float32"`), which is transformers'
  computation (see test_dsa_fp8.py for the FP8 rows).
- the indexer's LayerNorm: the reference runs it in float32 with float32 weights, transformers in the
  model dtype. We follow the reference; identical here because the tests run in float32.
- YaRN: the reference multiplies the softmax scale by mscale(factor, mscale)^2 and leaves cos/sin
  unscaled; transformers (and DeepSeek's own HF modeling code) use mscale_all_dim for the softmax and
  mscale / mscale_all_dim for cos/sin. Released configs set mscale = mscale_all_dim = 1, where all
  agree; we follow the config semantics of transformers and test with those released values.
- the newest token: neither selects it by rule (it competes on its score), and neither do we for DSA.
"""

from __future__ import annotations

import pytest
import torch
from dsa_checkpoints import (
    ARCHS,
    TOP_K,
    baseline_cache,
    build_checkpoint,
    record_chunk_selections,
    rel_err,
    sequence_logits,
)

from hisparse import SamplingParams
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.models.deepseek_v32 import load_dsa_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: with a busy machine, OpenMP workers spinning for them cost far more than they save."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_checkpoint(request.param, path)
    return request.param, hf, load_dsa_model(path)


def hf_logits_and_topk(hf, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    picked: list[torch.Tensor] = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, i, out: picked.append(out[0].long()))
             for layer in hf.model.layers if layer.self_attn.indexer is not None]
    try:
        with torch.no_grad():
            logits = hf(ids[None]).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return logits, picked


def test_architecture_specifics_are_read_from_the_config(pair):
    name, _, ours = pair
    cfg = ours.config
    assert cfg.indexer_rope_interleaved == name.startswith("glm")  # DeepSeek-V3.2: half-split indexer RoPE
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert cfg.indexer_types == (["full", "shared", "full"] if name == "glm_shared" else ["full"] * 3)
    spec = ours.indexer_spec()
    assert spec.top_k == TOP_K and spec.sparse_prefill and not spec.select_newest
    assert spec.shared_layers == ((1,) if name == "glm_shared" else ())
    assert spec.key_format.kind == "fp8" and spec.key_format.row_bytes == 32 + 4  # as 132 bytes for 128 dims


def test_dense_logits_match_transformers(pair):
    """Context <= index_topk: every past token is selected, so this is plain MLA attention."""
    _, hf, ours = pair
    ids = torch.randint(0, 128, (TOP_K,), generator=torch.Generator().manual_seed(1))
    ref, _ = hf_logits_and_topk(hf, ids)
    assert rel_err(sequence_logits(ours, ids, TOP_K, baseline_cache(ours, 64)), ref) < 1e-3
    # the same through a short prefill and then one token at a time
    steps = sequence_logits(ours, ids, 5, baseline_cache(ours, 64))
    for t in range(TOP_K):
        assert rel_err(steps[t], ref[t]) < 1e-3, t


def assert_same_topk_allowing_ties(ours: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor) -> None:
    """Per query row, the selected sets agree except where the scores tie at the k-th value."""
    for t in range(ours.shape[0]):
        if t + 1 <= TOP_K:  # dense row: every past position, whatever the padding holds
            assert set(ours[t][ours[t] >= 0].tolist()) == set(range(t + 1))
            assert set(range(t + 1)) <= set(theirs[t].tolist())
            continue
        a, b = set(ours[t].tolist()), set(theirs[t].tolist())
        if a == b:
            continue
        row = scores[t, : t + 1]
        kth = row.topk(TOP_K).values[-1]
        tol = 1e-5 * row.abs().max()
        for s in a ^ b:
            assert (row[s] - kth).abs() <= tol, f"row {t}: position {s} differs and is not a tie"


def test_sparse_selection_and_logits_match_transformers(pair, monkeypatch):
    """A prompt 5x index_topk in chunks of 24: each query's top-k (over its own causal past, across chunks)
    and the masked attention both agree."""
    name, hf, ours = pair
    n = 5 * TOP_K
    ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(2))
    ref, their_topk = hf_logits_and_topk(hf, ids)
    chosen = record_chunk_selections(monkeypatch)
    logits = sequence_logits(ours, ids, n, baseline_cache(ours, n + 1), chunk=24)
    assert sorted(chosen) == ([0, 2] if name == "glm_shared" else [0, 1, 2])  # layer 1 shares layer 0's
    assert len(their_topk) == len(chosen)
    for layer, theirs in zip(sorted(chosen), their_topk, strict=True):
        picked = torch.full((n, TOP_K), -1)
        scores = torch.full((n, n), float("-inf"))
        for sel, sc, positions in chosen[layer]:
            picked[positions, :sel.shape[1]] = sel
            scores[positions, :sc.shape[1]] = sc
        assert_same_topk_allowing_ties(picked, theirs, scores)
    assert rel_err(logits, ref) < 1e-3


def test_sparse_decode_matches_transformers(pair):
    """Decode steps past index_topk read only the selected rows (the gathered path)."""
    _, hf, ours = pair
    n = 5 * TOP_K
    ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(3))
    ref, _ = hf_logits_and_topk(hf, ids)
    logits = sequence_logits(ours, ids, n - 6, baseline_cache(ours, n + 1))
    for t in range(n - 6, n):
        assert rel_err(logits[t], ref[t]) < 1e-3, t


PROMPT_LENS = (3, 17, 40, 70, 90, 100, 121, 66)  # five longer than 4 x index_topk: really sparse
NEW_TOKENS = 10


def test_a_batch_through_the_engine_decodes_as_transformers_generate_does_alone(pair, tokenizer):
    """Eight prompts of mixed lengths served together, chunked prefill (48 tokens a step, so long prompts
    continue over steps while others decode): each gets the greedy tokens transformers' generate gives it
    alone."""
    name, hf, ours = pair
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=g) for n in PROMPT_LENS]
    theirs = []
    hf.generation_config.eos_token_id = None  # no end of text for either (the engine's ignore_eos)
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(p[None], max_new_tokens=NEW_TOKENS, do_sample=False)
            theirs.append(out[0, len(p):].tolist())
    config = EngineConfig(dtype="float32", kv_cache_dtype="float32", index_key_format="float32",
                          chunked_prefill_size=48, max_running_requests=8, device_kv_budget=64 << 20)
    engine = LLMEngine(config, model=ours, tokenizer=tokenizer)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p.tolist(), params) for p in prompts]
    mixed = False
    while engine.has_unfinished:
        batch_kinds = {r.in_prefill for r in engine.scheduler.running}
        mixed = mixed or batch_kinds == {True, False}
        engine.step()
    assert mixed, "some step ran prompt chunks and decodes together"
    assert [r.output_token_ids for r in requests] == theirs
    assert engine.flush_cache() and engine.cache.usage()["device_slots_used"] == 0
