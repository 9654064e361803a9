"""IndexerKeyCache: FP8, int8 and float32 key rows, each read back from the slot it was written to."""

from __future__ import annotations

import torch

from hisparse.formats.index_key import IndexKeyFormat, hadamard
from hisparse.memory.indexer_cache import IndexerKeyCache

D = 64
FP8, INT8 = IndexKeyFormat("fp8", D), IndexKeyFormat("int8", D)


def test_keys_survive_fp8_with_small_error_and_68_bytes():
    cache = IndexerKeyCache(3, 16, FP8)
    assert cache.rows.shape == (3, 16, 68) and cache.bytes_per_token == 3 * 68
    keys = torch.randn(16, D)
    cache.write(2, torch.arange(16), keys)
    back = cache.keys(2, torch.arange(16))
    keys = hadamard(keys)  # rows hold the Hadamard-rotated key (dot products with a rotated query unchanged)
    rel = (back - keys).norm(dim=-1) / keys.norm(dim=-1)
    assert rel.max() < 0.06  # e4m3 keeps 3 mantissa bits
    assert cache.rows[0].abs().sum() == 0, "other layers untouched"


def test_keys_survive_int8_within_half_a_step_and_68_bytes():
    cache = IndexerKeyCache(2, 16, INT8)
    assert cache.rows.shape == (2, 16, 68) and cache.bytes_per_token == 2 * 68
    keys = torch.randn(16, D)
    keys[3] = 0.0  # an all-zero key stays zero (no division by a zero scale)
    cache.write(1, torch.arange(16), keys)
    back = cache.keys(1, torch.arange(16))
    step = keys.abs().amax(dim=-1, keepdim=True) / 127  # no rotation: the key itself, rounded to its step
    assert back.dtype == torch.float32 and ((back - keys).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(back[3], keys[3])
    assert torch.equal(cache.format.prepare_query(keys), keys)


def test_each_key_is_read_back_from_the_slot_it_was_written_to():
    """Slots in the order a request holds them, not sorted (a request reuses slots others gave back)."""
    cache = IndexerKeyCache(2, 32, IndexKeyFormat("float32", D))
    slots = torch.tensor([17, 3, 30, 8, 0, 21])
    keys = torch.randn(6, D, generator=torch.Generator().manual_seed(0))
    cache.write(1, slots, keys)
    assert torch.equal(cache.keys(1, slots), keys)  # float32 rows: exact
    assert torch.equal(cache.keys(1, slots[[4, 0]]), keys[[4, 0]])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert cache.rows[1, untouched].abs().sum() == 0 and cache.rows[0].abs().sum() == 0
