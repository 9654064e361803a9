"""The indexer's selection, one layer: the compiled int8 scorer and top-k against the PyTorch path.

    python -m hisparse.bench.index_scores [--batches 1,4,8,16] [--context 2048] [--heads 4] [--head-dim 64]
                                          [--top-k 256]

Each decode step scores every past token of every request in every layer, so this is per-request work
that batching does not amortise. The keys sit in a cache of 30 layers larger than the CPU caches, each
request's slots a contiguous run as the allocator hands them out, and a 64 MiB buffer is rewritten
before every call (a decode step runs the rest of the layer between two scorings). The two paths take
turns call by call; printed: the median time of each and their ratio, for the scores of every past
token and for the top-k picked from them; then the whole selection as a decode step runs it on the CPU
(`IndexSelector.select`: scores and top-k in one compiled call, `index_scores_cpu.int8_top_k`) and its time
over the two compiled calls'.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hisparse.attention.index_selection import IndexSelector
from hisparse.bench import MAX_REPEATS
from hisparse.cli_args import OneLineParser, comma_list, int_in, positive_int, run_main
from hisparse.formats.index_key import IndexKeyFormat
from hisparse.memory.host_memory import check_fits_in_memory
from hisparse.memory.indexer_cache import IndexerKeyCache

LAYERS = 30
FLUSH_BYTES = 64 << 20  # rewritten before every call, to push the keys out of the CPU caches
PROG = "python -m hisparse.bench.index_scores"


def time_selection(cache: IndexSelector, batch: int, context: int, heads: int, top_k: int, repeats: int,
                   gen: torch.Generator) -> dict[str, float]:
    """Median seconds of the compiled and the PyTorch scores and top-k and of the one-call selection, and the
    scores' largest difference over the largest score."""
    spacing = cache.keys.rows.shape[1] // batch
    slots = torch.stack([torch.arange(b * spacing, b * spacing + context) for b in range(batch)])
    lengths = torch.full((batch,), context) - torch.arange(batch)  # the batch's lengths differ a little
    q = torch.randn(batch, heads, cache.keys.index_dim, generator=gen)
    w = torch.rand(batch, heads, generator=gen)
    flush = torch.ones(FLUSH_BYTES, dtype=torch.uint8)
    kernels = {"scores": cache._past_scores, "scores_ref": cache.past_scores_reference}
    times: dict[str, list[float]] = {name: [] for name in ("scores", "scores_ref", "top_k", "top_k_ref", "select")}
    worst = 0.0
    for i in range(repeats + 1):
        layer = i % LAYERS
        out = {}
        for name in ("scores", "scores_ref") if i % 2 else ("scores_ref", "scores"):
            flush.add_(1)
            start = time.perf_counter()
            out[name] = kernels[name](layer, q, w, slots, lengths)
            times[name].append(time.perf_counter() - start)
        for name in ("top_k", "top_k_ref") if i % 2 else ("top_k_ref", "top_k"):
            flush.add_(1)
            select = cache._select if name == "top_k" else cache.select_reference
            start = time.perf_counter()
            select(out["scores"], top_k)
            times[name].append(time.perf_counter() - start)
        flush.add_(1)
        start = time.perf_counter()
        cache.select(layer, q, w, slots, lengths, top_k)
        times["select"].append(time.perf_counter() - start)
        finite = torch.isfinite(out["scores_ref"])
        worst = max(worst, float((out["scores"][finite] - out["scores_ref"][finite]).abs().max()
                                 / out["scores_ref"][finite].abs().max()))
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}  # the first calls compile (numba)
    return {**medians, "worst": worst}


def head_dim_flag(text: str) -> int:
    """argparse type: a positive multiple of 4 (the int8 row's scale is read as one fp32 word)."""
    value = positive_int(text)
    if value % 4:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 4 (the int8 row's scale is read as one "
                                         f"fp32 word), got {value}")
    return value


def needed_bytes(batch: int, context: int, heads: int, head_dim: int) -> int:
    """About the memory a run takes at its largest batch: the key cache, the keys written into it, and a call's
    dequantized keys, per-head scores and scores (the PyTorch path), with the flush buffer."""
    slots = batch * (context + 64)
    cache = LAYERS * slots * (head_dim + 4)
    written = slots * head_dim * 4 * 2
    per_call = batch * context * (head_dim + heads + 4) * 4 * 2
    return cache + written + per_call + FLUSH_BYTES


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=comma_list(positive_int), default="1,4,8,16",
                        help="comma list of batch sizes (each below --context)")
    parser.add_argument("--context", type=int_in(2), default=2048, help="past tokens per request")
    parser.add_argument("--heads", type=positive_int, default=4, help="indexer heads")
    parser.add_argument("--head-dim", type=head_dim_flag, default=64, help="indexer head dim (a multiple of 4)")
    parser.add_argument("--top-k", type=positive_int, default=256, help="positions selected per request")
    parser.add_argument("--repeats", type=int_in(1, MAX_REPEATS), default=41,
                        help=f"timed calls per figure (median; at most {MAX_REPEATS})")
    args = parser.parse_args(argv)
    batches = args.batches
    if max(batches) >= args.context:  # request b has context - b past tokens
        parser.error(f"--batches {max(batches)} leaves a request without past tokens: each request of a batch has "
                     f"--context minus its index in the batch, so batches must be below --context ({args.context})")
    try:
        check_fits_in_memory(needed_bytes(max(batches), args.context, args.heads, args.head_dim),
                             f"batch {max(batches)} x context {args.context} x {args.heads} heads x {args.head_dim} "
                             f"dims over {LAYERS} layers")
    except ValueError as error:
        parser.error(str(error))
    gen = torch.Generator().manual_seed(0)
    slots = max(batches) * (args.context + 64)
    cache = IndexerKeyCache(LAYERS, slots, IndexKeyFormat("int8", args.head_dim))
    for layer in range(LAYERS):
        cache.write(layer, torch.arange(slots), torch.randn(slots, args.head_dim, generator=gen))
    print(f"int8 keys, {args.heads} heads x {args.head_dim} dims, {args.context} past tokens per request, "
          f"{LAYERS} layers of {slots} slots; median of {args.repeats}, torch threads {torch.get_num_threads()}")
    print(f"{'':>5} {'scores':>30} {'top-k':>27} {'selection':>22}")
    print(f"{'batch':>5} {'compiled us':>11} {'torch us':>9} {'ratio':>6} {'max diff':>9} "
          f"{'compiled us':>11} {'torch us':>9} {'ratio':>6} {'one call us':>11} {'vs two':>6}")
    for batch in batches:
        t = time_selection(IndexSelector(cache), batch, args.context, args.heads, args.top_k, args.repeats, gen)
        print(f"{batch:>5} {t['scores'] * 1e6:>11.0f} {t['scores_ref'] * 1e6:>9.0f} "
              f"{t['scores'] / t['scores_ref']:>6.2f} {t['worst']:>9.1e} {t['top_k'] * 1e6:>11.0f} "
              f"{t['top_k_ref'] * 1e6:>9.0f} {t['top_k'] / t['top_k_ref']:>6.2f} {t['select'] * 1e6:>11.0f} "
              f"{t['select'] / (t['scores'] + t['top_k']):>6.2f}")


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
