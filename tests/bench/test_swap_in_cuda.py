"""The GPU check script, run through the Triton interpreter: it passes on the real kernel, catches a
kernel that differs from the reference, and refuses a CUDA run where there is no CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from hisparse.bench import swap_in_cuda
from hisparse.memory.swap_in import swap_in as real_swap_in


def test_check_and_timing_run_through_the_interpreter(tmp_path, capsys):
    out = tmp_path / "cuda.json"
    swap_in_cuda.main(["--device", "cpu", "--policies", "lru,lrfu", "--batches", "2", "--miss-rates", "1.0",
                       "--repeats", "1", "--host-gib", "0.0625", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "check      lrfu batch   2: triton = reference" in printed
    report = json.loads(out.read_text())
    assert set(report["check"]) == {"lru batch 2", "lrfu batch 2"} and all(m > 0 for m in report["check"].values())
    (row,) = report["timing"]
    assert row["misses"] == 2 * swap_in_cuda.CHECK_TOP_K and row["gbps"] > 0 and row["copy_gbps"] > 0


def test_check_fails_when_the_kernel_differs(monkeypatch):
    def off_by_one(*args, backend, **kwargs):
        result = real_swap_in(*args, backend=backend, **kwargs)
        if backend == "triton":
            result.page_table[0, 0] += 1
        return result

    monkeypatch.setattr(swap_in_cuda, "swap_in", off_by_one)
    with pytest.raises(AssertionError, match="differ in page_table"):
        swap_in_cuda.check_policy("lru", "cpu", 1, torch.Generator().manual_seed(0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_run_without_cuda_says_so(capsys):
    with pytest.raises(SystemExit) as done:
        swap_in_cuda.main([])
    assert done.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_an_unsupported_policy_is_refused(capsys):
    with pytest.raises(SystemExit) as done:
        swap_in_cuda.main(["--device", "cpu", "--policies", "clock"])
    assert done.value.code == 2 and "'clock' is not one of lru" in capsys.readouterr().err
