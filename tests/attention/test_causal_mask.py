"""A prompt chunk's kept additive mask gives the same attention as the boolean mask SDPA would convert."""

from __future__ import annotations

import torch

from hisparse.attention.functional import _sdpa, causal_attention, causal_mask


def test_kept_mask_equals_the_boolean_one():
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 6, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    allowed = torch.arange(12)[None, :] <= torch.arange(7, 12)[:, None]
    want = _sdpa(q, k, v, allowed, 0.25)
    assert torch.equal(causal_attention(q, k, v, 0.25, causal_mask(5, 12, q.dtype)), want)
    assert torch.equal(causal_attention(q, k, v, 0.25), want)
