"""Two computations of the same indexer keys, compared as stored rows (int8 values, then a float32 scale)."""

from __future__ import annotations

import torch


def assert_within_a_rounding_step(rows: torch.Tensor, other: torch.Tensor) -> None:
    """The keys are the same but for a rounding step here and there: where two matmuls summed in another order
    (the key's rows alone, or the indexer's whole projection), a value may round to its neighbour."""
    values, other_values = rows[..., :-4].view(torch.int8).int(), other[..., :-4].view(torch.int8).int()
    scales, other_scales = rows[..., -4:].contiguous().view(torch.float32), other[..., -4:].contiguous().view(
        torch.float32)
    assert (values - other_values).abs().max() <= 1
    assert (values != other_values).float().mean() < 0.01
    assert torch.allclose(scales, other_scales, rtol=1e-3)
