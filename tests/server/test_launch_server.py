"""How `python -m hisparse.launch_server` lays out its threads: the engine loop in the thread that calls `run`
(the main thread, where torch steps are cheapest), HTTP in a thread of its own, and a signal that shuts both
down cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from hisparse.bench.serving_server import ServerProcess, wait_ready
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.server.engine_loop import Delta, EngineLoop, EngineUnavailable, Failed


def test_run_steps_the_engine_in_the_calling_thread(llama, tokenizer):
    engine = LLMEngine(EngineConfig(max_running_requests=2), model=llama, tokenizer=tokenizer)
    stepped_in = set()
    step = engine.step

    def recording_step():
        stepped_in.add(threading.get_ident())
        return step()

    engine.step = recording_step
    loop = EngineLoop(engine)
    events: list = []

    async def one_request() -> None:
        stream = loop.submit("r0", "The capital of France is", SamplingParams(max_tokens=3, temperature=0.0))
        while not stream.finished:
            events.append(await stream.get())

    def http_side() -> None:  # what uvicorn's thread does: submit, read the deltas, then stop the loop
        try:
            asyncio.run(one_request())
        finally:
            loop.stop()

    client = threading.Thread(target=http_side)
    loop.run(on_running=client.start)  # returns once the client thread has stopped it
    client.join(30)

    assert stepped_in == {threading.get_ident()}
    assert isinstance(events[-1], Delta) and events[-1].finish_reason == "length" and events[-1].completion_tokens == 3
    assert not loop.alive and not engine.has_unfinished
    with pytest.raises(RuntimeError, match="started already"):
        loop.start()


def test_a_drained_loop_refuses_new_requests_and_its_stop_frees_the_running_ones(llama, tokenizer):
    """The two steps of a shutdown: drain (503 for new requests, the running go on), then stop (they are
    aborted, their streams told why, their memory freed)."""
    engine = LLMEngine(EngineConfig(max_running_requests=2), model=llama, tokenizer=tokenizer)
    loop = EngineLoop(engine)
    loop.start()
    events: list = []

    async def drained() -> None:
        stream = loop.submit("long", "Count:", SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
        while len([e for e in events if isinstance(e, Delta)]) < 3:
            events.append(await stream.get())
        loop.drain()
        with pytest.raises(EngineUnavailable, match="shutting down"):
            loop.submit("late", "Hi", SamplingParams(max_tokens=2))
        await asyncio.to_thread(loop.stop)
        while not stream.finished:
            events.append(await stream.get())

    asyncio.run(drained())
    assert isinstance(events[-1], Failed) and (events[-1].status, events[-1].code) == (503, "server_shutting_down")
    assert engine.flush_cache()  # no request references the prefix cache any more
    assert all(v == 0 for k, v in engine.stats_dict()["memory"].items() if k.endswith("_used"))


def long_stream(server: ServerProcess, lines: list[tuple[float, str]], started: threading.Event) -> threading.Thread:
    """A 3000-token stream in a thread, its lines and their arrival times into `lines`."""
    def run() -> None:
        body = {"model": server.model_name(), "prompt": "Count:", "max_tokens": 3000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append((time.monotonic(), line))
                    if len(lines) == 3:
                        started.set()
        except httpx.HTTPError as error:  # the server went away mid-stream
            lines.append((time.monotonic(), f"error: {error!r}"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_server_process_serves_then_ends_a_long_stream_within_the_grace_period_on_sigterm(tmp_path):
    server = ServerProcess("default", ["--graceful-shutdown-timeout", "2"], tmp_path / "server.log")
    server.start()
    try:
        wait_ready([server], timeout=120)
        # the warm-up (tests/engine/test_warm_up.py shows it runs) is not counted in /metrics
        metrics = server.metrics()
        assert metrics["hisparse_engine_steps_total"] == metrics["hisparse_prompt_tokens_total"] == 0
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                              json={"model": server.model_name(), "prompt": "Hello", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        lines: list[tuple[float, str]] = []
        started = threading.Event()
        streamer = long_stream(server, lines, started)
        assert started.wait(60)
        children = [p for p in os.listdir("/proc") if p.isdigit() and _parent_of(p) == server.process.pid]
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)  # as service managers send it
        # No new request is taken: 503 while the socket still listens, refused once it has closed; a connection
        # that reached the accept queue just before uvicorn closed the socket is reset without an answer.
        try:
            late = httpx.post(f"{server.base_url}/v1/completions", timeout=10,
                              json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2})
            assert late.status_code == 503
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            pass
        streamer.join(30)
        assert server.process.wait(30) == 0
        exited = time.monotonic()
    finally:
        server.stop()
    ended, last = lines[-1]
    assert last == "data: [DONE]" and "server_shutting_down" in lines[-2][1], lines[-3:]
    assert ended - signalled < 2 + 3 and exited - signalled < 2 + 8  # within the grace period, and a little
    assert children == [] and "Traceback" not in server.log_path.read_text()


def test_a_second_signal_exits_at_once(tmp_path):
    server = ServerProcess("default", ["--graceful-shutdown-timeout", "60", "--skip-server-warmup"],
                           tmp_path / "server.log")
    server.start()
    try:
        wait_ready([server], timeout=120)
        started = threading.Event()
        long_stream(server, [], started)
        assert started.wait(60)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(10) == 128 + signal.SIGTERM
        assert time.monotonic() - signalled < 5
    finally:
        server.stop()


def _parent_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
