"""A prompt chunk's kept additive mask gives the same attention as the boolean mask SDPA would convert, and
padding its keys to an aligned count changes nothing."""

from __future__ import annotations

import torch

from hisparse.attention.functional import KEY_ALIGN, _sdpa, aligned_key_count, causal_attention, causal_mask


def test_kept_mask_equals_the_boolean_one():
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 6, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    allowed = torch.arange(12)[None, :] <= torch.arange(7, 12)[:, None]
    want = _sdpa(q, k, v, allowed, 0.25)
    assert torch.equal(causal_attention(q, k, v, 0.25, causal_mask(5, 12, q.dtype)), want)
    assert torch.equal(causal_attention(q, k, v, 0.25), want)


def test_padding_keys_past_the_mask_change_nothing():
    """A prompt chunk's keys padded to a multiple of KEY_ALIGN: the mask hides the padding columns."""
    torch.manual_seed(1)
    for tq, tk in [(5, 12), (12, 12), (3, 17)]:
        width = aligned_key_count(tk)
        assert width % KEY_ALIGN == 0 and tk <= width < tk + KEY_ALIGN
        q, k, v = torch.randn(tq, 6, 16), torch.randn(width, 2, 16), torch.randn(width, 2, 16)
        mask = causal_mask(tq, tk, q.dtype, width=width)
        assert (mask[:, tk:] == float("-inf")).all()
        want = causal_attention(q, k[:tk], v[:tk], 0.25)
        assert torch.allclose(causal_attention(q, k, v, 0.25, mask), want, atol=1e-6)


def test_prompt_chunks_read_aligned_keys_and_attend_as_without_them():
    """attend_prompt_chunks pads an unaligned chunk's rows (square or not) and gives what unpadded causal attention
    over the same pool rows gives; an aligned or long square chunk keeps SDPA's causal path (no mask, no padding)."""
    from hisparse.attention.prompt_chunks import MAX_PADDED_SQUARE, PromptChunk, attend_prompt_chunks
    from hisparse.formats.kv_layout import KVLayout

    torch.manual_seed(2)
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    pool = torch.randn(640, layout.row_width)
    for tq, context in [(7, 21), (21, 21), (16, 16), (9, 32), (600, 600)]:
        rows = torch.randperm(640)[:context]
        chunk = PromptChunk(slice(0, tq), rows, None, None)
        q = torch.randn(tq, 4, 16)
        out = torch.empty(tq, 4, 16)
        attend_prompt_chunks(out, 0, q, None, None, [chunk], pool, 0.25, layout, None, None)
        k, v = layout.unpack(pool[rows])
        assert torch.allclose(out, causal_attention(q, k, v, 0.25), atol=1e-5)
        if tq == context and (context % KEY_ALIGN == 0 or context > MAX_PADDED_SQUARE):
            assert chunk.mask is None and chunk.causal_rows is None
        else:
            assert chunk.causal_rows.shape[0] == aligned_key_count(context)
            assert torch.equal(chunk.causal_rows[:context], rows)
