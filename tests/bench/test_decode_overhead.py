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
