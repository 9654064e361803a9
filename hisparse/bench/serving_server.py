"""The real server (`python -m hisparse.launch_server`) as a child process on a free loopback port.

A serving benchmark has to measure what users run: the HTTP stack, the engine loop and the OpenAI wire
format included. Its output goes to a log file next to the results, so a server that fails to start is
reported with its own last lines instead of a bare timeout.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hisparse.distributed.tensor_parallel import free_loopback_port


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value}; a labelled pool sample is keyed `name[pool]`."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            pool = sample.labels.get("pool")
            out[f"{sample.name}[{pool}]" if pool else sample.name] = sample.value
    return out


class ServerProcess:
    def __init__(self, label: str, flags: list[str], log_path: Path, cpus: str | None = None) -> None:
        """cpus: pin the server to these cores (`taskset -c`), as if it had a machine of its own."""
        self.label = label
        self.flags = flags
        self.log_path = log_path
        self.cpus = cpus
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Returns at once; `wait_ready` blocks until the model is loaded (several seconds)."""
        self.port = free_loopback_port()
        command = [sys.executable, "-m", "hisparse.launch_server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--log-level", "warning", *self.flags]
        if self.cpus is not None:
            command = ["taskset", "-c", self.cpus, *command]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(f"$ {shlex.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def ready(self) -> bool:
        """Whether /health answers; raises if the process has exited (a bad flag, a port taken, no memory)."""
        assert self.process is not None, "start() first"
        code = self.process.poll()
        if code is not None:
            raise RuntimeError(f"the {self.label} server exited with status {code} before it was ready; "
                               f"last lines of {self.log_path}:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def metrics(self) -> dict[str, float]:
        response = httpx.get(f"{self.base_url}/metrics", timeout=30)
        response.raise_for_status()
        return parse_metrics(response.text)

    def model_name(self) -> str:
        response = httpx.get(f"{self.base_url}/v1/models", timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def stop(self) -> None:
        """SIGTERM lets uvicorn shut down, and the engine loop with it; a server that hangs is killed after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def wait_ready(servers: list[ServerProcess], timeout: float = 300.0) -> None:
    """Until every server answers /health; the first one to die or the timeout raises, naming the server."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        pending = [server for server in pending if not server.ready()]
        if pending and time.monotonic() > deadline:
            server = pending[0]
            raise RuntimeError(f"the {server.label} server did not answer /health within {timeout:.0f} s; "
                               f"last lines of {server.log_path}:\n{server.log_tail()}")
        if pending:
            time.sleep(0.25)


def start_pd_router(prefill_url: str, bootstrap_port: int, decode_url: str, log_path: Path | None = None,
                    timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """sglang-router (`--pd-disaggregation`) in front of one prefill and one decode server, on a free loopback
    port (its Prometheus exporter too, whose default port a second router would find taken); returns the
    process and its URL once its /health answers (its workers have passed their health checks)."""
    port = free_loopback_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill_url,
               str(bootstrap_port), "--decode", decode_url, "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-port", str(free_loopback_port()), "--log-level", "warn", "--disable-retries"]
    log = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL
    try:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        if log_path is not None:
            log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"sglang-router did not come up within {timeout:.0f} s (status {process.wait()}); see "
                       f"{log_path or 'its output'}")
