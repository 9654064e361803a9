"""A real uvicorn server on a free 127.0.0.1 port, in a thread of the test process.

In-process rather than a subprocess so that every module shares the session's loaded model (loading it takes
tens of seconds here) and tests can look at the engine loop directly; the socket, HTTP stack and engine thread
are the ones `python -m hisparse.launch_server` runs.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from hisparse.engine.llm_engine import LLMEngine
from hisparse.server.api_server import create_app
from hisparse.server.engine_loop import EngineLoop


class RunningServer:
    def __init__(self, base_url: str, engine_loop: EngineLoop, api_key: str | None = None) -> None:
        self.base_url = base_url
        self.engine_loop = engine_loop
        self.headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Until nothing runs or waits and, the prefix cache flushed (`POST /flush_cache`), no KV slot is held;
        returns the engine's stats then."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_loop.stats()
            used = {k: v for k, v in stats["memory"].items() if k.endswith("_used") and v}
            idle = (self.engine_loop.num_in_flight() == 0 and stats["running"] == 0 and stats["waiting"] == 0
                    and not stats.get("transferring") and not stats.get("held"))
            if idle and not used:
                return stats
            if idle and stats["memory"].get("prefix_cache_tokens"):
                httpx.post(f"{self.base_url}/flush_cache", headers=self.headers, timeout=timeout)
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: in flight "
                                     f"{self.engine_loop.num_in_flight()}, stats {stats}")
            time.sleep(0.05)


@contextmanager
def serve(engine: LLMEngine, model_name: str, max_queued_requests: int = 256, role=None,
          **app_args) -> Iterator[RunningServer]:
    """app_args: create_app's api_key and max_request_bytes; role(engine_loop): its disaggregation part."""
    engine_loop = EngineLoop(engine)
    app = create_app(engine_loop, model_name, max_queued_requests,
                     disaggregation=None if role is None else role(engine_loop), **app_args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; handing uvicorn the socket leaves no race
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine_loop, app_args.get("api_key"))
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="session")
def start_server():
    """`with start_server(engine, model_name, max_queued_requests) as server:` (test modules size their own)."""
    return serve
