"""`launch_server --tp-size 2` as users run it: real processes, the same answers as one rank, /metrics per rank,
SIGTERM ending every rank, a rank killed or stopped ending the server in one line that names it, and two
"machines" (`--nnodes 2`, two launches on loopback) answering alike; a DSA checkpoint with DP attention and its
experts split the same. No test leaves a process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hisparse.bench.serving_server import ServerProcess, free_loopback_port, wait_ready
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams

PROMPT = "The three primary colours are"
FLAGS = ["--dtype", "float32", "--device-kv-budget", "48M", "--max-running-requests", "4"]
DSA_PROMPTS = [PROMPT, "Sparse attention reads only the tokens its indexer selects. " * 8, "def add(a, b):",
               "Once upon a time " * 10]
DP_FLAGS = ["--dp-size", "2", "--enable-dp-attention", "--ep-size", "2", "--enable-hisparse", "--hisparse-config",
            '{"device_buffer_size": 32}']


@pytest.fixture(scope="module")
def one_rank_text(llama, tokenizer) -> str:
    engine = LLMEngine(EngineConfig(dtype="float32", device_kv_budget=48 << 20), model=llama, tokenizer=tokenizer)
    request = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    return request.output_text


def complete(server: ServerProcess) -> str:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                          json={"model": server.model_name(), "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def dsa_dir(tiny_dsa_dir):
    return str(tiny_dsa_dir("glm-5"))


@pytest.fixture(scope="module")
def dsa_one_rank(dsa_dir) -> list[str]:
    engine = LLMEngine(EngineConfig(model=dsa_dir, dtype="float32", device_kv_budget=48 << 20, enable_hisparse=True,
                                    hisparse_config={"device_buffer_size": 32}))
    requests = [engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
                for prompt in DSA_PROMPTS]
    while engine.has_unfinished:
        engine.step()
    return [r.output_text for r in requests]


def ranks_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "hisparse.engine.workers"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def exit_within(server: ServerProcess, seconds: float) -> int:
    try:
        return server.process.wait(seconds)
    finally:
        server.stop()


@pytest.fixture
def tp_server(tmp_path):
    started = []

    def start(*flags: str) -> ServerProcess:
        server = ServerProcess("tp2", ["--tp-size", "2", *FLAGS, *flags], tmp_path / f"server{len(started)}.log")
        server.start()
        started.append(server)
        wait_ready([server])
        return server

    yield start
    for server in started:
        server.stop()


def test_two_ranks_answer_as_one_and_sigterm_ends_both(tp_server, one_rank_text):
    server = tp_server()
    ranks = ranks_of(server.process.pid)
    assert len(ranks) == 1
    assert complete(server) == one_rank_text
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert "hisparse_tp_size 2.0" in metrics
    assert 'hisparse_device_kv_bytes{rank="0"}' in metrics and 'hisparse_device_kv_bytes{rank="1"}' in metrics
    server.process.send_signal(signal.SIGTERM)
    assert exit_within(server, 30) == 0
    assert not any(alive(pid) for pid in ranks)


def test_a_dsa_model_with_dp_attention_answers_as_one_rank(tp_server, dsa_dir, dsa_one_rank):
    """Four requests at once spread over both ranks (round robin), each answered as one rank answers it."""
    server = tp_server("--model-path", dsa_dir, *DP_FLAGS)
    ranks = ranks_of(server.process.pid)

    def ask(prompt: str) -> str:
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                              json={"model": server.model_name(), "prompt": prompt, "max_tokens": 24,
                                    "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(DSA_PROMPTS)) as pool:
        assert list(pool.map(ask, DSA_PROMPTS)) == dsa_one_rank
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert "hisparse_dp_size 2.0" in metrics and 'hisparse_host_kv_bytes{rank="1"}' in metrics
    misses = float(re.search(r"^hisparse_swap_in_misses_total (\S+)$", metrics, re.M).group(1))
    assert misses > 0
    server.process.send_signal(signal.SIGTERM)
    assert exit_within(server, 30) == 0
    assert not any(alive(pid) for pid in ranks)


@pytest.mark.parametrize("fault, words, dsa", [(signal.SIGKILL, "rank 1 died (exit code -9)", False),
                                               (signal.SIGSTOP, "rank 1 hung (stopped", False),
                                               (signal.SIGKILL, "rank 1 died (exit code -9)", True)],
                         ids=["killed", "stopped", "killed-dp-attention"])
def test_a_lost_rank_ends_the_server_in_one_line(tp_server, request, fault, words, dsa):
    flags = ["--model-path", request.getfixturevalue("dsa_dir"), *DP_FLAGS] if dsa else []
    server = tp_server("--skip-server-warmup", *flags)
    (rank,) = ranks_of(server.process.pid)
    started = time.monotonic()
    os.kill(rank, fault)
    assert exit_within(server, 15) == 1
    assert time.monotonic() - started < 10
    assert words in server.log_path.read_text()
    assert not alive(rank)


@pytest.mark.parametrize("model", ["llama", "dsa-dp-attention"])
def test_two_nodes_on_loopback_answer_as_one(tmp_path, request, model):
    addr = f"127.0.0.1:{free_loopback_port()}"
    nodes = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, *FLAGS, "--skip-server-warmup"]
    if model == "llama":
        expected = request.getfixturevalue("one_rank_text")
    else:
        nodes += ["--model-path", request.getfixturevalue("dsa_dir"), *DP_FLAGS]
        expected = request.getfixturevalue("dsa_one_rank")[0]
    second = subprocess.Popen([sys.executable, "-m", "hisparse.launch_server", *nodes, "--node-rank", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = ServerProcess("node 0", [*nodes, "--node-rank", "0"], tmp_path / "node0.log")
    try:
        first.start()
        wait_ready([first])
        assert ranks_of(first.process.pid) == []  # its other rank is the second node's
        assert complete(first) == expected
        first.process.send_signal(signal.SIGTERM)
        assert exit_within(first, 30) == 0
        assert second.wait(30) == 0, second.stdout.read()
    finally:
        first.stop()
        if second.poll() is None:
            second.kill()
            second.wait()


@pytest.mark.parametrize("argv, words", [
    (["--dp-size", "2"], "--dp-size: dp_size 2 without enable_dp_attention"),
    (["--tp-size", "2", "--enable-dp-attention"], "--enable-dp-attention: enable_dp_attention with dp_size 1"),
    (["--tp-size", "2", "--ep-size", "3"], "--ep-size: ep_size must be 1"),
    (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"], "--tp-size: tp_size 3 does not split"),
    (["--tp-size", "2", "--nnodes", "2"], "--nnodes: nnodes > 1 needs dist_init_addr"),
    (["--node-rank", "1"], "--node-rank: node_rank must be an integer in [0, nnodes=1)"),
    (["--tp-size", "2", "--dist-init-addr", "nohost"], "--dist-init-addr: dist_init_addr must be HOST:PORT"),
    (["--tp-size", "2", "--disaggregation-mode", "prefill"], "tp_size > 1 with --disaggregation-mode"),
])
def test_parallel_flags_are_checked_before_anything_loads(assert_refused, argv, words):
    from hisparse.launch_server import PROG, main

    assert_refused(main, argv, PROG, words)
