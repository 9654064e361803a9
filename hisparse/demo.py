"""`make run`: the default sparse-attention model answers a chat prompt, then serves the same long-context
workload under the same device KV budget with HiSparse off and on.

    python -m hisparse.demo [--requests 8] [--prompt-tokens 2000] [--output-tokens 32]
                            [--baseline-requests 2] [--hisparse-config JSON]

The device budget is set so that the baseline (every token's K/V on the device) fits exactly
`--baseline-requests` of the requests at once; HiSparse gets the very same budget. It prints how many
requests each admitted at once, output throughput, and HiSparse's hit rate and swap-in traffic.
The default HiSparse config provisions host rows and indexer keys for 4 tokens per device slot
(`host_to_device_ratio`): these requests hold 2032 tokens per 513 slots, and every unused indexer key
the budget pays for is device memory the hot buffers do not get.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from tqdm import tqdm

from hisparse.cli_args import OneLineParser, int_in, json_object, positive_int, run_main
from hisparse.data.pydoc_corpus import heldout_tokens
from hisparse.engine.engine_config import EngineConfig, resolve_model_dtype
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.engine.warm_up import warm_up
from hisparse.formats.kv_layout import KVLayout
from hisparse.memory.host_memory import check_fits_in_memory
from hisparse.models.loader import ModelFiles, load_llama, open_model

PROG = "python -m hisparse.demo"
MAX_REQUESTS = 4096  # far more than this machine serves at once; a cap, so that a typo cannot build 10**12 prompts


def chat(engine: LLMEngine, question: str) -> None:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": question}])
    request = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=64))
    start, first = time.perf_counter(), None
    while not request.finished:
        engine.step()
        first = first or time.perf_counter()
    decode = time.perf_counter() - first
    print(f"user: {question}\nassistant: {request.output_text.strip()}")
    n = len(request.output_token_ids)
    print(f"  ({n} tokens; time to first token {first - start:.2f} s; decode {(n - 1) / max(decode, 1e-9):.1f} tok/s)")


def serve(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, label: str) -> dict:
    requests = [engine.add_request(p, params) for p in prompts]
    start = time.perf_counter()
    with tqdm(total=len(requests) * params.max_tokens, desc=label, unit="tok", leave=False) as bar:
        while engine.has_unfinished:
            bar.update(len(engine.step()))
    elapsed = time.perf_counter() - start
    stats = engine.stats_dict()
    return {"peak_running": stats["peak_running"], "seconds": elapsed,
            "output_tok_s": sum(len(r.output_token_ids) for r in requests) / elapsed,
            "decode_tok_s": stats["decode_tokens"] / max(stats["decode_seconds"], 1e-9),
            "swap_in": stats.get("swap_in"), "memory": stats["memory"]}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int_in(1, MAX_REQUESTS), default=8,
                        help=f"requests served in each mode (at most {MAX_REQUESTS})")
    parser.add_argument("--prompt-tokens", type=positive_int, default=2000)
    parser.add_argument("--output-tokens", type=int_in(2), default=32,
                        help="at least 2: decode throughput is timed on the steps after a request's first token")
    parser.add_argument("--baseline-requests", type=int_in(1, MAX_REQUESTS), default=2,
                        help="size the device KV budget so that the baseline holds this many requests at once")
    parser.add_argument("--hisparse-config", type=json_object,
                        default='{"top_k": 256, "device_buffer_size": 512, "host_to_device_ratio": 4}')
    parser.add_argument("--skip-chat", action="store_true")
    return parser


def check_workload(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[EngineConfig, ModelFiles]:
    """Everything the flags can get wrong, found from the model's config before its weights load (a request
    past the context failed after loading and warm-up). Returns the HiSparse engine's config, budget unset,
    and the opened model for its weights and tokenizer."""
    try:
        config = EngineConfig(max_running_requests=args.requests, enable_hisparse=True,
                              hisparse_config=args.hisparse_config)
    except ValueError as error:
        parser.error(f"argument --hisparse-config: {error}")
    files = open_model(None)
    mc = files.config
    request_tokens = args.prompt_tokens + args.output_tokens
    if request_tokens > mc.max_position_embeddings:
        parser.error(f"--prompt-tokens + --output-tokens = {request_tokens} exceeds the model's context "
                     f"({mc.max_position_embeddings} tokens)")
    # The engine refuses a budget beyond available memory, but only once the model is loaded; K/V alone
    # (no indexer keys) is a lower bound of what the budget below will be.
    least = args.baseline_requests * request_tokens * KVLayout.of(mc, resolve_model_dtype()).bytes_per_token
    try:
        check_fits_in_memory(least, f"the device KV budget for --baseline-requests {args.baseline_requests} "
                                    f"requests of {request_tokens} tokens")
    except ValueError as error:
        parser.error(str(error))
    return config, files


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config, files = check_workload(parser, args)

    print(f"loading {files.path.name} with its lightning indexers ...", flush=True)
    dtype = resolve_model_dtype()
    model, tokenizer = load_llama(files, dtype=dtype), files.tokenizer()
    if getattr(model, "indexer_config", None) is None:
        print(f"{PROG}: error: the shipped indexer weights are missing; run `python -m hisparse.train_indexer`",
              file=sys.stderr)
        return 1
    if not args.skip_chat:
        chat(LLMEngine(EngineConfig(), model=model, tokenizer=tokenizer), "What is the capital of France?")

    prompts = [heldout_tokens(tokenizer, args.prompt_tokens, offset=97 * i) for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    # What the baseline pays the device per token: K and V in the model's dtype (kv_cache_dtype "auto"), plus
    # the indexer key. A budget the engines refuse (too few hot slots) is a ValueError: one line by run_main.
    layout = KVLayout.of(model.config, dtype)
    per_token = layout.baseline_bytes_per_token(model.indexer_config.key_layout)
    budget = args.baseline_requests * (args.prompt_tokens + args.output_tokens) * per_token
    hisparse_config = dataclasses.replace(config, device_kv_budget=budget)
    baseline_engine = LLMEngine(hisparse_config.without_hisparse(), model=model, tokenizer=tokenizer)
    hisparse_engine = LLMEngine(hisparse_config, model=model, tokenizer=tokenizer)
    policy = hisparse_engine.cache.policies[0].name  # what runs ("auto" resolved for the device)
    print(f"\nworkload: {args.requests} requests x {args.prompt_tokens} prompt tokens (held-out Python docs) + "
          f"{args.output_tokens} output tokens; device KV budget {budget / 2**20:.0f} MiB for both; model in "
          f"{str(dtype).removeprefix('torch.')}, eviction {policy}")
    print("warming up the compiled kernels (numba caches them: slow only on the first run) ...", flush=True)
    buffer = hisparse_engine.cache.config.device_buffer_size
    for config in (baseline_engine.config, hisparse_engine.config):  # a context past the buffer: swap-in runs
        warm_up(config, model, tokenizer, prompts[0][:buffer + 16])
    results = {label: serve(e, prompts, params, label)
               for label, e in (("baseline", baseline_engine), ("hisparse", hisparse_engine))}
    print(f"\n{'mode':<10}{'max concurrent':>16}{'decode tok/s':>14}{'output tok/s':>14}{'seconds':>9}{'hit rate':>10}")
    for label, r in results.items():
        hit = r["swap_in"]["hit_rate"] if r["swap_in"] else None
        print(f"{label:<10}{r['peak_running']:>16}{r['decode_tok_s']:>14.2f}{r['output_tok_s']:>14.2f}"
              f"{r['seconds']:>9.1f}{'-' if hit is None else f'{hit:.1%}':>10}")
    print("(decode tok/s: tokens of the steps that only decoded, over their time; output tok/s: all output tokens "
          "over the whole run, prefill included)")
    s = results["hisparse"]["swap_in"]
    print(f"\nhisparse swap-in: {s['hits']} hits, {s['misses']} misses, {s['evictions']} evictions, "
          f"{s['bytes_host_to_device'] / 2**20:.1f} MiB host->device in {s['swap_in_seconds']:.2f} s")
    b, h = results["baseline"], results["hisparse"]
    print(f"hisparse vs baseline: {h['peak_running'] / b['peak_running']:.1f}x concurrent requests, "
          f"{h['decode_tok_s'] / b['decode_tok_s']:.2f}x decode throughput, "
          f"{h['output_tok_s'] / b['output_tok_s']:.2f}x output throughput")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
