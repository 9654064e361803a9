"""The definition of swap-in: each request's plan from the policy's plain-Python rule, then the copies."""

from __future__ import annotations

import torch

from hisparse.kernels.swap_in import SwapInResult
from hisparse.memory.eviction import EvictionPolicy, resolve_policy


def swap_in_reference(top_k: torch.Tensor, rows: torch.Tensor, slot_pos: torch.Tensor, lru: torch.Tensor,
                      device_rows: torch.Tensor, host_rows: torch.Tensor, host_kv: torch.Tensor,
                      device_kv: torch.Tensor, *, policy: str | EvictionPolicy = "lru",
                      next_ranked: torch.Tensor | None = None) -> SwapInResult:
    policy = resolve_policy(policy)
    batch, width = top_k.shape
    page_table = torch.full((batch, width), -1, dtype=torch.int64, device=top_k.device)
    misses = torch.zeros(batch, dtype=torch.int32, device=top_k.device)
    evictions = torch.zeros(batch, dtype=torch.int32, device=top_k.device)
    hits = torch.zeros(batch, dtype=torch.int32, device=top_k.device)
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    for b in range(batch):
        r = int(rows[b])
        selected = top_k[b].tolist()
        old_pos = slot_pos[r].tolist()
        state = {key: tensor[r].tolist() for key, tensor in policy.state.items()}
        ranked = next_ranked[b].tolist() if next_ranked is not None else []
        plan = policy.plan_row(selected, old_pos, lru[r].tolist(), state, ranked)

        victims = torch.tensor(plan.victims, dtype=torch.int64, device=slot_pos.device)
        loaded = torch.tensor([selected[j] for j in plan.miss_columns], dtype=torch.int64,
                              device=slot_pos.device)
        misses[b] = len(plan.victims)
        held = set(old_pos)
        hits[b] = sum(p >= 0 and p in held for p in selected)
        evictions[b] = sum(old_pos[s] >= 0 for s in plan.victims)
        slot_pos[r, victims] = loaded.to(slot_pos.dtype)
        lru[r] = torch.tensor(plan.order, dtype=lru.dtype, device=lru.device)
        for key, values in plan.state.items():
            policy.state[key][r] = torch.tensor(values, dtype=policy.state[key].dtype)

        slots = torch.tensor(plan.slots, dtype=torch.int64, device=top_k.device)
        placed = slots >= 0
        page_table[b, placed] = device_rows[r, slots[placed]]
        src.append(host_rows[r, loaded])
        dst.append(device_rows[r, victims])
    if src:
        src_rows = torch.cat(src).to(host_kv.device)
        dst_rows = torch.cat(dst).to(device_kv.device)
        device_kv.index_copy_(0, dst_rows, host_kv.index_select(0, src_rows).to(device_kv.device))
    return SwapInResult(page_table, misses, evictions, hits)
