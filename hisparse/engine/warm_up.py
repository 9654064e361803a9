"""Compile (or load from numba's cache) every kernel a decode step runs, before anything is timed."""

from __future__ import annotations

from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.models.tokenizer import Tokenizer


def warm_up(config: EngineConfig, model, tokenizer: Tokenizer, prompt: list[int]) -> None:
    """One short request through a throwaway engine of the same config: on the first run after an install
    or an edit of a kernel, the first decode step otherwise counts seconds of numba compiling (the swap-in
    alone ~8 s), in the step and in the swap-in's own seconds. Pass a prompt longer than the hot buffer, so
    that the swap-in runs; the timed engine's counters are not touched."""
    engine = LLMEngine(config, model=model, tokenizer=tokenizer)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
