"""HiSparse on the DSA models: the packed latent rows offloaded change no result, nothing leaks, and
admission follows the reference's sizing.

Tiny random DeepSeek-V3.2 and GLM-5 checkpoints (kv_lora_rank 128 so that the FP8 latent layout
applies, index_topk 8) with a hot buffer of 16 slots, and three sequences open at once, decoded in turn,
whose contexts reach 2.5-4.5x the buffer: one prompt longer than the buffer (loaded tail, then misses),
one exactly as long (the take-over edge), one shorter (fast path, then the take-over mid-decode).
"""

from __future__ import annotations

import pytest
import torch
from test_dsa_parity import TINY, build_checkpoint

from hisparse.layers.dsa_indexer import IndexKeyFormat
from hisparse.memory.hisparse_latent_cache import HiSparseLatentCache
from hisparse.models.deepseek_v32 import load_dsa_model

TOP_K, BUFFER, RATIO = 8, 16, 4
KV_LORA = 128
PROMPTS = (40, 16, 10)  # tokens; see the module docstring
NEW_TOKENS = 32
MAX_CONTEXT = 96
BUDGET = 200_000  # bytes: 154-216 hot slots here, room for the three sequences' buffers
ROW_BYTES = {"bfloat16": 2 * (KV_LORA + TINY["qk_rope_head_dim"]),  # 288, as 1152 for 512 + 64
             "fp8": KV_LORA + 4 + 2 * TINY["qk_rope_head_dim"]}  # 164, as 656 for 512 + 64


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


def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in PROMPTS]


def interleaved_greedy(model, caches: list, prompts: list[torch.Tensor]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt, then decode the sequences in turn, one token each per round. Returns the
    tokens and the logits [1 + NEW_TOKENS, vocab] that chose them, per sequence."""
    logits = [[model(p, torch.arange(len(p)), c, last_only=True)] for p, c in zip(prompts, caches, strict=True)]
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(NEW_TOKENS):
        for i, (p, c) in enumerate(zip(prompts, caches, strict=True)):
            tokens[i].append(int(logits[i][-1][-1].argmax()))
            position = len(p) + len(tokens[i]) - 1
            logits[i].append(model(torch.tensor(tokens[i][-1:]), torch.tensor([position]), c))
    return tokens, [torch.cat(per) for per in logits]


def assert_hot_rows_are_host_rows(cache: HiSparseLatentCache, sequences) -> int:
    """Every position a hot slot claims to hold has exactly its host-pool bytes there."""
    checked = 0
    for seq in sequences:
        row = seq.alloc.row
        for layer in range(cache.num_layers):
            slot_pos = cache.slot_pos[layer, row]
            held = slot_pos >= 0
            positions = slot_pos[held].long()
            assert positions.unique().numel() == positions.numel()
            assert sorted(cache.lru[layer, row].tolist()) == list(range(BUFFER))
            device = cache.device_kv[layer, cache.device_rows[row][held]]
            assert torch.equal(device, cache.host_kv[layer, seq.host_rows[positions]])
            checked += positions.numel()
    return checked


def assert_all_free(cache: HiSparseLatentCache) -> None:
    usage = cache.usage()
    assert usage["device_slots_used"] == usage["host_slots_used"] == usage["indexer_slots_used"] == 0
    assert cache.row_allocator.num_used == 0
    assert (cache.slot_pos == -1).all()


@pytest.mark.parametrize("latent_kind, backend, policy",
                         [("bfloat16", "cpu", "auto"), ("fp8", "reference", "auto"), ("bfloat16", "cpu", "lrfu")])
def test_offloading_changes_no_result(model, latent_kind, backend, policy):
    ps = prompts()
    baseline = [model.new_cache(MAX_CONTEXT, latent_kind, "fp8") for _ in ps]
    base_tokens, base_logits = interleaved_greedy(model, baseline, ps)

    cache = HiSparseLatentCache.for_model(
        model, {"device_buffer_size": BUFFER, "host_to_device_ratio": RATIO, "eviction_policy": policy},
        budget_bytes=BUDGET, max_sequences=4, max_context=MAX_CONTEXT, latent_kind=latent_kind,
        swap_in_backend=backend)
    assert cache.config.top_k == TOP_K and cache.row_bytes == ROW_BYTES[latent_kind]
    sequences = [cache.open(len(p) + NEW_TOKENS) for p in ps]
    tokens, logits = interleaved_greedy(model, sequences, ps)

    assert tokens == base_tokens
    for ours, theirs in zip(logits, base_logits, strict=True):
        assert torch.equal(ours, theirs)  # the same bytes are read, in the same order
    stats = cache.counters.as_dict()
    assert stats["misses"] > 0 and stats["hits"] > 0 and stats["evictions"] > 0
    assert stats["fast_path_lookups"] > 0  # the short prompt decoded on the fast path first
    assert stats["bytes_host_to_device"] == stats["misses"] * ROW_BYTES[latent_kind]
    assert min(stats["per_layer"]["misses"]) > 0  # every layer swaps in, GLM's shared one included
    assert assert_hot_rows_are_host_rows(cache, sequences) == len(ps) * cache.num_layers * BUFFER
    for seq in sequences:
        cache.close(seq)
    assert_all_free(cache)


def test_lrfu_gets_the_model_indexers_runners_up_at_every_swapping_decode_step(model):
    """The model asks the sequence how many runners-up its policy reads and hands them to `locate` with
    each decode step's selection: past positions, distinct, none of them selected, padding last (their
    ranking is `select_runners_up`'s test); with none asked (lru) it computes none."""
    ps = prompts()
    for policy, wanted in (("lrfu", 2 * TOP_K), ("lru", 0)):
        cache = HiSparseLatentCache.for_model(
            model, {"device_buffer_size": BUFFER, "host_to_device_ratio": RATIO, "eviction_policy": policy},
            budget_bytes=BUDGET, max_sequences=4, max_context=MAX_CONTEXT)
        assert cache.num_next_ranks == wanted
        seen = []
        for bound in cache.swap_in:
            def spy(selected, rows, newest, reserved, next_ranked=None, _inner=bound.page_table, _seen=seen):
                _seen.append(None if next_ranked is None else tuple(next_ranked.shape))
                if next_ranked is not None:
                    ranked = next_ranked[0].tolist()
                    valid = [p for p in ranked if p >= 0]
                    assert valid and ranked == valid + [-1] * (len(ranked) - len(valid))
                    assert len(set(valid)) == len(valid) and max(valid) <= int(newest[0])
                    assert not set(valid) & set(selected[0].tolist())
                return _inner(selected, rows, newest, reserved, next_ranked)
            bound.page_table = spy
        sequences = [cache.open(len(p) + NEW_TOKENS) for p in ps]
        interleaved_greedy(model, sequences, ps)
        assert seen and set(seen) == ({(1, wanted)} if wanted else {None})
        for seq in sequences:
            cache.close(seq)


def test_admission_follows_the_reference_sizing(model):
    """cell = layers x (latent row + ratio x indexer key); hot buffers bound the device, the full
    latent the host pool. The same budget holding whole latent caches on the device fits far fewer."""
    total, budget, ratio = 80, 120_000, 8  # 80 tokens per sequence: 5x the buffer
    cache = HiSparseLatentCache.for_model(model, {"device_buffer_size": BUFFER, "host_to_device_ratio": ratio},
                                          budget_bytes=budget, max_sequences=64, max_context=total)
    layers, index_bytes = model.config.num_hidden_layers, TINY["index_head_dim"] + 4  # 132 for 128 dims
    assert cache.cell_bytes == layers * (ROW_BYTES["bfloat16"] + ratio * index_bytes)
    assert cache.device_slots == budget // cache.cell_bytes
    assert cache.logical_capacity == ratio * cache.device_slots

    admitted = []
    while cache.can_allocate(total):
        admitted.append(cache.open(total))
    # here the hot buffers (buffer + the reserved slot each) are what runs out
    assert len(admitted) == cache.device_slots // (BUFFER + 1) < cache.logical_capacity // total
    baseline = budget // (layers * (ROW_BYTES["bfloat16"] + index_bytes)) // total
    assert len(admitted) >= 2 * baseline > 0
    with pytest.raises(ValueError, match="cannot admit .* close a sequence"):
        cache.open(total)
    cache.close(admitted.pop())
    admitted.append(cache.open(total))  # what a sequence gives back, the next one gets
    for seq in admitted:
        cache.close(seq)
    assert_all_free(cache)
    with pytest.raises(ValueError, match="logical capacity"):
        cache.open(cache.logical_capacity + 1)


def test_bad_use_is_named(model):
    config = {"device_buffer_size": BUFFER}
    with pytest.raises(ValueError, match="budget"):
        HiSparseLatentCache.for_model(model, config, budget_bytes=1000, max_sequences=1, max_context=64)
    with pytest.raises(ValueError, match="device_buffer_size"):  # the model's index_topk (8) wins over top_k
        HiSparseLatentCache.for_model(model, {"top_k": 4, "device_buffer_size": 6}, budget_bytes=BUDGET,
                                      max_sequences=1, max_context=64)
    cache = HiSparseLatentCache.for_model(model, config, budget_bytes=BUDGET, max_sequences=1, max_context=64)
    with pytest.raises(ValueError, match="FP8"):
        HiSparseLatentCache(cache.num_layers, cache.latent_format, IndexKeyFormat("float32", 32), cache.config,
                            BUDGET, 1, 64)
    with pytest.raises(ValueError, match="max_context"):
        cache.open(65)
    seq = cache.open(20)
    ids = torch.arange(12)
    with pytest.raises(ValueError, match="without gaps"):
        model(ids, torch.arange(1, 13), seq)
    model(ids, torch.arange(12), seq)
    with pytest.raises(ValueError, match="does not fit"):
        model(torch.arange(9), torch.arange(12, 21), seq)
    cache.close(seq)
    cache.close(seq)  # twice is harmless
    with pytest.raises(ValueError, match="closed"):
        model(ids[:1], torch.tensor([12]), seq)
    assert_all_free(cache)
