"""Greedy tokens of the bfloat16 engine with its compiled C kernels against the same engine on PyTorch's ops.

The kernels round as PyTorch does where they can, but not everywhere: the decode attention keeps its softmax
weights in float32 where SDPA rounds them to bfloat16, and the norm sums its squares in another order. So
bfloat16 logits differ by a few bfloat16 steps, and greedy decoding may part where two tokens tie within that.
What must hold: the two runs pick the same tokens until a step where eager's own top two are that close, and
where they part, the compiled run's token is one eager also (nearly) picks. A kernel that read the wrong head,
row or scale parts at once, with a margin far above this noise.

Prompts: the transformers parity prompts, and one of real text longer than top_k and the hot buffer, so that
decode selects (the indexer kernels), attends sparsely and, with HiSparse, swaps rows in.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.data.pydoc_corpus import heldout_tokens
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.kernels import (
    c_library,
    decode_attention_cpu,
    index_keys_cpu,
    index_scores_cpu,
    indexer_key_cpu,
    kv_rows_cpu,
    lru_page_table_cpu,
    rms_norm_cpu,
    rotary_cpu,
    swiglu_cpu,
)

DECODE_KERNELS = (decode_attention_cpu, index_keys_cpu, index_scores_cpu, indexer_key_cpu, kv_rows_cpu,
                  lru_page_table_cpu, rms_norm_cpu, rotary_cpu, swiglu_cpu)
TOKENS = 40
NEAR_TIE = 0.25  # logits; two bfloat16 steps at the default model's top logits (8 to 32)
NOISE = 1.5  # largest |logit difference| allowed while the runs agree (measured up to 0.8)
PARITY_PROMPTS = [
    [1, 504, 3458, 282, 4649, 314],
    list(range(100, 164)),
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2114, 28, 7018, 411, 407, 19712, 8182, 2],
]
CONFIGS = {"baseline": {}, "hisparse": {"enable_hisparse": True,
                                        "hisparse_config": {"top_k": 256, "device_buffer_size": 300}}}


def greedy_with_logits(model, tokenizer, config: dict, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    """Each prompt's greedy tokens and the logits each was picked from, one request at a time."""
    engine = LLMEngine(EngineConfig(dtype="bfloat16", enable_prefix_caching=False, **config), model=model,
                       tokenizer=tokenizer)
    picked: list[torch.Tensor] = []
    compute = engine.runner.model.compute_logits

    def recording(hidden):
        logits = compute(hidden)
        picked.extend(logits.float())
        return logits

    engine.runner.model.compute_logits = recording
    try:
        runs = []
        for prompt in prompts:
            picked.clear()
            request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
            while engine.has_unfinished:
                engine.step()
            runs.append((list(request.output_token_ids), list(picked)))
        return runs
    finally:
        del engine.runner.model.compute_logits  # the shared model's own method again


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_compiled_kernels_pick_eager_tokens_but_at_near_ties(mode, llama_bf16, tokenizer):
    prompts = [*PARITY_PROMPTS, heldout_tokens(tokenizer, 420)]
    compiled = greedy_with_logits(llama_bf16, tokenizer, CONFIGS[mode], prompts)
    assert all(kernel.available() for kernel in DECODE_KERNELS)  # what the compiled run ran
    with c_library.eager():
        assert not any(library.available() for library in c_library.LIBRARIES)
        eager = greedy_with_logits(llama_bf16, tokenizer, CONFIGS[mode], prompts)
    largest = 0.0
    for number, ((ours, our_logits), (theirs, their_logits)) in enumerate(zip(compiled, eager, strict=True)):
        assert len(ours) == len(theirs) == len(their_logits) == TOKENS
        parted = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), TOKENS)
        for step in range(min(parted + 1, TOKENS)):
            largest = max(largest, float((our_logits[step] - their_logits[step]).abs().max()))
        if parted < TOKENS:
            logits = their_logits[parted]
            assert logits.max() - logits[ours[parted]] <= NEAR_TIE, \
                f"prompt {number}: the compiled run picked {ours[parted]} at step {parted}, which eager scores " \
                f"{float(logits.max() - logits[ours[parted]]):.3f} below its own pick {theirs[parted]}"
    assert 0 < largest <= NOISE  # the two runs really ran different code, and differ by rounding alone
