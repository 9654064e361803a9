"""Starting an engine: the model file is opened once, and a config that cannot work is refused from the model's
config, before the ten seconds of loading its weights."""

from __future__ import annotations

import re

import gguf
import pytest
import torch

from hisparse.engine import llm_engine
from hisparse.engine.engine_config import EngineConfig
from hisparse.models import loader

A_FILE = "/proc/version/traces"  # under a file, so never creatable, even by root


@pytest.mark.parametrize("overrides, words", [
    ({"enable_hisparse": True, "device_kv_budget": 1 << 20}, "fewer than one request's buffer (512 + 1)"),
    ({"device_kv_budget": 1}, "buys no token slot"),
    ({"dense_layers": (40,)}, "dense_layers [40] out of range: the model has 30 layers"),
    ({"enable_hisparse": True, "dense_layers": (0,)}, "HiSparse needs a sparse-attention model"),
    ({"enable_hisparse": True, "hisparse_config": {"device_buffer_size": 8191}},
     "device_buffer_size (8191) must be at most 8190 for a context of 8192 tokens"),
    ({"topk_trace_dir": A_FILE}, "cannot be created"),
])
def test_a_config_that_cannot_work_is_refused_before_the_weights_load(opened_model, forbid, overrides, words):
    opened_model(llm_engine)
    forbid(loader, "load_llama", "load_dsa_model")
    with pytest.raises(ValueError, match=re.escape(words)):
        llm_engine.LLMEngine(EngineConfig(**overrides))


def test_a_dense_model_is_refused_hisparse_before_its_weights_load(monkeypatch, forbid, model_files):
    """A model without the shipped indexers (any but the default) has no indexer keys to select with."""
    elsewhere = llm_engine.open_model(model_files)  # the same files, seen as another model's
    monkeypatch.setattr(elsewhere, "default_indexer_weights", lambda: None)
    monkeypatch.setattr(llm_engine, "open_model", lambda model=None: elsewhere)
    forbid(loader, "load_llama", "load_dsa_model")
    with pytest.raises(ValueError, match="HiSparse needs a sparse-attention model with an indexer in every layer"):
        llm_engine.LLMEngine(EngineConfig(enable_hisparse=True))


def test_the_engine_opens_the_model_file_once_and_loads_it_in_its_dtype(monkeypatch):
    """Config, weights and tokenizer all come from one GGUF reader (each opening costs about 3 s)."""
    opened = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            opened.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    engine = llm_engine.LLMEngine(EngineConfig(dtype="bfloat16", device_kv_budget=64 << 20))
    assert len(opened) == 1
    assert engine.tokenizer.decode(engine.tokenizer.encode("The capital of France")) == "The capital of France"
    assert engine.model.layers[0].mlp.gate_up.t.dtype == torch.bfloat16
    assert engine.model.layers[0].attn.indexer.wk.weight.dtype == torch.float32
    assert engine.cache.kv.dtype == torch.bfloat16  # kv_cache_dtype "auto": the model's


def test_the_device_is_named_with_its_gpu_index(monkeypatch):
    """A bare "cuda" runs on the current GPU, named with its index: torch.cuda.set_device refuses a device without
    one, and a model's weights on cuda:1 are not on torch.device("cuda"). A GPU the machine lacks, or a device that
    is none, is refused by name."""
    with pytest.raises(ValueError, match="CUDA is not available"):
        EngineConfig(device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert EngineConfig(device="cuda").rank_device(0) == "cuda:1"
    assert EngineConfig(device="cuda:0").rank_device(0) == "cuda:0" and EngineConfig().rank_device(0) == "cpu"
    with pytest.raises(ValueError, match="'cuda:2' asked for, but this machine has 2 CUDA device"):
        EngineConfig(device="cuda:2")
    for device in ("gpu", "cuda:", "cuda:x", 0):
        with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N"):
            EngineConfig(device=device)
