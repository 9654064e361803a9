"""Prefix reuse through the engine: tokens unchanged by it, the reused prefix really skipped, no slot leaked.

Three rounds run on one engine: requests sharing a prefix arrive together (the later ones reuse the
first one's prompt chunks as they are computed), the same prompts again (all but each last token reused),
then a second chat turn whose prompt extends a first turn's prompt and answer. Every round's greedy tokens
must equal those of an engine with prefix caching off, for the default model and a DSA model, HiSparse on
and off. At every step the pools' used slots must be the tree's plus the running requests' own.
"""

from __future__ import annotations

import pytest
import torch
from dsa_checkpoints import TINY, build_checkpoint

from hisparse import SamplingParams
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.models.deepseek_v32 import load_dsa_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BUFFER = 48  # the default model's hot buffer: shorter than the shared prefix, so requests swap in


@pytest.fixture(scope="module")
def text_ids(tokenizer):
    import pydoc_data.topics

    return tokenizer.encode(" ".join(pydoc_data.topics.topics[k] for k in ("assignment", "class", "for", "with")))


def shared_prefix_prompts(ids: list[int], prefix: int, own: list[int]) -> list[list[int]]:
    return [ids[:prefix] + ids[1000 + 50 * i:1000 + 50 * i + n] for i, n in enumerate(own)]


def pool_columns(cache) -> list:
    """The allocators a cached token holds a slot in, in the prefix cache's column order."""
    return cache.prefix.allocators


def assert_slots_are_tree_plus_running(engine: LLMEngine) -> None:
    cache = engine.cache
    own = sum(int(r.kv.claim.private.sum()) for r in engine.scheduler.running)
    for allocator in pool_columns(cache):
        assert allocator.num_used == cache.prefix.tree.total_size + own
    assert cache.prefix.tree.protected_size <= sum(r.kv.claim.shared for r in engine.scheduler.running)
    if engine.config.enable_hisparse:
        assert cache.device_allocator.num_used == sum(r.kv.device_rows.size for r in engine.scheduler.running)


def run_round(engine: LLMEngine, prompts, params=GREEDY, abort_after: int | None = None):
    """Submit `prompts` together and step to the end, checking the slot invariant at every step; with
    `abort_after`, the first request is aborted after that many steps."""
    requests = [engine.add_request(p, params) for p in prompts]
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        if steps == abort_after:
            engine.abort(requests[0].request_id)
        assert_slots_are_tree_plus_running(engine)
    return requests


def three_rounds(engine: LLMEngine, prompts):
    first = run_round(engine, prompts)
    again = run_round(engine, prompts)
    turn = prompts[0] + first[0].output_token_ids + prompts[1][-7:]
    second_turn = run_round(engine, [turn])
    return [first, again, second_turn]


def tokens_of(rounds) -> list[list[list[int]]]:
    return [[r.output_token_ids for r in requests] for requests in rounds]


def assert_flushed_to_nothing(engine: LLMEngine) -> None:
    assert engine.flush_cache()
    usage = engine.cache.usage()
    assert usage["prefix_cache_tokens"] == 0
    assert all(v == 0 for k, v in usage.items() if k.endswith("_slots_used"))


def default_engine(llama, tokenizer, caching: bool, hisparse: bool, **config) -> LLMEngine:
    extra = dict(enable_hisparse=True, device_kv_budget=40_000_000,
                 hisparse_config={"device_buffer_size": BUFFER}) if hisparse else {}
    config = EngineConfig(**{"top_k": 32, "chunked_prefill_size": 64, "max_running_requests": 8,
                             "enable_prefix_caching": caching, **extra, **config})
    return LLMEngine(config, model=llama, tokenizer=tokenizer)


@pytest.mark.parametrize("hisparse", [False, True], ids=["baseline", "hisparse"])
def test_default_model_tokens_unchanged_by_prefix_reuse(llama, tokenizer, text_ids, hisparse):
    prompts = shared_prefix_prompts(text_ids, 140, [20, 33, 9, 41])
    expected = tokens_of(three_rounds(default_engine(llama, tokenizer, False, hisparse), prompts))
    engine = default_engine(llama, tokenizer, True, hisparse)
    rounds = three_rounds(engine, prompts)
    assert tokens_of(rounds) == expected
    first, again, (turn,) = rounds
    assert first[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens >= 128 for r in first[1:])  # whole chunks of the first one's prompt
    assert [r.num_cached_tokens for r in again] == [len(p) - 1 for p in prompts]
    # The retrofit model decodes sparsely but prefills densely: a turn reuses its last prompt, not the answer.
    assert turn.num_cached_tokens == len(prompts[0])
    stats = engine.stats_dict()
    assert stats["cached_prompt_tokens"] == sum(r.num_cached_tokens for rs in rounds for r in rs)
    assert_flushed_to_nothing(engine)


def test_dense_decode_reuses_the_answer_too(llama, tokenizer, text_ids):
    """With decode attending as prefill does, a second turn reuses the first turn's answer as well."""
    prompts = shared_prefix_prompts(text_ids, 90, [20, 30])
    expected = tokens_of(three_rounds(default_engine(llama, tokenizer, False, False, sparse_attention=False),
                                      prompts))
    engine = default_engine(llama, tokenizer, True, False, sparse_attention=False)
    rounds = three_rounds(engine, prompts)
    assert tokens_of(rounds) == expected
    answer = rounds[0][0].output_token_ids
    assert rounds[2][0].num_cached_tokens == len(prompts[0]) + len(answer) - 1  # the last has no row yet


@pytest.mark.parametrize("hisparse", [False, True], ids=["baseline", "hisparse"])
def test_eviction_and_abort_keep_tokens_and_slots(llama, tokenizer, text_ids, hisparse):
    """A budget for about two requests: cached prefixes are evicted for new ones (never refusing one that
    fits without the cache), and an abort mid-prefill leaves tokens and slots as they should be."""
    prompts = shared_prefix_prompts(text_ids, 150, [30, 20, 40, 25])
    # About 380 token slots (46 KB of K/V and 2 KB of index keys each); HiSparse: 104 hot slots, 416 host rows.
    budget = {"device_kv_budget": 2 * 200 * 48_120} if not hisparse else {
        "device_kv_budget": 104 * 30 * (1536 + 4 * 68),
        "hisparse_config": {"device_buffer_size": BUFFER, "host_to_device_ratio": 4}}

    def run(caching):
        engine = default_engine(llama, tokenizer, caching, hisparse, **budget)
        tokens, cached = [], []
        for i in range(0, len(prompts), 2):
            requests = run_round(engine, prompts[i:i + 2], abort_after=2 if i == 2 else None)
            tokens.append([r.output_token_ids for r in requests if r.finish_reason != "abort"])
            cached.append([r.num_cached_tokens for r in requests])
        distinct = run_round(engine, [text_ids[3000:3300]])
        tokens.append([distinct[0].output_token_ids])
        return engine, tokens, cached

    _, expected, _ = run(False)
    engine, tokens, cached = run(True)
    assert tokens == expected
    assert cached[1][1] >= 64  # the shared prefix, next to an aborted request
    capacity = min(a.num_slots for a in pool_columns(engine.cache))
    assert engine.cache.prefix.tree.total_size <= capacity
    assert engine.cache.prefix.tree.total_size < sum(len(p) for p in prompts)  # something was evicted
    assert_flushed_to_nothing(engine)


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def dsa_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_checkpoint(request.param, path, index_topk=8, kv_lora_rank=128)
    return load_dsa_model(path)


@pytest.mark.parametrize("hisparse", [False, True], ids=["baseline", "hisparse"])
def test_dsa_tokens_unchanged_by_prefix_reuse(dsa_model, tokenizer, hisparse):
    """DSA prefills sparsely as it decodes, so a second turn reuses the first turn's answer too."""
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, TINY["vocab_size"], (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (9, 17, 4)]

    def engine(caching):
        extra = dict(enable_hisparse=True, hisparse_config={"device_buffer_size": 16}) if hisparse else {}
        config = EngineConfig(dtype="float32", device_kv_budget=200_000, chunked_prefill_size=16,
                              enable_prefix_caching=caching, **extra)
        return LLMEngine(config, model=dsa_model, tokenizer=tokenizer)

    expected = tokens_of(three_rounds(engine(False), prompts))
    cached = engine(True)
    rounds = three_rounds(cached, prompts)
    assert tokens_of(rounds) == expected
    assert [r.num_cached_tokens for r in rounds[1]] == [len(p) - 1 for p in prompts]
    assert rounds[2][0].num_cached_tokens == len(prompts[0]) + GREEDY.max_tokens - 1
    assert_flushed_to_nothing(cached)
