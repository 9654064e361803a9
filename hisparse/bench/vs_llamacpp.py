"""Our server against llama.cpp's own `llama-server` on the very same GGUF file, side by side.

    python -m hisparse.bench.vs_llamacpp [--rounds 2] [--workloads c1,c8,c32,long] [--threads 2]
        [--our-flags="--kv-cache-dtype bfloat16"] [--llama-server PATH] [--out-dir bench_results/vs_llamacpp]
    python -m hisparse.bench.vs_llamacpp --busy [--busy-threads 2] [--rounds 2]

Both servers stream OpenAI completions of held-out Python docs, sent as token ids, greedy, `ignore_eos`, 128
tokens out, at four workloads: c1 (5 requests one at a time, 100-token prompts), c8 and c32 (32 requests, 8 or
32 at once) and long (8 prompts of 1500 tokens at once). llama-server (`make llama-server`) gets 2 threads
(this machine's cores, all our server uses), 32 slots of room for the longest request and continuous batching;
its prompt cache is off (`--no-cache-prompt`, `cache_prompt: false`). The servers take turns round by round (a
round is one workload on one server, then on the other; which goes first alternates), and no prompt is sent
twice, so no prefix cache helps either side. Ratios are ours / llama.cpp's within each round, then their median.
Both servers slow down many times over beside another busy process: measure on a quiet machine (each turn's
load average is in results.json).

`--busy` measures the issue's other target instead: c1 on our server alone, quiet and then beside one
competing process (a torch matmul loop on `--busy-threads` threads), the two taking turns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from hisparse.bench.serving_client import RequestResult, stream_request
from hisparse.bench.serving_server import ServerProcess, wait_ready
from hisparse.cli_args import OneLineParser, comma_list, int_in, one_of, output_dir, run_main
from hisparse.distributed.tensor_parallel import free_loopback_port

PROG = "python -m hisparse.bench.vs_llamacpp"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LLAMA_SERVER = ROOT / ".venv" / "llama.cpp" / "bin" / "llama-server"  # where `make llama-server` puts it
SLOTS = 32  # llama-server's parallel slots: the most requests any workload has in flight
OURS, LLAMA, QUIET, BUSY = "hisparse", "llama.cpp", "quiet", "busy"
BUSY_LOOP = "import torch\ntorch.set_num_threads({threads})\na = torch.randn(512, 512)\nwhile True:\n    a @ a\n"


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    requests: int
    prompt_tokens: int
    target: float  # ours / llama.cpp's output tok/s at least this
    ttft_target: float | None = None  # ours / llama.cpp's median TTFT at most this
    output_tokens: int = 128

    @property
    def label(self) -> str:
        return f"c={self.concurrency}, {self.requests} x {self.prompt_tokens} + {self.output_tokens} tokens"


WORKLOADS = {w.name: w for w in (Workload("c1", 1, 5, 100, 1.0), Workload("c8", 8, 32, 100, 2.0),
                                 Workload("c32", 32, 32, 100, 3.0), Workload("long", 8, 8, 1500, 4.0, 0.25))}
BUSY_TARGET = 0.4  # c1 beside a busy process, at least this share of the quiet figure


def our_server_flags(text: str) -> list[str]:
    """argparse type: extra flags for our server, checked by its own parser now rather than after it has loaded."""
    from hisparse.server.args import ServerArgs
    from hisparse.server.args import build_parser as server_parser

    try:
        words = shlex.split(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}: {text!r}") from None
    refusal = io.StringIO()
    try:
        with contextlib.redirect_stderr(refusal):
            parsed = server_parser().parse_args(words)
    except SystemExit:
        raise argparse.ArgumentTypeError(refusal.getvalue().strip().split(": error: ", 1)[-1]) from None
    for dest in ("model_path", "host", "port"):
        if getattr(parsed, dest) != getattr(ServerArgs(), dest):
            raise argparse.ArgumentTypeError(f"--{dest.replace('_', '-')} is the benchmark's to set")
    return words


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int_in(1, 50), default=2, help="turns of each workload on each server")
    ap.add_argument("--workloads", type=comma_list(one_of(*WORKLOADS)), default=None,
                    help=f"a subset of {','.join(WORKLOADS)} (default all)")
    ap.add_argument("--llama-server", type=Path, default=None, help=f"default {DEFAULT_LLAMA_SERVER}")
    ap.add_argument("--threads", type=int_in(1, 1024), default=None, help="llama-server's threads (default 2)")
    ap.add_argument("--our-flags", type=our_server_flags, default=[],
                    help='extra flags for our server, one string: --our-flags="--kv-cache-dtype bfloat16"')
    ap.add_argument("--busy", action="store_true", help="c1 on our server, quiet and beside a busy process")
    ap.add_argument("--busy-threads", type=int_in(1, 1024), default=None, help="the busy process's (default 2)")
    ap.add_argument("--out-dir", type=output_dir, default=None, help="default bench_results/vs_llamacpp[_busy]")
    return ap


class LlamaServer(ServerProcess):
    """llama.cpp's llama-server as a child process; /health and /v1/models answer as ours do."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slot_tokens: int, log_path: Path) -> None:
        # --no-repack: ggml's AMX matmul, its one repacked kind for Q4_1, dies of a general protection fault on
        # this VM's AMX-capable Xeon (2026-12-05); without it Q4_1 runs ggml's AVX512 dot products.
        flags = ["-m", str(gguf), "-t", str(threads), "-np", str(SLOTS), "-c", str(SLOTS * slot_tokens),
                 "--cont-batching", "--no-cache-prompt", "--cache-reuse", "0", "--cache-ram", "0", "--no-repack",
                 "--no-webui"]
        super().__init__(LLAMA, flags, log_path)
        self.binary = binary

    def start(self) -> None:
        self.port = free_loopback_port()
        command = [str(self.binary), *self.flags, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(f"$ {shlex.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def busy_process(threads: int):
    """One competing process for the block's duration: a torch matmul loop on `threads` threads."""
    process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(threads=threads)], stdin=subprocess.DEVNULL)
    try:
        time.sleep(2.0)  # torch imported, the loop running
        if process.poll() is not None:
            raise RuntimeError(f"the busy process exited with status {process.returncode}")
        yield
    finally:
        process.kill()
        process.wait()


# -- prompts and turns ----------------------------------------------------------------------------------------


def plan_prompts(stream: list[int], workloads: list[Workload], rounds: int, sides: tuple[str, str]
                 ) -> dict[tuple[str, int, str], list[list[int]]]:
    """(workload, round, side) -> its prompts, plus ("warmup", 0, side): windows of the held-out stream that
    start at distinct offsets spread over it (read circularly), so no prompt is ever sent twice."""
    wanted = [("warmup", 0, side, 1, 16) for side in sides]
    wanted += [(w.name, r, side, w.requests, w.prompt_tokens)
               for w in workloads for r in range(rounds) for side in sides]
    count = sum(n for *_, n, _ in wanted)
    if count > len(stream):
        raise ValueError(f"{count} prompts need as many start offsets, more than the held-out text's "
                         f"{len(stream)} tokens: use fewer --rounds")
    stride, start, plan = len(stream) // count, 0, {}
    ring = stream * (max(length for *_, length in wanted) // len(stream) + 2)
    for name, r, side, n, length in wanted:
        plan[name, r, side] = [ring[s:s + length] for s in range(start, start + n * stride, stride)]
        start += n * stride
    return plan


async def _send(url: str, bodies: list[dict], concurrency: int, on_chunk: Callable[[int], None]
                ) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0), limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(body: dict) -> RequestResult:
            async with gate:
                return await stream_request(client, f"{url}/v1/completions", body, on_chunk, len(body["prompt"]))

        start = time.perf_counter()
        results = await asyncio.gather(*(one(body) for body in bodies))
        return list(results), time.perf_counter() - start


def run_workload(server: ServerProcess, model: str, prompts: list[list[int]], output_tokens: int, concurrency: int,
                 on_chunk: Callable[[int], None] = lambda n: None) -> dict:
    """One workload on one server: its figures, and an error for every request whose usage differs from what
    was sent and asked for (the servers must do the same work)."""
    extra = {"cache_prompt": False} if isinstance(server, LlamaServer) else {}
    bodies = [{"model": model, "prompt": p, "max_tokens": output_tokens, "temperature": 0.0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}} | extra for p in prompts]
    results, seconds = asyncio.run(_send(server.base_url, bodies, concurrency, on_chunk))
    for r, prompt in zip(results, prompts, strict=True):
        if r.error is None and (r.prompt_tokens, r.output_tokens) != (len(prompt), output_tokens):
            r.error = f"usage {r.prompt_tokens} + {r.output_tokens} tokens, sent {len(prompt)} + {output_tokens}"
    ok = [r for r in results if r.error is None]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:3], "seconds": seconds,
            "output_tok_s": sum(r.output_tokens for r in ok) / seconds,
            "ttft_median_s": median([r.ttft for r in ok]), "itl_median_s": median([x for r in ok for x in r.itl]),
            "cached_tokens": sum(r.cached_tokens for r in results)}


def take_turns(servers: dict[str, ServerProcess], workloads: list[Workload], rounds: int, plan: dict, bar: tqdm,
               setting: Callable[[str], contextlib.AbstractContextManager] = lambda side: contextlib.nullcontext()
               ) -> list[dict]:
    """Every workload `rounds` times on each side, the sides in turn, the first alternating; `setting(side)`
    is entered around each turn (the busy process)."""
    models = {side: server.model_name() for side, server in servers.items()}
    for side, server in servers.items():  # first-use costs stay out of the figures
        warmup = run_workload(server, models[side], plan["warmup", 0, side], 4, 1)
        if warmup["failed"]:
            raise RuntimeError(f"the warm-up request to the {server.label} server failed: {warmup['errors'][0]}")
    rows = []
    for i, w in enumerate(workloads):
        for r in range(rounds):
            for side in list(servers)[::1 if (i + r) % 2 == 0 else -1]:
                bar.set_description(f"{w.name} {side}")
                with setting(side):
                    # The machine's 1-minute load as the turn starts: another user's work shows there.
                    row = {"workload": w.name, "round": r, "side": side, "load": os.getloadavg()[0]} | run_workload(
                        servers[side], models[side], plan[w.name, r, side], w.output_tokens, w.concurrency,
                        bar.update)
                rows.append(row)
                bar.write(f"{w.name:>4} round {r} {side:>9}: {row['output_tok_s']:7.2f} tok/s, TTFT median "
                          f"{row['ttft_median_s'] or 0:.3f} s, load {row['load']:.1f}"
                          + (f"  FAILED {row['failed']}: {row['errors'][0]}" if row["failed"] else ""))
    return rows


# -- the report -----------------------------------------------------------------------------------------------


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[dict], sides: tuple[str, str]) -> list[dict]:
    """Per workload: each side's medians over rounds, and side 0 / side 1 taken within each round (rounds run
    minutes apart on a shared machine), then their median."""
    out = []
    for name in dict.fromkeys(row["workload"] for row in rows):
        by = {(row["round"], row["side"]): row for row in rows if row["workload"] == name}
        rounds = sorted({r for r, _ in by})
        entry = {"workload": name}
        for key in ("output_tok_s", "ttft_median_s", "itl_median_s"):
            for side in sides:
                entry.setdefault(side, {})[key] = median([by[r, side][key] for r in rounds if (r, side) in by])
            pairs = [(by.get((r, sides[0]), {}).get(key), by.get((r, sides[1]), {}).get(key)) for r in rounds]
            entry.setdefault("ratio", {})[key] = median([a / b for a, b in pairs if a is not None and b])
        out.append(entry)
    return out


def verdicts(summary: list[dict], busy: bool) -> list[str]:
    lines = []
    for entry in summary:
        w, ratio = WORKLOADS[entry["workload"]], entry["ratio"]
        target, whose = (BUSY_TARGET, "our quiet figure") if busy else (w.target, "llama.cpp's")
        met = ratio["output_tok_s"] is not None and ratio["output_tok_s"] >= target
        text = f"{w.label}: output tok/s {_x(ratio['output_tok_s'])} {whose}, target >= {target:g}x"
        if w.ttft_target is not None and not busy:
            met = met and ratio["ttft_median_s"] is not None and ratio["ttft_median_s"] <= w.ttft_target
            text += f"; TTFT {_x(ratio['ttft_median_s'])}, target <= {w.ttft_target:g}x"
        lines.append(f"{text}: {'met' if met else 'not met'}")
    return lines


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _s(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.1f}"


def markdown(report: dict) -> str:
    a, b = report["sides"]
    load = f"load average {report['load_average_before'][0]:.1f} before, {report['load_average_after'][0]:.1f} after"
    lines = [f"{report['title']} (commit {report['commit']}, {report['rounds']} rounds, medians; {load})", "",
             f"| workload | tok/s {a} | tok/s {b} | {a} / {b} | TTFT ms {a} | TTFT ms {b} | {a} / {b} "
             f"| ITL ms {a} | ITL ms {b} | {a} / {b} |", "|---|" + "---:|" * 9]
    for entry in report["summary"]:
        cells = [WORKLOADS[entry["workload"]].label]
        for key, scale in (("output_tok_s", 1.0), ("ttft_median_s", 1e3), ("itl_median_s", 1e3)):
            cells += [_s(entry[a][key], scale), _s(entry[b][key], scale), _x(entry["ratio"][key])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + report["verdicts"]) + "\n"


# -- the run --------------------------------------------------------------------------------------------------


def commit() -> str:
    """HEAD, with "+changes" when the work tree differs from it (the server runs the work tree)."""
    def git(*words: str) -> str:
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=10", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.busy and (args.workloads or args.llama_server or args.threads):
        raise ValueError("--busy runs c1 on our server alone: --workloads, --llama-server and --threads do not apply")
    if not args.busy and args.busy_threads:
        raise ValueError("--busy-threads needs --busy")
    binary = args.llama_server or DEFAULT_LLAMA_SERVER
    if not args.busy and not binary.is_file():
        raise ValueError(f"no llama-server at {binary}: run `make llama-server` (or pass --llama-server PATH)")
    workloads = [WORKLOADS["c1"]] if args.busy else [WORKLOADS[n] for n in args.workloads or WORKLOADS]
    sides = (BUSY, QUIET) if args.busy else (OURS, LLAMA)
    out_dir: Path = args.out_dir or Path("bench_results/vs_llamacpp" + ("_busy" if args.busy else ""))
    out_dir.mkdir(parents=True, exist_ok=True)

    from hisparse.data.pydoc_corpus import corpus_tokens
    from hisparse.models.default_model import default_model_path
    from hisparse.models.loader import open_model

    gguf = default_model_path()
    plan = plan_prompts(corpus_tokens(open_model(str(gguf)).tokenizer(), "heldout"), workloads, args.rounds, sides)
    ours = ServerProcess(OURS, ["--model-path", str(gguf), *args.our_flags], out_dir / "server-hisparse.log")
    if args.busy:
        servers = {BUSY: ours, QUIET: ours}
    else:
        slot_tokens = -(-max(w.prompt_tokens + w.output_tokens for w in workloads) // 256) * 256
        llama = LlamaServer(binary, gguf, args.threads or 2, slot_tokens, out_dir / "server-llama.cpp.log")
        servers = {OURS: ours, LLAMA: llama}
    busy_threads = args.busy_threads or 2
    print(f"model {gguf.name}; {', '.join(w.label for w in workloads)}; {args.rounds} rounds; our flags: "
          f"{shlex.join(args.our_flags) or '-'}; " + (f"busy process: torch matmuls on {busy_threads} threads"
                                                      if args.busy else f"llama-server {shlex.join(llama.flags)}"))
    started, load_before = time.time(), os.getloadavg()
    try:
        for server in set(servers.values()):
            server.start()
        wait_ready(list(set(servers.values())))
        total = 2 * args.rounds * sum(w.requests * w.output_tokens for w in workloads)
        with tqdm(total=total, unit="tok", desc="vs llama.cpp", dynamic_ncols=True) as bar:
            rows = take_turns(servers, workloads, args.rounds, plan, bar,
                              (lambda side: busy_process(busy_threads) if side == BUSY else contextlib.nullcontext()))
    except RuntimeError as error:
        raise ValueError(str(error)) from None
    finally:
        for server in set(servers.values()):
            server.stop()
    summary = summarize(rows, sides)
    report = {"title": "c1 beside a busy process vs quiet" if args.busy else "hisparse vs llama.cpp",
              "commit": commit(), "sides": sides, "rounds": args.rounds, "model": str(gguf),
              "our_flags": args.our_flags, "llama_server": None if args.busy else [str(binary), *llama.flags],
              "busy_threads": busy_threads if args.busy else None, "seconds": time.time() - started,
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "rows": rows, "summary": summary, "verdicts": verdicts(summary, args.busy)}
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out_dir / "results.md").write_text(text)
    print("\n" + text + f"\nwritten to {out_dir}/: results.json, results.md, server-*.log")
    return 1 if any(row["failed"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
