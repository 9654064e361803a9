"""What a request must pass before a handler runs, on the real server: the API key (401 without it, /health
open), the body size (413 before the body is read), bodies that are not UTF-8 or nest too deeply (a named
400), and a cheap body of 300,000 empty messages refused without stalling a concurrent stream."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine

MODEL_NAME = "guarded-model"
KEY = "sk-test-key"
LIMIT = 12 << 20  # above the 9.9 MB body of 300,000 messages, which must reach the handler
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(llama, tokenizer, start_server):
    engine = LLMEngine(EngineConfig(max_running_requests=4), model=llama, tokenizer=tokenizer)
    with start_server(engine, MODEL_NAME, api_key=KEY, max_request_bytes=LIMIT) as running:
        yield running


def post(server, path: str, body, headers=None, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) or not isinstance(body, dict) else json.dumps(body)
    return httpx.post(f"{server.v1}/{path}", content=content, timeout=120,
                      headers={"content-type": "application/json", **AUTH, **(headers or {})}, **kwargs)


def assert_error(response: httpx.Response, status: int, code: str, word: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and word in error["message"], error


def test_requests_need_the_api_key_but_health_does_not(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        response = httpx.get(f"{server.v1}/models", headers=headers)
        assert_error(response, 401, "invalid_api_key", "API key")
        assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.base_url}/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    out = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2


def test_an_oversized_body_is_refused_with_413_before_it_is_read(server):
    big = {"model": MODEL_NAME, "prompt": "x" * (LIMIT + 10)}
    assert_error(post(server, "completions", big), 413, "request_too_large", "--max-request-bytes")

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        yield b'{"model": "guarded-model", "prompt": "'
        for _ in range(LIMIT // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    assert_error(post(server, "completions", chunks()), 413, "request_too_large", f"more than {LIMIT} bytes")
    assert post(server, "completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("body, word", [
    (b'{"model": "guarded-model", "prompt": "\xff\xfe"}', "not valid UTF-8: byte 0xff"),
    (('{"model": "guarded-model", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}").encode(), "nests"),
    (b'{"model": "guarded-model", "prompt": ', "not valid JSON"),
])
def test_an_unparsable_body_is_a_named_400(server, body, word):
    assert_error(post(server, "completions", body), 400, "invalid_json", word)


def test_300000_empty_messages_are_refused_while_a_stream_flows(server):
    """The body costs nothing to send and, templated and tokenized, once stopped every stream for seconds."""
    arrivals: list[float] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL_NAME, "prompt": "Count: one, two, three,", "max_tokens": 80, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.v1}/completions", json=body, headers=AUTH, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 5:
                        started.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert started.wait(60)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": ""}] * 300_000}
    sent = time.perf_counter()
    response = post(server, "chat/completions", body)
    done = time.perf_counter()
    streamer.join(120)
    assert_error(response, 400, "context_length_exceeded", "300000 items")
    assert response.json()["error"]["param"] == "messages"
    during = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b > sent and a < done]
    assert during and max(during) < 1.0, during
    server.wait_idle()
