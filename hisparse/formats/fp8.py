"""FP8 (e4m3) in the two places DSA serving uses it: checkpoint weights and the KV cache rows.

Weights: DeepSeek-V3.x and GLM-5 FP8 checkpoints store each linear weight as e4m3 with one fp32
`weight_scale_inv` per 128x128 block (the name is historical: the value *multiplies* the e4m3
number). We dequantize once at load; the CPU has no FP8 GEMM worth using.

KV rows: the byte layouts the real systems keep per token per layer, so that capacity figures and
host<->device copies here are the ones a GPU deployment would see:

- MLA latent, FP8 sparse layout (FlashMLA / SGLang "fp8_e4m3" for DSA), 656 bytes for 512 + 64:
  [512 e4m3 of c_kv][4 fp32 scales, one per 128-value tile][64 bf16 of k_pe]. The rope part stays
  in bf16 because its magnitude carries position and quantizing it hurts attention far more.
- Indexer key, 132 bytes for 128 dims: [128 e4m3][1 fp32 scale].

Scales are amax / 448 (the e4m3 maximum), so the largest value of each tile is exactly
representable and nothing saturates.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
WEIGHT_BLOCK = 128
KV_TILE = 128
_SCALE_FLOOR = 1e-12  # an all-zero tile gets a tiny scale instead of a division by zero


def block_quant(weight: torch.Tensor, block: int = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to e4m3 with one scale per block x block tile (edges may be partial).

    Returns (e4m3 weight, fp32 scale_inv of shape [ceil(out/block), ceil(in/block)]): the format of
    DeepSeek's FP8 checkpoints, so tests can build one from a float model.
    """
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // block), -(-in_f // block)
    padded = weight.new_zeros(rows * block, cols * block, dtype=torch.float32)
    padded[:out_f, :in_f] = weight.float()
    tiles = padded.view(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_E4M3_MAX).clamp_min(_SCALE_FLOOR)
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(rows * block, cols * block)[:out_f, :in_f].contiguous(), scale


def block_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = WEIGHT_BLOCK,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 weight [out, in] x per-block scale_inv [ceil(out/block), ceil(in/block)] -> dtype."""
    out_f, in_f = weight.shape
    expected = (-(-out_f // block), -(-in_f // block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(weight.shape)} in {block}x{block} blocks (expected {expected})")
    scale = scale_inv.float().repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return (weight.float() * scale).to(dtype)


def _quant_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] (D % tile == 0) -> (e4m3 [N, D], fp32 scales [N, D / tile])."""
    n, d = x.shape
    tiles = x.float().view(n, d // tile, tile)
    scale = (tiles.abs().amax(dim=-1) / FP8_E4M3_MAX).clamp_min(_SCALE_FLOOR)
    q = (tiles / scale[..., None]).to(torch.float8_e4m3fn)
    return q.view(n, d), scale


def _dequant_tiles(q: torch.Tensor, scale: torch.Tensor, tile: int) -> torch.Tensor:
    n, d = q.shape
    return (q.float().view(n, d // tile, tile) * scale[..., None]).view(n, d)


def mla_fp8_row_bytes(kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
    """Bytes of one FP8 latent row: e4m3 c_kv + one fp32 scale per tile + bf16 k_pe (656 for DSA)."""
    if kv_lora_rank % KV_TILE:
        raise ValueError(f"the FP8 latent layout needs kv_lora_rank divisible by {KV_TILE}, "
                         f"got {kv_lora_rank}")
    return kv_lora_rank + 4 * (kv_lora_rank // KV_TILE) + 2 * rope_dim


def pack_mla_fp8(latent: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """latent [N, kv_lora_rank + rope] (float) -> uint8 rows [N, mla_fp8_row_bytes]."""
    n, width = latent.shape
    rope_dim = width - kv_lora_rank
    row_bytes = mla_fp8_row_bytes(kv_lora_rank, rope_dim)
    q, scale = _quant_tiles(latent[:, :kv_lora_rank], KV_TILE)
    rows = torch.empty(n, row_bytes, dtype=torch.uint8, device=latent.device)
    n_scales = kv_lora_rank // KV_TILE
    rows[:, :kv_lora_rank] = q.view(torch.uint8)
    rows[:, kv_lora_rank:kv_lora_rank + 4 * n_scales] = scale.contiguous().view(torch.uint8)
    rope = latent[:, kv_lora_rank:].to(torch.bfloat16).contiguous()
    rows[:, kv_lora_rank + 4 * n_scales:] = rope.view(torch.uint8)
    return rows


def unpack_mla_fp8(rows: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """uint8 rows [..., row_bytes] -> float32 latent [..., kv_lora_rank + rope]."""
    lead = rows.shape[:-1]
    rows = rows.reshape(-1, rows.shape[-1])
    n_scales = kv_lora_rank // KV_TILE
    rope_at = kv_lora_rank + 4 * n_scales
    q = rows[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn)
    scale = rows[:, kv_lora_rank:rope_at].contiguous().view(torch.float32)
    rope = rows[:, rope_at:].contiguous().view(torch.bfloat16).float()
    out = torch.cat([_dequant_tiles(q, scale, KV_TILE), rope], dim=-1)
    return out.view(*lead, out.shape[-1])


def index_k_fp8_row_bytes(head_dim: int = 128) -> int:
    """Bytes of one indexer key row: head_dim e4m3 + one fp32 scale (132 for DSA)."""
    return head_dim + 4


def pack_index_k_fp8(k: torch.Tensor) -> torch.Tensor:
    """k [N, head_dim] (float) -> uint8 rows [N, head_dim + 4]; one scale for the whole key."""
    n, d = k.shape
    q, scale = _quant_tiles(k, d)
    rows = torch.empty(n, d + 4, dtype=torch.uint8, device=k.device)
    rows[:, :d] = q.view(torch.uint8)
    rows[:, d:] = scale.contiguous().view(torch.uint8)
    return rows


def unpack_index_k_fp8(rows: torch.Tensor) -> torch.Tensor:
    """uint8 rows [..., head_dim + 4] -> float32 keys [..., head_dim]."""
    lead, d = rows.shape[:-1], rows.shape[-1] - 4
    rows = rows.reshape(-1, d + 4)
    q = rows[:, :d].contiguous().view(torch.float8_e4m3fn)
    scale = rows[:, d:].contiguous().view(torch.float32)
    return _dequant_tiles(q, scale, d).view(*lead, d)


def fake_quant_fp8(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize along the last dim with one scale per vector: what an FP8 indexer query
    goes through in the real kernel (DeepSeek's `act_quant` with a block of the head size)."""
    flat = x.reshape(-1, x.shape[-1])
    q, scale = _quant_tiles(flat, flat.shape[-1])
    return _dequant_tiles(q, scale, flat.shape[-1]).view(x.shape)
