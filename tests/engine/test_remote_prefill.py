"""The engine's side of prefill-decode disaggregation, without a transfer engine: a `hold_kv` request keeps its
rows after it finishes, a `remote_prefill` request is admitted without a prefill and decodes from rows copied
into its memory; tokens equal a co-located run, and every slot goes back."""

from __future__ import annotations

import pytest

from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.request import RequestStatus
from hisparse.engine.sampling_params import SamplingParams

PROMPT = "Sparse attention reads only the tokens its indexer selects, so the rest of the cache can wait. " * 3
HISPARSE = dict(enable_hisparse=True, hisparse_config='{"top_k": 32, "device_buffer_size": 48}')


def engine(llama, tokenizer, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(max_running_requests=2, device_kv_budget=32 << 20, **kw), model=llama,
                     tokenizer=tokenizer)


def run(engine: LLMEngine) -> None:
    while engine.has_unfinished:
        engine.step()


def used(engine: LLMEngine) -> dict:
    return {k: v for k, v in engine.cache.usage().items() if k.endswith("_used") and v}


@pytest.mark.parametrize("decode_kw", [{}, HISPARSE], ids=["baseline", "hisparse"])
def test_rows_copied_from_a_prefill_engine_decode_as_a_colocated_one(llama, tokenizer, decode_kw):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    colocated = engine(llama, tokenizer, **decode_kw)
    expected = colocated.add_request(PROMPT, params)
    run(colocated)
    prefill, decode = engine(llama, tokenizer), engine(llama, tokenizer, **decode_kw)
    source = prefill.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
    run(prefill)
    assert source.finished and prefill.scheduler.held and used(prefill)  # finished, its rows kept
    target = decode.add_request(PROMPT, params, remote_prefill=True)
    assert decode.step() == [] and target.status is RequestStatus.TRANSFERRING  # admitted, nothing computed
    n = target.num_prompt_tokens
    for i, ((_, src), (_, dst)) in enumerate(zip(prefill.row_pools(), decode.row_pools(), strict=True)):
        rows_from, rows_to = prefill.row_slots(source)[:n, i], decode.row_slots(target)[:n, i]
        dst[:, rows_to] = src[:, rows_from].to(dst.device)
    decode.start_decode(target.request_id, source.output_token_ids[0])
    run(decode)
    assert target.output_token_ids == expected.output_token_ids
    prefill.release_held(source.request_id)
    for e in (prefill, decode):
        assert e.flush_cache() and not used(e)


def test_an_aborted_transferring_request_and_a_held_one_give_their_memory_back(llama, tokenizer):
    e = engine(llama, tokenizer, **HISPARSE)
    waiting = e.add_request(PROMPT, SamplingParams(max_tokens=4), remote_prefill=True)
    e.step()
    assert e.stats_dict()["transferring"] == 1 and used(e)
    e.abort(waiting.request_id)
    held = e.add_request(PROMPT, SamplingParams(max_tokens=1), hold_kv=True)
    run(e)
    assert e.stats_dict()["held"] == 1
    e.abort(held.request_id)  # aborting a held request releases it
    assert e.stats_dict()["held"] == 0 and e.flush_cache() and not used(e)
