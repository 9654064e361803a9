"""The indexer's scoring of every past token, one layer: the compiled int8 scorer against the PyTorch path.

    python -m hisparse.bench.index_scores [--batches 1,4,8,16] [--context 2048] [--heads 4] [--head-dim 64]

Each decode step scores every past token of every request in every layer, so this is per-request work
that batching does not amortise. The keys sit in a cache of 30 layers larger than the CPU caches, each
request's slots a contiguous run as the allocator hands them out, and a 64 MiB buffer is rewritten
before every call (a decode step runs the rest of the layer between two scorings). The two paths take
turns call by call; printed: the median time of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hisparse.layers.dsa_indexer import IndexKeyFormat
from hisparse.memory.indexer_cache import IndexerKeyCache

LAYERS = 30


def time_scorers(cache: IndexerKeyCache, batch: int, context: int, heads: int, repeats: int,
                 gen: torch.Generator) -> tuple[float, float, float]:
    """(compiled seconds, reference seconds, largest difference over the largest score), medians of `repeats`."""
    spacing = cache.rows.shape[1] // batch
    slots = torch.stack([torch.arange(b * spacing, b * spacing + context) for b in range(batch)])
    lengths = torch.full((batch,), context) - torch.arange(batch)  # the batch's lengths differ a little
    q = torch.randn(batch, heads, cache.index_dim, generator=gen)
    w = torch.rand(batch, heads, generator=gen)
    flush = torch.ones(64 << 20, dtype=torch.uint8)
    times: dict[str, list[float]] = {"compiled": [], "reference": []}
    worst = 0.0
    for i in range(repeats + 1):
        layer = i % LAYERS
        for name in ("compiled", "reference") if i % 2 else ("reference", "compiled"):
            flush.add_(1)
            scorer = cache._past_scores if name == "compiled" else cache.past_scores_reference
            start = time.perf_counter()
            scores = scorer(layer, q, w, slots, lengths)
            elapsed = time.perf_counter() - start
            if i:  # the first call compiles (numba) and warms up
                times[name].append(elapsed)
            if name == "compiled":
                got = scores
            else:
                want = scores
        finite = torch.isfinite(want)
        worst = max(worst, float((got[finite] - want[finite]).abs().max() / want[finite].abs().max()))
    return statistics.median(times["compiled"]), statistics.median(times["reference"]), worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,8,16", help="comma list of batch sizes")
    parser.add_argument("--context", type=int, default=2048, help="past tokens per request")
    parser.add_argument("--heads", type=int, default=4, help="indexer heads")
    parser.add_argument("--head-dim", type=int, default=64, help="indexer head dim (a multiple of 4)")
    parser.add_argument("--repeats", type=int, default=41, help="timed calls per figure (median)")
    args = parser.parse_args(argv)
    if args.head_dim % 4 or args.head_dim <= 0:
        parser.error("--head-dim must be a positive multiple of 4 (the int8 row's scale is read as one fp32 word)")
    if args.context < 2:
        parser.error("--context must be at least 2")
    batches = [int(x) for x in args.batches.split(",")]
    gen = torch.Generator().manual_seed(0)
    slots = max(batches) * (args.context + 64)
    cache = IndexerKeyCache(LAYERS, slots, IndexKeyFormat("int8", args.head_dim))
    for layer in range(LAYERS):
        cache.write(layer, torch.arange(slots), torch.randn(slots, args.head_dim, generator=gen))
    print(f"int8 keys, {args.heads} heads x {args.head_dim} dims, {args.context} past tokens per request, "
          f"{LAYERS} layers of {slots} slots; median of {args.repeats}, torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'compiled us':>11} {'torch us':>9} {'ratio':>6} {'max diff':>9}")
    for batch in batches:
        compiled, reference, worst = time_scorers(cache, batch, args.context, args.heads, args.repeats, gen)
        print(f"{batch:>5} {compiled * 1e6:>11.0f} {reference * 1e6:>9.0f} {compiled / reference:>6.2f} {worst:>9.1e}")


if __name__ == "__main__":
    main()
