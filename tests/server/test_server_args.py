"""Flags of `python -m hisparse.launch_server` / `hisparse serve`: parsed into the engine's config, and every
mistake refused with one line and exit status 2 before any model loads."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from hisparse.cli import main as cli_main
from hisparse.cli_args import parse_size
from hisparse.launch_server import main as launch_main
from hisparse.server.args import ServerArgs, parse_args


@pytest.mark.parametrize("text, size", [
    ("1073741824", 1 << 30), ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("512mib", 512 << 20), ("1.5GB", 1_500_000_000),
    ("64K", 64 << 10), ("3 G", 3 << 30), ("100b", 100),
])
def test_sizes_in_bytes_or_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "2XB", "-1GiB", "0", "1.2.3G", "two"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_defaults_match_sglang_habits():
    args = parse_args([])
    assert (args.host, args.port, args.model_path) == ("127.0.0.1", 30000, None)
    config = args.engine_config()
    assert config.model is None and not config.enable_hisparse and config.sparse_attention


def test_flags_reach_the_engine_config():
    args = parse_args(["--model-path", "default", "--port", "8000", "--host", "0.0.0.0", "--enable-hisparse",
                       "--hisparse-config", '{"top_k": 32, "device_buffer_size": 48}', "--max-running-requests",
                       "8", "--chunked-prefill-size", "128", "--device-kv-budget", "256MiB", "--swap-in-backend",
                       "reference", "--max-queued-requests", "3", "--served-model-name", "m", "--log-level",
                       "WARNING"])
    assert (args.port, args.host, args.max_queued_requests, args.model_name(), args.log_level) == (
        8000, "0.0.0.0", 3, "m", "warning")
    config = args.engine_config()
    assert config.enable_hisparse and config.hisparse_config.device_buffer_size == 48 and config.top_k == 32
    assert (config.max_running_requests, config.chunked_prefill_size, config.device_kv_budget) == (8, 128, 256 << 20)
    assert config.swap_in_backend == "reference" and config.dtype == "auto"
    assert parse_args(["--dtype", "float32"]).engine_config().model_dtype == torch.float32
    dense = parse_args(["--disable-sparse-attention", "--top-k", "64"]).engine_config()
    assert not dense.sparse_attention and dense.top_k == 64


def test_served_model_name_defaults_to_the_model():
    assert ServerArgs().model_name() == "SmolLM2-135M-Instruct"


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("argv, words", [
    (["--port", "abc"], "--port"),
    (["--port", "70000"], "65535"),
    (["--device-kv-budget", "2XB"], "--device-kv-budget"),
    (["--max-running-requests", "0"], ">= 1"),
    (["--swap-in-backend", "gpu"], "invalid choice"),
    (["--dtype", "float16"], "invalid choice"),
    (["--bogus"], "unrecognized arguments"),
    (["--enable-hisparse", "--hisparse-config", "{bad"], "--hisparse-config: hisparse_config is not valid JSON"),
    (["--enable-hisparse", "--hisparse-config", '{"top_k": 64, "device_buffer_size": 32}'], "device_buffer_size"),
    (["--hisparse-config", "{}"], "enable_hisparse is off"),
    (["--enable-hisparse", "--disable-sparse-attention"], "sparse_attention"),
    (["--model-path", "/no/such/model.gguf"], "does not exist"),
    (["--device", "gpu"], "--device: not a device: 'gpu'"),
    *([] if torch.cuda.is_available() else [(["--device", "cuda"], "CUDA is not available")]),
])
def test_bad_flags_fail_with_one_line(capsys, argv, words):
    assert launch_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m hisparse.launch_server: error: ")
    assert words in err


def test_a_taken_port_fails_before_loading(capsys, busy_port):
    assert launch_main(["--port", str(busy_port)]) == 2
    assert f"cannot listen on 127.0.0.1:{busy_port}" in capsys.readouterr().err


def test_console_script_dispatches_serve(capsys):
    assert cli_main(["serve", "--port", "x"]) == 2
    assert capsys.readouterr().err.startswith("hisparse serve: error: argument --port")
    assert cli_main(["sevre"]) == 2
    assert "unknown command 'sevre'" in capsys.readouterr().err
    assert cli_main(["--help"]) == 0 and "serve" in capsys.readouterr().out


def test_module_entry_point_fails_without_traceback():
    run = subprocess.run([sys.executable, "-m", "hisparse.launch_server", "--device-kv-budget", "lots"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr and "not a size: 'lots'" in run.stderr


def test_disaggregation_flags_are_sglangs_and_a_taken_bootstrap_port_fails_before_loading(capsys, busy_port):
    args = parse_args([])
    assert (args.disaggregation_mode, args.disaggregation_transfer_backend, args.disaggregation_bootstrap_port) == \
        ("null", "mooncake", 8998)
    assert parse_args(["--disaggregation-mode", "decode"]).disaggregation_mode == "decode"
    assert launch_main(["--disaggregation-mode", "both"]) == 2
    assert "invalid choice: 'both'" in capsys.readouterr().err
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert launch_main(["--port", str(port), "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                        str(busy_port)]) == 2
    assert f"cannot listen on 127.0.0.1:{busy_port}" in capsys.readouterr().err
