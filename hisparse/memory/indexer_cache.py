"""The lightning indexer's key cache: every token's index key of every layer, always on the device.

Under HiSparse the big K/V rows of old tokens live in the host pool, but selection must score every
past token each decode step, so the indexer keys of all tokens stay on the device. Each is one row of an
`IndexKeyFormat`: for DSA models as DSA stores them (the Hadamard-rotated key in e4m3 with one fp32
scale), for the default model in int8 with one fp32 scale (the same 68 bytes for 64 dims, and 20x cheaper
to widen on a CPU). A request owns one slot per position it may ever hold. Scoring and top-k selection
over these rows are `hisparse.attention.index_selection`'s.
"""

from __future__ import annotations

import torch

from hisparse.formats.index_key import IndexKeyFormat
from hisparse.kernels import index_keys_cpu
from hisparse.memory.rows import gather_rows
from hisparse.memory.slot_allocator import SlotAllocator


class IndexerKeyCache:
    """Per-token lightning-indexer keys of every layer, one `key_format` row per token per layer."""

    def __init__(self, num_layers: int, num_slots: int, key_format: IndexKeyFormat, device="cpu") -> None:
        self.num_layers = num_layers
        self.index_dim = key_format.head_dim
        self.format = key_format
        # A row for every layer, GLM's shared layers too, though they write none: the sizing (here, in the pools'
        # and in the planner's) counts every layer.
        self.rows = torch.zeros(num_layers, num_slots, self.format.row_bytes, dtype=torch.uint8, device=device)
        self.compiled_write = (self.format.kind == "int8" and self.rows.device.type == "cpu"
                               and index_keys_cpu.available())
        self.allocator = SlotAllocator(num_slots)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.format.row_bytes

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """keys [N, index_dim] (float) go to rows `slots` [N] of `layer` (int8 rows on the CPU in one compiled
        loop, `kernels.index_keys_cpu`; the same bytes)."""
        if self.compiled_write:
            index_keys_cpu.write_int8_keys(self.rows[layer], slots, keys)
        else:
            self.rows[layer].index_copy_(0, slots, self.format.pack(keys))

    def keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The keys at `slots` (any shape) -> [*slots.shape, index_dim] float32, in the basis they are stored
        in (score them with `format.prepare_query(q)`)."""
        return self.format.unpack(gather_rows(self.rows[layer], slots))

    def unscaled_keys(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values [*slots.shape, index_dim], scale [*slots.shape] or None): key = values x scale."""
        return self.format.unpack_unscaled(gather_rows(self.rows[layer], slots))
