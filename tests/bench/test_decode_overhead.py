"""The equal-batch overhead benchmark runs both modes step by step and finds the same tokens."""

from __future__ import annotations

import re

import pytest

from hisparse.bench.decode_overhead import main


def test_decode_overhead_times_both_modes_and_finds_the_same_tokens(capsys):
    main(["--batch", "2", "--context", "200", "--steps", "4", "--repeats", "2",
          "--hisparse-config", '{"top_k": 32, "device_buffer_size": 48}'])
    out = capsys.readouterr().out
    ratio = re.search(r"ratio (\d+\.\d+) \(target <= 1\.10; per repeat (\S+), (\S+)\)", out)
    assert ratio and float(ratio.group(1)) > 0
    assert "outputs identical: True" in out
    hit_rate = float(re.search(r"hit rate (\d+\.\d)%", out).group(1))
    assert 0 < hit_rate < 100  # contexts longer than the buffer: swap-in ran and missed


def test_decode_overhead_compares_two_eviction_policies(capsys):
    main(["--batch", "2", "--context", "200", "--steps", "4", "--repeats", "1", "--policies", "lru,lrfu",
          "--hisparse-config", '{"top_k": 32, "device_buffer_size": 48}'])
    out = capsys.readouterr().out
    assert re.search(r"lru step \d+\.\d ms, lrfu step \d+\.\d ms, ratio \d+\.\d+ \(per repeat", out)
    assert "lru hit rate" in out and "lrfu hit rate" in out
    assert "outputs identical: True" in out  # offloading changes no result, whatever the policy


def test_decode_overhead_compares_the_indexer_kernels(capsys):
    """Two baseline engines, one on the PyTorch indexer path: timed in turn, outputs compared (they may part:
    the kernels break ties between equal scores differently)."""
    main(["--batch", "2", "--context", "200", "--steps", "4", "--repeats", "1", "--compare-indexer-kernels",
          "--hisparse-config", '{"top_k": 32, "device_buffer_size": 48}'])
    out = capsys.readouterr().out
    assert re.search(r"torch indexer step \d+\.\d ms, compiled indexer step \d+\.\d ms, ratio \d+\.\d+ \(per", out)
    assert "hit rate" not in out and "outputs identical: " in out


def test_two_comparisons_at_once_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--policies", "lru,lrfu", "--compare-indexer-kernels"])
    assert "pick one" in capsys.readouterr().err


def test_every_timed_step_decodes_the_whole_batch(llama, tokenizer):
    """With small prompt chunks the first request decodes while the second prefills: a max_tokens of steps + 1
    would end it during the timed steps (a batch smaller than the one named), which the timing refuses."""
    from hisparse.bench.decode_overhead import interleaved_step_seconds, prefill_steps
    from hisparse.engine.engine_config import EngineConfig
    from hisparse.engine.llm_engine import LLMEngine

    config = EngineConfig(device_kv_budget=64 << 20, chunked_prefill_size=64, enable_prefix_caching=False)
    engines = {"a": LLMEngine(config, model=llama, tokenizer=tokenizer)}
    prompts = [list(range(10, 210)), list(range(300, 500))]
    with pytest.raises(RuntimeError, match="a timed step decoded 1 of 2 requests"):
        interleaved_step_seconds(engines, prompts, steps=4, max_tokens=5)
    assert not engines["a"].has_unfinished
    times, outputs = interleaved_step_seconds(engines, prompts, 4, 5 + prefill_steps(2, 200, 64))
    assert len(times["a"]) == 4 and not engines["a"].has_unfinished  # timed, then aborted: no request is left
