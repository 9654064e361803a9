"""A DSA model's MLPs split over ranks (DP attention): each rank loads only its share of the checkpoint (its
experts under expert parallelism, else its columns of every expert; its columns of the dense MLP and the shared
experts), and the ranks' outputs on the same tokens add up to the whole model's."""

from __future__ import annotations

import pytest
import torch

from hisparse.distributed.tensor_parallel import TensorParallel
from hisparse.layers.moe import MoE
from hisparse.models.deepseek_v32 import load_dsa_model


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["experts-split", "columns-split"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_the_ranks_mlp_outputs_add_up_to_the_whole(tiny_dsa_dir, expert_parallel, ranks):
    path = tiny_dsa_dir("deepseek-v3.2")
    whole = load_dsa_model(path)
    shares = [load_dsa_model(path, tp=TensorParallel(r, ranks, dp_attention=True, expert_parallel=expert_parallel))
              for r in range(ranks)]
    x = torch.randn(37, whole.config.hidden_size, generator=torch.Generator().manual_seed(0))
    n_experts = whole.config.n_routed_experts
    for layer, parts in zip(whole.model.layers, zip(*(s.model.layers for s in shares), strict=True), strict=True):
        expected = layer.mlp(x)
        got = sum(part.mlp(x) for part in parts)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        if isinstance(layer.mlp, MoE):
            held = [len(part.mlp.experts) for part in parts]
            assert sum(held) == (n_experts if expert_parallel else n_experts * ranks)
            assert parts[0].self_attn.q_b_proj.weight.equal(layer.self_attn.q_b_proj.weight)  # attention whole
    # nothing but the MLPs differs: a rank holds fewer bytes, the attention and the vocabulary whole
    assert all(sum(p.numel() for p in s.parameters()) < sum(p.numel() for p in whole.parameters()) for s in shares)
    assert all(s.lm_head.weight.equal(whole.lm_head.weight) for s in shares)
    everything = dict(whole.named_parameters())
    for share in shares:
        for name, p in share.named_parameters():
            if ".mlp." not in name or ".mlp.gate." in name:  # attention, norms, router, vocabulary: whole
                assert p.equal(everything[name]), name
