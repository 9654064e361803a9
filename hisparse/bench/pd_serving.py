"""Prefill-decode disaggregation behind the real sglang-router against a co-located server, in one run.

    python -m hisparse.bench_serving --pd [--requests 16] [--prompt-tokens 1024] [--output-tokens 64]
        [--device-kv-budget 160MiB] [--repeats 1] [--out-dir bench_results/pd]

Four deployments take turns on the same requests, each deployment started fresh (so no prefix cache helps):
a co-located server on both cores, HiSparse off and on; and router + a prefill server on core 0 + a decode
server on core 1 (`taskset`, as two nodes would be), HiSparse off and on on the decode side. Every server
has the same device KV budget. All `--requests` completions are sent at once. Reported per deployment:
output tokens/s, median TTFT and ITL as the client sees them, the decode node's own decode throughput (its
decode-only steps' tokens over their time), and the KV transfer's bandwidth (bytes written over the sending
thread's time, prefill side) and latency per request (admission to rows written, decode side).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from hisparse.bench.prefix_reuse import completion, errors, median
from hisparse.bench.serving import prompts_from
from hisparse.bench.serving_client import send_all
from hisparse.bench.serving_server import ServerProcess, free_loopback_port, start_pd_router, wait_ready
from hisparse.cli_args import OneLineParser, int_in, output_dir, positive_int, size_flag
from hisparse.models.loader import open_model

PROG = "python -m hisparse.bench_serving --pd"
HISPARSE_CONFIG = {"top_k": 256, "device_buffer_size": 300, "host_to_device_ratio": 6}
DEPLOYMENTS = {  # label -> (disaggregated, HiSparse on the decoding server)
    "co-located, baseline": (False, False), "co-located, hisparse": (False, True),
    "PD, baseline decode": (True, False), "PD, hisparse decode": (True, True),
}


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int_in(1, 256), default=16, help="completions sent at once")
    ap.add_argument("--prompt-tokens", type=positive_int, default=1024)
    ap.add_argument("--output-tokens", type=positive_int, default=64)
    ap.add_argument("--device-kv-budget", type=size_flag, default=160 << 20, help="every server's (default 160MiB)")
    ap.add_argument("--repeats", type=int_in(1, 100), default=1, help="rounds over the four deployments")
    ap.add_argument("--out-dir", type=output_dir, default="bench_results/pd")
    return ap


class Deployment:
    """One deployment's processes; `url` is where clients send requests (the router's, or the server's)."""

    def __init__(self, label: str, disaggregated: bool, hisparse: bool, args, out_dir: Path) -> None:
        self.label = label
        common = ["--device-kv-budget", str(args.device_kv_budget), "--max-running-requests", str(args.requests),
                  "--top-k", str(HISPARSE_CONFIG["top_k"])]
        decoding = common + (["--enable-hisparse", "--hisparse-config", json.dumps(HISPARSE_CONFIG)] if hisparse
                             else [])
        name = label.replace(", ", "-").replace(" ", "-")
        self.router: subprocess.Popen | None = None
        self.bootstrap = free_loopback_port()
        if disaggregated:
            cores = sorted(os.sched_getaffinity(0))
            prefill_core, decode_core = str(cores[0]), str(cores[-1])
            self.prefill = ServerProcess(f"{label} prefill", common + [
                "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(self.bootstrap)],
                out_dir / f"server-{name}-prefill.log", prefill_core)
            self.decode = ServerProcess(f"{label} decode", decoding + ["--disaggregation-mode", "decode"],
                                        out_dir / f"server-{name}-decode.log", decode_core)
            self.servers = [self.prefill, self.decode]
        else:
            self.prefill = None
            self.decode = ServerProcess(label, decoding, out_dir / f"server-{name}.log")
            self.servers = [self.decode]
        self.router_log = out_dir / f"router-{name}.log"
        self.url = ""

    def start(self) -> None:
        for server in self.servers:
            server.start()
        wait_ready(self.servers)
        if self.prefill is None:
            self.url = self.decode.base_url
            return
        self.router, self.url = start_pd_router(self.prefill.base_url, self.bootstrap, self.decode.base_url,
                                                self.router_log)

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            self.router.wait(30)
        for server in self.servers:
            server.stop()

    def node_figures(self) -> dict:
        """The decode node's decode throughput and the KV transfer's bandwidth and per-request latency."""
        decode = self.decode.metrics()
        seconds = decode.get("hisparse_engine_decode_seconds_total", 0.0)
        out = {"decode_node_tok_s": decode.get("hisparse_engine_decode_tokens_total", 0) / seconds if seconds else None}
        if self.prefill is not None:
            prefill = self.prefill.metrics()
            sent, spent = prefill.get("hisparse_kv_transfer_bytes_total", 0), prefill.get(
                "hisparse_kv_transfer_seconds_total", 0.0)
            waits = decode.get("hisparse_kv_transfer_wait_seconds_count", 0)
            out |= {"kv_bytes": sent, "kv_gb_s": sent / spent / 1e9 if spent else None,
                    "kv_wait_mean_s": decode.get("hisparse_kv_transfer_wait_seconds_sum", 0.0) / waits if waits
                    else None}
        return out


def run_round(deployment: Deployment, model: str, prompts: list[str], args, bar: tqdm) -> dict:
    results, seconds = asyncio.run(send_all(deployment.url, [completion(model, p, args.output_tokens)
                                                              for p in prompts], bar.update))
    tokens = sum(r.output_tokens for r in results)
    itl = [gap for r in results for gap in r.itl]
    return {"output_tok_s": tokens / seconds, "seconds": seconds, "output_tokens": tokens,
            "ttft_median_s": median([r.ttft for r in results]),
            "itl_median_s": statistics.median(itl) if itl else None, "errors": errors(results)}


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    lines = [f"Prefill-decode disaggregation: {report['workload']}", "",
             "| deployment | output tok/s | TTFT median (s) | ITL median (ms) | decode node tok/s | KV GB/s "
             "| KV wait per request (s) | failed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["results"]:
        itl = None if row["itl_median_s"] is None else row["itl_median_s"] * 1e3
        lines.append(f"| {row['deployment']} | {row['output_tok_s']:.1f} | {_number(row['ttft_median_s'], 2)} "
                     f"| {_number(itl, 0)} | {_number(row['decode_node_tok_s'], 1)} "
                     f"| {_number(row.get('kv_gb_s'), 2)} | {_number(row.get('kv_wait_mean_s'), 2)} "
                     f"| {len(row['errors'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files = open_model(None)
    from hisparse.data.pydoc_corpus import corpus_tokens

    tokenizer = files.tokenizer()
    stream = corpus_tokens(tokenizer, "heldout")
    if args.prompt_tokens + args.output_tokens > files.config.max_position_embeddings:
        print(f"{PROG}: error: --prompt-tokens + --output-tokens exceeds the model's context", file=sys.stderr)
        return 2
    out_dir: Path = args.out_dir
    workload = (f"{args.requests} completions at once, {args.prompt_tokens}-token prompts (never repeated), "
                f"{args.output_tokens} tokens out; device KV budget {args.device_kv_budget / 2**20:.0f} MiB per "
                f"server; HiSparse {json.dumps(HISPARSE_CONFIG)}")
    print(f"workload: {workload}")
    rows: list[dict] = []
    started = time.time()
    with tqdm(total=args.repeats * len(DEPLOYMENTS) * args.requests * args.output_tokens, unit="tok",
              desc="pd", dynamic_ncols=True) as bar:
        for repeat in range(args.repeats):
            order = list(DEPLOYMENTS) if repeat % 2 == 0 else list(DEPLOYMENTS)[::-1]
            for label in order:
                deployment = Deployment(label, *DEPLOYMENTS[label], args, out_dir)
                # Windows of the text starting apart, the same for every deployment of a round (each starts fresh,
                # its prefix cache empty), new each round; as text: sglang-router 0.3 takes no token-id prompts.
                prompts = [tokenizer.decode(p) for p in prompts_from(stream, args.requests, args.prompt_tokens,
                                                                      repeat * args.requests)]
                bar.set_description(label)
                try:
                    deployment.start()
                    model = deployment.decode.model_name()
                    row = {"deployment": label, "repeat": repeat} | run_round(deployment, model, prompts, args, bar)
                    row |= deployment.node_figures()
                except RuntimeError as error:
                    print(f"{PROG}: error: {error}", file=sys.stderr)
                    return 2
                finally:
                    deployment.stop()
                rows.append(row)
                bar.write(f"{label:<22} {row['output_tok_s']:7.1f} tok/s, TTFT median "
                          f"{_number(row['ttft_median_s'], 2)} s, decode node {_number(row['decode_node_tok_s'], 1)} "
                          f"tok/s, KV {_number(row.get('kv_gb_s'), 2)} GB/s")
    report = {"workload": workload, "hisparse_config": HISPARSE_CONFIG, "repeats": args.repeats,
              "seconds": time.time() - started, "results": rows}
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out_dir / "results.md").write_text(text)
    print("\n" + text)
    print(f"written to {out_dir}/: results.json, results.md, server-*.log, router-*.log")
    return 1 if any(row["errors"] for row in rows) else 0
