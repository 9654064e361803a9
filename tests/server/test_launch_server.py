"""How `python -m hisparse.launch_server` lays out its threads: the engine loop in the thread that calls `run`
(the main thread, where torch steps are cheapest), HTTP in a thread of its own, and a signal that shuts both
down cleanly."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hisparse.bench.serving_server import free_loopback_port
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams
from hisparse.server.engine_loop import Delta, EngineLoop


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


def test_server_process_serves_and_shuts_down_on_sigterm():
    port = free_loopback_port()
    process = subprocess.Popen([sys.executable, "-m", "hisparse.launch_server", "--host", "127.0.0.1",
                                "--port", str(port), "--log-level", "warning"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /health in 120 s"
            time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                              json={"model": models["data"][0]["id"], "prompt": "Hello", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGTERM)  # what ServerProcess.stop and service managers send
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert "Traceback" not in output
