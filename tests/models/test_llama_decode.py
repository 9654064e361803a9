"""The decode step on buffers and calls made once per batch size (`models.llama_decode`) against the layers' own
forward: the same kernels in the same order, so every step's logits must be the same bits, in the baseline and with
HiSparse, dense and quantized, through both of the indexer's paths (keys alone while the contexts fit top_k, queries
and selection once they pass it)."""

from __future__ import annotations

import pytest
import torch

from hisparse.attention.hisparse import HiSparseAttention
from hisparse.attention.paged import PagedAttention
from hisparse.data.pydoc_corpus import heldout_tokens
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.layers.linear import InferenceWeight
from hisparse.models.llama_decode import MAX_BATCH, runs
from hisparse.models.loader import load_llama

TOP_K = 256
MODES = {"baseline": {}, "hisparse": {"enable_hisparse": True,
                                      "hisparse_config": {"top_k": TOP_K, "device_buffer_size": 300}},
         # both contexts past a buffer of 100 from the first step: every request swaps in
         "hisparse-swapping": {"enable_hisparse": True, "hisparse_config": {"top_k": 64, "device_buffer_size": 100}},
         # the shorter prompt on the fast path for 5 steps beside the longer one swapping in
         "hisparse-mixed": {"enable_hisparse": True, "hisparse_config": {"top_k": 64, "device_buffer_size": 245}}}
PROMPTS = (240, 250)  # tokens: with 24 decoded, the longer context passes top_k midway
TOKENS = 24
# Which reused steps the backend binds once (`bind_decode`) rather than calling `attend` per layer: all but a step
# with requests both on the fast path and swapping in.
BOUND = {"hisparse-mixed": [False] * 5 + [True] * (TOKENS - 6)}


@pytest.fixture(scope="module")
def llama_int4(model_files):
    return load_llama(model_files, dtype=torch.bfloat16, quantization="int4")


def decode_logits(model, tokenizer, mode: str, reuse: bool) -> tuple[list[torch.Tensor], list[int]]:
    """Every step's logits for both prompts decoding side by side, and the batch sizes the reused steps were made
    for."""
    model.reuse_decode_steps = reuse
    model._decode_steps.clear()
    engine = LLMEngine(EngineConfig(dtype="bfloat16", enable_prefix_caching=False, **MODES[mode]), model=model,
                       tokenizer=tokenizer)
    logits: list[torch.Tensor] = []
    compute = model.compute_logits
    model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        for n, offset in zip(PROMPTS, (3, 900), strict=True):
            engine.add_request(heldout_tokens(tokenizer, n, offset=offset), params)
        while engine.has_unfinished:
            engine.step()
    finally:
        del model.compute_logits
        model.reuse_decode_steps = True
    return logits, sorted(model._decode_steps)


@pytest.mark.parametrize("mode,quantization", [("baseline", "none"), ("hisparse", "none"), ("baseline", "int4"),
                                               ("hisparse", "int4"), ("hisparse-swapping", "int4"),
                                               ("hisparse-mixed", "none")])
def test_reused_decode_steps_give_the_layers_logits(mode, quantization, llama_bf16, llama_int4, tokenizer,
                                                    monkeypatch):
    model = llama_int4 if quantization == "int4" else llama_bf16
    bound = []

    def recording(bind):
        def bind_decode(*args, **kwargs):
            attend = bind(*args, **kwargs)
            bound.append(attend is not None)
            return attend
        return bind_decode

    for backend in (HiSparseAttention, PagedAttention):
        monkeypatch.setattr(backend, "bind_decode", recording(backend.bind_decode))
    reused, sizes = decode_logits(model, tokenizer, mode, reuse=True)
    eager, no_sizes = decode_logits(model, tokenizer, mode, reuse=False)
    assert sizes == [2] and no_sizes == []  # the reused path ran, and only there
    assert bound == BOUND.get(mode, [True] * (TOKENS - 1))  # every reused step asked; these got the bound calls
    assert len(reused) == len(eager) == TOKENS  # one step a token for both, the first the prefill
    for step, (ours, theirs) in enumerate(zip(reused, eager, strict=True)):
        assert torch.equal(ours, theirs), f"step {step}: logits differ by {float((ours - theirs).abs().max())}"


def test_preparing_again_or_moving_drops_the_steps_bound_to_the_old_weights(model_files, tokenizer):
    model = load_llama(model_files, dtype=torch.bfloat16)
    decode_logits(model, tokenizer, "baseline", reuse=True)
    model.prepare_for_inference("int4")
    assert not model._decode_steps
    eager, _ = decode_logits(model, tokenizer, "baseline", reuse=False)
    reused, _ = decode_logits(model, tokenizer, "baseline", reuse=True)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(reused, eager, strict=True))
    step = model._decode_steps[2]
    assert step.is_current()
    down = model.layers[3].mlp.down
    model.layers[3].mlp.down = InferenceWeight(model.layers[3].mlp.down_proj.weight, "int4")  # swapped by hand
    assert not step.is_current()  # the next step binds anew
    model.layers[3].mlp.down = down
    model.to(torch.bfloat16)  # any move may replace the parameters the steps read by address
    assert not model._decode_steps


def test_steps_it_does_not_take_run_the_layers(llama_bf16, llama):
    """Prompt chunks, batches past MAX_BATCH, training (gradients) and float32 models go through the layers' own
    forward."""

    class Backend:
        def __init__(self, decode_only: bool) -> None:
            self.decode_only = decode_only

    with torch.no_grad():
        assert runs(llama_bf16, Backend(True), 1) and runs(llama_bf16, Backend(True), MAX_BATCH)
        assert not runs(llama_bf16, Backend(True), MAX_BATCH + 1)
        assert not runs(llama_bf16, Backend(False), 1)
        assert not runs(llama, Backend(True), 1)
    with torch.enable_grad():
        assert not runs(llama_bf16, Backend(True), 1)
