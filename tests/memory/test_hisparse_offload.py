"""HiSparse on the real model: offloading changes no result, the page table matches the buffer, nothing leaks.

top_k and the hot buffer are set small (32 / 48 slots) so that contexts of a few hundred tokens are
several times the buffer and misses really happen, while the suite stays fast.
The last tests drive the pools on their own (no model): sizing and admission edges, the newest token's
reserved slot, counters, and a batch mixing fast-path and swapping requests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hisparse import SamplingParams
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.formats.index_key import IndexKeyFormat
from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.memory.hisparse_pools import HiSparsePools, PoolSizing
from hisparse.memory.slot_allocator import SlotAllocator

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
    """Nothing held once the prefix cache is flushed."""
    assert e.flush_cache()
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
    assert stats["bytes_host_to_device"] == stats["misses"] * e.cache.layout.row_width * 4
    assert_all_free(e)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])
def test_offloading_changes_no_result_in_bfloat16(llama_bf16, tokenizer, prompts, kv_cache_dtype):
    """The default dtype on CPUs with native bfloat16, with its K/V in a bfloat16 cache ("auto": 2-byte rows
    swapped in) and in a float32 one, which holds the bfloat16 K/V exactly."""
    e = hisparse_engine(llama_bf16, tokenizer, kv_cache_dtype=kv_cache_dtype)
    assert generate(e, prompts) == generate(engine(llama_bf16, tokenizer, kv_cache_dtype=kv_cache_dtype), prompts)
    stats = e.stats_dict()["swap_in"]
    width = 2 if kv_cache_dtype == "auto" else 4
    assert stats["misses"] > 0 and stats["bytes_host_to_device"] == stats["misses"] * e.cache.layout.row_width * width
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
        generate(e, [prompt[i:] for i in range(8)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert base.scheduler.peak_running == base.cache.capacity_tokens // per_request_baseline
    assert hs.scheduler.peak_running > 2 * base.scheduler.peak_running
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


# -- the pools on their own: small tables, no model ------------------------------------------------------

POOL_BUFFER, POOL_TOP_K, POOL_ROW = 4, 2, 3  # hot slots, selected per step, float32 elements per row


def small_pools(policy: str = "lru", device_slots: int = 32, max_requests: int = 4, max_context: int = 16):
    """One layer, rows of 3 floats, float32 indexer keys of 4 dims, `device_slots` hot rows bought exactly."""
    config = HiSparseConfig(top_k=POOL_TOP_K, device_buffer_size=POOL_BUFFER, host_to_device_ratio=2,
                            eviction_policy=policy)
    key = IndexKeyFormat("float32", 4)
    cell = 1 * (POOL_ROW * 4 + config.host_to_device_ratio * key.row_bytes)
    return HiSparsePools(1, POOL_ROW, torch.float32, key, config, device_slots * cell, max_requests, max_context)


def write_context(pools, alloc, length: int) -> None:
    """Host row of position p := (row, p, p) for p < length, as prefill and decode write them."""
    for p in range(length):
        pools.host_kv[0, int(alloc.host_rows[p])] = torch.tensor([alloc.row, p, p], dtype=torch.float32)


def test_pool_sizing_buys_exactly_one_buffer_and_its_reserved_slot():
    config = HiSparseConfig(top_k=POOL_TOP_K, device_buffer_size=POOL_BUFFER)
    cell = PoolSizing(1, 12, 16, config, 0).cell_bytes
    PoolSizing(1, 12, 16, config, (POOL_BUFFER + 1) * cell).check("cpu", 16)
    with pytest.raises(ValueError, match="fewer than one request's buffer"):
        PoolSizing(1, 12, 16, config, (POOL_BUFFER + 1) * cell - 1).check("cpu", 16)


def test_a_buffer_that_holds_the_whole_context_is_refused():
    """With the newest token's reserved slot, a buffer of context - 1 already holds every token."""
    small_pools(max_context=POOL_BUFFER + 2)
    with pytest.raises(ValueError, match=r"device_buffer_size \(4\) must be at most 3 for a context of 5 tokens"):
        small_pools(max_context=POOL_BUFFER + 1)


def test_a_request_that_fits_its_buffer_takes_no_reserved_slot():
    pools = small_pools(device_slots=POOL_BUFFER + 1)
    fits = pools.allocate(POOL_BUFFER)  # never outgrows its buffer: no slot for a newest token beyond it
    assert fits.device_rows.size == POOL_BUFFER and pools.usage()["device_slots_used"] == POOL_BUFFER
    assert pools.can_allocate(1) and not pools.can_allocate(2)
    pools.free(fits)
    grows = pools.allocate(POOL_BUFFER + 1)
    assert grows.device_rows.size == POOL_BUFFER + 1 and not pools.can_allocate(1)
    pools.free(grows)
    assert pools.usage()["device_slots_used"] == 0


def test_admission_is_refused_when_the_slot_tables_have_no_free_row():
    pools = small_pools(device_slots=64, max_requests=1)
    alloc = pools.allocate(8)
    assert pools.device_allocator.num_free >= 8 and pools.host_allocator.num_free >= 8
    assert not pools.can_allocate(1)  # device, host and indexer slots are left, but no row
    pools.free(alloc)
    assert pools.can_allocate(1)


def test_freeing_a_slot_twice_in_one_call_is_refused_and_changes_nothing():
    allocator = SlotAllocator(4)
    slots = allocator.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        allocator.free(np.array([slots[0], slots[0]]))
    assert allocator.num_free == 2
    allocator.free(slots)
    assert allocator.num_free == 4 and sorted(allocator.allocate(4).tolist()) == [0, 1, 2, 3]


@settings(max_examples=50, deadline=None)
@example(ops=[(True, 2), (False, 1), (False, 0)])
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=30))
def test_slots_are_never_handed_out_twice_and_a_freed_slot_cannot_be_freed_again(ops):
    """Random allocations and frees (a chunk of what is held): no slot is ever held by two owners, and giving
    back a slot already given back by an earlier call is refused (a request released twice would otherwise
    hand its slots to two new requests)."""
    allocator = SlotAllocator(8)
    held: list[int] = []
    freed: list[int] = []
    for allocate, n in ops:
        if allocate and n <= allocator.num_free:
            got = allocator.allocate(n).tolist()
            assert not set(got) & set(held) and len(set(got)) == n
            held += got
        elif not allocate:
            stale = [s for s in freed if s not in held]  # given back and not handed out since
            if n == 0 and stale:
                with pytest.raises(ValueError, match="double free"):
                    allocator.free(np.array(stale[:1]))
            else:
                chunk, held = held[:n], held[n:]
                allocator.free(np.array(chunk, dtype=np.int64))
                freed += chunk
        assert allocator.num_used == len(held)
    allocator.free(np.array(held, dtype=np.int64))
    assert sorted(allocator.allocate(8).tolist()) == list(range(8))


@pytest.mark.parametrize("prompt", [POOL_BUFFER - 1, POOL_BUFFER, POOL_BUFFER + 3])
def test_the_newest_position_reads_its_reserved_row_and_costs_no_swap_in(prompt):
    """Prompts shorter than, exactly as long as and longer than the buffer, decoded until each has outgrown it:
    every selected position reads its own row (the newest from the reserved slot, where the forward pass wrote
    it), and only older positions missing from the buffer count as misses."""
    pools = small_pools()
    alloc = pools.allocate(prompt + 6)
    write_context(pools, alloc, prompt)
    for start in range(prompt, prompt + 6):
        write_context(pools, alloc, start + 1)  # the newest token's row, written to the host pool...
        step = pools.begin_decode([alloc], [start])
        # the prompt's tail (at most a buffer's worth) was copied in once, before the first step
        assert pools.counters.prompt_load_bytes == min(prompt, POOL_BUFFER) * POOL_ROW * 4
        pools.device_kv[0, step.device_write] = pools.host_kv[0, int(alloc.host_rows[start])]  # ...and the device
        selected = torch.tensor([[start - 1, start, 0]])
        before = pools.counters.as_dict()
        page = pools.page_table(0, step, selected)
        rows = pools.device_kv[0, page[0]]
        assert rows[:, 1].tolist() == selected[0].float().tolist(), f"step at {start}: a column reads another row"
        if start >= POOL_BUFFER:
            assert int(page[0, 1]) == int(alloc.device_rows[-1])  # the reserved slot
            after = pools.counters.as_dict()
            held = {int(p) for p in pools.slot_pos[0, alloc.row] if p >= 0}
            assert start not in held, "the newest position was swapped into a hot slot"
            assert after["hits"] + after["misses"] - before["hits"] - before["misses"] == 2
    pools.free(alloc)


def test_fast_path_lookups_count_selected_positions_not_padding():
    pools = small_pools()
    alloc = pools.allocate(POOL_BUFFER)
    write_context(pools, alloc, 3)
    step = pools.begin_decode([alloc], [2])
    pools.page_table(0, step, torch.tensor([[0, 2, -1, -1]]))
    assert pools.counters.as_dict()["fast_path_lookups"] == 2


def test_a_mixed_step_gives_each_swapping_request_its_own_runners_up():
    """A batch with a request still on the fast path first: the swapping request's policy must read its own
    next-ranked positions, as when it steps alone."""
    states = []
    for together in (True, False):
        pools = small_pools("score_lru")
        short, long = pools.allocate(8), pools.allocate(12)
        write_context(pools, short, 2)
        write_context(pools, long, 9)
        allocs, starts = ([short, long], [1, 8]) if together else ([long], [8])
        step = pools.begin_decode(allocs, starts)
        # the long request holds 4..7 and ranks 6 and 7; the short one's runners-up are other positions it holds
        selected = torch.tensor([[0, 1]] * together + [[2, 8]])
        next_ranked = torch.tensor([[5, 4, 7, 6]] * together + [[6, 7, -1, -1]])
        pools.page_table(0, step, selected, next_ranked)
        states.append((pools.slot_pos[0, long.row].clone(), pools.lru[0, long.row].clone(),
                       pools.policies[0].state["age"][long.row].clone()))
    for mixed, alone in zip(*states, strict=True):
        assert torch.equal(mixed, alone)
