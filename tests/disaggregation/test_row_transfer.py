"""Rows moved between two pools by Mooncake's transfer engine land where the plan says, in few writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hisparse.disaggregation.row_transfer import PoolSpec, check_compatible, decode_runs, encode_runs, plan_writes
from hisparse.disaggregation.transfer_engine import KVTransferEngine, TransferError


@given(st.lists(st.integers(0, 50), max_size=40))
def test_runs_round_trip(rows):
    rows = np.array(rows, dtype=np.int64)
    assert np.array_equal(decode_runs(encode_runs(rows)), rows)


def test_a_fresh_request_moves_in_one_write_per_layer_and_pool():
    src = PoolSpec("kv", 1000, 3, 64, 16)
    dst = PoolSpec("kv", 9000, 3, 128, 16)
    sources, destinations, lengths = plan_writes(src, np.arange(10, 30), dst, np.arange(50, 70))
    assert lengths.tolist() == [20 * 16] * 3
    assert sources.tolist() == [1000 + (layer * 64 + 10) * 16 for layer in range(3)]
    assert destinations.tolist() == [9000 + (layer * 128 + 50) * 16 for layer in range(3)]


def test_rows_outside_a_pool_and_different_pools_are_refused():
    spec = PoolSpec("kv", 0, 2, 8, 4)
    with pytest.raises(ValueError, match="outside"):
        plan_writes(spec, np.array([7, 8]), spec, np.array([0, 1]))
    with pytest.raises(ValueError, match="kv pools differ"):
        check_compatible([spec], [PoolSpec("kv", 0, 2, 8, 6)])
    with pytest.raises(ValueError, match="different pools"):
        check_compatible([spec], [spec, PoolSpec("index_keys", 0, 2, 8, 4)])


def test_scattered_rows_arrive_in_the_peers_pool():
    sender, receiver = KVTransferEngine(), KVTransferEngine()
    source = torch.randn(2, 40, 6)
    destination = torch.zeros(2, 60, 6)
    sender.register(source)
    receiver.register(destination)
    rng = np.random.default_rng(0)
    src_rows = np.concatenate([np.arange(5, 15), rng.permutation(np.arange(20, 40))[:8]])
    dst_rows = np.concatenate([np.arange(30, 40), np.arange(0, 16, 2)])
    plan = plan_writes(PoolSpec.of("kv", source), src_rows, PoolSpec.of("kv", destination), dst_rows)
    assert len(plan[2]) < 2 * len(src_rows)  # the first ten rows go in one write per layer
    sender.write(receiver.session_id, *(p.tolist() for p in plan))
    assert torch.equal(destination[:, dst_rows], source[:, src_rows])
    untouched = np.setdiff1d(np.arange(60), dst_rows)
    assert not destination[:, untouched].any()
    gone = PoolSpec("kv", destination.data_ptr() + destination.numel() * 4, 2, 60, 24)  # not registered there
    with pytest.raises(TransferError, match="failed"):
        sender.write(receiver.session_id, *(p.tolist() for p in plan_writes(
            PoolSpec.of("kv", source), src_rows[:1], gone, dst_rows[:1])))
