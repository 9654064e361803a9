"""Our Llama forward pass against transformers reading the same GGUF file.

The GGUF stores Q and K with llama.cpp's RoPE row permutation; if our loader did not undo it, the
logits below would differ by far more than the tolerance (see test_permutation_matters).
"""

from __future__ import annotations

import pytest
import torch

from hisparse.attention.single_sequence import SingleSequenceCache

PROMPTS = [
    [1, 504, 3458, 282, 4649, 314],
    list(range(100, 164)),
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2114, 28, 7018, 411, 407, 19712, 8182, 2],
]


def our_logits(model, ids: list[int]) -> torch.Tensor:
    cache = SingleSequenceCache(model.config.num_layers, model.attention_scale)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), cache)
    return model.compute_logits(hidden)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("ids", PROMPTS)
def test_logits_match_transformers(llama, hf_model, ids):
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0]
    ours = our_logits(llama, ids)
    assert relative_error(ours, theirs) < 1e-3


def test_permutation_matters(llama, hf_model):
    """Without undoing llama.cpp's Q/K permutation the model is measurably different."""
    from hisparse.layers.linear import InferenceWeight
    from hisparse.models.gguf_loader import unpermute_rope_rows

    ids = PROMPTS[1]
    layer = llama.layers[0].attn
    saved = layer.qkv
    q = layer.q_proj.weight.numpy()
    # Re-apply the permutation (its inverse is the same reshape read the other way round).
    heads, half = llama.config.num_heads, llama.config.head_dim // 2
    permuted = q.reshape(heads, 2, half, -1).swapaxes(1, 2).reshape(q.shape)
    assert torch.equal(torch.from_numpy(unpermute_rope_rows(permuted, heads)), layer.q_proj.weight)
    # A whole new weight: every form of it (plain, packed) holds the permuted rows.
    layer.qkv = InferenceWeight(torch.cat([torch.from_numpy(permuted), saved.t[:, q.shape[0]:].t()]))
    try:
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids])).logits[0]
        assert relative_error(our_logits(llama, ids), theirs) > 1e-2
    finally:
        layer.qkv = saved


def test_greedy_64_tokens_match_transformers(llama, hf_model):
    prompt = PROMPTS[2]
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                                   min_new_tokens=64)[0, len(prompt):].tolist()
    cache = SingleSequenceCache(llama.config.num_layers, llama.attention_scale)
    ids, positions, ours = torch.tensor(prompt), torch.arange(len(prompt)), []
    for _ in range(64):
        token = int(llama.compute_logits(llama(ids, positions, cache)[-1:]).argmax())
        ours.append(token)
        positions = positions[-1:] + 1
        ids = torch.tensor([token])
    assert ours == theirs
