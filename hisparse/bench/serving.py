"""Serving benchmark: the real server, HiSparse off and on under the same device KV budget, driven over HTTP
with streaming OpenAI completions at a sweep of concurrencies.

    python -m hisparse.bench_serving [--workload hisparse] [--concurrency 1,4,16] [--prompt-tokens 1536]
                                     [--output-tokens 192] [--rounds 1] [--min-requests 3] [--poll-interval 0.5]
                                     [--baseline-admits 4] [--device-kv-budget SIZE]
                                     [--hisparse-config JSON] [--ceiling] [--device cpu]
                                     [--out-dir bench_results/serving]

The device budget is what the comparison is about: by default it holds exactly `--baseline-admits` of the
requests (prompt + output tokens) with every token's K/V and indexer key on the device, which is what the
baseline needs; HiSparse gets the very same budget and keeps only a hot buffer per request there. The
default HiSparse config is sized for that budget: a 300-slot hot buffer (top_k 256 plus slack) and a host
pool 6x the device's let it admit 16 of the default 1728-token requests where the baseline admits 4. The
reference's 2 x top_k buffer and 8x pool would admit 8: every device slot also pays for `ratio` indexer
keys (68 B per layer each, against 768 B of bfloat16 K/V), and 512 slots per request is 30% of a request.
(With a float32 K/V cache, twice the bytes per token, a 352-slot buffer and a 5x pool admitted 16.)

`--ceiling` adds a third server, the baseline with a budget that holds every request of the highest level at
once: what device memory alone would buy. Its throughput over the baseline's is the most any offloading
scheme could reach on this machine and workload, and HiSparse's over its says how much of that HiSparse gets.

`--device cuda` runs both servers on a GPU (their pools, weights and steps; the host pool stays in host memory),
the regime the reference measures: there a prompt's prefill is a small part of a request, where on our CPU
both modes' prefill of the same prompts bounds the ratio (`serving_report.prefill_bounds`).

The servers start at once (loading overlaps; an idle server costs the other nothing). Each level sends
`rounds x concurrency` requests (at least `--min-requests`, so that concurrency 1 does not rest on a single
request) of held-out Python-docs text with at most `concurrency` in flight; every request generates
exactly `--output-tokens` tokens. The modes take turns round by round (a round is `concurrency` of the
level's requests), rotating which goes first, so slow phases of a shared machine hit both alike: at
concurrency 1 each mode's three requests are spread over the level instead of one mode's running while the
machine was quiet and the other's while it was not (0.89x-1.08x over five runs that took turns by level).

Reported per mode and level: output throughput (generated tokens / the wall time of its rounds), TTFT and ITL
(median, p99), the most requests the server actually ran at once (its /metrics gauge, polled), and the
hit rate over the level (/metrics hit and miss counters), and the engine's time in steps with prompt
chunks and in decode-only steps: since both modes prefill the same prompts, the first bounds the ratio
(`serving_report.prefill_bounds`). Written to --out-dir: results.json, results.md,
throughput.png, latency.png, and each server's log.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hisparse.bench.serving_client import LevelRun, run_level
from hisparse.bench.serving_server import ServerProcess, wait_ready
from hisparse.cli_args import (
    OneLineParser,
    comma_list,
    device_flag,
    int_in,
    json_object,
    output_dir,
    positive_float,
    positive_int,
    size_flag,
)
from hisparse.engine.engine_config import check_device, resolve_model_dtype
from hisparse.formats.kv_layout import KVLayout
from hisparse.memory.hisparse_pools import PoolSizing
from hisparse.models.loader import ModelFiles, open_model

MODES = ("baseline", "hisparse")
CEILING = "ceiling"  # --ceiling: the baseline with the device memory to run the highest level at once
PROMPT_STRIDE = 97  # tokens between the starts of consecutive prompts in the held-out stream
WARMUP_TOKENS = 4
HITS, MISSES = "hisparse_swap_in_hits_total", "hisparse_swap_in_misses_total"
DECODE_STEPS, DECODE_SECONDS = "hisparse_engine_decode_steps_total", "hisparse_engine_decode_seconds_total"
STEP_SECONDS = "hisparse_engine_step_seconds_total"
DEFAULT_HISPARSE_CONFIG = '{"top_k": 256, "device_buffer_size": 300, "host_to_device_ratio": 6}'
PROG = "python -m hisparse.bench_serving"
# Requests sent at one level, at most: far more than a server on this machine runs at once (16 is the
# README's highest level), and a bound on the prompts built for a level (a typo of 10**12 never ended).
MAX_LEVEL_REQUESTS = 4096


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=comma_list(int_in(1, MAX_LEVEL_REQUESTS)), default="1,4,16",
                    help="comma-separated levels (default 1,4,16)")
    ap.add_argument("--prompt-tokens", type=positive_int, default=1536)
    ap.add_argument("--output-tokens", type=positive_int, default=192)
    ap.add_argument("--rounds", type=int_in(1, MAX_LEVEL_REQUESTS), default=1,
                    help=f"requests per level = rounds x concurrency (at most {MAX_LEVEL_REQUESTS})")
    ap.add_argument("--min-requests", type=int_in(1, MAX_LEVEL_REQUESTS), default=3,
                    help="at least this many requests per level (default 3: one request alone was too noisy a "
                         "figure at concurrency 1, 0.83x-1.03x across three runs)")
    ap.add_argument("--poll-interval", type=positive_float, default=0.5,
                    help="seconds between polls of the server's running-requests gauge (default 0.5: each poll "
                         "costs the measured server a /metrics page; 0.1 s made batch-1 steps about 10%% slower)")
    ap.add_argument("--baseline-admits", type=positive_int, default=4,
                    help="size the default device budget so that the baseline holds this many requests at once")
    ap.add_argument("--device-kv-budget", type=size_flag, default=None,
                    help="bytes or e.g. 320MiB; overrides --baseline-admits")
    ap.add_argument("--hisparse-config", type=json_object, default=DEFAULT_HISPARSE_CONFIG,
                    help="JSON for the HiSparse server; its top_k is given to both servers")
    ap.add_argument("--ceiling", action="store_true",
                    help="also run the baseline with a budget that holds every request of the highest level: the "
                         "most memory alone buys (a third server, half again the time)")
    ap.add_argument("--device", type=device_flag, default="cpu",
                    help="where both servers run: cpu, cuda or cuda:N (default cpu)")
    ap.add_argument("--out-dir", type=output_dir, default="bench_results/serving",
                    help="created now, so that an unwritable folder is found before the servers start")
    return ap


# -- sizing -------------------------------------------------------------------------------------------


def default_model_shape(files: ModelFiles, device: str = "cpu") -> tuple[KVLayout, int, int]:
    """(K/V layout as the servers on `device` store it, indexer key format, context length) of the default model,
    read from its config and the shipped indexer's metadata without loading any weights."""
    indexer = files.default_indexer_config()
    if indexer is None:
        raise FileNotFoundError("the default model's indexer weights are missing; run `python -m "
                                "hisparse.train_indexer`")
    index_key = indexer.key_layout
    # The servers store K/V in the model's dtype (--kv-cache-dtype auto), as they pick it on the device.
    layout = KVLayout.of(files.config, resolve_model_dtype(device=device))
    return layout, index_key, files.config.max_position_embeddings


def admits(mode: str, pools: dict[str, float], request_tokens: int, buffer: int, max_running: int) -> int:
    """How many requests of `request_tokens` the server's reported pools hold at once, by the rule its cache
    admits with: the whole request on the device for the baseline; for HiSparse a hot buffer (plus the
    newest token's slot) on the device and the whole request in the host pool and the indexer-key cache."""
    device = int(pools.get("hisparse_kv_slots_total[device]", 0))
    if mode != "hisparse":
        return min(device // request_tokens, max_running)
    hot = request_tokens if request_tokens <= buffer else buffer + 1
    host = int(pools.get("hisparse_kv_slots_total[host]", 0))
    index = int(pools.get("hisparse_kv_slots_total[indexer]", host))
    return min(device // hot, host // request_tokens, index // request_tokens, max_running)


def prompts_from(stream: list[int], count: int, length: int, first: int = 0) -> list[list[int]]:
    """`count` windows of real text, PROMPT_STRIDE tokens apart; the stream repeats if it is too short."""
    while len(stream) < PROMPT_STRIDE * (first + count) + length:
        stream = stream + stream
    return [stream[PROMPT_STRIDE * i:PROMPT_STRIDE * i + length] for i in range(first, first + count)]


# -- one level ----------------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(mode: str, concurrency: int, run: LevelRun, before: dict, after: dict) -> dict:
    ok = [r for r in run.results if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    tokens = sum(r.output_tokens for r in ok)
    hits = misses = hit_rate = None
    if HITS in after:
        hits, misses = int(after[HITS] - before.get(HITS, 0)), int(after[MISSES] - before.get(MISSES, 0))
        hit_rate = hits / (hits + misses) if hits + misses else None
    decode_steps = after.get(DECODE_STEPS, 0) - before.get(DECODE_STEPS, 0)
    decode_seconds = after.get(DECODE_SECONDS, 0) - before.get(DECODE_SECONDS, 0)
    decode_step_s = decode_seconds / decode_steps if decode_steps else None
    return {
        "mode": mode, "concurrency": concurrency, "requests": len(run.results), "failed": len(run.results) - len(ok),
        "errors": sorted({r.error for r in run.results if r.error})[:3],
        "seconds": run.seconds, "output_tokens": tokens, "output_tok_s": tokens / run.seconds,
        "ttft_median_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
        "itl_median_s": _percentile(itl, 50), "itl_p99_s": _percentile(itl, 99),
        "e2e_median_s": _percentile([r.latency for r in ok], 50),
        "decode_step_s": decode_step_s,  # the engine's mean decode-only step, as it timed it
        # The engine's time in steps that carried prompt chunks (and the decodes batched with them), and in
        # decode-only steps: where the level's wall time went.
        "prompt_step_seconds": after.get(STEP_SECONDS, 0) - before.get(STEP_SECONDS, 0) - decode_seconds,
        "decode_seconds": decode_seconds,
        "max_running": run.max_running, "hits": hits, "misses": misses, "hit_rate": hit_rate,
    }


def rounds_of(prompts: list[list[int]], concurrency: int) -> list[list[list[int]]]:
    """The level's prompts in consecutive rounds of at least `concurrency` each (as many as fit; a remainder
    joins the last round), so that every round runs at the level's concurrency."""
    count = max(1, len(prompts) // concurrency)
    cuts = [len(prompts) * r // count for r in range(count + 1)]
    return [prompts[cuts[r]:cuts[r + 1]] for r in range(count)]


def turn_order(modes: tuple[str, ...], turn: int) -> tuple[str, ...]:
    """The modes in the order they run round `turn`: rotated one place a round (two modes alternate)."""
    shift = turn % len(modes)
    return modes[shift:] + modes[:shift]


def level_in_turns(servers: dict[str, ServerProcess], model: str, prompts: list[list[int]], max_tokens: int,
                   concurrency: int, first: int, bar: tqdm, poll_interval: float) -> dict[str, tuple]:
    """One level on every server, the modes taking turns round by round (`rounds_of`), which goes first
    rotating from `first` (`turn_order`): at concurrency 1 the three requests of a level are three rounds, so a
    slow phase of the machine lands on every mode instead of on whichever ran that level last. Returns, per
    mode, its rounds as one LevelRun (wall times added up) and its server's metrics before and after."""
    modes = tuple(servers)
    runs: dict[str, list[LevelRun]] = {mode: [] for mode in modes}
    before = {mode: servers[mode].metrics() for mode in modes}
    for r, chunk in enumerate(rounds_of(prompts, concurrency)):
        for mode in turn_order(modes, first + r):
            bar.set_description(f"{mode} c={concurrency}")
            runs[mode].append(run_level(servers[mode].base_url, model, chunk, max_tokens, concurrency, bar.update,
                                        poll_interval))
    return {mode: (LevelRun([x for run in runs[mode] for x in run.results], sum(run.seconds for run in runs[mode]),
                            max(run.max_running for run in runs[mode])), before[mode], servers[mode].metrics())
            for mode in modes}


# -- the run ------------------------------------------------------------------------------------------


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from hisparse.memory.hisparse_config import HiSparseConfig

    try:
        config = HiSparseConfig.parse(args.hisparse_config)
    except ValueError as error:
        parser.error(f"argument --hisparse-config: {error}")
    levels = sorted(args.concurrency)
    per_level = {c: max(args.rounds * c, args.min_requests) for c in levels}  # requests sent at each level
    if max(per_level.values()) > MAX_LEVEL_REQUESTS:
        parser.error(f"--rounds {args.rounds} x --concurrency {levels[-1]} = {args.rounds * levels[-1]} requests at "
                     f"a level, more than {MAX_LEVEL_REQUESTS}")
    try:
        check_device(args.device)
    except ValueError as error:
        return _fail(f"--device {args.device}: no such CUDA device on this machine ({error})")
    try:
        files = open_model(None)  # seconds: its tokenizer comes from it later
        layout, index_key, max_context = default_model_shape(files, args.device)
    except (FileNotFoundError, ValueError) as error:
        return _fail(str(error))
    request_tokens = args.prompt_tokens + args.output_tokens
    if request_tokens > max_context:
        return _fail(f"--prompt-tokens + --output-tokens = {request_tokens} exceeds the model's context "
                     f"({max_context} tokens)")
    per_token = layout.baseline_bytes_per_token(index_key)  # what the baseline server pays per token
    budget = args.device_kv_budget or args.baseline_admits * request_tokens * per_token
    try:
        # The HiSparse server's own checks of its pools, made before either server starts: a server refusing
        # them exits after some 25 s of loading.
        PoolSizing(layout.num_layers, layout.row_bytes, index_key.row_bytes, config, budget).check(args.device,
                                                                                                  max_context)
    except ValueError as error:
        return _fail(str(error))
    max_running = max(levels)
    common = ["--max-running-requests", str(max_running), "--max-queued-requests", str(max(256, *per_level.values())),
              "--top-k", str(config.top_k), "--device", args.device]
    flags = {"baseline": ["--device-kv-budget", str(budget), *common],
             "hisparse": ["--device-kv-budget", str(budget), *common, "--enable-hisparse", "--hisparse-config",
                          json.dumps(dataclasses.asdict(config))]}
    modes = MODES
    ceiling_budget = max(budget, max_running * request_tokens * per_token)
    if args.ceiling:
        modes += (CEILING,)
        flags[CEILING] = ["--device-kv-budget", str(ceiling_budget), *common]
    out_dir: Path = args.out_dir
    servers = {mode: ServerProcess(mode, flags[mode], out_dir / f"server-{mode}.log") for mode in modes}

    print(f"workload: {args.rounds} x concurrency requests (at least {args.min_requests}) per level at concurrency "
          f"{', '.join(map(str, levels))}; "
          f"{args.prompt_tokens} prompt tokens (held-out Python docs) + {args.output_tokens} output tokens each; "
          f"servers on {args.device}")
    print(f"device KV budget {budget / 2**20:.1f} MiB for both modes "
          f"({per_token} B per token without HiSparse); HiSparse config {json.dumps(dataclasses.asdict(config))}")
    if args.ceiling:
        print(f"ceiling: the baseline with {ceiling_budget / 2**20:.1f} MiB, every request of c = {max_running} "
              f"at once")
    if args.prompt_tokens <= config.device_buffer_size:
        print(f"note: prompts fit the {config.device_buffer_size}-slot hot buffer, so HiSparse rarely swaps in")
    started = time.time()
    load_before = os.getloadavg()
    try:
        for server in servers.values():  # all load at once; an idle server costs the others nothing
            server.start()
        from hisparse.data.pydoc_corpus import corpus_tokens

        stream = corpus_tokens(files.tokenizer(), "heldout")
        wait_ready(list(servers.values()))
        model = servers["baseline"].model_name()
        capacity = {mode: admits(mode, servers[mode].metrics(), request_tokens, config.device_buffer_size,
                                 max_running) for mode in modes}
        print(f"admitted at once: baseline {capacity['baseline']}, HiSparse {capacity['hisparse']} "
              f"({capacity['hisparse'] / max(capacity['baseline'], 1):.1f}x)"
              + (f", ceiling {capacity[CEILING]}" if args.ceiling else ""))
        if args.device_kv_budget is None and capacity["baseline"] != args.baseline_admits:
            print(f"warning: the baseline server admits {capacity['baseline']}, not {args.baseline_admits}: its "
                  f"per-token cost is not the {per_token} bytes computed here; pass --device-kv-budget")
        if capacity["baseline"] < 1:
            return _fail(f"the device budget ({budget} bytes) does not hold one request of {request_tokens} tokens")
        warmup = prompts_from(stream, 1, min(args.prompt_tokens, config.device_buffer_size + 64))
        for server in servers.values():  # first-use costs (JIT caches, allocator) stay out of the figures
            run = run_level(server.base_url, model, warmup, WARMUP_TOKENS, 1)
            if run.results[0].error:
                return _fail(f"warm-up request to the {server.label} server failed: {run.results[0].error}")

        rows: list[dict] = []
        total = len(modes) * sum(per_level.values()) * args.output_tokens
        with tqdm(total=total, unit="tok", desc="serving", dynamic_ncols=True) as bar:
            sent = 1  # windows used: the warm-up's, then each level's own
            for i, concurrency in enumerate(levels):
                prompts = prompts_from(stream, per_level[concurrency], args.prompt_tokens, first=sent)
                sent += per_level[concurrency]
                runs = level_in_turns(servers, model, prompts, args.output_tokens, concurrency, first=i % 2,
                                      bar=bar, poll_interval=args.poll_interval)
                for mode in modes:
                    run, before, after = runs[mode]
                    row = summarize(mode, concurrency, run, before, after)
                    rows.append(row)
                    bar.write(f"{mode:>8} c={concurrency:<3} {row['output_tok_s']:7.2f} tok/s  max running "
                              f"{row['max_running']}" + (f"  FAILED {row['failed']}: {row['errors'][0]}"
                                                          if row["failed"] else ""))
    except RuntimeError as error:
        return _fail(str(error))
    finally:
        for server in servers.values():
            server.stop()

    from hisparse.bench.serving_plot import plot_latency, plot_throughput
    from hisparse.bench.serving_report import markdown_report, prefill_bounds, ratios

    report = {
        "workload": {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                     "rounds": args.rounds, "min_requests": args.min_requests, "concurrency": levels,
                     "text": "held-out Python docs", "device": args.device},
        "device_kv_budget_bytes": budget, "baseline_bytes_per_token": per_token,
        "hisparse_config": dataclasses.asdict(config), "admitted_at_once": capacity,
        "server_flags": flags, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": time.time() - started, "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "results": rows, "hisparse_vs_baseline": ratios(rows),
        "hisparse_vs_baseline_at_most": prefill_bounds(rows),
    }
    if args.ceiling:
        report["ceiling_vs_baseline"] = ratios(rows, CEILING)
        report["hisparse_vs_ceiling"] = ratios(rows, "hisparse", CEILING)
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = markdown_report(report)
    (out_dir / "results.md").write_text(markdown)
    plot_throughput(rows, capacity, out_dir / "throughput.png")
    plot_latency(rows, out_dir / "latency.png")
    print("\n" + markdown)
    print(f"written to {out_dir}/: results.json, results.md, throughput.png, latency.png, server-*.log")
    return 1 if any(row["failed"] for row in rows) else 0
