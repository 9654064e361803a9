"""Top-k selection of sparse attention: the one path every model's indexer goes through.

A lightning indexer scores past tokens, I[t, s] = sum_h w[t, h] ReLU(q[t, h] . k[s]), and attention reads
only the `top_k` best. Here the scores are computed from the stored key rows (`memory.indexer_cache`) and
the top-k picked, for a decode step (one query per request, its keys anywhere in the cache) and for a
prompt chunk (many queries of one request, each over its own causal past). The positions come out
ascending, -1 padded: a query with no more than top_k past tokens selects all of them, so a short context
is exactly dense attention.

The newest token: where `select_newest` holds it is always selected (its score set to +inf). The default
model's retrofit indexers were trained that way (its own token is what attention weighs most), and under
HiSparse it sits in the request's reserved slot; DSA's indexers were trained without the rule and score it
like any other token, as their reference does.

On the CPU the int8 keys of a decode step are scored and their top-k picked in one compiled call
(`kernels.index_scores_cpu.int8_top_k`); where the policy also reads the runners-up, or other scores are
ranked, the top-k is `kernels.top_k_cpu`'s. `past_scores_reference` and `select_reference` are the PyTorch
paths, which every other key format and device uses.
"""

from __future__ import annotations

import torch

from hisparse.kernels import index_scores_cpu
from hisparse.kernels.index_scores_cpu import int8_past_scores, int8_top_k
from hisparse.kernels.top_k_cpu import top_k_and_runners_up, top_k_ascending
from hisparse.memory.indexer_cache import IndexerKeyCache

_QUERY_CHUNK = 256  # bounds the [chunk, heads, context] tensor of a long prompt chunk


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """I[t, s] = sum_h weights[t, h] * ReLU(q[t, h] . keys[s]). q [T, H, D], keys [S, D] -> [T, S]."""
    out = []
    keys = keys.float()
    for start in range(0, q.shape[0], _QUERY_CHUNK):
        sl = slice(start, start + _QUERY_CHUNK)
        logits = torch.einsum("thd,sd->ths", q[sl].float(), keys).relu_()
        out.append(torch.einsum("th,ths->ts", weights[sl].float(), logits))
    return torch.cat(out)


def runners_up(scores: torch.Tensor, selection: torch.Tensor, num_next: int) -> torch.Tensor:
    """The `num_next` best-scored columns of `scores` [T, S] (-inf: not a candidate) that `selection`
    [T, K] (-1 padded) left out, best first: int64 [T, num_next], -1 padded. They are not attended; an
    eviction policy reads them as the likeliest next selections (`EvictionPolicy.num_next_ranks`). PyTorch's
    way, for every device; the CPU's compiled top-k has its own (`kernels.top_k_cpu.top_k_and_runners_up`)."""
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


class IndexSelector:
    """Scores and top-k over one `IndexerKeyCache`, with one rule for the newest token (`select_newest`)."""

    def __init__(self, keys: IndexerKeyCache, select_newest: bool = True) -> None:
        self.keys = keys
        self.format = keys.format
        self.select_newest = select_newest
        on_cpu = keys.rows.device.type == "cpu"
        # The compiled scorer reads the fp32 scale in place, so the row must be whole fp32 words; it sets the
        # newest score to +inf, so it serves only the rule that selects it.
        self.compiled_scores = (on_cpu and self.format.kind == "int8" and keys.index_dim % 4 == 0
                                and select_newest and index_scores_cpu.available())
        self.compiled_top_k = on_cpu

    # -- a decode step: one query per request -----------------------------------------------------

    def select(self, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, slots: torch.Tensor,
               lengths: torch.Tensor, top_k: int) -> torch.Tensor:
        """Top-k positions per request: int64 [B, min(top_k, Lmax)], ascending, padded with -1.

        slots[b, p] holds position p's key for p < lengths[b] (the rest is ignored); the query is the
        newest position, lengths[b] - 1. A request with lengths[b] <= top_k gets every position.
        """
        if self.compiled_scores and self.compiled_top_k:  # scores and top-k in one compiled call
            return int8_top_k(*self._compiled_inputs(layer, index_q, index_w, slots, lengths),
                              min(top_k, slots.shape[1]))
        return self._select(self._past_scores(layer, index_q, index_w, slots, lengths), top_k)

    def select_with_next(self, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, slots: torch.Tensor,
                         lengths: torch.Tensor, top_k: int, num_next: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`select`'s top-k, and the `num_next` positions ranked just below it: int64 [B, num_next], the
        best first, padded with -1 (they are what the next step will most likely select).

        The top-k is computed exactly as `select` computes it, so a caller that also wants the next ranks
        selects the same tokens (ties included) as one that does not.
        """
        scores = self._past_scores(layer, index_q, index_w, slots, lengths)
        if self.compiled_top_k and scores.dtype == torch.float32:  # both in one compiled pass per row
            return top_k_and_runners_up(scores.contiguous(), min(top_k, scores.shape[1]), num_next)
        selected = self._select(scores, top_k)
        return selected, runners_up(scores, selected, num_next)

    def _past_scores(self, layer, index_q, index_w, slots, lengths) -> torch.Tensor:
        """Scores [B, width]: -inf beyond each request's length (+inf at its newest position by the rule)."""
        if self.compiled_scores:
            return int8_past_scores(*self._compiled_inputs(layer, index_q, index_w, slots, lengths))
        return self.past_scores_reference(layer, index_q, index_w, slots, lengths)

    def _compiled_inputs(self, layer, index_q, index_w, slots, lengths) -> tuple:
        """The compiled scorer's arguments (`index_scores_cpu`): the layer's key rows and the step's tensors as it
        reads them."""
        return (self.keys.rows[layer], self.keys.index_dim, slots.contiguous(),
                self.format.prepare_query(index_q).contiguous(), index_w.float().contiguous(), lengths.contiguous())

    def past_scores_reference(self, layer, index_q, index_w, slots, lengths) -> torch.Tensor:
        """`_past_scores` in PyTorch, for every key format and device."""
        b, width = slots.shape
        values, scale = self.keys.unscaled_keys(layer, slots)  # [B, L, d], [B, L]
        q = self.format.prepare_query(index_q)
        per_head = torch.bmm(q, values.transpose(1, 2)).relu_()  # [B, H, L]
        scores = torch.bmm(index_w.float().unsqueeze(1), per_head).squeeze(1)
        if scale is not None:
            scores = scores.mul_(scale)
        positions = torch.arange(width, device=slots.device)
        scores = scores.masked_fill(positions[None, :] >= lengths[:, None], float("-inf"))
        if self.select_newest:
            scores[torch.arange(b, device=slots.device), lengths - 1] = float("inf")
        return scores

    # -- a prompt chunk: many queries of one request ------------------------------------------------

    def select_chunk(self, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, top_k: int) -> torch.Tensor:
        """Top-k positions of each query of one request's chunk: int64 [T, min(top_k, S)], ascending, -1
        padded. slots [S]: the key slots of positions 0..S-1; positions [T]: the queries' positions (< S)."""
        values, scale = self.keys.unscaled_keys(layer, slots)  # [S, d], [S]
        scores = index_scores(self.format.prepare_query(index_q), index_w, values)
        if scale is not None:
            scores = scores.mul_(scale)
        future = torch.arange(slots.shape[0], device=slots.device)[None, :] > positions[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        if self.select_newest:
            scores[torch.arange(positions.shape[0], device=slots.device), positions] = float("inf")
        return self._select(scores, top_k)

    # -- the top-k ----------------------------------------------------------------------------------

    def _select(self, scores: torch.Tensor, top_k: int) -> torch.Tensor:
        if self.compiled_top_k and scores.dtype == torch.float32:
            return top_k_ascending(scores.contiguous(), min(top_k, scores.shape[1]))
        return self.select_reference(scores, top_k)

    @staticmethod
    def select_reference(scores: torch.Tensor, top_k: int) -> torch.Tensor:
        """`_select` in PyTorch: the top-k columns of each row, ascending, -inf never picked (-1 padding);
        ties as `topk` breaks them."""
        b, width = scores.shape
        k = min(top_k, width)
        values, picked = scores.topk(k, dim=-1, sorted=False)
        padding = values == float("-inf")  # a row with fewer than k positions
        if scores.device.type == "cpu" and not bool(padding.any()):
            # Every row has k positions: marking them and reading the marks back lists them in ascending
            # order, for a fraction of what sorting them costs on a CPU (on a GPU the check and nonzero()
            # would each wait for the device).
            marked = torch.zeros(b, width, dtype=torch.bool, device=scores.device)
            marked.scatter_(1, picked, True)
            return marked.nonzero()[:, 1].view(b, k)
        picked = picked.masked_fill(padding, width)  # padding sorts last...
        picked = picked.sort(dim=-1).values
        return picked.masked_fill_(picked == width, -1)  # ...and reads as -1
