"""Bad flags of the tools (`hisparse.quality_report`, `hisparse.train_indexer`): one line on stderr naming the
problem, exit status 2, no traceback, and nothing expensive started (no model loaded, nothing captured)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from hisparse import quality_report, train_indexer
from hisparse.layers.indexer import SHIPPED_WEIGHTS


@pytest.fixture
def no_work(monkeypatch, forbid, opened_model, tmp_path, tokenizer):
    """The model's config and tokenizer from the session; loading the model or capturing fails the test."""
    import hisparse.models.loader as loader

    opened_model()
    forbid(loader, "load_llama")
    forbid(train_indexer, "_frozen_model", "capture_to_memmap")
    monkeypatch.setattr(train_indexer, "_tokenizer", lambda: tokenizer)
    monkeypatch.chdir(tmp_path)  # the default --json / --out land here, not in the checkout
    return tmp_path


@pytest.mark.parametrize("argv,message", [
    (["--threads", "0"], "--threads: must be in [1, 1024], got 0"),
    (["--dense-layers", "x"], "--dense-layers: not an integer: 'x'"),
    (["--compare-dense-layers", "x"], "--compare-dense-layers: not an integer: 'x'"),
    (["--dense-layers", "99"], "--dense-layers: layer 99 does not exist; the model has layers 0..29"),
    (["--compare-dense-layers", "0,30"], "layer 30 does not exist"),
    (["--indexer", "/nonexistent"], "--indexer: '/nonexistent' is not a file"),
    (["--indexer", "/tmp"], "--indexer: '/tmp' is a directory"),
    (["--contexts", "0"], "--contexts: must be >= 1, got 0"),
    (["--contexts", "-5"], "--contexts: must be >= 1, got -5"),
    (["--contexts", "20000"], "--contexts 20000 exceeds the model's context of 8192 tokens"),
    (["--contexts", str(10**12)], "exceeds the model's context"),
    (["--contexts", "64"], "--contexts 64 must exceed --top-k 256 + 1"),
    (["--contexts", "64", "64", "--tail", "8"], "a context given twice"),
    (["--contexts", "300", "--tail", "8"], "--tail 8 must be at least 20"),
    (["--contexts", "2048", "--tail", "2048"], "--tail 2048 must be smaller than --contexts 2048"),
    (["--contexts", "40", "--top-k", "8", "--tail", "20"], "--contexts 40 is too short for the passkey prompt"),
    (["--trials", "0"], "--trials: must be in [1, 1000], got 0"),
    (["--tail", "0"], "--tail: must be >= 1, got 0"),
    (["--top-k", "0"], "--top-k: must be >= 1, got 0"),
    (["--json", "/proc/x"], "--json: cannot write into folder '/proc'"),
    (["--json", "/proc/x/y.json"], "--json: cannot write into folder '/proc/x'"),
])
def test_quality_report_refuses_bad_flags_before_loading(assert_refused, no_work, argv, message):
    assert_refused(quality_report.main, argv, quality_report.PROG, message)


def test_quality_report_refuses_weights_that_are_not_indexers(assert_refused, no_work):
    (no_work / "junk.safetensors").write_bytes(b"not safetensors")
    assert_refused(quality_report.main, ["--indexer", "junk.safetensors"], quality_report.PROG,
                   "is not a safetensors file")


def test_quality_report_defaults_and_readme_flags_pass_the_checks(no_work, tokenizer, model_config):
    parser = quality_report.build_parser()
    for argv in ([], ["--contexts", "2048", "4096", "--trials", "2"], ["--dense-layers", "", "--indexer",
                                                                       str(SHIPPED_WEIGHTS)]):
        args = parser.parse_args(argv)
        quality_report.check_args(args, model_config.num_layers, model_config.max_position_embeddings)
        quality_report.check_passkey_fits(args, tokenizer)
    assert not (no_work / "quality_report.json").exists()  # checked writable, not written


def test_the_smallest_accepted_report_has_no_nan_and_one_position_less_has(llama, tokenizer):
    """The bounds are the real ones: context top_k + 2 with tail 20 measures every figure; a tail of 19 leaves
    the NLL no text position (it was NaN)."""
    from hisparse.quality_report import PASSKEY_QUESTION, passkey_prompt, run_trial, summarize

    context, top_k = 64, 62
    prompt, answer, _ = passkey_prompt(tokenizer, context, 0)
    text_end = len(prompt) - len(tokenizer.encode(PASSKEY_QUESTION))
    summary = summarize(context, [run_trial(llama, prompt, answer, top_k, (), 20, text_end=text_end)])
    assert all(math.isfinite(summary[key]) for key in ("mass", "oracle", "overlap", "dense_nll", "sparse_nll"))
    assert math.isnan(run_trial(llama, prompt, answer, top_k, (), 19, text_end=text_end)["dense_nll"])


@pytest.mark.parametrize("argv,message", [
    (["--out", "/proc/x"], "--out: cannot write into folder '/proc/x'"),
    (["--out", "afile"], "--out: cannot write into folder 'afile': File exists"),
    (["--threads", "0"], "--threads: must be in [1, 1024], got 0"),
    (["--init", "/nonexistent"], "--init: '/nonexistent' is not a file"),
    (["--layers", "99"], "--layers: layer 99 does not exist; the model has layers 0..29"),
    (["--layers", "x"], "--layers: not an integer: 'x'"),
    (["--layers", ","], "--layers: an empty item in ','"),
    (["--heads", "0"], "--heads: must be in [1, 64], got 0"),
    (["--rope-dim", "0"], "--rope-dim: must be >= 1, got 0"),
    (["--rope-dim", "6"], "--rope-dim 6 must be even, divide the model's head dim (64)"),
    (["--rope-dim", "64", "--head-dim", "32"], "be at most --head-dim (32)"),
    (["--epochs", "0"], "--epochs: must be in [1, 1000], got 0"),
    (["--top-k", "0"], "--top-k: must be >= 1, got 0"),
    (["--queries", "0"], "--queries: must be >= 1, got 0"),
    (["--min-row", "10000"], "--min-row 10000 must be below --seq-len 2048"),
    (["--retrieval-chunks", "-1"], "--retrieval-chunks: must be in [0, 100], got -1"),
    (["--seq-len", "0"], "--seq-len: must be >= 1, got 0"),
    (["--seq-len", "9000"], "--seq-len 9000 exceeds the model's context of 8192"),
    (["--seq-len", "128"], "--top-k 256 must be below --seq-len 128"),
    (["--seq-len", "40", "--top-k", "8", "--min-row", "4", "--retrieval-chunks", "1"],
     "--seq-len 40 is too short for --retrieval-chunks"),
    (["--export", "/proc/x/y.safetensors"], "--export: cannot write into folder '/proc/x'"),
    (["--export", "/proc/y.safetensors"], "--export: cannot write into folder '/proc'"),
    (["--export", "."], "--export: '.' is a folder, not a file"),
    (["--max-chunks", "0"], "--max-chunks: must be >= 1, got 0"),
    (["--stop-after", "0"], "--stop-after: must be >= 1, got 0"),
    (["--lr", "nan"], "--lr: must be > 0, got nan"),
])
def test_train_indexer_refuses_bad_flags_before_capturing(assert_refused, no_work, argv, message):
    (no_work / "afile").write_text("")
    out = [] if argv[0] == "--out" else ["--out", str(no_work / "run")]
    assert_refused(train_indexer.main, [*out, *argv], train_indexer.PROG, message)


def test_train_indexer_refuses_init_weights_of_another_model(assert_refused, no_work):
    from hisparse.layers.indexer import IndexerConfig, LlamaIndexer, save_indexer_weights

    path = no_work / "two_layers.safetensors"
    save_indexer_weights(path, [LlamaIndexer(576, 64, IndexerConfig()) for _ in range(2)], IndexerConfig())
    assert_refused(train_indexer.main, ["--out", str(no_work / "run"), "--init", str(path)],
                   train_indexer.PROG, "holds indexers of 2 layers; the model has 30")


def test_train_indexer_readme_flags_and_shipped_init_pass_the_checks(no_work, model_config):
    argv = ["--out", str(no_work / "run"), "--seq-len", "8192", "--init", str(SHIPPED_WEIGHTS), "--epochs", "24",
            "--queries", "512", "--lr", "3e-3", "--target", "max", "--loss", "kl+topk", "--retrieval-chunks", "6"]
    train_indexer.check_args(train_indexer.parse_args(argv), model_config)
    assert train_indexer._weights_history(SHIPPED_WEIGHTS)  # the shipped weights carry their history


@pytest.mark.parametrize("module,argv,message", [
    ("hisparse.train_indexer", ["--threads", "0"], "--threads: must be in [1, 1024], got 0"),
    ("hisparse.quality_report", ["--contexts", "20000"], "exceeds the model's context of 8192 tokens"),
])
def test_module_entry_points_print_one_line(tmp_path, module, argv, message):
    run = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert lines[0].startswith(f"python -m {module}: error: ") and message in lines[0]
