"""Multi-head latent attention (MLA), in the absorbed form that reads only the cached latent.

Each token caches one latent row per layer: c_kv (kv_lora_rank, 512) followed by the roped shared
key k_pe (64). Keys and values are never materialised: the per-head key up-projection W_UK is
absorbed into the query (q_lat = q_nope W_UK, one 512-vector per head) and the value up-projection
W_UV is applied after attention. Attention is then multi-query over the latent rows, which is what
lets a sparse step read exactly `top_k` rows of 576 values through a page table, wherever the
memory hierarchy keeps them.
"""

from __future__ import annotations

import torch
from torch import nn

from hisparse.layers.norm import RMSNorm
from hisparse.layers.rotary import apply_rope_interleaved


class MultiHeadLatentAttention(nn.Module):
    """MLA projections with DeepSeek's weight names; the attention itself is the backend's, over latent rows.

    `softmax_scale` is passed in because YaRN checkpoints fold mscale^2 into it.
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, softmax_scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.softmax_scale = softmax_scale
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        # DeepSeek's reference builds these two norms with the default eps whatever rms_norm_eps says.
        self.q_a_layernorm = RMSNorm(q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * (qk_nope_head_dim + qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (q_resid [T, q_lora] for the indexer, q_nope [T, H, nope], q_pe [T, H, rope])."""
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(x.shape[0], self.num_heads, -1)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return q_resid, q_nope, apply_rope_interleaved(q_pe, cos, sin)

    def project_latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the cached latent row [T, kv_lora_rank + rope]: normed c_kv, then roped k_pe."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rope_interleaved(k_pe.unsqueeze(-2), cos, sin).squeeze(-2)
        return torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)

    def _w_kv_b(self) -> torch.Tensor:
        per_head = self.qk_nope_head_dim + self.v_head_dim
        return self.kv_b_proj.weight.view(self.num_heads, per_head, self.kv_lora_rank)

    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] -> q_lat [T, H, kv_lora_rank] (W_UK folded into the query)."""
        w_uk = self._w_kv_b()[:, : self.qk_nope_head_dim]
        return torch.einsum("thd,hdc->thc", q_nope.float(), w_uk.float())

    def output(self, o_lat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o_lat [T, H, kv_lora_rank] -> [T, hidden] (W_UV, then o_proj)."""
        w_uv = self._w_kv_b()[:, self.qk_nope_head_dim:]
        o = torch.einsum("thc,hvc->thv", o_lat, w_uv.float())
        return self.o_proj(o.reshape(o.shape[0], -1).to(dtype))
