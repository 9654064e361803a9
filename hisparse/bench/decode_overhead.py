"""What HiSparse costs a decode step at equal batch: the same requests, the same batch, offloaded or not.

    python -m hisparse.bench.decode_overhead [--batch 8] [--context 2048] [--steps 24] [--repeats 3]
                                             [--hisparse-config JSON]

Both engines get a budget large enough to run the whole batch at once, so they run identical batches;
after the prompts are in, the decode steps are timed. The two modes alternate over the repeats so both
see the same machine load; the printed ratio (HiSparse step time / baseline step time, median) has a
target of at most 1.10. Contexts are longer than the hot buffer, so swap-in really runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from hisparse.data.pydoc_corpus import heldout_tokens
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.models.default_model import default_model_path
from hisparse.models.loader import load_llama
from hisparse.models.tokenizer import Tokenizer


def decode_step_seconds(engine: LLMEngine, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while any(r.in_prefill or not r.output_token_ids for r in requests):
        engine.step()
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times), [r.output_token_ids for r in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hisparse-config", default='{"top_k": 256, "device_buffer_size": 512}')
    args = parser.parse_args()

    path = default_model_path()
    model, tokenizer = load_llama(path, dtype=EngineConfig().model_dtype), Tokenizer.from_path(path)
    prompts = [heldout_tokens(tokenizer, args.context, offset=131 * i) for i in range(args.batch)]
    budget = 2 << 30
    common = dict(device_kv_budget=budget, max_running_requests=args.batch, chunked_prefill_size=1024)
    engines = {"baseline": LLMEngine(EngineConfig(**common), model=model, tokenizer=tokenizer),
               "hisparse": LLMEngine(EngineConfig(**common, enable_hisparse=True,
                                                  hisparse_config=args.hisparse_config),
                                     model=model, tokenizer=tokenizer)}
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    outputs = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            step, outputs[name] = decode_step_seconds(engine, prompts, args.steps)
            seconds[name].append(step)
    base, hs = statistics.median(seconds["baseline"]), statistics.median(seconds["hisparse"])
    swap = engines["hisparse"].stats_dict()["swap_in"]
    print(f"batch {args.batch}, context {args.context}, {args.steps} decode steps x {args.repeats} repeats")
    print(f"baseline step {base * 1e3:.1f} ms, hisparse step {hs * 1e3:.1f} ms, ratio {hs / base:.3f} (target <= 1.10)")
    share = swap["swap_in_seconds"] / (hs * args.steps * args.repeats)
    print(f"hisparse hit rate {swap['hit_rate']:.1%}; swap-in {share:.1%} of the decode time; "
          f"outputs identical: {outputs['baseline'] == outputs['hisparse']}")


if __name__ == "__main__":
    main()
