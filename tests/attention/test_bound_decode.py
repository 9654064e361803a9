"""A decode step's attention bound once (`bind_decode` of both backends) against the backend's `attend`, layer by
layer: the same outputs, the same pools, tables and counters after every step, swap-ins and evictions included; and
the steps it does not take are left to `attend`."""

from __future__ import annotations

import pytest
import torch

from hisparse import SamplingParams
from hisparse.attention.hisparse import HiSparseKVCache
from hisparse.attention.paged import PagedKVCache
from hisparse.engine.request import Request
from hisparse.formats.forward_batch import ForwardBatch
from hisparse.formats.index_key import IndexKeyFormat
from hisparse.formats.kv_layout import KVLayout
from hisparse.formats.sparse_attention import SparseAttention
from hisparse.kernels import decode_attention_cpu, index_scores_cpu, kv_rows_cpu, lru_page_table_cpu, page_rows_cpu
from hisparse.kernels.page_rows_cpu import bind_page_rows
from hisparse.memory.hisparse_config import HiSparseConfig

pytestmark = pytest.mark.skipif(not all(k.available() for k in (decode_attention_cpu, index_scores_cpu, kv_rows_cpu,
                                                                  lru_page_table_cpu, page_rows_cpu)),
                                reason="no gcc here")

LAYERS, HQ, HKV, D, HI, DI = 3, 4, 2, 16, 3, 64
TOP_K, BUFFER = 8, 12
SWAPPING = (30, 45, 20)  # every one past the buffer: each step swaps in for all of them
FAST = (5, 4, 3)  # every one within the buffer all along, passing top_k midway
STEPS = 6


def hisparse_cache(dtype: torch.dtype, policy: str = "lru") -> HiSparseKVCache:
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, dtype=dtype)
    config = HiSparseConfig(top_k=TOP_K, device_buffer_size=BUFFER, eviction_policy=policy)
    return HiSparseKVCache(layout, config, 8 << 20, SparseAttention(IndexKeyFormat("int8", DI), True, TOP_K),
                           max_requests=4, max_context=128, scale=D**-0.5)


def paged_cache(dtype: torch.dtype, sparse: bool = True, dense_layers: tuple[int, ...] = ()) -> PagedKVCache:
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, dtype=dtype)
    return PagedKVCache(layout, 512, D**-0.5, sparse=SparseAttention(IndexKeyFormat("int8", DI), True, TOP_K,
                                                                     dense_layers) if sparse else None)


def step_buffers(n: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a model's decode step keeps: q, k, v as slices of one projection's rows, the indexer's float32 outputs."""
    qkv = torch.empty(n, HQ + 2 * HKV, D, dtype=dtype)
    return {"q": qkv[:, :HQ], "k": qkv[:, HQ:HQ + HKV], "v": qkv[:, HQ + HKV:], "index_q": torch.empty(n, HI, DI),
            "index_k": torch.empty(n, DI), "index_w": torch.empty(n, HI)}


def fill(buffers: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    for t in buffers.values():
        t.copy_(torch.randn(t.shape, generator=gen))


def decode(make_cache, bound: bool, prompts, record: bool = False):
    """Prefill the prompts, then STEPS decode steps of all of them: every layer's output, the cache, its requests
    and whether each step was bound."""
    gen = torch.Generator().manual_seed(0)
    cache = make_cache()
    dtype = cache.layout.dtype
    requests = [Request(list(range(1, n + 1)), SamplingParams(max_tokens=STEPS + 1)) for n in prompts]
    for r in requests:
        r.record_topk = record
        cache.admit(r)
    prefill = cache.bind(ForwardBatch.build([(r, r.num_prompt_tokens) for r in requests]))
    buffers = step_buffers(sum(prompts), dtype)
    for layer in range(LAYERS):
        fill(buffers, gen)
        prefill.attend(layer, **buffers)
    outputs, took = [], []
    for _ in range(STEPS):
        for r in requests:
            r.num_computed_tokens = r.num_prompt_tokens + len(r.output_token_ids)
            r.output_token_ids.append(7)
        backend = cache.bind(ForwardBatch.build([(r, 1) for r in requests]))
        buffers, out = step_buffers(len(requests), dtype), torch.empty(len(requests), HQ, D, dtype=dtype)
        attend = backend.bind_decode(**buffers, out=out) if bound else None
        took.append(attend is not None)
        for layer in range(LAYERS):
            fill(buffers, gen)
            if attend is not None:
                attend(layer)
                outputs.append(out.clone())
            else:
                outputs.append(backend.attend(layer, **buffers))
    return outputs, cache, requests, took


def assert_same_outputs(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"step {i // LAYERS}, layer {i % LAYERS}"


def written_host_rows(cache: HiSparseKVCache, requests: list[Request]) -> torch.Tensor:
    """The host rows of the requests' positions so far, as bytes (the rest of the pool is never written)."""
    rows = torch.cat([torch.from_numpy(r.kv.host_rows[:r.num_computed_tokens + 1]) for r in requests])
    return cache.host_kv[:, rows].view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prompts", [SWAPPING, FAST], ids=["swapping", "fast path"])
def test_bound_hisparse_steps_compute_and_store_what_attend_does(dtype, prompts):
    ours, bound_cache, bound_requests, took = decode(lambda: hisparse_cache(dtype), True, prompts)
    theirs, cache, requests, _ = decode(lambda: hisparse_cache(dtype), False, prompts)
    assert all(took)
    assert_same_outputs(ours, theirs)
    assert torch.equal(bound_cache.device_kv, cache.device_kv)
    assert torch.equal(written_host_rows(bound_cache, bound_requests), written_host_rows(cache, requests))
    assert torch.equal(bound_cache.index_cache.rows, cache.index_cache.rows)
    for layer in range(LAYERS):
        assert torch.equal(bound_cache.slot_pos[layer], cache.slot_pos[layer])
        assert torch.equal(bound_cache.lru[layer], cache.lru[layer])
    counts, want = counts_of(bound_cache), counts_of(cache)
    if prompts == SWAPPING:
        assert counts["misses"] > 0 and counts["evictions"] > 0  # the steps swapped in, and evicted
    else:
        assert counts["fast_path_lookups"] > 0 and counts["misses"] == 0
    assert counts == want


def counts_of(cache: HiSparseKVCache) -> dict:
    """The counters but their timings."""
    counts = cache.counters.as_dict()
    counts["per_layer"].pop("swap_in_seconds")
    return {k: v for k, v in counts.items() if "seconds" not in k}


@pytest.mark.parametrize("prompts,policy,bound", [
    ((30, 10, 20), "lru", [False, False, True, True, True, True]),  # one on the fast path until it outgrows it
    (SWAPPING, "score_lru", [False] * STEPS),  # a policy that reads the runners-up
])
def test_hisparse_steps_it_cannot_bind_are_left_to_attend(prompts, policy, bound):
    ours, _, _, took = decode(lambda: hisparse_cache(torch.bfloat16, policy), True, prompts)
    theirs, _, _, _ = decode(lambda: hisparse_cache(torch.bfloat16, policy), False, prompts)
    assert took == bound
    assert_same_outputs(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sparse,dense_layers", [(True, ()), (True, (1,)), (False, ())],
                         ids=["sparse", "a dense layer", "no indexer"])
def test_bound_baseline_steps_compute_and_store_what_attend_does(dtype, sparse, dense_layers):
    """Contexts of 5 to 50 tokens: some within top_k (every position, unscored), most past it (selected)."""
    prompts = (5, 44, 20)
    ours, bound_cache, _, took = decode(lambda: paged_cache(dtype, sparse, dense_layers), True, prompts)
    theirs, cache, _, _ = decode(lambda: paged_cache(dtype, sparse, dense_layers), False, prompts)
    assert all(took)
    assert_same_outputs(ours, theirs)
    assert torch.equal(bound_cache.kv, cache.kv)
    if sparse:
        assert torch.equal(bound_cache.index_cache.rows, cache.index_cache.rows)


def test_a_step_that_records_its_top_k_is_left_to_attend():
    ours, _, requests, took = decode(lambda: paged_cache(torch.bfloat16), True, (5, 44), record=True)
    theirs, _, _, _ = decode(lambda: paged_cache(torch.bfloat16), False, (5, 44), record=True)
    assert not any(took) and all(len(r.topk_trace) == STEPS for r in requests)
    assert_same_outputs(ours, theirs)


def test_page_rows_looks_selected_positions_up_and_refuses_others():
    selected = torch.tensor([[0, 3, 11], [2, -1, -1]])
    page = torch.empty_like(selected)
    look_up = bind_page_rows(torch.arange(24).view(2, 12) * 10, selected, page)  # a table no one else holds
    torch.full((2, 12), 99)  # would take the table's memory, were it freed
    assert look_up() == 4
    assert page.tolist() == [[0, 30, 110], [140, -1, -1]]
    table = torch.arange(24).view(2, 12) * 10
    for bad in (12, -2):
        selected[1, 1] = bad
        page.fill_(7)
        with pytest.raises(ValueError, match=r"outside \[-1, 12\)"):
            bind_page_rows(table, selected, page)()
        assert (page == 7).all()
    with pytest.raises(ValueError, match="page_rows takes"):
        bind_page_rows(table, selected.int(), page)


def test_a_layer_outside_the_pools_is_refused():
    cache = hisparse_cache(torch.bfloat16)
    requests = [Request(list(range(1, 31)), SamplingParams(max_tokens=4))]
    cache.admit(requests[0])
    buffers = step_buffers(30, torch.bfloat16)
    prefill = cache.bind(ForwardBatch.build([(requests[0], 30)]))
    for layer in range(LAYERS):
        fill(buffers, torch.Generator().manual_seed(layer))
        prefill.attend(layer, **buffers)
    requests[0].num_computed_tokens = 30
    requests[0].output_token_ids.append(7)
    attend = cache.bind(ForwardBatch.build([(requests[0], 1)])).bind_decode(
        **step_buffers(1, torch.bfloat16), out=torch.empty(1, HQ, D, dtype=torch.bfloat16))
    before = written_host_rows(cache, requests).clone()
    with pytest.raises(IndexError, match=f"layer {LAYERS} is not one of the pool's {LAYERS}"):
        attend(LAYERS)
    assert torch.equal(written_host_rows(cache, requests), before)
