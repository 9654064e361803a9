"""FP8 in the DSA model: block-FP8 checkpoints dequantized at load, and the FP8 KV rows end to end."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_dsa_parity import TOP_K, build_checkpoint, rel_err

from hisparse.layers.fp8 import block_dequant, block_quant
from hisparse.models.deepseek_v32 import DsaTrace, load_dsa_model


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
    pos = torch.arange(3 * TOP_K)
    run = [m(ids, pos, m.new_cache(64, "float32", "float32")) for m in (from_fp8, reference, original)]
    assert rel_err(run[0], run[1]) < 1e-6
    # FP8 weights move the logits (and flip a few expert choices of this random model), but not far
    assert rel_err(run[0], run[2]) < 0.3


def test_fp8_kv_rows_end_to_end(tmp_path):
    """The serving formats (656-byte FP8 latent, 132-byte FP8 indexer key) against exact float32 rows.

    The exact rows are what transformers computes. DeepSeek's reference (inference/model.py) differs
    from transformers here: it rotates indexer q and k by a Hadamard transform and scores them in FP8
    (fp8_index); we follow the reference for the stored key, so selections may differ from
    transformers' near the top-k boundary. A tiny random model is far less well conditioned than a
    trained one, so the bounds are loose; the byte-level bounds are in tests/layers/test_fp8_layouts.py.
    """
    build_checkpoint("deepseek_v32", tmp_path)
    model = load_dsa_model(tmp_path)
    n = 4 * TOP_K
    ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(n)
    exact = DsaTrace()
    ref = model(ids, pos, model.new_cache(n, "float32", "float32"), trace=exact)

    assert rel_err(model(ids, pos, model.new_cache(n, "fp8", "float32")), ref) < 0.15

    fp8_keys = DsaTrace()
    cache = model.new_cache(n, "float32", "fp8")
    assert cache.index_k.shape == (3, n, 32 + 4)
    model(ids, pos, cache, trace=fp8_keys)
    # layer 0 sees the same hidden states either way: only key/query quantization differs
    a, b = exact.selections[0][TOP_K:], fp8_keys.selections[0][TOP_K:]
    overlap = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b, strict=True)) / a.numel()
    assert overlap > 0.95

    bf16 = load_dsa_model(tmp_path, dtype=torch.bfloat16)
    cache = bf16.new_cache(n, "fp8", "fp8")
    assert cache.latent.shape == (3, n, 128 + 4 + 32)
    got = bf16(ids[:-1], pos[:-1], cache)
    step = bf16(ids[-1:], pos[-1:], cache)
    assert torch.isfinite(got).all() and torch.isfinite(step).all()
    assert torch.nn.functional.cosine_similarity(torch.cat([got, step]), ref, dim=-1).mean() > 0.9
