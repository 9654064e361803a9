"""HiSparse on a DSA model under one device budget: requests admitted at once and decode throughput, against
the baseline and against the planner's prediction for the same shape.

    python -m hisparse.bench.dsa_capacity [--arch glm-5 | --model DIR] [--prompt-tokens 960]
        [--output-tokens 64] [--baseline-admits 4] [--hisparse-config JSON] [--kv-cache-dtype bfloat16]

Without --model it writes a random checkpoint of --arch (`hisparse.tools.random_checkpoint`: DSA-shaped per
token, latent 512 + 64 and a 128-dim indexer key, 4 layers, index_topk 64) and serves that. The device budget
is what `--baseline-admits` requests of prompt + output tokens take with every latent row and indexer key on
the device. Both modes get the same requests, as many as the planner says HiSparse holds at once, on the same
loaded model, their engines stepping in turn; each runs a short warm-up request first, so that no kernel
compiles in the timed run. Printed: for each mode the most requests running at once (admission by the device
budget), decode throughput (tokens over the time of its decode-only steps) and output throughput (tokens over
the time of all its steps, prefill included), next to `hisparse.plan`'s sizing of the same shape; exit status
1 when either mode admits another number of requests than the planner says.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from hisparse.cli_args import OneLineParser, int_in, json_object, run_main
from hisparse.data.pydoc_corpus import heldout_tokens
from hisparse.engine.engine_config import EngineConfig, resolve_model_dtype
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.engine.warm_up import warm_up
from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.models.loader import open_model
from hisparse.plan import ModelShape, requests_within
from hisparse.tools import random_checkpoint

PROG = "python -m hisparse.bench.dsa_capacity"
LATENT_KINDS = ("bfloat16", "fp8_e4m3")


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--arch", choices=sorted(random_checkpoint.ARCHS), default="glm-5",
                        help="write a random checkpoint of this architecture (default)")
    source.add_argument("--model", type=Path, help="a DeepSeek-V3.2 / GLM-5 folder to serve instead")
    ap.add_argument("--layers", type=int_in(1, 64), default=4, help="layers of the written checkpoint")
    ap.add_argument("--index-topk", type=int_in(1), default=64, help="index_topk of the written checkpoint")
    ap.add_argument("--prompt-tokens", type=int_in(1), default=960)
    ap.add_argument("--output-tokens", type=int_in(2), default=64)
    ap.add_argument("--baseline-admits", type=int_in(1, 256), default=4,
                    help="size the device budget so that the baseline holds this many requests at once")
    ap.add_argument("--hisparse-config", type=json_object, default={"host_to_device_ratio": 8},
                    help="device_buffer_size defaults to 2 x the model's index_topk")
    ap.add_argument("--kv-cache-dtype", choices=LATENT_KINDS, default="bfloat16")
    return ap


def run_side_by_side(configs: dict[str, EngineConfig], model, tokenizer, prompts: list[list[int]],
                     output_tokens: int) -> dict[str, dict]:
    """Serve every prompt through one engine per config, the engines stepping in turn (so that the load of a
    shared machine hits each alike); what each admitted at once, and its throughput over its own step time."""
    for config in configs.values():
        warm_up(config, model, tokenizer, prompts[0])
    engines = {name: LLMEngine(config, model=model, tokenizer=tokenizer) for name, config in configs.items()}
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    for engine in engines.values():
        for p in prompts:
            engine.add_request(p, params)
    with tqdm(total=len(prompts) * len(engines), desc="requests") as bar:
        while any(engine.has_unfinished for engine in engines.values()):
            for engine in engines.values():
                if engine.has_unfinished:
                    bar.update(sum(r.finished for r in engine.step()))
    results = {}
    for name, engine in engines.items():
        stats = engine.stats_dict()
        results[name] = {"admitted_at_once": stats["peak_running"], "seconds": stats["step_seconds"],
                         "decode_tok_s": stats["decode_tokens"] / max(stats["decode_seconds"], 1e-9),
                         "output_tok_s": stats["generated_tokens"] / max(stats["step_seconds"], 1e-9),
                         "hit_rate": (stats.get("swap_in") or {}).get("hit_rate")}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    context = args.prompt_tokens + args.output_tokens
    if args.model is None and context > random_checkpoint.DEFAULT_MAX_CONTEXT:  # checked before writing one
        parser.error(f"--prompt-tokens + --output-tokens = {context} exceeds the model's context "
                     f"({random_checkpoint.DEFAULT_MAX_CONTEXT} tokens)")
    with tempfile.TemporaryDirectory(prefix="hisparse-dsa-") as scratch:
        folder = args.model
        if folder is None:
            folder = Path(scratch)
            random_checkpoint.main(["--arch", args.arch, "--out", str(folder), "--layers", str(args.layers),
                                    "--index-topk", str(args.index_topk)])
        files = open_model(folder)
        if not hasattr(files.config, "index_topk"):
            parser.error(f"--model {str(folder)!r} is {files.architecture}, not a DSA model")
        name = folder.name if args.model is not None else f"random {args.arch}"
        shape = ModelShape.from_hf_config(json.loads((folder / "config.json").read_text()), name)
        if context > shape.context_length:
            parser.error(f"--prompt-tokens + --output-tokens = {context} exceeds the model's context "
                         f"({shape.context_length} tokens)")
        try:
            hisparse = HiSparseConfig.parse(args.hisparse_config, shape.index_topk, check_buffer=False)
            hisparse = hisparse.with_model_top_k(shape.index_topk)
            hisparse.check_context(shape.context_length)
        except ValueError as error:
            parser.error(f"argument --hisparse-config: {error}")
        budget = args.baseline_admits * context * shape.num_layers * (shape.kv_bytes(args.kv_cache_dtype)
                                                                      + shape.indexer_bytes)
        planned = requests_within(shape, hisparse, budget, context, args.kv_cache_dtype)
        if planned.hisparse < 1:
            parser.error(f"HiSparse holds no request of {context} tokens in {budget} bytes: raise --baseline-admits "
                         "or lower device_buffer_size")
        config = EngineConfig(model=str(folder), device_kv_budget=budget, kv_cache_dtype=args.kv_cache_dtype,
                              max_running_requests=max(planned.hisparse, args.baseline_admits) + 1,
                              enable_hisparse=True, hisparse_config=hisparse)
        model, tokenizer = files.load(resolve_model_dtype()), files.tokenizer()
        prompts = [heldout_tokens(tokenizer, args.prompt_tokens, offset=97 * i) for i in range(planned.hisparse)]
        results = run_side_by_side({"baseline": config.without_hisparse(), "hisparse": config}, model, tokenizer,
                                   prompts, args.output_tokens)
    print(f"{shape.name}: {shape.num_layers} layers, latent {shape.kv_lora_rank} + {shape.qk_rope_head_dim} "
          f"({args.kv_cache_dtype}, {shape.kv_bytes(args.kv_cache_dtype)} B), indexer key {shape.indexer_bytes} B, "
          f"index_topk {shape.index_topk}; {len(prompts)} requests of {args.prompt_tokens} + {args.output_tokens} "
          f"tokens; device budget {budget / 2**20:.1f} MiB; HiSparse buffer {hisparse.device_buffer_size}, "
          f"host_to_device_ratio {hisparse.host_to_device_ratio}")
    print(f"{'mode':<10}{'admitted (planner)':>20}{'decode tok/s':>14}{'output tok/s':>14}{'seconds':>9}"
          f"{'hit rate':>10}")
    for name, r in results.items():
        expected = planned.hisparse if name == "hisparse" else planned.baseline
        hit = "" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        print(f"{name:<10}{r['admitted_at_once']:>12} ({expected:>4}){r['decode_tok_s']:>14.1f}"
              f"{r['output_tok_s']:>14.1f}{r['seconds']:>9.1f}{hit:>10}")
    base, ours = results["baseline"], results["hisparse"]
    admitted = ours["admitted_at_once"] / base["admitted_at_once"]
    predicted = planned.hisparse / planned.baseline
    print(f"HiSparse / baseline: admitted {admitted:.2f}x (planner {predicted:.2f}x: min(slots / "
          f"{hisparse.device_buffer_size + 1} = {planned.by_slots}, logical / context = {planned.by_logical}) "
          f"against {planned.baseline}), decode {ours['decode_tok_s'] / base['decode_tok_s']:.2f}x, "
          f"output {ours['output_tok_s'] / base['output_tok_s']:.2f}x")
    matches = (ours["admitted_at_once"], base["admitted_at_once"]) == (planned.hisparse, planned.baseline)
    print("admission matches the planner" if matches else "admission DIFFERS from the planner")
    return 0 if matches else 1


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
