"""The dense warm-up trainer: its target is the model's attention, its loss a KL, and a resumed run is the same run."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from hisparse.train_indexer import (
    attention_target,
    head_attention,
    kl_loss,
    main,
    topk_margin_loss,
    worst_head_miss,
)


def test_target_is_the_models_head_averaged_attention(llama):
    from hisparse.layers.rotary import apply_rope_half

    torch.manual_seed(0)
    x = torch.randn(30, llama.config.hidden_size)
    rows = torch.tensor([0, 7, 29])
    got = attention_target(llama, 4, x, rows)
    attn = llama.layers[4].attn
    cos, sin = llama.rotary.cos_sin(torch.arange(30))
    q = apply_rope_half((x @ attn.q_proj.weight.T).view(30, 9, 64), cos, sin)
    k = apply_rope_half((x @ attn.k_proj.weight.T).view(30, 3, 64), cos, sin)
    want = torch.zeros(3, 30)
    for h in range(9):
        for i, r in enumerate(rows.tolist()):
            want[i, :r + 1] += torch.softmax(q[r, h] @ k[:r + 1, h // 3].T / 8, -1) / 9
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kl_loss_is_kl_divergence():
    torch.manual_seed(1)
    target = torch.softmax(torch.randn(4, 10), -1)
    target[:, 6:] = 0
    target /= target.sum(-1, keepdim=True)
    logits = torch.randn(4, 10)
    logits[:, 6:] = -1e30
    want = (target[:, :6] * (target[:, :6].log() - logits[:, :6].log_softmax(-1))).sum(-1).mean()
    torch.testing.assert_close(kl_loss(target, logits), want)


def test_topk_margin_loss_charges_the_mass_below_the_kth_score_and_lifts_it():
    target = torch.tensor([[0.7, 0.1, 0.1, 0.1, 0.0, 0.0]])
    ranked_well = torch.tensor([[9.0, 8.0, 7.0, 1.0, 0.0, -1e30]], requires_grad=True)
    ranked_badly = torch.tensor([[1.0, 8.0, 7.0, 9.0, 0.0, -1e30]], requires_grad=True)
    well, badly = topk_margin_loss(target, ranked_well, 3), topk_margin_loss(target, ranked_badly, 3)
    assert badly.item() > 2 * well.item()
    badly.backward()
    grad = ranked_badly.grad[0]
    assert grad[0] < 0  # descent raises the heavy key that fell out...
    assert grad[2] > 0  # ...and lowers the k-th key that crowds it out
    assert grad[5] == 0  # a masked (future) position takes no gradient


def test_worst_head_miss_is_zero_for_the_oracle_and_counts_a_lost_head(llama):
    torch.manual_seed(2)
    x = torch.randn(48, llama.config.hidden_size)
    rows = torch.tensor([20, 33, 47])
    target, probs = attention_target(llama, 3, x, rows), head_attention(llama, 3, x, rows)
    assert worst_head_miss(probs, target, rows, 8) == 0.0
    assert worst_head_miss(probs, -target, rows, 8) > 0.05


def test_training_lowers_kl_and_resumes_to_the_same_weights(tmp_path):
    common = ["--seq-len", "128", "--max-chunks", "2", "--layers", "2", "--queries", "32", "--min-row", "16",
              "--top-k", "16", "--epochs", "2", "--threads", "2", "--lr", "1e-2"]
    straight = main([*common, "--out", str(tmp_path / "a")])
    assert straight[-1]["train_loss"] < straight[0]["train_loss"]
    first = main([*common, "--out", str(tmp_path / "b"), "--stop-after", "1"])
    assert len(first) == 1 and not (tmp_path / "b" / "smollm2_indexer.safetensors").exists()
    rest = main([*common, "--out", str(tmp_path / "b"), "--resume"])
    assert [s["epoch"] for s in rest] == [2]
    assert rest[0]["seconds"] > first[0]["seconds"]  # the clock carries over a resume
    a = load_file(str(tmp_path / "a" / "smollm2_indexer.safetensors"))
    b = load_file(str(tmp_path / "b" / "smollm2_indexer.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_retrieval_sequence_ends_with_the_answer_copied_from_its_needle(tokenizer):
    import numpy as np

    from hisparse.data.pydoc_corpus import corpus_tokens
    from hisparse.data.retrieval_sequences import retrieval_sequence
    from hisparse.train_indexer import _retrieval_rows

    ids, answer_rows = retrieval_sequence(tokenizer, corpus_tokens(tokenizer, "train"), 512, np.random.default_rng(3))
    assert len(ids) == 512
    key = tokenizer.decode(ids[-answer_rows:]).strip(" .")
    assert key.isdigit() and len(key) == 5 and tokenizer.decode(ids[:-answer_rows]).count(key) == 2
    rows = _retrieval_rows(torch.Generator().manual_seed(0), 512, 64, 16, answer_rows)
    assert len(rows) == 64 and set(range(511 - answer_rows, 511)) <= set(rows.tolist())
