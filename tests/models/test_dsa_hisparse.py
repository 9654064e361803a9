"""HiSparse on the DSA models through the engine: the packed latent rows offloaded change no token, nothing
leaks after finish or abort, and admission follows the reference's sizing.

Tiny random DeepSeek-V3.2 and GLM-5 checkpoints (kv_lora_rank 128 so that the FP8 latent layout applies,
index_topk 8) with a hot buffer of 16 slots and three requests decoded together, whose contexts reach
2.5-4.5x the buffer: one prompt longer than the buffer (loaded tail, then misses), one exactly as long (the
take-over edge), one shorter (fast path, then the take-over mid-decode).
"""

from __future__ import annotations

import pytest
import torch
from dsa_checkpoints import TINY, build_checkpoint

from hisparse import SamplingParams
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.models.deepseek_v32 import load_dsa_model

TOP_K, BUFFER, RATIO = 8, 16, 4
KV_LORA = 128
PROMPTS = (40, 16, 10)  # tokens; see the module docstring
NEW_TOKENS = 32
BUDGET = 200_000  # bytes: 154-216 hot slots here, room for the three requests' buffers
ROW_BYTES = {"bfloat16": 2 * (KV_LORA + TINY["qk_rope_head_dim"]),  # 288, as 1152 for 512 + 64
             "fp8_e4m3": KV_LORA + 4 + 2 * TINY["qk_rope_head_dim"]}  # 164, as 656 for 512 + 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_shared"])
def model(request, tmp_path_factory):
    """glm_shared: GLM-5 with a layer that reuses the previous layer's top-k (its own hot buffer still
    swaps in)."""
    path = tmp_path_factory.mktemp(request.param)
    build_checkpoint(request.param, path, index_topk=TOP_K, kv_lora_rank=KV_LORA)
    return load_dsa_model(path)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in PROMPTS]


def engine_for(model, tokenizer, hisparse: dict | None = None, budget: int = BUDGET, **config) -> LLMEngine:
    config = EngineConfig(dtype="float32", device_kv_budget=budget, enable_hisparse=hisparse is not None,
                          hisparse_config=hisparse, **config)
    return LLMEngine(config, model=model, tokenizer=tokenizer)


def assert_hot_rows_are_host_rows(cache, requests) -> int:
    """Every position a hot slot claims to hold has exactly its host-pool bytes there."""
    checked = 0
    for request in requests:
        alloc = request.kv
        if alloc is None or not alloc.buffered:
            continue
        for layer in range(cache.num_layers):
            slot_pos = cache.slot_pos[layer, alloc.row]
            held = slot_pos >= 0
            positions = slot_pos[held].long()
            assert positions.unique().numel() == positions.numel()
            assert sorted(cache.lru[layer, alloc.row].tolist()) == list(range(BUFFER))
            device = cache.device_kv[layer, cache.device_rows[alloc.row][held]]
            assert torch.equal(device, cache.host_kv[layer, torch.from_numpy(alloc.host_rows)[positions]])
            checked += positions.numel()
    return checked


def assert_all_free(cache) -> None:
    """Nothing held once the prefix cache is flushed."""
    assert cache.prefix.flush()
    usage = cache.usage()
    assert usage["device_slots_used"] == usage["host_slots_used"] == usage["indexer_slots_used"] == 0
    assert cache.row_allocator.num_used == 0
    assert (cache.slot_pos == -1).all()


def run(engine, ps, check=None) -> list[list[int]]:
    requests = [engine.add_request(p, GREEDY) for p in ps]
    while engine.has_unfinished:
        engine.step()
        if check is not None:
            check(requests)
    return [r.output_token_ids for r in requests]


@pytest.mark.parametrize("kv_cache_dtype, backend, policy",
                         [("bfloat16", "cpu", "auto"), ("fp8_e4m3", "reference", "auto"),
                          ("fp8_e4m3", "cpu", "lrfu")])
def test_offloading_changes_no_token(model, tokenizer, kv_cache_dtype, backend, policy):
    ps = prompts()
    base_tokens = run(engine_for(model, tokenizer, kv_cache_dtype=kv_cache_dtype), ps)
    hisparse = {"device_buffer_size": BUFFER, "host_to_device_ratio": RATIO, "eviction_policy": policy}
    engine = engine_for(model, tokenizer, hisparse, kv_cache_dtype=kv_cache_dtype, swap_in_backend=backend)
    cache = engine.cache
    assert cache.config.top_k == TOP_K and cache.row_bytes == ROW_BYTES[kv_cache_dtype]
    checked = []
    tokens = run(engine, ps, lambda requests: checked.append(assert_hot_rows_are_host_rows(cache, requests)))

    assert tokens == base_tokens
    stats = cache.counters.as_dict()
    assert stats["misses"] > 0 and stats["hits"] > 0 and stats["evictions"] > 0
    assert stats["fast_path_lookups"] > 0  # the short prompt decoded on the fast path first
    assert stats["bytes_host_to_device"] == stats["misses"] * ROW_BYTES[kv_cache_dtype]
    assert min(stats["per_layer"]["misses"]) > 0  # every layer swaps in, GLM's shared one included
    assert max(checked) == len(ps) * cache.num_layers * BUFFER  # every hot slot of every request, checked
    assert_all_free(cache)


def test_an_aborted_request_leaves_nothing_behind(model, tokenizer):
    engine = engine_for(model, tokenizer, {"device_buffer_size": BUFFER, "host_to_device_ratio": RATIO})
    ps = prompts()
    requests = [engine.add_request(p, GREEDY) for p in ps]
    for _ in range(8):  # prompts done, a few decode steps in, the long one swapping in
        engine.step()
    assert requests[0].kv.buffered
    for request in requests[:2]:
        engine.abort(request.request_id)
    waiting = engine.add_request(ps[0], GREEDY)  # queued behind the one still running
    while engine.has_unfinished:
        engine.step()
    assert [r.finish_reason for r in (*requests, waiting)] == ["abort", "abort", "length", "length"]
    assert_all_free(engine.cache)


def test_lrfu_gets_the_indexers_runners_up_at_every_swapping_decode_step(model, tokenizer):
    """The backend asks the indexer for as many runners-up as the policy reads and hands them to the swap-in
    with each decode step's selection: past positions, distinct, none of them selected, padding last; with
    none asked (lru) it computes none."""
    ps = prompts()
    for policy, wanted in (("lrfu", 2 * TOP_K), ("lru", 0)):
        engine = engine_for(model, tokenizer, {"device_buffer_size": BUFFER, "host_to_device_ratio": RATIO,
                                               "eviction_policy": policy})
        cache = engine.cache
        assert cache.num_next_ranks == wanted
        seen = []
        for bound in cache.swap_in:
            def spy(selected, rows, newest, reserved, next_ranked=None, _inner=bound.page_table, _seen=seen):
                _seen.append(None if next_ranked is None else tuple(next_ranked.shape))
                if next_ranked is not None:
                    for b in range(selected.shape[0]):
                        ranked = next_ranked[b].tolist()
                        valid = [p for p in ranked if p >= 0]
                        assert valid and ranked == valid + [-1] * (len(ranked) - len(valid))
                        assert len(set(valid)) == len(valid) and max(valid) <= int(newest[b])
                        assert not set(valid) & set(selected[b].tolist())
                return _inner(selected, rows, newest, reserved, next_ranked)
            bound.page_table = spy
        run(engine, ps)
        assert seen and {shape[1] if shape else 0 for shape in seen} == {wanted}


def test_admission_follows_the_reference_sizing(model, tokenizer):
    """cell = layers x (latent row + ratio x indexer key); hot buffers bound the device, the full latent the
    host pool. The same budget holding whole latent caches on the device fits far fewer."""
    total, budget, ratio = 80, 120_000, 8  # 80 tokens per request: 5x the buffer
    engine = engine_for(model, tokenizer, {"device_buffer_size": BUFFER, "host_to_device_ratio": ratio},
                        budget=budget, kv_cache_dtype="bfloat16")
    cache = engine.cache
    layers, index_bytes = model.config.num_hidden_layers, TINY["index_head_dim"] + 4  # 132 for 128 dims
    assert cache.cell_bytes == layers * (ROW_BYTES["bfloat16"] + ratio * index_bytes)
    assert cache.device_slots == budget // cache.cell_bytes
    assert cache.logical_capacity == ratio * cache.device_slots

    admitted = []
    while cache.can_allocate(total):
        admitted.append(cache.allocate(total))
    # here the hot buffers (buffer + the reserved slot each) are what runs out
    assert len(admitted) == cache.device_slots // (BUFFER + 1) < cache.logical_capacity // total
    baseline = engine_for(model, tokenizer, budget=budget, kv_cache_dtype="bfloat16").cache.capacity_tokens // total
    assert baseline == budget // (layers * (ROW_BYTES["bfloat16"] + index_bytes)) // total
    assert len(admitted) >= 2 * baseline > 0
    cache.free(admitted.pop())
    admitted.append(cache.allocate(total))  # what a request gives back, the next one gets
    for alloc in admitted:
        cache.free(alloc)
    assert_all_free(cache)


def test_bad_configs_are_named(model, tokenizer):
    with pytest.raises(ValueError, match="budget"):
        engine_for(model, tokenizer, {"device_buffer_size": BUFFER}, budget=1000)
    with pytest.raises(ValueError, match="device_buffer_size"):  # the model's index_topk (8) wins over top_k
        engine_for(model, tokenizer, {"top_k": 4, "device_buffer_size": 6})
    engine = engine_for(model, tokenizer, {"top_k": 4})  # a buffer left to its default follows index_topk
    assert (engine.cache.config.top_k, engine.cache.config.device_buffer_size) == (TOP_K, 2 * TOP_K)
    with pytest.raises(ValueError, match="context length of 256"):
        engine.add_request([1] * 250, GREEDY)
    assert_all_free(engine.cache)


def test_a_dense_layer_that_a_shared_layer_follows_is_refused_at_start(model, tokenizer):
    """A dense layer selects nothing, so a shared layer after it would have no top-k to reuse."""
    if not model.config.indexer_spec().shared_layers:
        pytest.skip("the architecture has no shared layers")
    with pytest.raises(ValueError, match="dense_layers has layer 0, whose top-k the shared layer 1 reuses"):
        engine_for(model, tokenizer, dense_layers=(0,))
    run(engine_for(model, tokenizer, dense_layers=(0, 1)), prompts()[:1])  # both dense: nothing to reuse
