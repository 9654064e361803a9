"""Bad flags of the miss-rate, swap-in, Triton swap-in and indexer-selection benches and of the top-k trace tool:
each ends in one line on stderr naming the problem and exit status 2, before any trace is recorded or replayed,
any pool allocated or any call timed (those functions fail the test here when called).

The model's config is read once per session: the miss-rate bench and the trace tool read it to check the
context, and each read costs seconds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse.bench import index_scores, missrate, swap_in, swap_in_cuda
from hisparse.tools import topk_trace

BIG = str(10**12)


@pytest.fixture(autouse=True)
def no_expensive_work(monkeypatch, forbid, opened_model):
    """Recording, replaying, allocating pools and timing fail the test; the model's config is read once."""
    forbid(missrate, "load_or_record", "synthetic_trace", "run")
    forbid(swap_in, "PlainCopy", "table_for")
    forbid(swap_in_cuda, "check_policy", "time_rows")
    forbid(index_scores, "IndexerKeyCache", "time_selection")
    forbid(topk_trace, "record")
    opened_model()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so that --device cpu gets past its own check


SYN = ["--synthetic"]


@pytest.mark.parametrize(("argv", "word"), [
    (["--buffers", "x", *SYN], "not a number"),
    (["--buffers", "1,,2", *SYN], "empty item"),
    (["--buffers", "0.5", *SYN], ">= 1"),
    (["--num-requests", "0", *SYN], "--num-requests"),
    (["--num-requests", BIG, *SYN], "--num-requests"),
    (["--steps", "0", *SYN], "--steps"),
    (["--top-k", "-1", *SYN], "--top-k"),
    (["--top-k", "0", *SYN], "--top-k"),
    (["--context", "0", *SYN], "--context"),
    (["--context", "-5", *SYN], "--context"),
    (["--context", BIG, *SYN], "synthetic traces hold at most"),
    (["--context", "8000"], "beyond the model's context"),
    (["--top-k", "4096", "--context", "200", "--steps", "12", *SYN], "no step would swap anything in"),
    (["--top-k", "8192", "--context", "60000", "--steps", "4096", "--num-requests", "1024", *SYN], "memory"),
    (["--policies", "bogus"], "'bogus' is not one of"),
    (["--policies", ",", *SYN], "empty item"),
    (["--tune", "--policies", "fifo"], "needs lru in --policies"),
    (["--out", "/proc/x"], "--out"),
    (["--out", "/proc"], "--out"),  # a folder root may "access" but not write into
    (["--trace-dir", "/proc/x"], "--trace-dir"),
    (["--split", "dev"], "--split"),
])
def test_missrate_refuses(argv, word, tmp_path, assert_refused):
    out = [] if "--out" in argv else ["--out", str(tmp_path)]
    assert_refused(missrate.main, [*argv, *out], missrate.PROG, word)


@pytest.mark.parametrize(("argv", "word"), [
    (["--repeats", "0"], "--repeats"),
    (["--repeats", BIG], "--repeats"),
    (["--dtype", "float16"], "'float16' is not one of"),
    (["--dtype", ","], "empty item"),
    (["--batches", "x"], "not an integer"),
    (["--batches", "1,,2"], "empty item"),
    (["--batches", "0"], "--batches"),
    (["--batches", "-1"], "--batches"),
    (["--batches", BIG], "too few for a buffer"),
    (["--miss-rates", "2"], "in [0, 1]"),
    (["--miss-rates", "-0.5"], "in [0, 1]"),
    (["--host-gib", "0"], "--host-gib"),
    (["--host-gib", "-1"], "--host-gib"),
    (["--host-gib", "1e12"], "memory available"),
    (["--host-gib", "0.0001"], "too few for a buffer"),
    (["--copy-mib", "-1"], "--copy-mib"),
    (["--copy-mib", "0"], "--copy-mib"),
    (["--copy-mib", BIG], "memory available"),
    (["--backends", "bogus"], "'bogus' is not one of"),
    (["--top-k", "0"], "--top-k"),
    (["--buffer", "0"], "--buffer: must be >= 1"),
    (["--top-k", "64", "--buffer", "32"], "--top-k must not exceed --buffer"),
])
def test_swap_in_refuses(argv, word, assert_refused):
    assert_refused(swap_in.main, argv, swap_in.PROG, word)


def test_swap_in_triton_needs_the_interpreter(monkeypatch, assert_refused):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert_refused(swap_in.main, ["--backends", "triton"], swap_in.PROG, "TRITON_INTERPRET=1")


CPU = ["--device", "cpu"]


@pytest.mark.parametrize(("argv", "word"), [
    (["--device", "bogus"], "not a device"),
    (["--device", "tpu"], "not a device"),
    (["--device", "cuda:x"], "not a device"),
    (["--repeats", "0", *CPU], "--repeats"),
    (["--batches", "x", *CPU], "not an integer"),
    (["--batches", "0", *CPU], "--batches"),
    (["--batches", str(swap_in_cuda.MAX_CHECK_BATCH + 1), *CPU], "--batches"),
    (["--miss-rates", "x", *CPU], "not a number"),
    (["--miss-rates", "2", *CPU], "in [0, 1]"),
    (["--policies", ",", *CPU], "empty item"),
    (["--policies", "clock", *CPU], "'clock' is not one of"),
    (["--host-gib", "1e12", *CPU], "memory available"),
    (["--host-gib", "0.001", *CPU], "too few for a buffer"),
    (["--out", "/proc/x", *CPU], "--out"),
    (["--out", "/tmp", *CPU], "a folder"),
])
def test_swap_in_cuda_refuses(argv, word, assert_refused):
    assert_refused(swap_in_cuda.main, argv, swap_in_cuda.PROG, word)


def test_swap_in_cuda_cpu_needs_the_interpreter(monkeypatch, assert_refused):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert_refused(swap_in_cuda.main, CPU, swap_in_cuda.PROG, "TRITON_INTERPRET=1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_swap_in_cuda_without_cuda_exits_2(assert_refused):
    assert_refused(swap_in_cuda.main, [], swap_in_cuda.PROG, "no CUDA device")


@pytest.mark.parametrize(("argv", "word"), [
    (["--batches", "x"], "not an integer"),
    (["--batches", "1,,2"], "empty item"),
    (["--batches", "0"], "--batches"),
    (["--batches", "-2"], "--batches"),
    (["--batches", BIG], "below --context"),
    (["--batches", "40", "--context", "40"], "below --context"),
    (["--heads", "-1"], "--heads"),
    (["--heads", "0"], "--heads"),
    (["--heads", BIG], "memory available"),
    (["--context", BIG], "memory available"),
    (["--context", "1"], "--context"),
    (["--head-dim", "6"], "multiple of 4"),
    (["--top-k", "0"], "--top-k"),
    (["--repeats", "0"], "--repeats"),
])
def test_index_scores_refuses(argv, word, assert_refused):
    assert_refused(index_scores.main, argv, index_scores.PROG, word)


@pytest.mark.parametrize(("argv", "word"), [
    ([], "required: command"),
    (["record"], "required: --out"),
    (["record", "--length", "0", "--out", "{tmp}/t.npz"], "--length"),
    (["record", "--max-tokens", "x", "--out", "{tmp}/t.npz"], "--max-tokens"),
    (["record", "--top-k", "0", "--out", "{tmp}/t.npz"], "--top-k"),
    (["record", "--length", "9000", "--out", "{tmp}/t.npz"], "beyond the model's context"),
    (["record", "--top-k", BIG, "--out", "{tmp}/t.npz"], "beyond the model's context"),
    (["record", "--prompt-file", "/nonexistent", "--out", "{tmp}/t.npz"], "--prompt-file"),
    (["record", "--out", "/proc/x/t.npz"], "--out"),
    (["show", "/nonexistent.npz"], "not a file"),
    (["show", "{tmp}/other.npz"], "not a top-k trace file"),
    (["show", "{tmp}/text.npz"], "not a top-k trace file"),
])
def test_topk_trace_refuses(argv, word, tmp_path, run_command):
    np.savez(tmp_path / "other.npz", a=np.arange(3))
    (tmp_path / "text.npz").write_text("not an archive")
    argv = [a.format(tmp=tmp_path) for a in argv]
    code, _, lines = run_command(topk_trace.main, argv, topk_trace.PROG)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(topk_trace.PROG) and "error:" in lines[0] and word in lines[0], lines[0]


@pytest.mark.parametrize(("main", "prog"), [
    (missrate.main, missrate.PROG), (swap_in.main, swap_in.PROG), (swap_in_cuda.main, swap_in_cuda.PROG),
    (index_scores.main, index_scores.PROG), (topk_trace.main, topk_trace.PROG),
])
def test_help_works(main, prog, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {prog}")


def test_missrate_no_progress_hides_the_recording_bar(monkeypatch, tmp_path):
    """--no-progress reaches the recording's progress bar (it only hid the replay's)."""
    asked = []

    def record_batch(paths, missing, split, num_requests, context, steps, top_k, dtype, progress=True):
        asked.append(progress)
        for i in missing:
            topk_trace.save_topk_trace(paths[i], missrate.synthetic_trace(i, context=context, steps=steps, top_k=top_k))

    monkeypatch.undo()  # the real load_or_record and synthetic_trace, a stand-in recorder
    monkeypatch.setattr(missrate, "record_batch", record_batch)
    traces = missrate.load_or_record(tmp_path, "heldout", 1, 40, 4, 8, progress=False)
    assert asked == [False] and traces[0].num_steps == 4
