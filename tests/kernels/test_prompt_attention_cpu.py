"""The compiled prompt attention equals causal attention over the gathered rows (SDPA in float32 from the same bfloat16
values), whatever the chunk's length, its context, the heads and where the rows lie in the pool."""

from __future__ import annotations

import pytest
import torch

from hisparse.attention.functional import causal_attention
from hisparse.kernels import prompt_attention_cpu

pytestmark = pytest.mark.skipif(not prompt_attention_cpu.available(), reason="no AVX512-BF16 here (or no gcc)")


def pool_of(k: torch.Tensor, v: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [S, Hkv, D] as rows of a larger pool at scattered slots: (pool, slots)."""
    s = k.shape[0]
    slots = torch.randperm(3 * s + 5, generator=generator)[:s]
    pool = torch.randn(3 * s + 5, 2 * k.shape[1] * k.shape[2], generator=generator).bfloat16()
    pool[slots] = torch.cat([k.reshape(s, -1), v.reshape(s, -1)], dim=1)
    return pool, slots


# (queries, context, KV heads, query heads per KV head): first chunks and later ones, tiles full and partial,
# key blocks of 512 crossed (by a tile of queries too: 509 over 1018), the default model's heads among them.
SHAPES = [(1, 1, 1, 1), (5, 5, 3, 3), (16, 16, 3, 3), (17, 40, 2, 2), (33, 33, 1, 4), (100, 300, 3, 3),
          (300, 700, 1, 1), (509, 1018, 3, 3), (513, 513, 3, 3)]


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_causal_attention_in_float32(shape):
    t, s, kv_heads, group = shape
    generator = torch.Generator().manual_seed(t * 1000 + s)
    q = (torch.randn(t, kv_heads * group, 64, generator=generator) * 2).bfloat16()
    k = (torch.randn(s, kv_heads, 64, generator=generator) * 2).bfloat16()
    v = torch.randn(s, kv_heads, 64, generator=generator).bfloat16()
    pool, slots = pool_of(k, v, generator)
    got = prompt_attention_cpu.prompt_attention(q, pool, slots, kv_heads, 0.125)
    want = causal_attention(q.float(), k.float(), v.float(), 0.125)
    sdpa = causal_attention(q, k, v, 0.125).float()  # PyTorch's own bfloat16 path, for scale
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    error, sdpa_error = (got.float() - want).abs().max(), (sdpa - want).abs().max()
    assert error <= max(2 * sdpa_error, 1e-2)


def test_bad_slots_and_shapes_are_refused_before_anything_is_read():
    pool = torch.zeros(10, 2 * 64).bfloat16()
    q = torch.zeros(2, 1, 64).bfloat16()
    with pytest.raises(ValueError, match="outside the pool's 10 rows"):
        prompt_attention_cpu.prompt_attention(q, pool, torch.tensor([0, 10]), 1, 0.125)
    with pytest.raises(ValueError, match="slots"):
        prompt_attention_cpu.prompt_attention(q, pool, torch.tensor([0]), 1, 0.125)  # fewer keys than queries
    with pytest.raises(ValueError, match="bfloat16 q"):
        prompt_attention_cpu.prompt_attention(q.float(), pool, torch.tensor([0, 1]), 1, 0.125)
    assert not prompt_attention_cpu.takes(torch.zeros(2, 1, 32).bfloat16(), torch.zeros(10, 64).bfloat16(), 1)


def test_prompt_chunks_of_a_bfloat16_pool_attend_through_it_without_masks():
    """attend_prompt_chunks hands a bfloat16 pool of 64-dim heads to the kernel: no mask or padded rows are built,
    and a first chunk and a later one attend as causal attention over their rows does."""
    from hisparse.attention.prompt_chunks import PromptChunk, attend_prompt_chunks
    from hisparse.formats.kv_layout import KVLayout

    generator = torch.Generator().manual_seed(3)
    layout = KVLayout(num_layers=1, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    pool = torch.randn(900, layout.row_width, generator=generator).bfloat16()
    for tq, context in [(300, 300), (200, 500)]:
        rows = torch.randperm(900, generator=generator)[:context]
        chunk = PromptChunk(slice(0, tq), rows, None, None)
        q = torch.randn(tq, 9, 64, generator=generator).bfloat16()
        out = torch.empty(tq, 9, 64, dtype=torch.bfloat16)
        attend_prompt_chunks(out, 0, q, None, None, [chunk], pool, 0.125, layout, None, None)
        assert chunk.mask is None and chunk.causal_rows is None
        k, v = layout.unpack(pool[rows])
        want = causal_attention(q.float(), k.float(), v.float(), 0.125)
        assert (out.float() - want).abs().max() <= 1e-2


def test_a_first_call_asks_for_the_amx_state_itself():
    """Called first thing in a fresh process (no `available()` before it), the kernel still has Linux's permission
    for AMX tile data: without it the tiles' first instruction kills the process."""
    import subprocess
    import sys

    code = ("import torch; from hisparse.kernels import prompt_attention_cpu as p; "
            "out = p.prompt_attention(torch.ones(3, 2, 64).bfloat16(), torch.ones(5, 2 * 64).bfloat16(), "
            "torch.arange(5), 1, 0.125); assert torch.allclose(out.float(), torch.ones(3, 2, 64))")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
