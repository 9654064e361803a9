"""FP8 in the DSA model: block-FP8 checkpoints dequantized at load, and the FP8 KV rows end to end."""

from __future__ import annotations

import json

import pytest
import torch
from dsa_checkpoints import TOP_K, baseline_cache, build_checkpoint, record_chunk_selections, rel_err, sequence_logits
from safetensors.torch import load_file, save_file

from hisparse.formats.fp8 import block_dequant, block_quant
from hisparse.models.deepseek_v32 import load_dsa_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _quantized(name: str) -> bool:
    """What DeepSeek's FP8 release quantizes: the linear weights of attention, indexer and MLPs; not
    embeddings, lm_head, norms, the router or the indexer's head weights."""
    return (name.endswith("proj.weight") or name.endswith(("indexer.wq_b.weight", "indexer.wk.weight"))) \
        and "weights_proj" not in name


def test_block_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path):
    float_dir, fp8_dir = tmp_path / "float", tmp_path / "fp8"
    build_checkpoint("deepseek_v32", float_dir)
    state = load_file(float_dir / "model.safetensors")
    weights, scales, fake = {}, {}, dict(state)
    for name, t in state.items():
        if _quantized(name):
            q, s = block_quant(t)
            weights[name], scales[name + "_scale_inv"] = q, s
            fake[name] = block_dequant(q, s)
        else:
            weights[name] = t
    # two shards with the scales apart from their weights, as large checkpoints do
    fp8_dir.mkdir()
    save_file(weights, fp8_dir / "model-00001-of-00002.safetensors")
    save_file(scales, fp8_dir / "model-00002-of-00002.safetensors")
    index = {n: "model-00001-of-00002.safetensors" for n in weights}
    index.update({n: "model-00002-of-00002.safetensors" for n in scales})
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    # a float checkpoint of exactly the dequantized weights is the reference
    (tmp_path / "fake").mkdir()
    save_file(fake, tmp_path / "fake" / "model.safetensors")
    (tmp_path / "fake" / "config.json").write_text((float_dir / "config.json").read_text())

    from_fp8, reference, original = (load_dsa_model(p) for p in (fp8_dir, tmp_path / "fake", float_dir))
    assert sum(_quantized(n) for n in state) > 20
    q_b = "model.layers.1.self_attn.indexer.wq_b.weight"  # 512 x 48: four row blocks
    assert torch.equal(from_fp8.state_dict()[q_b], fake[q_b])
    ids = torch.randint(0, 128, (3 * TOP_K,), generator=torch.Generator().manual_seed(7))
    run = [sequence_logits(m, ids, 3 * TOP_K, baseline_cache(m, 64)) for m in (from_fp8, reference, original)]
    assert rel_err(run[0], run[1]) < 1e-6
    # FP8 weights move the logits (and flip a few expert choices of this random model), but not far
    assert rel_err(run[0], run[2]) < 0.3


def test_fp8_kv_rows_end_to_end(tmp_path, monkeypatch):
    """The serving formats (656-byte FP8 latent, 132-byte FP8 indexer key) against exact float32 rows.

    The exact rows are what transformers computes. DeepSeek's reference (inference/model.py) differs
    from transformers here: it rotates indexer q and k by a Hadamard transform and scores them in FP8
    (fp8_index); we follow the reference for the stored key, so selections may differ from
    transformers' near the top-k boundary. A tiny random model is far less well conditioned than a
    trained one, so the bounds are loose; the byte-level bounds are in tests/formats/test_fp8_layouts.py.
    """
    build_checkpoint("deepseek_v32", tmp_path)
    model = load_dsa_model(tmp_path)
    n = 4 * TOP_K
    ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(8))
    selections = record_chunk_selections(monkeypatch)
    ref = sequence_logits(model, ids, n, baseline_cache(model, n + 1))
    exact = selections.pop(0)[0][0]

    fp8_rows = baseline_cache(model, n + 1, rows="fp8_e4m3")
    assert fp8_rows.kv.shape == (3, n + 1, 128 + 4 + 32)
    assert rel_err(sequence_logits(model, ids, n, fp8_rows), ref) < 0.15

    selections.clear()
    fp8_keys = baseline_cache(model, n + 1, keys="fp8")
    assert fp8_keys.index_cache.rows.shape == (3, n + 1, 32 + 4)
    sequence_logits(model, ids, n, fp8_keys)
    # layer 0 sees the same hidden states either way: only key/query quantization differs
    a, b = exact[TOP_K:], selections[0][0][0][TOP_K:]
    overlap = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b, strict=True)) / a.numel()
    assert overlap > 0.95

    bf16 = load_dsa_model(tmp_path, dtype=torch.bfloat16)
    both = baseline_cache(bf16, n + 1, rows="fp8_e4m3", keys="fp8")
    got = sequence_logits(bf16, ids, n - 1, both)  # the last token as a decode step
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).mean() > 0.9
