"""Parity of the DSA models with transformers on tiny random checkpoints.

Each checkpoint is built by transformers from a fixed seed, perturbed so that no weight keeps its
neat initial value (norm weights of exactly 1, zero routing bias), saved as safetensors and read
back by our loader: the test covers config parsing and weight names as well as the math.

Where transformers 5.24 and DeepSeek's reference (DeepSeek-V3.2-Exp inference/model.py) differ:
- indexer RoPE: the reference was fixed on 2025-11-17 to rotate the indexer half-split
  (non-interleaved) while MLA stays interleaved; transformers does the same for DeepSeek-V3.2, and
  GLM-5 (config indexer_rope_interleave=true) is interleaved in both. We agree with both.
- indexer key precision: the reference Hadamard-rotates q and k and scores them in FP8; transformers
  scores unrotated floats. We follow the reference for the stored key (fp8 rows); these parity tests
  use float32 rows, which is transformers' computation (see test_dsa_fp8.py for the FP8 rows).
- the indexer's LayerNorm: the reference runs it in float32 with float32 weights, transformers in the
  model dtype. We follow the reference; identical here because the tests run in float32.
- YaRN: the reference multiplies the softmax scale by mscale(factor, mscale)^2 and leaves cos/sin
  unscaled; transformers (and DeepSeek's own HF modeling code) use mscale_all_dim for the softmax and
  mscale / mscale_all_dim for cos/sin. Released configs set mscale = mscale_all_dim = 1, where all
  agree; we follow the config semantics of transformers and test with those released values.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from hisparse.models.deepseek_v32 import DsaTrace, LatentCache, load_dsa_model

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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: with a busy machine, OpenMP workers spinning for them cost far more than they save."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_checkpoint(name: str, path, **overrides) -> torch.nn.Module:
    """Save the tiny `name` checkpoint (config fields in `overrides` replace TINY's) to `path`."""
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


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_checkpoint(request.param, path)
    return request.param, hf, load_dsa_model(path)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


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


def test_dense_logits_match_transformers(pair):
    """Context <= index_topk: every past token is selected, so this is plain MLA attention."""
    _, hf, ours = pair
    ids = torch.randint(0, 128, (TOP_K,), generator=torch.Generator().manual_seed(1))
    ref, _ = hf_logits_and_topk(hf, ids)
    cache = ours.new_cache(64, "float32", "float32")
    assert rel_err(ours(ids, torch.arange(TOP_K), cache), ref) < 1e-3
    # the same through a short prefill and then one token at a time
    cache = ours.new_cache(64, "float32", "float32")
    ours(ids[:5], torch.arange(5), cache)
    for t in range(5, TOP_K):
        step = ours(ids[t:t + 1], torch.tensor([t]), cache)
        assert rel_err(step[0], ref[t]) < 1e-3, t


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


def test_sparse_selection_and_logits_match_transformers(pair):
    """A context 5x index_topk: the indexer's choices and the masked attention both agree."""
    name, hf, ours = pair
    n = 5 * TOP_K
    ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(2))
    ref, their_topk = hf_logits_and_topk(hf, ids)
    trace = DsaTrace()
    logits = ours(ids, torch.arange(n), ours.new_cache(n, "float32", "float32"), trace=trace)
    ours_full = [(sel, sc) for sel, sc in zip(trace.selections, trace.scores, strict=True) if sc is not None]
    assert len(ours_full) == len(their_topk) == (2 if name == "glm_shared" else 3)
    for (sel, sc), theirs in zip(ours_full, their_topk, strict=True):
        assert sel.shape == (n, TOP_K)
        assert_same_topk_allowing_ties(sel, theirs, sc)
    if name == "glm_shared":
        assert torch.equal(trace.selections[1], trace.selections[0])
    assert rel_err(logits, ref) < 1e-3


def test_sparse_decode_matches_transformers(pair):
    """Decode steps past index_topk read only the selected rows (the gathered path)."""
    _, hf, ours = pair
    n = 5 * TOP_K
    ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(3))
    ref, _ = hf_logits_and_topk(hf, ids)
    cache = ours.new_cache(n, "float32", "float32")
    ours(ids[: n - 6], torch.arange(n - 6), cache)
    for t in range(n - 6, n):
        assert rel_err(ours(ids[t:t + 1], torch.tensor([t]), cache)[0], ref[t]) < 1e-3, t


class RecordingCache(LatentCache):
    """Rows in a shuffled pool, and a log of what decode asked for: the hook a memory hierarchy uses."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.page_table = torch.randperm(self.capacity, generator=torch.Generator().manual_seed(4))
        self.requests: list[tuple[int, torch.Tensor]] = []

    def locate(self, layer: int, positions: torch.Tensor, runners_up: torch.Tensor | None = None) -> torch.Tensor:
        assert runners_up is None  # a plain cache asks for none (num_next_ranks 0)
        self.requests.append((layer, positions.clone()))
        return super().locate(layer, positions, runners_up)


def test_decode_reads_rows_through_the_page_table_only_at_selected_positions(tmp_path):
    build_checkpoint("deepseek_v32", tmp_path)
    ours = load_dsa_model(tmp_path)
    n = 4 * TOP_K
    ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(5))
    plain = ours.new_cache(n, "float32", "float32")
    shuffled = RecordingCache(3, n, plain.latent_format, plain.index_format)
    ours(ids[:-1], torch.arange(n - 1), plain)
    ours(ids[:-1], torch.arange(n - 1), shuffled)
    shuffled.requests.clear()
    trace = DsaTrace()
    a = ours(ids[-1:], torch.tensor([n - 1]), plain)
    b = ours(ids[-1:], torch.tensor([n - 1]), shuffled, trace=trace)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert [layer for layer, _ in shuffled.requests] == [0, 1, 2]
    for (_, asked), selected in zip(shuffled.requests, trace.selections, strict=True):
        assert asked.shape == (1, TOP_K) and torch.equal(asked, selected)
