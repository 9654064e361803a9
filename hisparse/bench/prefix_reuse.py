"""Prefix reuse behind the real server: two workloads that repeat prompt prefixes, on four servers (the radix
cache on and off, HiSparse off and on), in one run.

    python -m hisparse.bench_serving --workload prefix-reuse [--requests 16] [--shared-tokens 1024]
        [--own-tokens 256] [--output-tokens 32] [--conversations 4] [--turns 4] [--turn-tokens 256]
        [--repeats 1] [--out-dir bench_results/prefix_reuse]

- shared prefix: `--requests` completions sent at once, each a `--shared-tokens` system prompt of held-out
  Python docs and `--own-tokens` of its own; then one more sent alone, whose TTFT is that of a request whose
  prefix is cached (or, without reuse, is not);
- multi-turn chat: `--conversations` chats at once through /v1/chat/completions, `--turns` turns each; a turn
  sends the conversation so far (the earlier questions and the server's own answers) and a new question of
  `--turn-tokens` tokens.

Each server's device budget holds all the shared-prefix requests without reuse (the baseline: their whole
K/V; HiSparse: their hot buffers, and a host pool 6x the device's), so memory never makes a request wait and
what differs is the prefill that reuse skips. The servers run one at a time, their caches flushed
(`POST /flush_cache`) before each workload, in an order that alternates between repeats. Reported per server
and workload: output tokens/s, median TTFT, the prompt tokens reused (usage.prompt_tokens_details.cached_tokens)
and, per mode, the ratios with reuse over without (within each repeat, then their median).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from hisparse.bench.serving import default_model_shape
from hisparse.bench.serving_client import RequestResult, send_all, stream_request
from hisparse.bench.serving_server import ServerProcess, wait_ready
from hisparse.cli_args import OneLineParser, int_in, output_dir, positive_int
from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.memory.hisparse_pools import PoolSizing
from hisparse.models.loader import open_model

PROG = "python -m hisparse.bench_serving --workload prefix-reuse"
HISPARSE_CONFIG = {"top_k": 256, "device_buffer_size": 300, "host_to_device_ratio": 6}
SERVERS = {  # label -> (HiSparse on, radix cache on)
    "baseline, no reuse": (False, False), "baseline, reuse": (False, True),
    "hisparse, no reuse": (True, False), "hisparse, reuse": (True, True),
}


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int_in(1, 256), default=16, help="shared-prefix requests sent at once")
    ap.add_argument("--shared-tokens", type=positive_int, default=1024, help="the prefix they share")
    ap.add_argument("--own-tokens", type=positive_int, default=256, help="each one's own tokens after it")
    ap.add_argument("--output-tokens", type=positive_int, default=32, help="tokens generated per request")
    ap.add_argument("--conversations", type=int_in(1, 256), default=4, help="multi-turn chats at once")
    ap.add_argument("--turns", type=int_in(1, 64), default=4)
    ap.add_argument("--turn-tokens", type=positive_int, default=256, help="tokens of each question")
    ap.add_argument("--repeats", type=int_in(1, 100), default=1, help="runs of both workloads on every server")
    ap.add_argument("--out-dir", type=output_dir, default="bench_results/prefix_reuse")
    return ap


def budgets(args, files) -> dict[bool, int]:
    """Device KV budget by HiSparse on/off: room for every shared-prefix request without reuse."""
    layout, index_key, max_context = default_model_shape(files)
    request_tokens = args.shared_tokens + args.own_tokens + args.output_tokens
    if request_tokens > max_context:
        raise ValueError(f"--shared-tokens + --own-tokens + --output-tokens = {request_tokens} exceeds the "
                         f"model's context ({max_context} tokens)")
    config = HiSparseConfig.parse(json.dumps(HISPARSE_CONFIG))
    cell = PoolSizing(layout.num_layers, layout.row_bytes, index_key.row_bytes, config, 0).cell_bytes
    # Device slots for every request's hot buffer, and enough that the host pool (ratio x them) holds them all.
    hot = args.requests * min(request_tokens, config.device_buffer_size + 1)
    device_slots = max(hot, -(-args.requests * request_tokens // config.host_to_device_ratio))
    hisparse = PoolSizing(layout.num_layers, layout.row_bytes, index_key.row_bytes, config, (device_slots + 1) * cell)
    hisparse.check("cpu", max_context)
    return {False: (args.requests + 1) * request_tokens * layout.baseline_bytes_per_token(index_key),
            True: hisparse.budget_bytes}


# -- workloads ------------------------------------------------------------------------------------------------


def completion(model: str, prompt: list[int] | str, max_tokens: int) -> tuple[str, dict]:
    return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def shared_prefix(server: ServerProcess, model: str, args, stream: list[int], bar: tqdm) -> dict:
    shared = stream[:args.shared_tokens]
    start = args.shared_tokens
    own = [stream[start + args.own_tokens * i:start + args.own_tokens * (i + 1)] for i in range(args.requests + 1)]
    bodies = [completion(model, shared + own[i], args.output_tokens) for i in range(args.requests)]
    results, seconds = asyncio.run(send_all(server.base_url, bodies, bar.update))
    alone, _ = asyncio.run(send_all(server.base_url, [completion(model, shared + own[-1], args.output_tokens)],
                                   bar.update))
    return summary(results, seconds) | {"ttft_alone_s": alone[0].ttft,
                                        "cached_tokens_alone": alone[0].cached_tokens,
                                        "errors": errors(results + alone)}


def multi_turn(server: ServerProcess, model: str, args, questions: list[list[str]], bar: tqdm) -> dict:
    """Every conversation's turns in order, the conversations side by side; turn 1 reuses nothing (but the
    chat template's opening), so TTFT is taken over the later turns."""

    async def chat(client: httpx.AsyncClient, asked: list[str]) -> list[RequestResult]:
        messages, results = [], []
        for question in asked:
            messages.append({"role": "user", "content": question})
            body = {"model": model, "messages": list(messages), "max_tokens": args.output_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            result = await stream_request(client, f"{server.base_url}/v1/chat/completions", body, bar.update)
            results.append(result)
            messages.append({"role": "assistant", "content": result.text})
        return results

    async def run() -> tuple[list[list[RequestResult]], float]:
        limits = httpx.Limits(max_connections=len(questions) + 2)
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0), limits=limits) as client:
            start = time.perf_counter()
            chats = await asyncio.gather(*(chat(client, asked) for asked in questions))
            return chats, time.perf_counter() - start

    chats, seconds = asyncio.run(run())
    results = [r for turns in chats for r in turns]
    later = [r for turns in chats for r in turns[1:]]
    return summary(results, seconds) | {"ttft_median_s": median([r.ttft for r in later]),
                                        "errors": errors(results)}


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def errors(results: list[RequestResult]) -> list[str]:
    return sorted({r.error for r in results if r.error})[:3]


def summary(results: list[RequestResult], seconds: float) -> dict:
    tokens = sum(r.output_tokens for r in results)
    return {"requests": len(results), "seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "ttft_median_s": median([r.ttft for r in results]),
            "prompt_tokens": sum(r.prompt_tokens for r in results),
            "cached_tokens": sum(r.cached_tokens for r in results)}


# -- the run --------------------------------------------------------------------------------------------------


def ratios(rows: list[dict]) -> list[dict]:
    """Per workload and mode: reuse / no reuse within each repeat (a repeat's servers run minutes apart, the
    repeats up to half an hour: the machine's speed drifts between them), then the median over repeats."""

    def value(workload: str, label: str, repeat: int, key: str) -> float | None:
        found = [r.get(key) for r in rows
                 if (r["workload"], r["server"], r.get("repeat", 0)) == (workload, label, repeat)]
        return found[0] if found else None

    repeats = sorted({r.get("repeat", 0) for r in rows})
    out = []
    for workload in ("shared prefix", "multi-turn chat"):
        for mode in ("baseline", "hisparse"):
            row = {"workload": workload, "mode": mode}
            for key in ("output_tok_s", "ttft_median_s", "ttft_alone_s"):
                pairs = [(value(workload, f"{mode}, reuse", r, key), value(workload, f"{mode}, no reuse", r, key))
                         for r in repeats]
                row[key] = median([on / off for on, off in pairs if on is not None and off])
            out.append(row)
    return out


def _number(value: float | None, digits: int, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(report: dict) -> str:
    lines = [f"Prefix reuse: {report['workload']}", "",
             "| workload | server | output tok/s | TTFT median (s) | TTFT alone (s) | prompt tokens reused | failed |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in report["results"]:
        lines.append(f"| {row['workload']} | {row['server']} | {row['output_tok_s']:.2f} "
                     f"| {_number(row['ttft_median_s'], 2)} | {_number(row.get('ttft_alone_s'), 2)} "
                     f"| {row['cached_tokens']} / {row['prompt_tokens']} | {len(row['errors'])} |")
    lines += ["", "| workload | mode | output tok/s, reuse / none | TTFT median, reuse / none "
              "| TTFT alone, reuse / none |", "|---|---|---:|---:|---:|"]
    for row in report["reuse_vs_none"]:
        lines.append(f"| {row['workload']} | {row['mode']} | {_number(row['output_tok_s'], 2, 'x')} "
                     f"| {_number(row['ttft_median_s'], 2, 'x')} | {_number(row['ttft_alone_s'], 2, 'x')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files = open_model(None)
    try:
        budget = budgets(args, files)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    tokenizer = files.tokenizer()
    from hisparse.data.pydoc_corpus import corpus_tokens

    stream = corpus_tokens(tokenizer, "heldout")
    start = args.shared_tokens + args.own_tokens * (args.requests + 1)
    questions = [[tokenizer.decode(stream[start + args.turn_tokens * (c * args.turns + t):
                                          start + args.turn_tokens * (c * args.turns + t + 1)])
                  for t in range(args.turns)] for c in range(args.conversations)]
    if start + args.turn_tokens * args.conversations * args.turns > len(stream):
        print(f"{PROG}: error: the held-out text ({len(stream)} tokens) is too short for these sizes",
              file=sys.stderr)
        return 2
    out_dir: Path = args.out_dir
    servers = {}
    for label, (hisparse, reuse) in SERVERS.items():
        flags = ["--device-kv-budget", str(budget[hisparse]), "--max-running-requests", str(args.requests + 1),
                 "--top-k", str(HISPARSE_CONFIG["top_k"])]
        flags += ["--enable-hisparse", "--hisparse-config", json.dumps(HISPARSE_CONFIG)] if hisparse else []
        flags += [] if reuse else ["--disable-radix-cache"]
        log = out_dir / f"server-{label.replace(', ', '-').replace(' ', '-')}.log"
        servers[label] = ServerProcess(label, flags, log)
    workload = (f"{args.requests} requests at once sharing {args.shared_tokens} tokens, {args.own_tokens} of their "
                f"own; {args.conversations} chats of {args.turns} turns of {args.turn_tokens}-token questions; "
                f"{args.output_tokens} tokens out each")
    print(f"workload: {workload}")
    print(f"device KV budget: baseline {budget[False] / 2**20:.0f} MiB, HiSparse {budget[True] / 2**20:.0f} MiB "
          f"({json.dumps(HISPARSE_CONFIG)})")
    rows: list[dict] = []
    started = time.time()
    try:
        for server in servers.values():
            server.start()
        wait_ready(list(servers.values()))
        model = next(iter(servers.values())).model_name()
        per_repeat = (2 * args.requests + 1 + args.conversations * args.turns) * args.output_tokens
        with tqdm(total=args.repeats * len(servers) * per_repeat, unit="tok", desc="prefix reuse",
                  dynamic_ncols=True) as bar:
            for repeat in range(args.repeats):
                order = list(servers) if repeat % 2 == 0 else list(servers)[::-1]
                for label in order:
                    server = servers[label]
                    bar.set_description(label)
                    for name in ("shared prefix", "multi-turn chat"):
                        httpx.post(f"{server.base_url}/flush_cache", timeout=60).raise_for_status()
                        figures = (shared_prefix(server, model, args, stream, bar) if name == "shared prefix"
                                   else multi_turn(server, model, args, questions, bar))
                        row = {"workload": name, "server": label, "repeat": repeat} | figures
                        rows.append(row)
                        bar.write(f"{name:>15} | {label:<18} {row['output_tok_s']:7.2f} tok/s, TTFT median "
                                  f"{row['ttft_median_s']:.2f} s, reused {row['cached_tokens']} of "
                                  f"{row['prompt_tokens']} prompt tokens")
    except RuntimeError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    finally:
        for server in servers.values():
            server.stop()
    report = {"workload": workload, "device_kv_budget_bytes": {"baseline": budget[False], "hisparse": budget[True]},
              "hisparse_config": HISPARSE_CONFIG, "repeats": args.repeats, "seconds": time.time() - started,
              "results": rows, "reuse_vs_none": ratios(rows)}
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out_dir / "results.md").write_text(text)
    print("\n" + text)
    print(f"written to {out_dir}/: results.json, results.md, server-*.log")
    return 1 if any(row["errors"] for row in rows) else 0
