"""The DSA lightning indexer's projections: which past tokens each query attends to.

I[t, s] = sum_h w_h(x_t) * ReLU(q_{t,h} . k_s) / sqrt(d_I), with w = W_w x / sqrt(H_I), one shared key
per token k = LayerNorm(W_k x) and RoPE on its first `rope_dim` dims. DeepSeek-V3.2 rotates those
dims half-split (non-interleaved) while its MLA is interleaved; GLM-5 rotates both interleaved.
The scores and the top-k are the attention backends' (`hisparse.attention.index_selection`), one
path for every model; how the key is stored is `hisparse.formats.index_key`.
"""

from __future__ import annotations

import torch
from torch import nn

from hisparse.layers.rotary import apply_rope_half, apply_rope_interleaved


class LightningIndexer(nn.Module):
    """Projections of the indexer, with the checkpoint's names (wq_b, wk, k_norm, weights_proj)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int,
                 rope_interleaved: bool, top_k: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.rope_dim = rope_dim
        self.rope_interleaved = rope_interleaved
        self.top_k = top_k
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the leading rope_dim dims of x [T, H, head_dim]; the rest passes through."""
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        apply = apply_rope_interleaved if self.rope_interleaved else apply_rope_half
        return torch.cat([apply(rot, cos, sin), rest], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> k [T, head_dim], the row the indexer key cache stores."""
        k = self.k_norm(self.wk(x).float())
        return self._rope(k.unsqueeze(-2), cos, sin).squeeze(-2)

    def queries(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q_resid [T, q_lora] (shared with MLA) -> q [T, H, head_dim]."""
        q = self.wq_b(q_resid).float().view(q_resid.shape[0], self.n_heads, self.head_dim)
        return self._rope(q, cos, sin)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """w [T, H] with both the 1/sqrt(H) weight scale and the 1/sqrt(d) score scale folded in."""
        return self.finish_weights(self.weights_proj(x.to(self.weights_proj.weight.dtype)))

    def finish_weights(self, projected: torch.Tensor) -> torch.Tensor:
        """`head_weights` from the projection weights_proj(x), for a model that computes it in a matmul of its own."""
        weight_scale, score_scale = self.weight_scales
        return projected.float() * weight_scale * score_scale

    @property
    def weight_scales(self) -> tuple[float, float]:
        """The factors `finish_weights` multiplies by, in order (what a compiled caller multiplies by: the decode
        step's `kernels.indexer_key_cpu.bind_indexer_weights`)."""
        return self.n_heads**-0.5, self.head_dim**-0.5
