"""Compile (or load from numba's cache) every kernel a decode step runs, before anything is timed or served.

A kernel's serial and parallel variants are compiled separately, and a short request reaches only the serial
ones, so every warm-up runs its request twice on the CPU: as it comes, then with every parallel threshold at 0
(`every_loop_parallel`), the variants a batch of 16 first uses.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch

from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.models.tokenizer import Tokenizer

WARM_UP_PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
WARM_UP_TEXT = "The engine compiles its kernels before the first request arrives. "
# Each compiled CPU kernel's size from which it runs its parallel variant (module, global).
PARALLEL_THRESHOLDS = (("hisparse.kernels.decode_attention_cpu", "PARALLEL_MIN_ROWS"),
                       ("hisparse.kernels.index_scores_cpu", "PARALLEL_MIN_KEYS"),
                       ("hisparse.kernels.lru_page_table_cpu", "PARALLEL_MIN_SELECTED"),
                       ("hisparse.kernels.swap_in_cpu", "PARALLEL_MIN_SELECTED"),
                       ("hisparse.kernels.swap_in_cpu", "PARALLEL_MIN_BYTES"),
                       ("hisparse.kernels.top_k_cpu", "PARALLEL_MIN_SCORES"))


def warm_up(config: EngineConfig, model, tokenizer: Tokenizer, prompt: list[int]) -> None:
    """The warm-up through a throwaway engine of the same config: on the first run after an install or an edit
    of a kernel, the first decode step otherwise counts seconds of numba compiling (the swap-in alone ~8 s), in
    the step and in the swap-in's own seconds. Pass a prompt longer than the hot buffer, so that the swap-in
    runs; the timed engine's counters are not touched."""
    _run_warm_up(LLMEngine(config, model=model, tokenizer=tokenizer), prompt)


def warm_up_in_place(engine: LLMEngine) -> bool:
    """The warm-up through `engine` itself, then its counters zeroed: a server must not make its first users
    pay the kernels' compiling (seconds on the first run after an install, a load from numba's cache after
    that), and a second engine of the same config would need its memory twice. The prompt outgrows the hot
    buffer, so that the swap-in runs. False (nothing run) when the budget cannot hold such a request."""
    length = (engine.cache.config.device_buffer_size if engine.config.enable_hisparse else 0) + 16
    if length + WARM_UP_PARAMS.max_tokens > min(engine.cache.capacity_tokens, engine.max_model_len):
        return False
    _run_warm_up(engine, engine.tokenizer.encode(WARM_UP_TEXT * (length // 8 + 1))[:length])
    engine.reset_stats()
    return True


@contextmanager
def every_loop_parallel():
    """The CPU kernels take their parallel variants at any size, until the block ends. Process-wide: only for a
    warm-up, before any other thread runs the kernels."""
    thresholds = [(importlib.import_module(module), name) for module, name in PARALLEL_THRESHOLDS]
    saved = [getattr(module, name) for module, name in thresholds]
    for module, name in thresholds:
        setattr(module, name, 0)
    try:
        yield
    finally:
        for (module, name), value in zip(thresholds, saved, strict=True):
            setattr(module, name, value)


def _run_warm_up(engine: LLMEngine, prompt: list[int]) -> None:
    _run_one(engine, prompt)
    # The numba kernels run only on the CPU. The thresholds are this process's: tensor-parallel ranks would run
    # different variants (and wait on each other's compiling), so they compile their parallel ones when first used.
    if torch.device(engine.config.device).type == "cpu" and engine.config.tp_size == 1:
        with every_loop_parallel():
            _run_one(engine, prompt)


def _run_one(engine: LLMEngine, prompt: list[int]) -> None:
    """One request (under DP attention one per rank, each placed in turn), its prefill run in full: what it left
    in the prefix cache is dropped after it."""
    for _ in range(engine.dp_size):
        engine.add_request(prompt, WARM_UP_PARAMS)
    while engine.has_unfinished:
        engine.step()
    engine.flush_cache()
