"""A server's warm-up runs a short request through its own engine, with the serial and then the parallel kernel
variants: the swap-in really runs, and afterwards no counter shows it and no memory stays taken, so /metrics
starts from the first user request."""

from __future__ import annotations

import importlib

from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.engine.warm_up import PARALLEL_THRESHOLDS, warm_up_in_place
from hisparse.kernels import swap_in_cpu

BUFFER = 48


def hisparse_engine(llama, tokenizer, budget: int = 40_000_000, policy: str = "auto") -> LLMEngine:
    config = EngineConfig(top_k=32, chunked_prefill_size=128, max_running_requests=4, enable_hisparse=True,
                          device_kv_budget=budget,
                          hisparse_config={"device_buffer_size": BUFFER, "eviction_policy": policy})
    return LLMEngine(config, model=llama, tokenizer=tokenizer)


def test_warm_up_swaps_in_then_leaves_zero_counters_and_free_memory(llama, tokenizer):
    engine = hisparse_engine(llama, tokenizer)
    seen_before_reset = {}
    reset = engine.reset_stats

    def recording_reset():
        seen_before_reset.update(engine.stats_dict())
        reset()

    engine.reset_stats = recording_reset
    assert warm_up_in_place(engine)
    assert seen_before_reset["prompt_tokens"] == 2 * (BUFFER + 16)  # once with serial kernels, once parallel
    swap_in = seen_before_reset["swap_in"]
    assert swap_in["hits"] + swap_in["misses"] > 0  # the prompt outgrew the hot buffer: the swap-in ran

    stats = engine.stats_dict()
    assert (stats["steps"], stats["prompt_tokens"], stats["generated_tokens"], stats["finished_requests"],
            stats["decode_steps"], stats["decode_seconds"], stats["peak_running"]) == (0, 0, 0, 0, 0, 0.0, 0)
    assert stats["forward_seconds"] == 0.0
    assert stats["swap_in"]["hits"] == stats["swap_in"]["misses"] == stats["swap_in"]["evictions"] == 0
    assert stats["swap_in"]["swap_in_seconds"] == 0.0 and stats["swap_in"]["fast_path_lookups"] == 0
    memory = stats["memory"]
    assert memory["device_slots_used"] == memory["host_slots_used"] == memory["indexer_slots_used"] == 0

    # the counters count again from zero: a request after the warm-up is all they show
    request = engine.add_request(list(range(100, 180)), SamplingParams(temperature=0.0, max_tokens=5,
                                                                       ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    stats = engine.stats_dict()
    assert stats["prompt_tokens"] == 80 and stats["generated_tokens"] == len(request.output_token_ids) == 5
    assert stats["swap_in"]["hits"] + stats["swap_in"]["misses"] > 0


def test_a_budget_too_small_for_the_warm_up_request_skips_it(llama, tokenizer, monkeypatch):
    engine = hisparse_engine(llama, tokenizer)
    monkeypatch.setattr(type(engine.cache), "capacity_tokens", property(lambda self: BUFFER))
    assert not warm_up_in_place(engine)
    assert engine.stats_dict()["steps"] == 0 and not engine.has_unfinished


def test_warm_up_runs_the_parallel_variants_and_puts_the_thresholds_back(llama, tokenizer, monkeypatch):
    engine = hisparse_engine(llama, tokenizer, policy="fifo")  # a policy numba plans (lru's page table is C's)
    before = {(module, name): getattr(importlib.import_module(module), name) for module, name in PARALLEL_THRESHOLDS}
    called = []
    compiled = swap_in_cpu._plan_batch_parallel  # numba's (the selection's top-k is C, compiled at build)

    def spy(*args):
        called.append("_plan_batch_parallel")
        return compiled(*args)

    monkeypatch.setattr(swap_in_cpu, "_plan_batch_parallel", spy)
    assert warm_up_in_place(engine)
    assert "_plan_batch_parallel" in called
    assert {key: getattr(importlib.import_module(key[0]), key[1]) for key in before} == before
