"""Bad flags of the demo, the serving bench, the decode-overhead bench, engine_vs_hf and the `hisparse` script:
each ends in one line on stderr naming the problem and exit status 2, before any model loads or server starts.

The model is opened once per session here (`opened_model`): the commands read its config before loading to
check sizes against the context, and each opening of the GGUF costs seconds."""

from __future__ import annotations

import pytest
import torch

import hisparse.cli as hisparse_cli
from hisparse import demo
from hisparse.bench import decode_overhead, engine_vs_hf, serving

BIG = str(10**12)


@pytest.fixture(autouse=True)
def no_expensive_work(forbid, opened_model):
    """Loading a model, building an engine or starting a server fails the test; the model is opened once."""
    for module in (demo, decode_overhead, engine_vs_hf):
        forbid(module, "load_llama", "LLMEngine")
    opened_model(demo, decode_overhead, engine_vs_hf, serving)
    forbid(serving.ServerProcess, "start")


DEMO = [
    (["--hisparse-config", "{bad"], "not valid JSON"),
    (["--hisparse-config", '{"top_kk": 4}'], "unknown field 'top_kk'"),
    (["--hisparse-config", '{"top_k": 64, "device_buffer_size": 32}'], "device_buffer_size"),
    (["--prompt-tokens", BIG], "model's context"),
    (["--requests", BIG], "--requests"),
    (["--skip-chat", "--prompt-tokens", "20000", "--requests", "1", "--baseline-requests", "1"], "model's context"),
    (["--output-tokens", "1"], "--output-tokens: must be >= 2"),
    (["--requests", "0"], "--requests: must be in [1, 4096], got 0"),
    (["--baseline-requests", "4096", "--prompt-tokens", "8000"], "available"),
]


@pytest.mark.parametrize("argv, word", DEMO)
def test_demo_bad_flags(argv, word, assert_refused):
    assert_refused(demo.main, argv, demo.PROG, word)


SERVING = [
    (["--out-dir", "/proc/x"], "cannot write into folder"),
    (["--concurrency", BIG], "--concurrency"),
    (["--concurrency", "1,,4"], "empty item"),
    (["--concurrency", "4,4"], "twice"),
    (["--concurrency", "4,x"], "not an integer"),
    (["--rounds", BIG], "--rounds"),
    (["--min-requests", BIG], "--min-requests"),
    (["--rounds", "2", "--concurrency", "1,4096"], "8192 requests at a level"),
    (["--poll-interval", "0"], "--poll-interval: must be > 0"),
    (["--hisparse-config", "{bad"], "not valid JSON"),
    (["--hisparse-config", '{"top_k": 64, "device_buffer_size": 32}'], "device_buffer_size"),
    (["--device-kv-budget", "1000TiB"], "available"),
    (["--device-kv-budget", "1MiB"], "hot slots"),
    (["--prompt-tokens", "9000"], "model's context"),
    (["--device", "gpu"], "not a device"),
    *([] if torch.cuda.is_available() else [(["--device", "cuda"], "no such CUDA device")]),
]


@pytest.mark.parametrize("argv, word", SERVING)
def test_bench_serving_bad_flags(argv, word, assert_refused, tmp_path):
    if "--out-dir" not in argv:
        argv = [*argv, "--out-dir", str(tmp_path / "out")]
    assert_refused(serving.main, argv, serving.PROG, word)


def test_bench_serving_refuses_a_file_as_out_dir(tmp_path, assert_refused):
    (tmp_path / "file").write_text("")
    assert_refused(serving.main, ["--out-dir", str(tmp_path / "file")], serving.PROG, "cannot write into folder")


DECODE_OVERHEAD = [
    (["--policies", "bogus,lru"], "'bogus' is not one of"),
    (["--policies", ",lru"], "empty item"),
    (["--policies", "lru,lru"], "twice"),
    (["--policies", "lru,lrfu,fifo"], "two eviction policies"),
    (["--policies", "lru,lrfu", "--compare-indexer-kernels"], "pick one"),
    (["--hisparse-config", "{bad"], "not valid JSON"),
    (["--hisparse-config", '{"bogus": 1}'], "unknown field 'bogus'"),
    (["--batch", "0"], "--batch: must be in [1,"),
    (["--batch", "-1"], "--batch: must be in [1,"),
    (["--batch", BIG], "--batch: must be in [1,"),
    (["--batch", "4096"], "GiB budget"),
    (["--context", "0"], "--context: must be >= 1"),
    (["--context", "100000"], "model's context"),
    (["--repeats", "0"], "--repeats: must be >= 1"),
    (["--steps", "0"], "--steps: must be >= 1"),
]


@pytest.mark.parametrize("argv, word", DECODE_OVERHEAD)
def test_decode_overhead_bad_flags(argv, word, assert_refused):
    assert_refused(decode_overhead.main, argv, decode_overhead.PROG, word)


ENGINE_VS_HF = [
    (["--threads", "0"], "--threads: must be in [1,"),
    (["--new-tokens", "0"], "--new-tokens: must be >= 1"),
    (["--new-tokens", "100000"], "model's context"),
    (["--repeats", "0"], "--repeats: must be >= 1"),
    (["--batch-sizes", "1", "-1"], "--batch-sizes: must be in [1,"),
    (["--batch-sizes", BIG], "--batch-sizes: must be in [1,"),
]


@pytest.mark.parametrize("argv, word", ENGINE_VS_HF)
def test_engine_vs_hf_bad_flags(argv, word, assert_refused, forbid):
    import transformers

    forbid(transformers.AutoModelForCausalLM, "from_pretrained")
    assert_refused(engine_vs_hf.main, argv, engine_vs_hf.PROG, word)


def test_engine_vs_hf_refuses_a_batch_beyond_memory(assert_refused, monkeypatch):
    from hisparse.memory import host_memory

    monkeypatch.setattr(host_memory, "available_host_memory", lambda: 1 << 30)
    assert_refused(engine_vs_hf.main, ["--batch-sizes", "1", "4096"], engine_vs_hf.PROG,
                   "more than the 1 GiB of memory available")


@pytest.mark.parametrize("main, prog", [(demo.main, demo.PROG), (serving.main, serving.PROG),
                                        (decode_overhead.main, decode_overhead.PROG),
                                        (engine_vs_hf.main, engine_vs_hf.PROG)])
def test_help_works(main, prog, run_command):
    code, _, lines = run_command(main, ["--help"], prog)
    assert (code, lines) == (0, [])


def test_hisparse_without_a_command_says_so_on_stderr(capsys):
    assert hisparse_cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: hisparse") and err.splitlines()[-1].startswith("hisparse: error: a command")
    assert hisparse_cli.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: hisparse")
