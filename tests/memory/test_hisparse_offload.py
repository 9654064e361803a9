"""HiSparse on the real model: offloading changes no result, the page table matches the buffer, nothing leaks.

top_k and the hot buffer are set small (32 / 48 slots) so that contexts of a few hundred tokens are
several times the buffer and misses really happen, while the suite stays fast.
"""

from __future__ import annotations

import pytest
import torch

from hisparse import SamplingParams
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.memory.hisparse_config import HiSparseConfig

TOP_K, BUFFER = 32, 48
BUDGET = 40_000_000
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics[k] for k in ("assignment", "class", "for", "with"))
    ids = tokenizer.encode(text)
    return [ids[:30], ids[100:260], ids[400:700], ids[800:1010]]


def engine(llama, tokenizer, **kwargs) -> LLMEngine:
    config = EngineConfig(**{"top_k": TOP_K, "chunked_prefill_size": 128, "max_running_requests": 8, **kwargs})
    return LLMEngine(config, model=llama, tokenizer=tokenizer)


def hisparse_engine(llama, tokenizer, policy="lru", backend="auto", budget=BUDGET, **kwargs) -> LLMEngine:
    return engine(llama, tokenizer, enable_hisparse=True, device_kv_budget=budget, swap_in_backend=backend,
                  hisparse_config={"device_buffer_size": BUFFER, "eviction_policy": policy}, **kwargs)


def generate(e: LLMEngine, prompts, params=PARAMS) -> list[list[int]]:
    requests = [e.add_request(p, params) for p in prompts]
    while e.has_unfinished:
        e.step()
    return [r.output_token_ids for r in requests]


def assert_all_free(e: LLMEngine) -> None:
    usage = e.cache.usage()
    assert usage["device_slots_used"] == 0
    assert usage["host_slots_used"] == 0
    assert usage["indexer_slots_used"] == 0
    assert e.cache.row_allocator.num_used == 0
    assert (e.cache.slot_pos == -1).all()


@pytest.fixture(scope="module")
def baseline_tokens(llama, tokenizer, prompts):
    return generate(engine(llama, tokenizer), prompts)


@pytest.mark.parametrize("policy, backend",
                         [("lru", "cpu"), ("fifo", "cpu"), ("clock", "reference"), ("score_lru", "cpu"),
                          ("lrfu", "cpu")])
def test_offloading_changes_no_result(llama, tokenizer, prompts, baseline_tokens, policy, backend):
    e = hisparse_engine(llama, tokenizer, policy, backend)
    assert generate(e, prompts) == baseline_tokens
    stats = e.stats_dict()["swap_in"]
    assert stats["misses"] > 0 and stats["hits"] > 0
    assert e.cache.host_kv.dtype == torch.float32  # the float32 model's K/V ("auto")
    assert stats["bytes_host_to_device"] == stats["misses"] * e.cache.layout.row_size * 4
    assert_all_free(e)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])
def test_offloading_changes_no_result_in_bfloat16(llama_bf16, tokenizer, prompts, kv_cache_dtype):
    """The default dtype on CPUs with native bfloat16, with its K/V in a bfloat16 cache ("auto": 2-byte rows
    swapped in) and in a float32 one, which holds the bfloat16 K/V exactly."""
    e = hisparse_engine(llama_bf16, tokenizer, kv_cache_dtype=kv_cache_dtype)
    assert generate(e, prompts) == generate(engine(llama_bf16, tokenizer, kv_cache_dtype=kv_cache_dtype), prompts)
    stats = e.stats_dict()["swap_in"]
    width = 2 if kv_cache_dtype == "auto" else 4
    assert stats["misses"] > 0 and stats["bytes_host_to_device"] == stats["misses"] * e.cache.layout.row_size * width
    assert_all_free(e)


def test_page_table_matches_buffer_mid_flight(llama, tokenizer, prompts):
    e = hisparse_engine(llama, tokenizer, policy="score_lru")
    requests = [e.add_request(p, PARAMS) for p in prompts[1:]]
    for _ in range(12):
        e.step()
    cache = e.cache
    # score_lru ages move in whole steps (top_k units) unless the indexer's runners-up reached the policy
    ages = torch.stack([policy.state["age"] for policy in cache.policies])
    assert cache.num_next_ranks == 2 * (BUFFER - TOP_K) and (ages % TOP_K != 0).any()
    checked = 0
    for request in requests:
        alloc = request.kv
        assert alloc.buffered
        for layer in range(cache.layout.num_layers):
            slot_pos = cache.slot_pos[layer, alloc.row]
            held = slot_pos[slot_pos >= 0].long()
            assert held.unique().numel() == held.numel()  # no position twice
            assert sorted(cache.lru[layer, alloc.row].tolist()) == list(range(BUFFER))  # order is a permutation
            device = cache.device_kv[layer, cache.device_rows[alloc.row][slot_pos >= 0]]
            host = cache.host_kv[layer, torch.from_numpy(alloc.host_rows)[held]]
            assert torch.equal(device, host)
            checked += held.numel()
    assert checked > 0
    for request in requests:
        e.abort(request.request_id)
    assert_all_free(e)


def test_hisparse_admits_more_requests_under_the_same_budget(llama, tokenizer, prompts):
    prompt = prompts[3]
    per_request_baseline = len(prompt) + PARAMS.max_tokens
    base = engine(llama, tokenizer, device_kv_budget=BUDGET // 2)
    hs = hisparse_engine(llama, tokenizer, budget=BUDGET // 2)
    for e in (base, hs):
        for i in range(8):
            e.add_request(prompt[i:], PARAMS)
        e.step()
    assert len(base.scheduler.running) == base.cache.capacity_tokens // per_request_baseline
    assert len(hs.scheduler.running) > 2 * len(base.scheduler.running)
    for e in (base, hs):
        for r in [*e.scheduler.running, *e.scheduler.waiting]:
            e.abort(r.request_id)
    assert_all_free(hs)


def test_requests_that_cannot_fit_are_refused_at_the_door(llama, tokenizer):
    with pytest.raises(ValueError, match="budget"):
        hisparse_engine(llama, tokenizer, budget=100_000)
    e = hisparse_engine(llama, tokenizer, budget=4_000_000)
    with pytest.raises(ValueError, match="capacity"):
        e.add_request([1] * (e.cache.capacity_tokens + 1), PARAMS)


def test_a_host_pool_larger_than_the_machine_is_refused_before_allocating(llama, tokenizer, monkeypatch):
    from hisparse.memory import hisparse_pools

    monkeypatch.setattr(hisparse_pools, "available_host_memory", lambda: 1 << 20)
    with pytest.raises(ValueError, match="host pool needs .* GiB available; lower host_to_device_ratio"):
        hisparse_engine(llama, tokenizer)
    monkeypatch.undo()
    assert hisparse_pools.available_host_memory() > 1 << 30  # the real figure, read from /proc/meminfo


def test_a_budget_eaten_by_the_ratio_says_so(llama, tokenizer):
    # Each hot slot pays for host_to_device_ratio tokens' indexer keys: a huge ratio leaves no buffer.
    with pytest.raises(ValueError, match=r"host_to_device_ratio \(5000\) tokens; raise the budget or lower"):
        engine(llama, tokenizer, enable_hisparse=True, device_kv_budget=BUDGET,
               hisparse_config={"device_buffer_size": BUFFER, "host_to_device_ratio": 5000})


def test_slot_tables_have_no_more_rows_than_requests_can_be_admitted(llama, tokenizer, prompts):
    # Each request holds a device slot, so a huge max_running_requests must not size the tables (host_rows
    # alone is rows x max_context int64: 65 GB for a million rows).
    e = hisparse_engine(llama, tokenizer, max_running_requests=10**6)
    assert e.cache.row_allocator.num_slots == e.cache.device_slots < 10**6
    generate(e, prompts[:2])
    assert_all_free(e)


def test_a_failed_allocation_gives_back_what_it_took(llama, tokenizer, prompts, monkeypatch):
    e = hisparse_engine(llama, tokenizer)
    monkeypatch.setattr(e.cache.host_allocator, "allocate", lambda n: (_ for _ in ()).throw(RuntimeError("full")))
    with pytest.raises(RuntimeError, match="full"):
        e.cache.allocate(100)
    monkeypatch.undo()
    assert_all_free(e)
    with pytest.raises(ValueError, match="record_topk"):
        e.add_request(prompts[0], PARAMS, record_topk=True)
    assert_all_free(e)


@pytest.mark.parametrize("value, field", [
    ("{", "JSON"), ('{"top_k": 8, "buffer": 3}', "'buffer'"), ('{"top_k": "8"}', "top_k"),
    ('{"top_k": 8, "device_buffer_size": 4}', "device_buffer_size"), ('{"host_to_device_ratio": 0}', "ratio"),
    ('{"eviction_policy": "mru"}', "eviction_policy"), ("[1]", "object"),
])
def test_bad_hisparse_config_names_the_problem(value, field):
    with pytest.raises(ValueError, match=field):
        HiSparseConfig.parse(value)


def test_config_defaults_follow_the_reference():
    config = HiSparseConfig.parse('{"top_k": 2048}')
    assert config.device_buffer_size == 4096 and config.eviction_policy == "auto"
    assert config.policy_for("cpu") == "lru" and config.policy_for("cuda:0") == "lrfu"
    assert HiSparseConfig.parse('{"eviction_policy": "fifo"}').policy_for("cuda") == "fifo"
    with pytest.raises(ValueError, match="enable_hisparse"):
        EngineConfig(hisparse_config={"top_k": 8})
