"""The DSA lightning indexer: which past tokens each query attends to.

I[t, s] = sum_h w_h(x_t) * ReLU(q_{t,h} . k_s) / sqrt(d_I), with w = W_w x / sqrt(H_I), one shared key
per token k = LayerNorm(W_k x) and RoPE on its first `rope_dim` dims. DeepSeek-V3.2 rotates those
dims half-split (non-interleaved) while its MLA is interleaved; GLM-5 rotates both interleaved.

The key cache of the indexer is what stays on the device for every token under HiSparse, so it is
stored as DeepSeek does: a Hadamard rotation (which spreads outliers over all dims and leaves dot
products unchanged) and then e4m3 with one fp32 scale, 132 bytes for 128 dims. The query goes
through the same rotation and quantization, as in the reference's fp8_index kernel. The int8 layout
(one int8 per dim and one fp32 scale, the same 4 + head_dim bytes) is for the CPU, where torch widens
e4m3 one element at a time (about 2 ns each, 20x the cost of widening int8): scoring every past key
each step from FP8 rows would cost more than the rest of a decode step.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from hisparse.layers import fp8
from hisparse.layers.rotary import apply_rope_half, apply_rope_interleaved

INDEX_KEY_KINDS = ("float32", "int8", "fp8")
_QUERY_CHUNK = 256  # bounds the [chunk, heads, context] tensor of a long prefill


@functools.lru_cache(maxsize=8)
def _hadamard_matrix(dim: int) -> torch.Tensor:
    if dim & (dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head dim, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / dim**0.5).float()


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Hadamard rotation of the last dim (the reference's `rotate_activation`)."""
    return x.float() @ _hadamard_matrix(x.shape[-1]).to(x.device)


class IndexKeyFormat:
    """How an indexer key row is stored: float32 (exact), int8 or fp8 (head_dim int8 / e4m3 values and one
    fp32 scale for the key)."""

    def __init__(self, kind: str, head_dim: int = 128) -> None:
        if kind not in INDEX_KEY_KINDS:
            raise ValueError(f"unknown indexer key format {kind!r}; expected one of {INDEX_KEY_KINDS}")
        self.kind = kind
        self.head_dim = head_dim
        self.row_bytes = 4 * head_dim if kind == "float32" else fp8.index_k_fp8_row_bytes(head_dim)

    def pack(self, k: torch.Tensor) -> torch.Tensor:
        """k [N, head_dim] -> uint8 [N, row_bytes] (fp8 rows hold the Hadamard-rotated key)."""
        if self.kind == "fp8":
            return fp8.pack_index_k_fp8(hadamard(k))
        if self.kind == "int8":
            k = k.float()
            scale = k.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
            rows = torch.empty(k.shape[0], self.row_bytes, dtype=torch.uint8, device=k.device)
            rows[:, :self.head_dim] = (k / scale).round_().to(torch.int8).view(torch.uint8)
            rows[:, self.head_dim:] = scale.view(torch.uint8)
            return rows
        return k.float().contiguous().view(torch.uint8)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 rows [..., row_bytes] -> float32 keys [..., head_dim]."""
        values, scale = self.unpack_unscaled(rows)
        return values if scale is None else values * scale.unsqueeze(-1)

    def unpack_unscaled(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values [..., head_dim], scale [...] or None): key = values x scale. Scoring applies the scale
        to the scores, since ReLU(q . s v) = s ReLU(q . v) for s >= 0: one multiply per key, not per dim."""
        if self.kind == "int8":
            values = rows[..., :self.head_dim].view(torch.int8).float()
            if self.head_dim % 4 == 0 and rows.is_contiguous() and rows.data_ptr() % 4 == 0:  # scale read in place
                return values, rows.view(torch.float32)[..., self.head_dim // 4]
            return values, rows[..., self.head_dim:].contiguous().view(torch.float32).squeeze(-1)
        if self.kind == "fp8":
            return fp8.unpack_index_k_fp8(rows), None
        return rows.contiguous().view(torch.float32), None

    def prepare_query(self, q: torch.Tensor) -> torch.Tensor:
        """Put the query in the same basis and precision as the stored keys."""
        if self.kind == "fp8":
            return fp8.fake_quant_fp8(hadamard(q))
        return q.float()


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
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
        return w * (self.n_heads**-0.5) * (self.head_dim**-0.5)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """I[t, s] = sum_h weights[t, h] * ReLU(q[t, h] . keys[s]). q [T, H, D], keys [S, D] -> [T, S]."""
    out = []
    keys = keys.float()
    for start in range(0, q.shape[0], _QUERY_CHUNK):
        sl = slice(start, start + _QUERY_CHUNK)
        logits = torch.einsum("thd,sd->ths", q[sl].float(), keys).relu_()
        out.append(torch.einsum("th,ths->ts", weights[sl].float(), logits))
    return torch.cat(out)


def select_topk(scores: torch.Tensor, query_positions: torch.Tensor, top_k: int) -> torch.Tensor:
    """Causal top-k: for query t, the top_k positions s <= query_positions[t] by score.

    Returns int64 [T, min(top_k, S)], -1 where a query has fewer than top_k past tokens; such a query
    selects every past token, so a context no longer than top_k is exactly dense attention.
    """
    s = scores.shape[-1]
    k = min(top_k, s)
    future = torch.arange(s, device=scores.device)[None, :] > query_positions[:, None]
    masked = scores.masked_fill(future, float("-inf"))
    values, idx = masked.topk(k, dim=-1)
    return idx.masked_fill(values == float("-inf"), -1)


def select_runners_up(scores: torch.Tensor, query_positions: torch.Tensor, selection: torch.Tensor,
                      num_next: int) -> torch.Tensor:
    """The `num_next` past positions ranked just below `selection` (what `select_topk` returned for the
    same scores), best first: int64 [T, num_next], -1 padded. They are not attended; an eviction policy
    of a memory hierarchy reads them as the likeliest next selections (`EvictionPolicy.num_next_ranks`).
    The newest position is not forced into the top-k here (the default model's indexer scores it +inf);
    listed as a runner-up it takes a rank no hot slot holds (it lives in the reserved slot), so later
    runners-up are credited one rank lower."""
    future = torch.arange(scores.shape[-1], device=scores.device)[None, :] > query_positions[:, None]
    return runners_up(scores.masked_fill(future, float("-inf")), selection, num_next)


def runners_up(scores: torch.Tensor, selection: torch.Tensor, num_next: int) -> torch.Tensor:
    """The `num_next` best-scored columns of `scores` [T, S] (-inf: not a candidate) that `selection`
    [T, K] (-1 padded) left out, best first: int64 [T, num_next], -1 padded. PyTorch's way, for every
    device; the CPU's compiled top-k has its own (`kernels.top_k_cpu.top_k_and_runners_up`)."""
    out = torch.full((scores.shape[0], num_next), -1, dtype=torch.int64, device=scores.device)
    n = min(num_next, scores.shape[-1])
    if n == 0:
        return out
    # Padding (-1) masks column 0, which is then selected anyway: a row is padded only when it selects
    # every candidate, and then has no runners-up.
    rest = scores.scatter(1, selection.clamp(min=0), float("-inf"))
    values, ranked = rest.topk(n, dim=-1, sorted=True)
    out[:, :n] = ranked.masked_fill(values == float("-inf"), -1)
    return out
