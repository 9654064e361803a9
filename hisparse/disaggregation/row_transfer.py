"""Which bytes go where when a prompt's rows move between two instances' pools.

A pool is a contiguous [layers, rows, row bytes] tensor (the K/V rows, the indexer keys), registered once
with the transfer engine; a request's rows are one row number per position. What crosses the control channel
is a `PoolSpec` per pool (its address and shape) and the destination's row numbers as runs; what the transfer
engine moves is one copy per layer per stretch of positions whose rows are consecutive on both sides, so a
freshly allocated request moves in a few large writes, not one write per row (scattered 768-byte writes ran
at 0.06 GB/s here, 256 MiB in one at 1.8 GB/s).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PoolSpec:
    name: str  # "kv" (K/V or latent rows), "index_keys"
    address: int
    num_layers: int
    num_rows: int
    row_bytes: int

    @classmethod
    def of(cls, name: str, pool: torch.Tensor) -> PoolSpec:
        layers, rows = pool.shape[:2]
        return cls(name, pool.data_ptr(), layers, rows, pool[0, 0].numel() * pool.element_size())

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> PoolSpec:
        return cls(str(data["name"]), int(data["address"]), int(data["num_layers"]), int(data["num_rows"]),
                   int(data["row_bytes"]))


def check_compatible(sources: list[PoolSpec], destinations: list[PoolSpec]) -> None:
    """ValueError naming the difference unless both instances cache the same rows (same model, same KV and
    indexer-key formats): a row copied into a pool of another format would be garbage, silently."""
    names = ([s.name for s in sources], [d.name for d in destinations])
    if names[0] != names[1]:
        raise ValueError(f"the instances cache different pools: {names[0]} here, {names[1]} there (is one of them "
                         f"a dense model, or without sparse attention?)")
    for s, d in zip(sources, destinations, strict=True):
        if (s.num_layers, s.row_bytes) != (d.num_layers, d.row_bytes):
            raise ValueError(f"the {s.name} pools differ: {s.num_layers} layers of {s.row_bytes}-byte rows here, "
                             f"{d.num_layers} of {d.row_bytes} there (the same model and --kv-cache-dtype on both?)")


def encode_runs(rows: np.ndarray) -> list[list[int]]:
    """Row numbers as [first, count] runs of consecutive rows: a few pairs for a fresh request's thousands."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return []
    starts = np.flatnonzero(np.diff(rows, prepend=rows[0] - 2) != 1)
    counts = np.diff(np.append(starts, rows.size))
    return [[int(rows[s]), int(c)] for s, c in zip(starts, counts, strict=True)]


def decode_runs(runs: list[list[int]]) -> np.ndarray:
    if not runs:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.arange(first, first + count, dtype=np.int64) for first, count in runs])


def plan_writes(src: PoolSpec, src_rows: np.ndarray, dst: PoolSpec, dst_rows: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source addresses, destination addresses, lengths) that copy row src_rows[i] of every layer of `src` to
    row dst_rows[i] of the same layer of `dst`: one entry per layer per stretch consecutive on both sides."""
    src_rows, dst_rows = np.asarray(src_rows, np.int64), np.asarray(dst_rows, np.int64)
    if src_rows.shape != dst_rows.shape:
        raise ValueError(f"{src_rows.size} source rows for {dst_rows.size} destination rows")
    if src_rows.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    for spec, rows in ((src, src_rows), (dst, dst_rows)):
        if rows.min() < 0 or rows.max() >= spec.num_rows:
            raise ValueError(f"row numbers outside the {spec.name} pool's {spec.num_rows} rows")
    breaks = (np.diff(src_rows) != 1) | (np.diff(dst_rows) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    counts = np.diff(np.append(starts, src_rows.size))
    layers = np.arange(src.num_layers, dtype=np.int64)[:, None]
    row = src.row_bytes
    sources = src.address + (layers * src.num_rows + src_rows[starts]) * row
    destinations = dst.address + (layers * dst.num_rows + dst_rows[starts]) * row
    lengths = np.broadcast_to(counts * row, sources.shape)
    return sources.ravel(), destinations.ravel(), np.ascontiguousarray(lengths).ravel()
