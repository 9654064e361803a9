"""A DSA model over two rank processes, on a small random checkpoint, with the MLPs split over the ranks (the
experts with ep_size 2, each expert's columns without). DP attention (`tp_size=2, dp_size=2,
enable_dp_attention=True`) gives the tokens one process gives, with the baseline cache and with HiSparse, the
requests spread over both ranks, each rank holding and freeing only its own; tensor parallel (the heads split,
every rank every token) gives them too; what cannot run is refused with a message."""

from __future__ import annotations

import pytest

from hisparse.engine import model_runner
from hisparse.engine.data_parallel import summed
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.model_runner import StepFailed
from hisparse.engine.request import RequestStatus
from hisparse.engine.sampling_params import SamplingParams
from hisparse.llm import LLM
from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.models.hf_checkpoint import read_config
from hisparse.plan import ModelShape, requests_within

PROMPTS = ["Sparse attention reads only the tokens its indexer selects. " * 6, "The capital of France is",
           "def fibonacci(n):\n    " * 3, "Once upon a time, in a small village, there lived " * 4]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
PARAMS = [GREEDY, GREEDY, SEEDED, GREEDY]
BASE = {"dtype": "float32", "device_kv_budget": 32 << 20, "max_running_requests": 4, "chunked_prefill_size": 64}
MODES = {"baseline": {}, "hisparse": {"enable_hisparse": True, "hisparse_config": {"device_buffer_size": 24}}}
DP2 = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}


@pytest.fixture(scope="module")
def one_rank(tiny_dsa_dir):
    outputs = {}
    for mode, extra in MODES.items():
        engine = LLMEngine(EngineConfig(model=str(tiny_dsa_dir("glm-5")), **BASE, **extra))
        requests = [engine.add_request(p, params) for p, params in zip(PROMPTS, PARAMS, strict=True)]
        while engine.has_unfinished:
            engine.step()
        outputs[mode] = [(r.output_token_ids, r.output_text) for r in requests]
    return outputs


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("ep_size", [2, 1])
def test_two_dp_ranks_give_one_ranks_tokens(tiny_dsa_dir, one_rank, mode, ep_size):
    with LLM(str(tiny_dsa_dir("glm-5")), **DP2, ep_size=ep_size, **BASE, **MODES[mode]) as llm:
        engine = llm.engine
        outputs = llm.generate(PROMPTS, PARAMS)
        assert [(o.token_ids, o.text) for o in outputs] == one_rank[mode]
        # Round robin: requests 0 and 2 ran on rank 0, 1 and 3 on rank 1; each rank freed its own.
        stats = llm.stats()
        assert stats["dp_size"] == 2 and stats["finished_requests"] == len(PROMPTS)
        assert stats["generated_tokens"] == sum(len(o.token_ids) for o in outputs)
        assert engine.flush_cache()
        usage = engine.rank_usage()
        assert all(v == 0 for u in usage for k, v in u.items() if k.endswith("_slots_used")), usage
        if mode == "hisparse":  # the ranks' counters summed
            assert stats["swap_in"]["misses"] > 0 and engine.cache.counters.as_dict()["misses"] < stats["swap_in"][
                "misses"]
        # A stop string cuts the text on rank 0's stand-in as on the rank that runs the request (one of each).
        text = one_rank[mode][1][1]
        stop = text[len(text) // 2:len(text) // 2 + 3]
        cut = [(o.text, o.finish_reason) for o in llm.generate([PROMPTS[1]] * 2, SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))]
        assert cut == [(text[:text.index(stop)], "stop")] * 2
        # A long request on each rank, aborted mid-decode: both ranks held rows, both free them.
        long = [engine.add_request(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)) for _ in range(2)]
        for _ in range(4):
            engine.step()
        usage = engine.rank_usage()
        assert all(u["device_slots_used"] > 0 for u in usage), usage
        assert llm.stats()["running"] == 2
        for request in long:
            assert engine.abort(request.request_id).finish_reason == "abort"
        assert not engine.has_unfinished
        assert engine.flush_cache()
        usage = engine.rank_usage()
        assert all(v == 0 for u in usage for k, v in u.items() if k.endswith("_slots_used") or
                   k.startswith("prefix_cache")), usage


@pytest.mark.parametrize("mode, ep_size", [("baseline", 2), ("hisparse", 1)])
def test_tensor_parallel_gives_one_ranks_tokens(tiny_dsa_dir, one_rank, mode, ep_size):
    with LLM(str(tiny_dsa_dir("glm-5")), tp_size=2, ep_size=ep_size, **BASE, **MODES[mode]) as llm:
        assert [(o.token_ids, o.text) for o in llm.generate(PROMPTS, PARAMS)] == one_rank[mode]
        usage = llm.engine.rank_usage()
        assert usage[0] == usage[1]  # every rank holds every token's latent rows
        stats = llm.stats()
        assert stats["tp_size"] == 2 and "dp_size" not in stats
        ranks = stats["ranks"]
        assert ranks[0] == ranks[1]


def test_a_rank_that_cannot_sample_fails_the_step_on_every_rank(tiny_dsa_dir, one_rank, monkeypatch):
    """Rank 0 alone fails to sample (sampling is patched away in its process only): every rank gives the step up
    before committing anything, so the same requests then run on to one rank's tokens."""
    with LLM(str(tiny_dsa_dir("glm-5")), **DP2, ep_size=2, **BASE) as llm:
        engine = llm.engine
        requests = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
        with monkeypatch.context() as patch:
            patch.setattr(model_runner, "sample", lambda logits, requests: 1 / 0)
            with pytest.raises(StepFailed, match="ZeroDivisionError"):
                while True:
                    engine.step()
        assert all(r.output_token_ids == [] for r in requests)  # rank 1 sampled, but kept nothing
        assert all(r.status is RequestStatus.RUNNING for r in requests)  # both admitted: a server fails both
        while engine.has_unfinished:
            engine.step()
        assert [(r.output_token_ids, r.output_text) for r in requests] == one_rank["baseline"][:2]


def test_shortest_queue_places_requests_on_the_least_loaded_rank(tiny_dsa_dir):
    with LLM(str(tiny_dsa_dir("glm-5")), **DP2, ep_size=2, **BASE, load_balance_method="shortest_queue") as llm:
        engine = llm.engine
        first = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
        second = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
        assert engine.placement.owner == {first.request_id: 0, second.request_id: 1}
        while not first.finished:
            engine.step()
        third = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
        assert engine.placement.owner[third.request_id] == 0  # rank 1 still runs the second
        engine.abort(second.request_id)
        while engine.has_unfinished:
            engine.step()


@pytest.mark.parametrize("args, message", [
    ({"tp_size": 3}, "tp_size 3 is more than the model's 2 attention heads"),
    ({"tp_size": 2, "dp_size": 2}, "without enable_dp_attention"),
    ({"dp_size": 2, "enable_dp_attention": True}, "dp_size must equal tp_size"),
    ({**DP2, "ep_size": 3}, "ep_size must be 1"),
    ({**DP2, "load_balance_method": "random"}, "load_balance_method must be one of"),
])
def test_what_is_not_implemented_is_refused(tiny_dsa_dir, args, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_dsa_dir("glm-5")), **BASE, **args)


def test_the_llama_family_refuses_dp_attention():
    with pytest.raises(ValueError, match="a Llama model runs tensor-parallel"):
        LLM(**DP2, **BASE)


def test_each_rank_sizes_its_pools_as_the_planner_does(tiny_dsa_dir):
    """The budget is per rank: each DP rank's HiSparse pools are hisparse.plan's for that budget, and the ranks'
    pools add up (the planner's kv_pools = dp)."""
    path = str(tiny_dsa_dir("glm-5"))
    shape = ModelShape.from_hf_config(read_config(path))
    hisparse = HiSparseConfig.parse({"device_buffer_size": 32}, shape.index_topk, check_buffer=False)
    budget = 16 << 20
    planned = requests_within(shape, hisparse, budget, 256, "bfloat16").sizing
    with LLM(path, **DP2, ep_size=2, dtype="float32", kv_cache_dtype="bfloat16", device_kv_budget=budget,
             enable_hisparse=True, hisparse_config={"device_buffer_size": 32}) as llm:
        usage = llm.engine.rank_usage()
        assert [(u["device_slots_total"], u["host_slots_total"]) for u in usage] == \
            [(planned.device_slots, planned.logical_capacity)] * 2
        memory = llm.stats()["memory"]
        assert memory["device_slots_total"] == 2 * planned.device_slots


def test_counters_add_up_over_ranks_that_looked_up_nothing():
    rank0 = {"hits": 3, "misses": 1, "hit_rate": 0.75, "swap_in_seconds": 0.5, "per_layer": {"misses": [1, 0]}}
    rank1 = {"hits": 0, "misses": 0, "hit_rate": None, "swap_in_seconds": 0.0, "per_layer": {"misses": [0, 0]}}
    assert summed([rank0, rank1]) == rank0
    assert summed([rank0, rank0])["hit_rate"] == 0.75
