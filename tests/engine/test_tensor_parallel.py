"""Tensor parallel on the default model: two rank processes (shared-memory collectives) give the greedy tokens
one process gives, with sparse and dense decode, with HiSparse on and off; every rank holds the same tokens and
frees them (an abort mid-decode included); a bad config or a rank that fails to load refuses the start,
leaving no process behind."""

from __future__ import annotations

import os
import subprocess

import numba
import pytest
import torch

from hisparse.engine import model_runner
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.model_runner import StepFailed
from hisparse.engine.sampling_params import SamplingParams
from hisparse.llm import LLM

PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ", "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
BASE = {"dtype": "float32", "device_kv_budget": 48 << 20, "max_running_requests": 8}
HISPARSE = {"enable_hisparse": True, "top_k": 16, "hisparse_config": {"top_k": 16, "device_buffer_size": 24}}
MODES = {"sparse": {}, "dense": {"sparse_attention": False}, "hisparse": HISPARSE}


def worker_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "hisparse.engine.workers"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.fixture(scope="module")
def one_rank(llama, tokenizer):
    outputs = {}
    for mode, extra in MODES.items():
        engine = LLMEngine(EngineConfig(**BASE, **extra), model=llama, tokenizer=tokenizer)
        requests = [engine.add_request(p, params) for p, params in zip(PROMPTS, [GREEDY, GREEDY, SEEDED], strict=True)]
        while engine.has_unfinished:
            engine.step()
        outputs[mode] = [r.output_token_ids for r in requests]
    return outputs


@pytest.mark.parametrize("mode", list(MODES))
def test_two_ranks_give_one_ranks_tokens(one_rank, mode, monkeypatch):
    threads, cpus, numba_threads = torch.get_num_threads(), os.sched_getaffinity(0), numba.get_num_threads()
    with LLM(tp_size=2, **BASE, **MODES[mode]) as llm:
        got = [r.token_ids for r in llm.generate(PROMPTS, [GREEDY, GREEDY, SEEDED])]
        engine = llm.engine
        assert got == one_rank[mode]
        long = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        short = engine.add_request(PROMPTS[1] * 2, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while not short.finished:
            engine.step()
        engine.abort(long.request_id)  # mid-decode: every rank frees it
        usage = engine.rank_usage()
        assert usage[0] == usage[1]  # the same tokens in the same slots' counts on both ranks
        stats = llm.stats()
        assert stats["tp_size"] == 2
        # The 3 KV heads split 2 + 1: rank 1's rows are half rank 0's, for as many tokens.
        ranks = stats["ranks"]
        if mode != "hisparse":
            assert ranks[0]["device_kv_bytes"] > ranks[1]["device_kv_bytes"]
        else:
            assert ranks[0]["host_kv_bytes"] == 2 * ranks[1]["host_kv_bytes"]
            assert stats["swap_in"]["misses"] > 0
        if mode == "dense":  # rank 0 alone fails to sample: every rank gives the step up, then goes on
            failing = engine.add_request(PROMPTS[2], GREEDY)
            with monkeypatch.context() as patch:
                patch.setattr(model_runner, "sample", lambda logits, requests: 1 / 0)
                with pytest.raises(StepFailed, match="ZeroDivisionError"):
                    engine.step()
            engine.abort(failing.request_id)
            assert [r.token_ids for r in llm.generate(PROMPTS, [GREEDY, GREEDY, SEEDED])] == one_rank[mode]
        assert engine.flush_cache()
        usage = engine.rank_usage()
        assert all(v == 0 for u in usage for k, v in u.items() if k.endswith("_slots_used")), usage
    # rank 0's thread gets its CPUs and threads back
    assert (torch.get_num_threads(), os.sched_getaffinity(0), numba.get_num_threads()) == (threads, cpus, numba_threads)
    assert not worker_processes()


def test_more_ranks_than_kv_heads_is_refused_at_once():
    with pytest.raises(ValueError, match="tp_size 4 is more than the model's 3 KV heads"):
        LLM(tp_size=4, **BASE)
    assert not worker_processes()


def test_cuda_ranks_take_one_gpu_each(monkeypatch):
    """Each CUDA rank runs on cuda:<its local rank>: fewer GPUs than ranks is refused before anything loads, and
    a device index cannot be given with several ranks."""
    with pytest.raises(ValueError, match="pass cpu, or cuda"):
        EngineConfig(tp_size=2, device="cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="device_kv_budget is needed with tp_size > 1 on CUDA"):
        EngineConfig(tp_size=2, device="cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 ranks on this machine, one per GPU, and it has 1"):
        LLM(tp_size=2, device="cuda", **BASE)
    assert not worker_processes()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for rank, nodes, device in ((1, 1, "cuda:1"), (3, 2, "cuda:1"), (2, 2, "cuda:0")):
        config = EngineConfig(tp_size=4, device="cuda", nnodes=nodes, dist_init_addr="127.0.0.1:1", **BASE)
        assert config.rank_device(rank) == device


def test_a_rank_that_fails_to_load_refuses_the_start(tmp_path, tokenizer):
    """A checkpoint whose LM head is cut short: rank 0's rows of it are there, rank 1's are not."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"][:30_000].clone()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="rank 1 could not start"):
        LLM(str(tmp_path), tp_size=2, **BASE)
    assert not worker_processes()
