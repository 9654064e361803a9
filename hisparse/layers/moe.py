"""DeepSeek-style mixture of experts: sigmoid router with `noaux_tc` bias, group-limited top-k,
shared experts. Used by DeepSeek-V3.2 and GLM-5 alike (GLM-5 has a single expert group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """The dense MLP of the first `first_k_dense_replace` layers, of each expert and of the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopkRouter(nn.Module):
    """Sigmoid scores; the correction bias steers *which* experts win (load balancing without an aux
    loss) but the mixing weights are the unbiased scores, renormalised and scaled."""

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float) -> None:
        super().__init__()
        if n_experts % n_group:
            raise ValueError(f"{n_experts} experts do not split into {n_group} groups")
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, top_k] float32, expert ids [N, top_k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias
        n = x.shape[0]
        # A group's strength is the sum of its two best biased scores; only topk_group groups compete.
        group_scores = biased.view(n, self.n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        per_group = biased.shape[-1] // self.n_group
        expert_mask = group_mask[:, :, None].expand(n, self.n_group, per_group).reshape(n, -1)
        ids = biased.masked_fill(~expert_mask, float("-inf")).topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class MoE(nn.Module):
    """experts: the routed experts this module holds (all of them, or a rank's share under expert parallelism:
    then its output is that share's part of the sum, and the ranks' parts add up to the whole).
    shared_size: the shared experts' columns it holds (0: none)."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, shared_size: int, router: TopkRouter,
                 experts: range) -> None:
        super().__init__()
        self.gate = router
        self.n_experts = router.weight.shape[0]
        self.local = experts
        self.experts = nn.ModuleList(SwiGLU(hidden_size, moe_intermediate_size) for _ in self.local)
        self.shared_experts = SwiGLU(hidden_size, shared_size) if shared_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]. The (token, expert) pairs are grouped by expert with one sort, so each expert that
        was hit runs once, on all of its tokens of the step; the weighted outputs are summed back per token
        in expert order."""
        weights, ids = self.gate(x)  # [N, k] each
        k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)
        # The one wait for the device in a layer's step: each expert's token count decides the slices.
        counts = torch.bincount(ids.flatten(), minlength=self.n_experts).tolist()
        first = sum(counts[:self.local.start])  # the pairs of the experts held here are consecutive in `order`
        counts = counts[self.local.start:self.local.stop]
        order = order[first:first + sum(counts)]
        token = order // k
        grouped = x[token]
        y = torch.empty_like(grouped)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                y[start:start + n] = expert(grouped[start:start + n])
                start += n
        y = y * weights.flatten()[order, None].to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
