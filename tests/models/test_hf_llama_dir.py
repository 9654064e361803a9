"""A Hugging Face Llama directory (config.json + safetensors) loads into the same model code."""

from __future__ import annotations

import pytest
import torch

from hisparse.attention.single_sequence import SingleSequenceCache
from hisparse.models.loader import load_llama


@pytest.fixture(scope="module")
def tiny_hf_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def test_hf_directory_logits_match_transformers(tiny_hf_llama):
    hf, folder = tiny_hf_llama
    ours = load_llama(folder, indexer=False)
    ids = torch.randint(0, 300, (40,))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    cache = SingleSequenceCache(ours.config.num_layers, ours.attention_scale)
    mine = ours.compute_logits(ours(ids, torch.arange(40), cache))
    assert ((mine - theirs).norm() / theirs.norm()).item() < 1e-4


def test_bad_model_paths_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_llama(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="config.json"):
        load_llama(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_llama(tmp_path / "weights.bin")
