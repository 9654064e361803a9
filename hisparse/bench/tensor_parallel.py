"""Decode step and output throughput of a model on 1 and on 2 ranks, side by side.

    python -m hisparse.bench.tensor_parallel [--batch-sizes 1 8 16] [--prompt-tokens 256] [--output-tokens 64]
                                              [--repeats 3] [--enable-hisparse] [--model DIR [--ep-size 1|2]]

The default model runs tensor-parallel; a DSA checkpoint (`--model`, e.g. one written by
`python -m hisparse.tools.random_checkpoint`) runs with DP attention, each rank half of the batch's requests,
its experts split (--ep-size 2) or each expert's columns (--ep-size 1).

Each engine runs in a process of its own (a rank binds its process to its share of the cores), both loaded at
once; each repeat sends every engine fresh prompts (never seen, so no prefix is reused), the engines taking turns
batch by batch so that both see the same machine load; figures are medians of the repeats. Both engines get the
whole machine: one rank with all its cores as threads, two ranks with half each. It also prints what one
all-reduce of a decode step's hidden state costs (shared memory, and gloo as between machines): the price of
a per-layer collective such as a broadcast of the indexer's selection instead of computing it on every rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from hisparse.cli_args import OneLineParser, int_in, positive_int, run_main
from hisparse.engine.sampling_params import SamplingParams
from hisparse.engine.workers import cpu_shares, free_init_addr
from hisparse.llm import LLM
from hisparse.models.deepseek_v32 import ARCHITECTURES as DSA_ARCHITECTURES
from hisparse.models.loader import open_model

PROG = "python -m hisparse.bench.tensor_parallel"


def decode_run(llm: LLM, prompts: list[list[int]], output_tokens: int) -> tuple[float, float]:
    """(output tokens/s, mean decode step in ms) of one batch generated to the end."""
    engine = llm.engine
    steps0, seconds0 = engine.stats.decode_steps, engine.stats.decode_seconds
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    steps = engine.stats.decode_steps - steps0
    step_ms = 1000 * (engine.stats.decode_seconds - seconds0) / max(1, steps)
    return len(prompts) * output_tokens / elapsed, step_ms


def fresh_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab, (count, length), generator=g).tolist()


ALL_REDUCE_TIMING = """
import sys, time, torch
from hisparse.distributed.tensor_parallel import TensorParallel, join_group, leave_group
rank, addr, rows, width, calls, shared = int(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:])
tp = TensorParallel(rank, 2)
join_group(tp, addr, same_machine=bool(shared))
x = torch.randn(rows, width)
for _ in range(50):
    tp.all_reduce(x.clone())
start = time.perf_counter()
for _ in range(calls):
    tp.all_reduce(x)
if rank == 0:
    print(1e6 * (time.perf_counter() - start) / calls)
leave_group()
"""


def all_reduce_us(rows: int, width: int, calls: int = 1000, shared: bool = True) -> float:
    """Microseconds per all-reduce of [rows, width] float32 between two rank processes, one core each, through
    the engine's own communicator (shared memory, or gloo as between machines), timed on rank 0."""
    addr = free_init_addr()
    cpus = cpu_shares(2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(rows), str(width), str(calls), str(int(shared))]
    ranks = [subprocess.Popen(["taskset", "-c", ",".join(map(str, cpus[r])) if cpus[r] else "0-1024",
                               sys.executable, "-c", ALL_REDUCE_TIMING, str(r), addr, *args],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    out = [rank.communicate(timeout=120)[0] for rank in ranks]
    return float(out[0])


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int_in(1, 64), nargs="+", default=[1, 8, 16])
    parser.add_argument("--prompt-tokens", type=int_in(1, 1536), default=256)
    parser.add_argument("--output-tokens", type=int_in(2, 512), default=64)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--enable-hisparse", action="store_true", help="both engines with HiSparse (buffer 512)")
    parser.add_argument("--model", default=None, help="a model folder or file (default: the default model); a DSA "
                                                      "checkpoint runs with DP attention on two ranks")
    parser.add_argument("--ep-size", type=int, choices=(1, 2), default=2,
                        help="a DSA model on two ranks: 2 splits the experts, 1 each expert's columns")
    return parser


def serve_runs(parallel: dict, common: dict, prompt_tokens: int, output_tokens: int) -> None:
    """One engine's process: loads, warms up, says "ready", then answers each "batch seed" line on stdin with
    "tok/s step_ms" on stdout."""
    llm = LLM(**parallel, **common)
    vocab = llm.engine.model.config.vocab_size
    decode_run(llm, fresh_prompts(2, 32, vocab, 0), 4)  # kernels compiled, caches touched
    print("ready", llm.engine.model.config.hidden_size, llm.engine.model.config.num_layers, flush=True)
    for line in sys.stdin:
        batch, seed = map(int, line.split())
        tok_s, step_ms = decode_run(llm, fresh_prompts(batch, prompt_tokens, vocab, seed), output_tokens)
        print(tok_s, step_ms, flush=True)
    llm.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    common = {"model": args.model, "device_kv_budget": 256 << 20, "max_running_requests": 64,
              "enable_prefix_caching": False}
    if args.enable_hisparse:
        common.update(enable_hisparse=True, hisparse_config={"device_buffer_size": 512})
    try:
        dsa = open_model(args.model).architecture in DSA_ARCHITECTURES
    except (OSError, ValueError) as error:
        print(f"{PROG}: error: --model: {error}", file=sys.stderr)
        return 2
    two = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": args.ep_size} if dsa else {"tp_size": 2}

    def code(tp: int) -> str:
        return (f"from hisparse.bench.tensor_parallel import serve_runs; "
                f"serve_runs({two if tp == 2 else {}!r}, {common!r}, {args.prompt_tokens}, {args.output_tokens})")

    engines = {tp: subprocess.Popen([sys.executable, "-c", code(tp)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for tp in (1, 2)}
    try:
        shapes = {tp: engine.stdout.readline().split() for tp, engine in engines.items()}
        if any(not shape or shape[0] != "ready" for shape in shapes.values()):
            print(f"{PROG}: error: an engine failed to start (its error is above)", file=sys.stderr)
            return 1
        hidden, layers = int(shapes[1][1]), int(shapes[1][2])
        results = {(tp, b): [] for tp in engines for b in args.batch_sizes}
        seed = 1
        for repeat in range(args.repeats):
            for batch in args.batch_sizes:
                for tp, engine in engines.items():
                    seed += 1
                    engine.stdin.write(f"{batch} {seed}\n")
                    engine.stdin.flush()
                    tok_s, step_ms = map(float, engine.stdout.readline().split())
                    results[tp, batch].append((tok_s, step_ms))
                    print(f"repeat {repeat + 1}/{args.repeats} batch {batch} tp {tp}: {tok_s:.1f} tok/s, "
                          f"step {step_ms:.1f} ms", flush=True)
    finally:
        for engine in engines.values():
            engine.stdin.close()
            engine.wait(60)
    mode = ("HiSparse" if args.enable_hisparse else "baseline") + (
        f", DP attention with ep_size {args.ep_size} on 2 ranks" if dsa else ", tensor parallel on 2 ranks")
    print(f"\n{args.prompt_tokens}-token prompts, {args.output_tokens} tokens out, {mode}, float32 where the CPU has "
          f"no bfloat16; medians of {args.repeats}")
    print("| batch | tp 1 step ms | tp 2 step ms | tp 2 / tp 1 step | tp 1 tok/s | tp 2 tok/s | tp 2 / tp 1 tok/s |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch_sizes:
        (tok1, step1), (tok2, step2) = ([statistics.median(v) for v in zip(*results[tp, batch], strict=True)]
                                        for tp in (1, 2))
        print(f"| {batch} | {step1:.1f} | {step2:.1f} | {step2 / step1:.2f}x | {tok1:.1f} | {tok2:.1f} | "
              f"{tok2 / tok1:.2f}x |")
    for batch in args.batch_sizes:
        us, gloo = all_reduce_us(batch, hidden), all_reduce_us(batch, hidden, calls=200, shared=False)
        if dsa:  # an all-gather of every rank's rows and an all-reduce per MLP: the all-reduce is the one timed
            print(f"batch {batch}: one shared-memory all-reduce of [{batch}, {hidden}] {us:.0f} us (gloo over "
                  f"loopback: {gloo:.0f} us), one per layer {layers * us / 1000:.2f} ms a step, besides the all-gather")
            continue
        print(f"batch {batch}: one shared-memory all-reduce of [{batch}, {hidden}] {us:.0f} us (gloo over loopback: "
              f"{gloo:.0f} us); the two per layer cost {2 * layers * us / 1000:.2f} ms a step, a third (the "
              f"selection broadcast) would add {layers * us / 1000:.2f} ms")
    return 0


if __name__ == "__main__":
    run_main(main)
