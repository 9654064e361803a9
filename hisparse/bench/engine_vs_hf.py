"""Decode throughput of our engine against Hugging Face `generate`, same model, same workload, one run.

    python -m hisparse.bench.engine_vs_hf [--batch-sizes 1 8 32] [--new-tokens 64] [--repeats 3] [--threads N]

Each batch size decodes the same prompts greedily for a fixed number of new tokens in both engines,
alternating between them so that both see the same machine load; figures are medians of the repeats.
It also prints the share of our step time spent outside the model forward (scheduling, bookkeeping,
sampling, detokenisation).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hisparse.cli_args import OneLineParser, int_in, positive_int, run_main
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.formats.kv_layout import KVLayout
from hisparse.memory.host_memory import check_fits_in_memory
from hisparse.models.config import LlamaConfig
from hisparse.models.loader import load_llama, open_model

PROG = "python -m hisparse.bench.engine_vs_hf"
MAX_BATCH = 4096  # a cap checked first, so that a typo builds no 10**12 prompts; memory bounds it further
MAX_THREADS = 1024  # far more than any machine's cores: beyond them threads only slow torch down

TEXT = ("The history of computing is a story of machines that learned to remember. Early devices kept a few "
        "numbers in relays; later ones stored programs beside their data, and the memory hierarchy was born.")


def our_run(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    forward0, step0 = engine.runner.forward_seconds, engine.stats.step_seconds
    start = time.perf_counter()
    requests = [engine.add_request(p, params) for p in prompts]
    while any(not r.finished for r in requests):
        engine.step()
    elapsed = time.perf_counter() - start
    outside = 1 - (engine.runner.forward_seconds - forward0) / (engine.stats.step_seconds - step0)
    return len(prompts) * new_tokens / elapsed, outside


def hf_run(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int_in(1, MAX_BATCH), nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=int_in(1, MAX_THREADS), default=None,
                        help="torch threads for both (default: torch's); 1 gives steadier ratios on a busy machine")
    return parser


def check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace, prompt_tokens: int,
                mc: LlamaConfig) -> None:
    """Found from the model's config before either model loads (35 s): a run past the context failed only
    then, and transformers' cache for the largest batch must fit in memory (float32 K/V, as it loads)."""
    tokens = prompt_tokens + args.new_tokens
    if tokens > mc.max_position_embeddings:
        parser.error(f"the {prompt_tokens}-token prompt + --new-tokens {args.new_tokens} exceeds the model's "
                     f"context ({mc.max_position_embeddings} tokens)")
    batch = max(args.batch_sizes)
    needed = batch * tokens * KVLayout.of(mc, torch.float32).bytes_per_token
    try:
        check_fits_in_memory(needed, f"transformers' K/V cache of --batch-sizes {batch} x {tokens} tokens")
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    files = open_model(None)
    tokenizer = files.tokenizer()
    base = tokenizer.encode(TEXT)
    check_sizes(parser, args, len(base), files.config)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    # The dense model on both sides: this compares engines, not attention kinds; and every repeat prefills
    # its prompts again, as transformers does.
    engine = LLMEngine(EngineConfig(max_running_requests=max(args.batch_sizes), sparse_attention=False,
                                    enable_prefix_caching=False),
                       model=load_llama(files, indexer=False), tokenizer=tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(str(files.path.parent), gguf_file=files.path.name,
                                              dtype=torch.float32).eval()
    print(f"{'batch':>5} {'hisparse tok/s':>15} {'transformers tok/s':>19} {'ratio':>7} {'outside forward':>16}")
    our_run(engine, [base], 4)  # warm-up both
    hf_run(hf, [base], 4)
    for batch in args.batch_sizes:
        # Distinct prompts of equal length, so transformers needs no padding.
        prompts = [[(t + i) % 49000 + 100 if j == 0 else t for j, t in enumerate(base)] for i in range(batch)]
        ours, theirs, outside = [], [], []
        for _ in range(args.repeats):
            speed, share = our_run(engine, prompts, args.new_tokens)
            ours.append(speed)
            outside.append(share)
            theirs.append(hf_run(hf, prompts, args.new_tokens))
        o, t = statistics.median(ours), statistics.median(theirs)
        print(f"{batch:>5} {o:>15.1f} {t:>19.1f} {o / t:>6.2f}x {statistics.median(outside):>15.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
