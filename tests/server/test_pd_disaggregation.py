"""Prefill-decode disaggregation behind the real sglang-router: a prefill server writes each prompt's rows into
the decode server's pools with Mooncake's transfer engine, and the answers equal a co-located server's, for
both model families, streaming and not, with HiSparse on the decode side and prompts several times longer
than its hot buffer. Then the faults: each one ends the request with a clear error and leaves no slot held
on either side."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from hisparse.bench.serving_server import free_loopback_port as free_port
from hisparse.bench.serving_server import start_pd_router
from hisparse.disaggregation.protocol import Destination, prompt_digest
from hisparse.disaggregation.transfer_engine import KVTransferEngine
from hisparse.engine.llm_engine import LLMEngine
from hisparse.server.args import parse_args
from hisparse.server.pd_decode import DecodeRooms
from hisparse.server.pd_prefill import PrefillInstance

MODEL = "pd-test-model"
HISPARSE = ["--enable-hisparse", "--hisparse-config", '{"top_k": 32, "device_buffer_size": 48}']
# About 120 tokens: two and a half hot buffers of the decode side.
PROMPT = ("The history of the printing press begins with movable type in East Asia and continues in Europe, "
          "where Johannes Gutenberg combined a press, oil-based ink and metal type around 1440. ") * 3 + \
         "In one sentence,"
TIMEOUT = 20.0  # each room's: generous for two cores under load, short enough for the fault tests


def engine(flags: list[str], model, tokenizer) -> LLMEngine:
    config = parse_args([*flags, "--max-running-requests", "4", "--device-kv-budget", "64MiB",
                         "--dtype", "float32"]).engine_config()
    return LLMEngine(config) if model is None else LLMEngine(config, model=model, tokenizer=tokenizer)


def prefill_role(engine_loop):
    return PrefillInstance(engine_loop, KVTransferEngine(), "127.0.0.1", 0, TIMEOUT)


def decode_role(engine_loop):
    return DecodeRooms(engine_loop, KVTransferEngine(), TIMEOUT)


class Deployment:
    """A prefill server, a decode server, a co-located server to compare with, and sglang-router in front."""

    def __init__(self, prefill, decode, colocated, router: str) -> None:
        self.prefill, self.decode, self.colocated, self.router = prefill, decode, colocated, router

    @property
    def bootstrap_port(self) -> int:
        return httpx.get(f"{self.prefill.base_url}/server_info").json()["bootstrap_port"]

    def idle(self) -> None:
        for server in (self.prefill, self.decode):
            stats = server.wait_idle()
            assert not stats["transferring"] and not stats["held"], stats

    def rooms(self) -> dict:
        return self.prefill.engine_loop.call(lambda _: dict(self.prefill_rooms.rooms)).result(10)

    @property
    def prefill_rooms(self):
        return next(h.__self__ for h in self.prefill.engine_loop.after_step)


@pytest.fixture(scope="module")
def deployments(llama, tokenizer, tiny_dsa_dir, start_server):
    """Per model family: (Deployment, served model name)."""
    made, routers, contexts = {}, [], []
    try:
        for family, flags, model in (("default", [], llama), ("glm-5", ["--model-path", str(tiny_dsa_dir("glm-5")),
                                                                         "--served-model-name", MODEL], None)):
            shared = model
            if model is None:  # one load of the checkpoint for the three engines
                shared = engine(flags, None, None)
                model, tok = shared.model, shared.tokenizer
            else:
                tok = tokenizer
            servers = []
            for role, extra in ((prefill_role, []), (decode_role, HISPARSE), (None, HISPARSE)):
                context = start_server(engine(flags + extra, model, tok), MODEL, role=role)
                contexts.append(context)
                servers.append(context.__enter__())
            prefill, decode, colocated = servers
            port = httpx.get(f"{prefill.base_url}/server_info").json()["bootstrap_port"]
            process, url = start_pd_router(prefill.base_url, port, decode.base_url)
            routers.append(process)
            made[family] = Deployment(prefill, decode, colocated, url)
        yield made
    finally:
        for process in routers:
            process.terminate()
            process.wait(10)
        for context in reversed(contexts):
            context.__exit__(None, None, None)


def completion(base: str, **fields) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": MODEL, "temperature": 0, **fields}, timeout=120)


def streamed_text(base: str, path: str, body: dict) -> str:
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)


@pytest.mark.parametrize("family", ["default", "glm-5"])
def test_answers_through_the_router_equal_a_colocated_servers(deployments, family):
    d = deployments[family]
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    expected = completion(d.colocated.base_url, **body).json()
    routed = completion(d.router, **body)
    assert routed.status_code == 200, routed.text
    got = routed.json()
    assert got["choices"][0]["text"] == expected["choices"][0]["text"]
    assert got["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"] > 2 * 48
    assert got["usage"]["completion_tokens"] == 12
    assert streamed_text(d.router, "/v1/completions", {"model": MODEL, "temperature": 0, **body}) == \
        expected["choices"][0]["text"]
    chat = {"model": MODEL, "temperature": 0, "max_tokens": 8, "messages": [{"role": "user", "content": PROMPT}]}
    want = httpx.post(f"{d.colocated.base_url}/v1/chat/completions", json=chat, timeout=120).json()
    routed_chat = httpx.post(f"{d.router}/v1/chat/completions", json=chat, timeout=120).json()
    assert routed_chat["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert streamed_text(d.router, "/v1/chat/completions", chat) == want["choices"][0]["message"]["content"]
    d.idle()
    decoded = d.decode.engine_loop.stats()
    assert decoded["prompt_tokens"] > 0 and decoded["swap_in"]["misses"] > 0  # the decode side swapped in


def test_concurrent_requests_beyond_the_decode_batch_wait_their_turn(deployments):
    d = deployments["default"]
    prompts = [f"Request {i}: " + PROMPT for i in range(6)]  # 6 requests for 4 running places
    with ThreadPoolExecutor(6) as pool:
        expected = list(pool.map(lambda p: completion(d.colocated.base_url, prompt=p, max_tokens=6).json(), prompts))
        routed = list(pool.map(lambda p: completion(d.router, prompt=p, max_tokens=6), prompts))
    assert [r.status_code for r in routed] == [200] * 6
    assert [r.json()["choices"][0]["text"] for r in routed] == [e["choices"][0]["text"] for e in expected]
    d.idle()


def test_a_decode_instance_refuses_a_request_without_a_room(deployments):
    d = deployments["default"]
    refused = completion(d.decode.base_url, prompt="Hi", max_tokens=2)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "missing_bootstrap"


def test_a_room_nobody_claims_times_out_and_frees_the_prefill_side(deployments, monkeypatch):
    d = deployments["default"]
    monkeypatch.setattr(d.prefill_rooms, "timeout", 1.0)
    start = time.monotonic()
    lone = completion(d.prefill.base_url, prompt=PROMPT, max_tokens=4, bootstrap_host="127.0.0.1",
                      bootstrap_port=d.bootstrap_port, bootstrap_room=1)
    assert lone.status_code == 504 and lone.json()["error"]["code"] == "room_timeout", lone.text
    assert "never claimed" in lone.json()["error"]["message"] and time.monotonic() - start < 10
    d.idle()
    late = completion(d.decode.base_url, prompt=PROMPT, max_tokens=4, bootstrap_host="127.0.0.1",
                      bootstrap_port=d.bootstrap_port, bootstrap_room=1)  # the decode half, after the room ended
    assert late.status_code == 502 and "timed out" in late.json()["error"]["message"], late.text
    d.idle()


def test_a_prefill_half_that_comes_after_its_room_was_cancelled_fails_at_once_and_frees(deployments):
    d = deployments["default"]
    port = d.bootstrap_port
    assert httpx.delete(f"http://127.0.0.1:{port}/rooms/7", timeout=30).status_code == 200
    late = completion(d.prefill.base_url, prompt="Short.", max_tokens=4, bootstrap_host="127.0.0.1",
                      bootstrap_port=port, bootstrap_room=7)
    assert late.status_code == 499 and late.json()["error"]["code"] == "cancelled", late.text
    d.idle()  # its held rows went back


def test_an_unreachable_prefill_instance_fails_the_decode_request_and_frees_it(deployments):
    d = deployments["default"]
    failed = completion(d.decode.base_url, prompt=PROMPT, max_tokens=4, bootstrap_host="127.0.0.1",
                        bootstrap_port=free_port(), bootstrap_room=2)
    assert failed.status_code == 502 and failed.json()["error"]["code"] == "prefill_unreachable", failed.text
    d.idle()


def test_a_prefill_instance_that_sends_nothing_fails_the_decode_request_within_its_timeout(deployments,
                                                                                         monkeypatch):
    """The prefill side answers its bootstrap port but no rows come (its half of the room never arrives, as when
    it stalls): the decode request fails after the timeout, cancels the room and frees its memory."""
    d = deployments["default"]
    rooms = next(h.__self__ for h in d.decode.engine_loop.after_step)
    monkeypatch.setattr(rooms, "timeout", 1.5)
    monkeypatch.setattr(rooms, "_client", None)  # the next claim's client takes the short timeout
    start = time.monotonic()
    failed = completion(d.decode.base_url, prompt=PROMPT, max_tokens=4, bootstrap_host="127.0.0.1",
                        bootstrap_port=d.bootstrap_port, bootstrap_room=6)
    assert failed.status_code == 504 and failed.json()["error"]["code"] == "kv_transfer_timeout", failed.text
    assert time.monotonic() - start < 10
    monkeypatch.undo()
    rooms._client = None
    deadline = time.monotonic() + 20
    while 6 in d.rooms():  # cancelled at the prefill side too
        assert time.monotonic() < deadline
        time.sleep(0.05)
    d.idle()


def test_a_decode_instance_that_is_gone_frees_the_prefill_side(deployments, tokenizer):
    """Its transfer engine no longer answers: the first write fails, the prefill request fails and frees."""
    d = deployments["default"]
    gone = KVTransferEngine()
    ids = tokenizer.encode(PROMPT)
    rows = np.arange(len(ids), dtype=np.int64)[:, None].repeat(len(d.prefill_rooms.pools), 1)
    destination = Destination("127.0.0.1:1", d.prefill_rooms.pools, rows, 0, len(ids), prompt_digest(ids))
    port = d.bootstrap_port
    with ThreadPoolExecutor(2) as pool:
        claim = pool.submit(httpx.put, f"http://127.0.0.1:{port}/rooms/3", json=destination.to_json(), timeout=60)
        answer = completion(d.prefill.base_url, prompt=ids, max_tokens=4, bootstrap_host="127.0.0.1",
                            bootstrap_port=port, bootstrap_room=3)
        claimed = claim.result()
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "kv_transfer_failed", answer.text
    assert claimed.status_code == 502 and "writing the rows" in claimed.json()["error"]["message"]
    del gone
    d.idle()


def test_a_client_gone_while_its_rows_are_awaited_cancels_the_room_on_both_sides(deployments):
    """The decode request holds its memory while it waits for a prefill request that never comes; the client
    hangs up: the decode side cancels the room at the prefill side before it frees its own memory."""
    d = deployments["default"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": d.bootstrap_port, "bootstrap_room": 4}
    with httpx.stream("POST", f"{d.decode.v1}/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        deadline = time.monotonic() + 20
        while 4 not in d.rooms():  # the decode side has claimed it
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline = time.monotonic() + 20
    while 4 in d.rooms():
        assert time.monotonic() < deadline, "the room was not cancelled"
        time.sleep(0.05)
    d.idle()


def test_a_client_gone_mid_stream_through_the_router_frees_both_sides(deployments):
    d = deployments["default"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", f"{d.router}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()  # kept open: leaving a loop over it would close the connection
        for _ in range(3):
            next(lines)
    d.idle()


def test_a_prefill_process_killed_mid_request_fails_the_decode_request(deployments, model_path, tmp_path):
    """A real prefill server process: the decode request waits on its room, the process is killed, and the
    decode side answers with an error at once (not after the timeout) and frees its memory."""
    d = deployments["default"]
    port, bootstrap = free_port(), free_port()
    log = open(tmp_path / "prefill.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "hisparse.launch_server", "--port", str(port),
                                "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap),
                                "--skip-server-warmup", "--device-kv-budget", "64MiB", "--dtype", "float32",
                                "--served-model-name", MODEL], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "prefill.log").read_text()
            time.sleep(0.2)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(completion, d.decode.base_url, prompt=PROMPT, max_tokens=4,
                                  bootstrap_host="127.0.0.1", bootstrap_port=bootstrap, bootstrap_room=5)
            deadline = time.monotonic() + 20
            while not d.decode.engine_loop.stats().get("transferring"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(0.3)  # its claim is on the wire
            process.kill()
            killed = time.monotonic()
            failed = waiting.result()
        assert time.monotonic() - killed < TIMEOUT / 2
        assert failed.status_code == 502, failed.text
        assert failed.json()["error"]["code"] in ("prefill_unreachable", "kv_transfer_failed"), failed.text
    finally:
        process.kill()
        process.wait(10)
        log.close()
    d.idle()
