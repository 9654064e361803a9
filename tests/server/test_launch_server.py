"""How `python -m hisparse.launch_server` lays out its threads: the engine loop in the thread that calls `run`
(the main thread, where torch steps are cheapest), HTTP in a thread of its own, and a signal that shuts both
down cleanly."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from hisparse.bench.serving_server import ServerProcess, wait_ready
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


def test_server_process_serves_and_shuts_down_on_sigterm(tmp_path):
    server = ServerProcess("default", [], tmp_path / "server.log")
    server.start()
    try:
        wait_ready([server], timeout=120)
        # the warm-up (tests/engine/test_warm_up.py shows it runs) is not counted in /metrics
        metrics = server.metrics()
        assert metrics["hisparse_engine_steps_total"] == metrics["hisparse_prompt_tokens_total"] == 0
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                              json={"model": server.model_name(), "prompt": "Hello", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()  # SIGTERM, as service managers send; killed (a non-zero status) if it hangs 30 s
    log = server.log_path.read_text()
    assert server.process.returncode == 0, log
    assert "Traceback" not in log
