"""The lightning indexer's key cache: every token's index key of every layer, always on the device.

Under HiSparse the big K/V rows of old tokens live in the host pool, but selection must score every
past token each decode step, so the indexer keys of all tokens stay on the device. Each is one row of an
`IndexKeyFormat`: for DSA models as DSA stores them (the Hadamard-rotated key in e4m3 with one fp32
scale, the query rotated and quantized the same way before scoring), for the default model in int8
with one fp32 scale (the same 68 bytes for 64 dims, and 20x cheaper to widen on a CPU).
A request owns one slot per position it may ever hold; `select` works in positions. On the CPU the int8
keys are scored by one compiled loop (`kernels.index_scores_cpu`, about a third of the PyTorch path's
time) and the top-k picked by another (`kernels.top_k_cpu`); `past_scores_reference` and
`select_reference` are the PyTorch paths, which every other key format and device uses.
"""

from __future__ import annotations

import torch

from hisparse.kernels.index_scores_cpu import int8_past_scores
from hisparse.kernels.top_k_cpu import top_k_and_runners_up, top_k_ascending
from hisparse.layers.dsa_indexer import IndexKeyFormat, runners_up
from hisparse.memory.rows import gather_rows
from hisparse.memory.slot_allocator import SlotAllocator

_NEWEST = float("inf")


class IndexerKeyCache:
    """Per-token lightning-indexer keys of every layer, one `key_format` row per token per layer."""

    def __init__(self, num_layers: int, num_slots: int, key_format: IndexKeyFormat, device="cpu") -> None:
        self.num_layers = num_layers
        self.index_dim = key_format.head_dim
        self.format = key_format
        self.rows = torch.zeros(num_layers, num_slots, self.format.row_bytes, dtype=torch.uint8, device=device)
        self.allocator = SlotAllocator(num_slots)
        # The compiled scorer reads the fp32 scale in place, so the row must be whole fp32 words.
        self.compiled_scores = key_format.kind == "int8" and self.rows.device.type == "cpu" and self.index_dim % 4 == 0
        self.compiled_top_k = self.rows.device.type == "cpu"

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.format.row_bytes

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """keys [N, index_dim] (float) go to rows `slots` [N] of `layer`."""
        self.rows[layer].index_copy_(0, slots, self.format.pack(keys))

    def keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The keys at `slots` (any shape) -> [*slots.shape, index_dim] float32, in the basis they are stored
        in (score them with `format.prepare_query(q)`)."""
        return self.format.unpack(gather_rows(self.rows[layer], slots))

    def scores(self, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """I[b, p] = sum_h w[b, h] * ReLU(q[b, h] . k[slots[b, p]]): [B, L] for q [B, H, d], w [B, H]."""
        keys, scale = self.format.unpack_unscaled(gather_rows(self.rows[layer], slots))  # [B, L, d], [B, L]
        q = self.format.prepare_query(index_q)
        per_head = torch.bmm(q, keys.transpose(1, 2)).relu_()  # [B, H, L]
        scores = torch.bmm(index_w.float().unsqueeze(1), per_head).squeeze(1)
        return scores if scale is None else scores.mul_(scale)

    def select(self, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, slots: torch.Tensor,
               lengths: torch.Tensor, top_k: int) -> torch.Tensor:
        """Top-k positions per request: int64 [B, min(top_k, Lmax)], ascending, padded with -1.

        slots[b, p] holds position p's key for p < lengths[b] (the rest is ignored). The newest position
        (lengths[b] - 1) is always selected; a request with lengths[b] <= top_k gets every position.
        """
        return self._select(self._past_scores(layer, index_q, index_w, slots, lengths), top_k)

    def select_with_next(self, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, slots: torch.Tensor,
                         lengths: torch.Tensor, top_k: int, num_next: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`select`'s top-k, and the `num_next` positions ranked just below it: int64 [B, num_next], the
        best first, padded with -1 (they are what the next step will most likely select).

        The top-k is computed exactly as `select` computes it, so a caller that also wants the next ranks
        selects the same tokens (ties included) as one that does not; the next ranks are a second top-k
        over the positions left out.
        """
        scores = self._past_scores(layer, index_q, index_w, slots, lengths)
        if self.compiled_top_k and scores.dtype == torch.float32:  # both in one compiled pass per row
            return top_k_and_runners_up(scores.contiguous(), min(top_k, scores.shape[1]), num_next)
        selected = self._select(scores, top_k)
        return selected, runners_up(scores, selected, num_next)

    def _past_scores(self, layer, index_q, index_w, slots, lengths) -> torch.Tensor:
        """Scores [B, width]: -inf beyond each request's length, +inf at its newest position."""
        if self.compiled_scores:
            return int8_past_scores(self.rows[layer], self.index_dim, slots.contiguous(),
                                    self.format.prepare_query(index_q).contiguous(), index_w.float().contiguous(),
                                    lengths.contiguous())
        return self.past_scores_reference(layer, index_q, index_w, slots, lengths)

    def past_scores_reference(self, layer, index_q, index_w, slots, lengths) -> torch.Tensor:
        """`_past_scores` in PyTorch, for every key format and device."""
        b, width = slots.shape
        scores = self.scores(layer, index_q, index_w, slots)
        positions = torch.arange(width, device=slots.device)
        past = positions[None, :] < lengths[:, None]
        scores = scores.masked_fill(~past, float("-inf"))
        scores[torch.arange(b, device=slots.device), lengths - 1] = _NEWEST
        return scores

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
