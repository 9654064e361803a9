"""The collectives tensor parallelism runs on, between real processes: shared memory (one machine) and gloo
(several), each checked against sums taken here in rank order, on every rank bit for bit."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hisparse.engine.workers import free_init_addr

RANK = r"""
import pickle, sys, torch
from hisparse.distributed.tensor_parallel import TensorParallel, join_group, leave_group
rank, world, addr, same, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", sys.argv[5]
tp = TensorParallel(rank, world)
join_group(tp, addr, same_machine=same)
g = torch.Generator().manual_seed(rank)
small, big = torch.randn(3, 1000, generator=g), torch.randn(3_000_000, generator=g)  # big: over one 8 MiB slot
blob = bytes(range(256)) * 40_000  # 10 MB pickled: over one slot too
results = {
    "small": tp.all_reduce(small.clone()),
    "big": tp.all_reduce(big.clone()),
    "gathered": tp.comm.gather_last_dim(torch.arange(6 * (rank + 2), dtype=torch.float32).view(6, rank + 2)
                                        + 100 * rank, [r + 2 for r in range(world)]),
    "wide": tp.gather_last_dim(torch.full((80, 30_000), float(rank)), 30_000 * world),
    "no rows": tp.gather_last_dim(torch.zeros(0, 5 - (rank > 0)), 5 + 4 * (world - 1)),
    "bf16": tp.all_reduce(torch.full((7,), 0.5 + rank, dtype=torch.bfloat16)),
    "object": tp.broadcast_object({"from": rank, "blob": blob} if rank == 0 else None),
    "all": tp.all_gather_object(("rank", rank)),
    # DP attention: each rank's tokens, a rank with none among them; rank 1's 300k rows of 8 go over a slot
    "rows": tp.all_gather_rows(torch.arange(rank * 3, dtype=torch.float32).view(rank, 3) + 10 * rank,
                               [r for r in range(world)]),
    "many rows": tp.all_gather_rows(torch.arange(300_000 * rank * 8, dtype=torch.float32).view(-1, 8) + rank,
                                    [300_000 * r for r in range(world)]),
}
leave_group()
with open(out, "wb") as f:
    pickle.dump(results, f)
"""


def run_ranks(tmp_path, world: int, same_machine: bool) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    addr = free_init_addr()
    outs = [tmp_path / f"rank{r}.pkl" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), addr, "1" if same_machine else "0",
                               str(outs[r])]) for r in range(world)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    assert not list(Path("/dev/shm").glob("hisparse-tp-*"))  # unlinked once every rank mapped it
    return [pickle.loads(out.read_bytes()) for out in outs]


@pytest.mark.parametrize("world, same_machine", [(2, True), (3, True), (2, False)],
                         ids=["shared-memory-2", "shared-memory-3", "gloo-2"])
def test_collectives_match_rank_order_sums_on_every_rank(tmp_path, world, same_machine):
    results = run_ranks(tmp_path, world, same_machine)
    inputs = []
    for rank in range(world):
        g = torch.Generator().manual_seed(rank)
        inputs.append((torch.randn(3, 1000, generator=g), torch.randn(3_000_000, generator=g)))
    for name, index in (("small", 0), ("big", 1)):
        expected = inputs[0][index].clone()
        for rank in range(1, world):
            expected += inputs[rank][index]
        for rank, got in enumerate(results):
            assert torch.equal(got[name], expected), f"rank {rank}'s {name} all-reduce differs"
    widths = [r + 2 for r in range(world)]
    expected = torch.cat([torch.arange(6 * w, dtype=torch.float32).view(6, w) + 100 * r
                          for r, w in enumerate(widths)], -1)
    assert torch.equal(results[0]["gathered"], expected)
    assert torch.equal(results[0]["wide"], torch.cat([torch.full((80, 30_000), float(r)) for r in range(world)], -1))
    assert all(r["gathered"] is None and r["wide"] is None for r in results[1:])
    assert results[0]["no rows"].shape == (0, 5 + 4 * (world - 1))  # a step that samples nothing
    bf16 = sum(torch.full((7,), 0.5 + r, dtype=torch.bfloat16) for r in range(world))
    assert all(torch.equal(r["bf16"], bf16) for r in results)
    blob = bytes(range(256)) * 40_000
    assert all(r["object"] == {"from": 0, "blob": blob} for r in results)
    assert all(r["all"] == [("rank", k) for k in range(world)] for r in results)
    rows = torch.cat([torch.arange(r * 3, dtype=torch.float32).view(r, 3) + 10 * r for r in range(world)])
    many = torch.cat([torch.arange(300_000 * r * 8, dtype=torch.float32).view(-1, 8) + r for r in range(world)])
    assert all(torch.equal(r["rows"], rows) and torch.equal(r["many rows"], many) for r in results)
