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
import time

import torch

from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.models.default_model import default_model_path
from hisparse.models.loader import load_llama

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both (default: torch's); 1 gives steadier ratios on a busy machine")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    path = default_model_path()
    # The dense model on both sides: this compares engines, not attention kinds.
    engine = LLMEngine(EngineConfig(max_running_requests=max(args.batch_sizes), sparse_attention=False),
                       model=load_llama(path, indexer=False))
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    base = engine.tokenizer.encode(TEXT)
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


if __name__ == "__main__":
    main()
