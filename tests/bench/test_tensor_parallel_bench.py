"""The tensor-parallel benchmark's collective timing runs two real rank processes and reports a time."""

from __future__ import annotations

from hisparse.bench.tensor_parallel import all_reduce_us, main


def test_all_reduce_timing_runs_two_ranks():
    us = all_reduce_us(4, 576, calls=50)
    assert 0 < us < 100_000


def test_bad_flags_are_refused(assert_refused):
    assert_refused(main, ["--batch-sizes", "0"], "python -m hisparse.bench.tensor_parallel", "--batch-sizes")


def test_a_missing_model_is_refused(assert_refused, tmp_path):
    assert_refused(main, ["--model", str(tmp_path / "nothing")], "python -m hisparse.bench.tensor_parallel", "--model")
