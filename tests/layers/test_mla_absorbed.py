"""The absorbed form: MLA as multi-query attention over latent rows (one K head, its prefix the V), as the
attention backends run it for every model, equals plain multi-head attention restricted to the selected
tokens, computed the long way with explicit per-head keys and values."""

from __future__ import annotations

import torch

from hisparse.attention.functional import attend_prompt, attend_rows
from hisparse.formats.latent import LatentFormat, LatentLayout
from hisparse.layers.mla import MultiHeadLatentAttention
from hisparse.layers.rotary import RotaryEmbedding

H, C, R, NOPE, V = 4, 64, 16, 24, 20


def _mla() -> MultiHeadLatentAttention:
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(48, H, 40, C, NOPE, R, V, softmax_scale=(NOPE + R) ** -0.5)
    for p in mla.parameters():
        torch.nn.init.normal_(p, 0.0, 0.2)
    return mla.eval()


def _direct(mla: MultiHeadLatentAttention, x: torch.Tensor, query: int,
            selected: torch.Tensor) -> torch.Tensor:
    """Expand K and V per head from the latent and attend over `selected` only (the MHA form)."""
    rope = RotaryEmbedding(R, 64, 10000.0)
    cos, sin = rope.cos_sin(torch.arange(x.shape[0]))
    _, q_nope, q_pe = mla.project_q(x, cos, sin)
    latent = mla.project_latent(x, cos, sin)
    kv = mla.kv_b_proj(latent[:, :C]).view(-1, H, NOPE + V)
    k = torch.cat([kv[..., :NOPE], latent[:, None, C:].expand(-1, H, R)], dim=-1)
    v = kv[..., NOPE:]
    q = torch.cat([q_nope[query], q_pe[query]], dim=-1)  # [H, NOPE + R]
    scores = torch.einsum("hd,shd->hs", q, k) * mla.softmax_scale
    mask = torch.full((x.shape[0],), float("-inf"))
    mask[selected] = 0.0
    out = torch.einsum("hs,shv->hv", (scores + mask).softmax(-1), v)
    return mla.o_proj(out.reshape(1, -1))


def test_sparse_decode_equals_attention_restricted_to_the_selection():
    mla = _mla()
    x = torch.randn(40, 48)
    rope = RotaryEmbedding(R, 64, 10000.0)
    cos, sin = rope.cos_sin(torch.arange(40))
    with torch.no_grad():
        layout = LatentLayout(1, LatentFormat("float32", C, R))
        pool = layout.pack(mla.project_latent(x, cos, sin).unsqueeze(1))
        # the rows live in a shuffled pool: attention must only see them through the page table
        perm = torch.randperm(40)
        shuffled = torch.empty_like(pool)
        shuffled[perm] = pool
        page_table = perm
        selected = torch.tensor([0, 3, 7, 11, 12, 20, 31, 39])
        padded = torch.cat([selected, torch.tensor([-1, -1])])[None]  # [1, K] with padding
        slots = torch.where(padded >= 0, page_table[padded.clamp_min(0)], padded)
        _, q_nope, q_pe = mla.project_q(x[39:], cos[39:], sin[39:])
        q = torch.cat([mla.absorb_q(q_nope), q_pe], dim=-1)
        o_lat = attend_rows(shuffled, slots, q, mla.softmax_scale, layout)
        ours = mla.output(o_lat, x.dtype)
        ref = _direct(mla, x, 39, selected)
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-5), (ours - ref).abs().max()


def test_a_sparse_prompt_chunk_equals_each_query_alone_over_its_selection():
    """Many queries over one run of rows with a mask per query (prefill) = each query's own gathered rows."""
    mla = _mla()
    x = torch.randn(30, 48)
    rope = RotaryEmbedding(R, 64, 10000.0)
    cos, sin = rope.cos_sin(torch.arange(30))
    layout = LatentLayout(1, LatentFormat("float32", C, R))
    with torch.no_grad():
        pool = layout.pack(mla.project_latent(x, cos, sin).unsqueeze(1))
        _, q_nope, q_pe = mla.project_q(x, cos, sin)
        q = torch.cat([mla.absorb_q(q_nope), q_pe], dim=-1)
        g = torch.Generator().manual_seed(1)
        allowed = (torch.rand(30, 30, generator=g) < 0.4).tril()
        allowed[:, 0] = True
        k = int(allowed.sum(-1).max())
        sel = torch.full((30, k), -1)
        for t in range(30):
            idx = allowed[t].nonzero().squeeze(-1)
            sel[t, : len(idx)] = idx
        chunk = attend_prompt(pool, torch.arange(30), q, mla.softmax_scale, layout, sel)
        alone = attend_rows(pool, sel, q, mla.softmax_scale, layout)
    assert torch.allclose(chunk, alone, rtol=1e-5, atol=1e-6)


def test_latent_formats_round_trip():
    latent = torch.randn(10, C + R)
    f32 = LatentFormat("float32", C, R)
    assert torch.equal(f32.unpack(f32.pack(latent)), latent)
    bf16 = LatentFormat("bfloat16", C, R)
    assert bf16.pack(latent).shape == (10, 2 * (C + R))
    assert ((bf16.unpack(bf16.pack(latent)) - latent).abs() <= latent.abs() * 2.0**-8).all()
