"""What HiSparse costs a decode step at equal batch: the same requests, the same batch, offloaded or not.

    python -m hisparse.bench.decode_overhead [--batch 8] [--context 2048] [--steps 24] [--repeats 3]
                                             [--hisparse-config JSON] [--policies A,B | --compare-indexer-kernels]

Both engines get a budget large enough to run the whole batch at once, so they run identical batches.
Each repeat gives both the same prompts, prefills them (untimed), then steps the two engines in turn,
one decode step each, which of them goes first alternating: consecutive steps of the two modes are a
fraction of a second apart, so the load of a shared machine hits both alike (timing whole runs one
after the other gave ratios from 1.07 to 1.25 for the same code). Printed: the median step time of
each mode and their ratio (HiSparse / baseline, the median over repeats of each repeat's ratio), with a
target of at most 1.10. Contexts are longer than the hot buffer, so swap-in really runs. Before any of
it, a short request through a throwaway engine of each config compiles the kernels (`engine.warm_up`), so
that no compile lands in a timed step or in the swap-in seconds printed.

`--policies lru,lrfu` times two HiSparse engines instead, the same config but these eviction policies,
and prints the second's step time over the first's and each one's hit rate and swap-in seconds.
`--compare-indexer-kernels` times two baseline engines instead, the first selecting with the indexer's
PyTorch path (`IndexSelector.past_scores_reference` and `select_reference`), the second with the
compiled int8 scorer and top-k (the CPU default).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from tqdm import tqdm

from hisparse.cli_args import OneLineParser, comma_list, int_in, json_object, one_of, positive_int, run_main
from hisparse.data.pydoc_corpus import heldout_tokens
from hisparse.engine.engine_config import GIB, EngineConfig, resolve_model_dtype
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.engine.warm_up import warm_up
from hisparse.formats.kv_layout import KVLayout
from hisparse.memory.eviction import EVICTION_POLICIES
from hisparse.models.loader import ModelFiles, load_llama, open_model

PROG = "python -m hisparse.bench.decode_overhead"
BUDGET = 2 * GIB  # device KV budget of both engines: the whole batch must fit it, so that both run it at once
MAX_BATCH = 4096  # a cap far above what fits BUDGET, checked first so that a typo builds no 10**12 prompts


def interleaved_step_seconds(engines: dict[str, LLMEngine], prompts: list[list[int]], steps: int,
                             max_tokens: int) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Prefill the prompts in every engine, then time `steps` decode steps of each, taking turns. Each timed
    step must decode the whole batch (`max_tokens` leaves room for the tokens the first requests decode while
    the later ones prefill); the requests are aborted after the timing, or when it fails."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = {name: [engine.add_request(p, params) for p in prompts] for name, engine in engines.items()}
    for name, engine in engines.items():
        while any(r.in_prefill or not r.output_token_ids for r in requests[name]):
            engine.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    order = list(engines)
    try:
        for i in range(steps):
            for name in order if i % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                produced = engines[name].step()
                times[name].append(time.perf_counter() - start)
                if len(produced) != len(prompts):
                    raise RuntimeError(f"{name}: a timed step decoded {len(produced)} of {len(prompts)} requests")
    finally:
        for name, engine in engines.items():
            for request in requests[name]:
                engine.abort(request.request_id)
    return times, {name: [r.output_token_ids for r in rs] for name, rs in requests.items()}


def prefill_steps(batch: int, context: int, chunk: int) -> int:
    """At most how many steps the batch's prompts take to prefill: every step's chunk budget, less one token
    for each request already decoding, goes to prompts. The first requests decode a token in each."""
    return -(-batch * context // max(chunk - batch, 1))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int_in(1, MAX_BATCH), default=8)
    parser.add_argument("--context", type=positive_int, default=2048, help="prompt tokens of each request")
    parser.add_argument("--steps", type=positive_int, default=24, help="timed decode steps per repeat")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--hisparse-config", type=json_object, default='{"top_k": 256, "device_buffer_size": 512}')
    parser.add_argument("--policies", type=comma_list(one_of("auto", *EVICTION_POLICIES)), default=None,
                        help="two eviction policies, e.g. lru,lrfu: compare HiSparse with each instead of the baseline")
    parser.add_argument("--compare-indexer-kernels", action="store_true",
                        help="time the baseline with the PyTorch indexer path against the compiled kernels instead")
    return parser


def check_args(parser: argparse.ArgumentParser,
               args: argparse.Namespace) -> tuple[EngineConfig, ModelFiles, int]:
    """What the flags can get wrong, found before the model loads (each of these failed after loading, some
    after the warm-up too). Returns the HiSparse engine's config, the opened model and each request's max_tokens."""
    if args.policies is not None and len(args.policies) != 2:
        parser.error("--policies takes two eviction policies, e.g. lru,lrfu")
    if args.policies is not None and args.compare_indexer_kernels:
        parser.error("--policies and --compare-indexer-kernels are two different comparisons; pick one")
    try:
        # Prefix caching off: every repeat sends the same prompts, and each is to prefill and decode as the first.
        hisparse = EngineConfig(device_kv_budget=BUDGET, max_running_requests=args.batch, chunked_prefill_size=1024,
                                enable_hisparse=True, hisparse_config=args.hisparse_config,
                                enable_prefix_caching=False)
    except ValueError as error:
        parser.error(f"argument --hisparse-config: {error}")
    files = open_model(None)
    mc = files.config
    bytes_per_token = KVLayout.of(mc, resolve_model_dtype()).bytes_per_token  # K/V alone: a lower bound

    def refuse_past_limits(tokens: int, why: str) -> None:
        if tokens > mc.max_position_embeddings:
            parser.error(f"{why} = {tokens} tokens, past the model's context ({mc.max_position_embeddings} tokens)")
        if args.batch * tokens * bytes_per_token > BUDGET:
            parser.error(f"--batch {args.batch} requests of {why} = {tokens} tokens need at least "
                         f"{args.batch * tokens * bytes_per_token / GIB:.1f} GiB of K/V, more than the "
                         f"{BUDGET / GIB:.0f} GiB budget that runs the whole batch at once")

    # The flags' own length first, then what the batch adds: the first requests decode while the others prefill.
    refuse_past_limits(args.context + args.steps + 1, "--context + --steps + 1")
    max_tokens = args.steps + 1 + prefill_steps(args.batch, args.context, hisparse.chunked_prefill_size)
    refuse_past_limits(args.context + max_tokens, "--context + --steps + 1 + the steps the batch's prefill takes")
    return hisparse, files, max_tokens


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    hisparse, files, max_tokens = check_args(parser, args)
    policies = args.policies

    model, tokenizer = load_llama(files, dtype=resolve_model_dtype()), files.tokenizer()
    prompts = [heldout_tokens(tokenizer, args.context, offset=131 * i) for i in range(args.batch)]
    if args.compare_indexer_kernels:
        configs = {"torch indexer": hisparse.without_hisparse(), "compiled indexer": hisparse.without_hisparse()}
    elif policies is None:
        configs = {"baseline": hisparse.without_hisparse(), "hisparse": hisparse}
    else:
        configs = {name: dataclasses.replace(hisparse, hisparse_config=dataclasses.replace(
            hisparse.hisparse_config, eviction_policy=name)) for name in policies}
    engines = {name: LLMEngine(config, model=model, tokenizer=tokenizer) for name, config in configs.items()}
    first, second = engines
    if args.compare_indexer_kernels:
        selector = engines[first].cache.selector
        if not selector.compiled_scores:
            parser.error("this model's indexer keys are not int8 rows on the CPU: no compiled kernels to compare")
        selector.compiled_scores = selector.compiled_top_k = False
    buffer = hisparse.hisparse_config.device_buffer_size
    for config in configs.values():  # a context past the buffer, so that the swap-in compiles too
        warm_up(config, model, tokenizer, prompts[0][:buffer + 16])
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    ratios = []
    identical = True
    for _ in tqdm(range(args.repeats), desc="repeats"):
        times, outputs = interleaved_step_seconds(engines, prompts, args.steps, max_tokens)
        identical = identical and outputs[first] == outputs[second]
        for name in engines:
            seconds[name] += times[name]
        ratios.append(statistics.median(times[second]) / statistics.median(times[first]))
    steps = {name: statistics.median(seconds[name]) for name in engines}
    print(f"batch {args.batch}, context {args.context}, {args.steps} decode steps x {args.repeats} repeats")
    comparing = policies is not None or args.compare_indexer_kernels
    target = "" if comparing else "target <= 1.10; "
    print(f"{first} step {steps[first] * 1e3:.1f} ms, {second} step {steps[second] * 1e3:.1f} ms, "
          f"ratio {statistics.median(ratios):.3f} ({target}per repeat {', '.join(f'{r:.3f}' for r in ratios)})")
    if args.compare_indexer_kernels:
        with_swap_in = []  # two baselines
    elif policies:
        with_swap_in = list(engines)
    else:
        with_swap_in = [second]
    for name in with_swap_in:
        swap = engines[name].stats_dict()["swap_in"]
        share = swap["swap_in_seconds"] / sum(seconds[name])
        print(f"{name} hit rate {swap['hit_rate']:.1%}; {swap['misses']} misses; swap-in "
              f"{swap['swap_in_seconds']:.2f} s, {share:.1%} of the decode time")
    note = " (the two break ties between equal scores differently, so greedy outputs may part)" \
        if args.compare_indexer_kernels else ""
    print(f"outputs identical: {identical}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
