"""The server through the official `openai` client and raw HTTP, on the real model.

Greedy decoding makes the answers deterministic, so streamed and non-streamed text must be identical and
token counts exact. Generations are a few tokens long to keep the module fast on a loaded CPU.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.request import Request
from hisparse.engine.sampling_params import SamplingParams
from hisparse.server.engine_loop import EngineLoop

MODEL_NAME = "test-model"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name one colour."}]


@pytest.fixture(scope="module")
def server(llama, tokenizer, start_server):
    """Two running slots and two queue places: small enough for the queue-full test to reach the limit."""
    engine = LLMEngine(EngineConfig(max_running_requests=2), model=llama, tokenizer=tokenizer)
    with start_server(engine, MODEL_NAME, max_queued_requests=2) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    # No retries: a 5xx or 429 must reach the test, not be retried away.
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(client) -> str:
    """The greedy continuation every 'still serves' check compares against."""
    return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text


def assert_still_serves(client: openai.OpenAI, reference: str) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.choices[0].text == reference
    assert out.usage.completion_tokens == 2


def metric_values(base_url: str) -> dict[str, float]:
    """{'name{label="v"}': value} for every sample on /metrics."""
    text = httpx.get(f"{base_url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


# -- the happy paths --------------------------------------------------------------------------------


def test_health_and_models_list_the_served_model(server, client):
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_stream_equals_non_stream_with_exact_usage(client, tokenizer):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL_NAME
    assert abs(out.created - time.time()) < 300
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    prompt_tokens = len(tokenizer.encode(PROMPT))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        prompt_tokens, 6, prompt_tokens + 6)

    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt_equals_text_prompt(client, tokenizer, reference):
    out = client.completions.create(model=MODEL_NAME, prompt=tokenizer.encode(PROMPT), max_tokens=2, temperature=0)
    assert out.choices[0].text == reference


def test_chat_stream_equals_non_stream_with_exact_usage(client, tokenizer):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=5, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == MODEL_NAME
    message = out.choices[0].message
    assert message.role == "assistant" and message.content
    prompt_tokens = len(tokenizer.encode_chat(MESSAGES))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        prompt_tokens, 5, prompt_tokens + 5)

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == out.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == prompt_tokens + 5


def test_sse_wire_format_ends_in_done(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    first = json.loads(events[0].removeprefix("data: "))
    assert set(first) >= {"id", "object", "created", "model", "choices"} and "usage" not in first
    assert first["choices"][0].keys() == {"index", "text", "logprobs", "finish_reason"}


def test_stop_string_is_cut_from_streamed_and_plain_text(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]  # several characters: streaming must hold them back
    expected = full[:full.find(stop)]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    def sample() -> str:
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=1.0,
                                         seed=1234).choices[0].text

    assert sample() == sample()


# -- bad input: a 400 that names the problem, and the next request is served as before ------------------

TOO_LONG = "hello " * 9000  # 9000 tokens: over the 8192-token context

BAD_INPUTS = {
    # id: (endpoint, body (a dict, or raw text), status, param, a word the message must contain)
    "malformed_json": ("completions", '{"model": "test-model", "prompt": ', 400, None, "JSON"),
    "body_not_an_object": ("completions", "[1, 2]", 400, None, "request body"),
    "missing_model": ("completions", {"prompt": "x"}, 400, "model", "missing"),
    "missing_prompt": ("completions", {}, 400, "prompt", "missing"),
    "missing_messages": ("chat/completions", {}, 400, "messages", "missing"),
    "prompt_wrong_type": ("completions", {"prompt": 123}, 400, "prompt", "string"),
    "prompt_id_wrong_type": ("completions", {"prompt": [1, "a"]}, 400, "prompt[1]", "integer"),
    "max_tokens_wrong_type": ("completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    "temperature_wrong_type": ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    "stream_wrong_type": ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    "stop_wrong_type": ("completions", {"prompt": "x", "stop": 5}, 400, "stop", "string"),
    "messages_not_a_list": ("chat/completions", {"messages": "hi"}, 400, "messages", "list"),
    "messages_empty": ("chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    "message_unknown_role": ("chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400,
                             "messages[0].role", "user"),
    "message_content_wrong_type": ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
                                   "messages[0].content", "string"),
    "negative_max_tokens": ("completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    "zero_max_completion_tokens": ("chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, 400,
                                   "max_completion_tokens", ">= 1"),
    "absurd_max_tokens": ("completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens", "context"),
    "negative_temperature": ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", "[0, 100]"),
    "absurd_temperature": ("completions", {"prompt": "x", "temperature": 1e30}, 400, "temperature", "[0, 100]"),
    "top_p_zero": ("completions", {"prompt": "x", "top_p": 0.0}, 400, "top_p", "(0, 1]"),
    "negative_seed": ("completions", {"prompt": "x", "seed": -1}, 400, "seed", "non-negative"),
    "n_two": ("completions", {"prompt": "x", "n": 2}, 400, "n", "n must be 1"),
    "logprobs": ("chat/completions", {"messages": MESSAGES, "logprobs": True}, 400, "logprobs", "not supported"),
    "empty_prompt": ("completions", {"prompt": ""}, 400, "prompt", "empty"),
    "token_id_out_of_vocab": ("completions", {"prompt": [10**9]}, 400, "prompt", "token ids"),
    "prompt_over_context": ("completions", {"prompt": TOO_LONG}, 400, "prompt", "context length"),
    "chat_over_context": ("chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, 400,
                          "messages", "context length"),
    "unknown_model": ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    # JSON can spell a lone UTF-16 surrogate, which no tokenizer takes (it was a 500 with a traceback)
    "prompt_lone_surrogate": ("completions", '{"model": "test-model", "prompt": "\\ud800 x"}', 400, "prompt",
                              "surrogate"),
    "chat_lone_surrogate": ("chat/completions",
                            '{"model": "test-model", "messages": [{"role": "user", "content": "x\\udfff"}]}',
                            400, "messages[0].content", "surrogate"),
    "stop_lone_surrogate": ("completions", '{"model": "test-model", "prompt": "x", "stop": ["\\ud83d"]}', 400,
                            "stop[0]", "surrogate"),
    # fields that would change the answer and that the server does not honour
    "response_format": ("chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}}, 400,
                        "response_format", "not supported"),
    "tools": ("chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
              400, "tools", "not supported"),
    "best_of": ("completions", {"prompt": "x", "best_of": 2}, 400, "best_of", "not supported"),
    "suffix": ("completions", {"prompt": "x", "suffix": "!"}, 400, "suffix", "not supported"),
    "stop_token_id_out_of_vocab": ("completions", {"prompt": "x", "stop_token_ids": [2**70]}, 400, "stop_token_ids",
                                   "token ids in [0, 49152)"),
    "logit_bias_key_not_an_id": ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias",
                                 "token ids"),
    "logit_bias_out_of_range": ("completions", {"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias",
                                "[-100, 100]"),
    "logit_bias_id_out_of_vocab": ("completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias",
                                   "token ids in [0, 49152)"),
    "presence_penalty_out_of_range": ("completions", {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty",
                                      "[-2, 2]"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_a_named_400_and_the_server_still_serves(server, client, reference, case):
    endpoint, body, status, param, word = BAD_INPUTS[case]
    url = f"{server.v1}/{endpoint}"
    if isinstance(body, dict):
        body = {"model": MODEL_NAME, **body} if case != "missing_model" else body
        response = httpx.post(url, json=body, timeout=60)
    else:
        response = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert word in error["message"], error["message"]
    assert_still_serves(client, reference)


def test_logit_bias_and_penalties_change_the_answer(client, tokenizer):
    """A bias of 100 on one token makes greedy decoding emit only it; a frequency penalty of 2 makes a
    repetitive greedy answer repeat itself less."""
    paris = tokenizer.encode(" Paris")[0]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logit_bias={str(paris): 100})
    assert out.choices[0].text == tokenizer.decode([paris] * 3)
    prompt = "one two one two one two one two"

    def most_repeated(**penalty) -> tuple[str, int]:
        text = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                         **penalty).choices[0].text
        ids = tokenizer.encode(text)
        return text, max(ids.count(t) for t in set(ids))

    plain, penalised = most_repeated(), most_repeated(frequency_penalty=2.0)
    assert penalised[0] != plain[0] and penalised[1] < plain[1]
    assert most_repeated(presence_penalty=2.0)[0] != plain[0]


def test_a_body_sent_without_a_json_content_type_is_told_so(server, client, reference):
    body = json.dumps({"model": MODEL_NAME, "prompt": PROMPT})
    response = httpx.post(f"{server.v1}/completions", content=body, headers={"content-type": "text/plain"})
    assert response.status_code == 400
    assert "Content-Type: application/json" in response.json()["error"]["message"]
    assert_still_serves(client, reference)


def test_a_megabyte_prompt_is_refused_without_being_tokenized(server, client, reference, tokenizer, monkeypatch):
    """Tokenizing holds the GIL (about a second per MB): a prompt that cannot fit is refused by its length."""
    encode = tokenizer.encode

    def encode_short_only(text, *args, **kwargs):
        assert len(text) < 1 << 20, "a megabyte prompt reached the tokenizer"
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode_short_only)
    huge = "hello world " * 200_000
    for endpoint, body, param in [("completions", {"prompt": huge}, "prompt"),
                                  ("chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages")]:
        response = httpx.post(f"{server.v1}/{endpoint}", json={"model": MODEL_NAME, **body}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "context_length_exceeded")
        assert "context length" in error["message"]
    assert_still_serves(client, reference)


def test_vanishing_temperature_or_top_p_samples_greedily(client, reference):
    # Accepted at the door, so they must sample: below about 1e-38 they once overflowed float32, and the NaN
    # failed every request in the step with a 500.
    for extreme in ({"temperature": 1e-300}, {"temperature": 5e-39, "top_p": 1e-300}, {"top_p": 5e-324}):
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, seed=1, **extreme)
        assert out.choices[0].text == reference, extreme


def test_openai_client_sees_unknown_model_as_not_found(client, reference):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=-5)
    assert info.value.param == "max_tokens"
    assert_still_serves(client, reference)


def test_engine_failure_fails_only_its_requests(server, client, reference, monkeypatch):
    engine = server.engine_loop.engine
    real_step, real_add = engine.step, engine.add_request
    failures = {"step": 1}

    def failing_step():
        out = real_step()  # fail after the forward pass, as a kernel error would: the request holds memory
        if failures["step"]:
            failures["step"] -= 1
            raise RuntimeError("injected step failure")
        return out

    def failing_add(prompt, params, request_id=None, **roles):
        if params.seed == 666:
            raise RuntimeError("injected add failure")
        return real_add(prompt, params, request_id, **roles)

    monkeypatch.setattr(engine, "step", failing_step)
    monkeypatch.setattr(engine, "add_request", failing_add)
    with pytest.raises(openai.InternalServerError, match="injected step failure"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    server.wait_idle()  # the failed request's memory is back
    with pytest.raises(openai.InternalServerError, match="injected add failure"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, seed=666)
    assert server.engine_loop.alive
    assert_still_serves(client, reference)
    metrics = metric_values(server.base_url)
    assert metrics['hisparse_requests_total{finish_reason="error"}'] >= 2
    # ... and not again as refused at the door: they reached the engine
    assert metrics.get('hisparse_requests_rejected_total{status="500"}', 0) == 0


# -- disconnects and overload ---------------------------------------------------------------------------

LONG = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}


def test_streaming_client_disconnect_aborts_and_frees_memory(server, client, reference):
    aborted = metric_values(server.base_url).get('hisparse_requests_total{finish_reason="abort"}', 0)
    with httpx.stream("POST", f"{server.v1}/completions", json={**LONG, "stream": True}, timeout=60) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
        assert server.engine_loop.stats()["memory"]["device_slots_used"] > 0
    stats = server.wait_idle()  # the request left the engine long before its 4000 tokens
    assert stats["memory"]["device_slots_used"] == 0
    metrics = metric_values(server.base_url)
    assert metrics['hisparse_requests_total{finish_reason="abort"}'] == aborted + 1
    assert metrics["hisparse_num_running_requests"] == 0
    assert_still_serves(client, reference)


def test_non_streaming_client_disconnect_aborts_and_frees_memory(server, client, reference):
    aborted = metric_values(server.base_url).get('hisparse_requests_total{finish_reason="abort"}', 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.v1}/completions", json=LONG, timeout=httpx.Timeout(60, read=3))
    server.wait_idle()
    assert metric_values(server.base_url)['hisparse_requests_total{finish_reason="abort"}'] == aborted + 1
    assert_still_serves(client, reference)


def test_more_requests_than_the_queue_holds_get_429_at_once(server, client, reference):
    """Two run (max_running_requests=2), two wait (max_queued_requests=2); the fifth is refused."""
    with ExitStack() as stack:
        for _ in range(4):
            stack.enter_context(httpx.stream("POST", f"{server.v1}/completions", json={**LONG, "stream": True},
                                             timeout=60))
        deadline = time.monotonic() + 60
        while not (server.engine_loop.stats()["running"] == 2 and server.engine_loop.num_queued() == 2):
            assert time.monotonic() < deadline, "four requests never settled as 2 running + 2 queued"
            time.sleep(0.05)
        metrics = metric_values(server.base_url)
        assert (metrics["hisparse_num_running_requests"], metrics["hisparse_num_queued_requests"]) == (2, 2)
        start = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
        assert time.monotonic() - start < 5
        assert info.value.code == "queue_full" and "max-queued-requests" in info.value.message
    server.wait_idle()  # closing the four streams aborted them all
    assert_still_serves(client, reference)


def test_a_burst_at_an_idle_server_runs_and_queues_without_429(server, reference):
    """Two run and two may wait: a burst of four at an idle server is all served, although the engine has not
    seen any of them when the last arrives (counting those as waiting refused half of such a burst)."""
    server.wait_idle()
    start = threading.Barrier(4)

    def one() -> int:
        start.wait()
        return httpx.post(f"{server.v1}/completions", timeout=120,
                          json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).status_code

    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda _: one(), range(4)))
    assert statuses == [200] * 4
    server.wait_idle()


class _StalledEngine:
    """An engine whose latest step left `running` requests running and `waiting` waiting, and that takes every
    new request without stepping: what the engine thread reports while newcomers pile up (no model)."""

    has_unfinished = False

    def __init__(self, running: int, waiting: int, max_running: int) -> None:
        self.scheduler = type("Scheduler", (), {"max_running_requests": max_running})()
        self.counts = {"running": running, "waiting": waiting, "memory": {}}

    def stats_dict(self) -> dict:
        return self.counts

    def add_request(self, prompt, params, request_id=None, **roles) -> Request:
        return Request([1], params, request_id)

    def abort(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("running, waiting, newcomers, queued", [
    (0, 0, 6, 2),  # an idle server: four of a burst of six take the free places
    (2, 0, 1, 0),  # a newcomer with a free place runs
    (2, 1, 2, 3),  # one already waits for memory: the newcomers wait behind it, free places or not
    (4, 0, 2, 2),  # every place taken
])
def test_queued_requests_are_those_waiting_and_newcomers_beyond_the_free_places(running, waiting, newcomers, queued):
    loop = EngineLoop(_StalledEngine(running, waiting, max_running=4))
    loop.start()

    async def submit_all() -> None:
        for i in range(running + waiting + newcomers):
            loop.submit(f"r{i}", [1], SamplingParams(max_tokens=1))

    try:
        asyncio.run(submit_all())
        assert loop.num_in_flight() == running + waiting + newcomers
        assert loop.num_queued() == queued
    finally:
        loop.stop()


def test_metrics_report_serving_and_memory(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    httpx.post(f"{server.v1}/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "n": 3})
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    m = metric_values(server.base_url)
    for name in ("hisparse_num_running_requests", "hisparse_num_queued_requests"):
        assert m[name] == 0
    assert m["hisparse_prompt_tokens_total"] >= 5 and m["hisparse_generation_tokens_total"] >= 3
    assert m["hisparse_time_to_first_token_seconds_count"] >= 1
    assert m["hisparse_inter_token_latency_seconds_count"] >= 2
    assert m["hisparse_e2e_request_latency_seconds_count"] >= 1
    # a 3-token completion decodes twice after its prefill step; the engine's own time of those steps
    assert m["hisparse_engine_decode_steps_total"] >= 2 and m["hisparse_engine_decode_seconds_total"] > 0
    assert m["hisparse_engine_steps_total"] >= m["hisparse_engine_decode_steps_total"] + 1
    assert m["hisparse_engine_step_seconds_total"] > m["hisparse_engine_decode_seconds_total"]  # + the prefill step
    assert m['hisparse_requests_total{finish_reason="length"}'] >= 1
    assert m['hisparse_kv_slots_total{pool="device"}'] > 0
    assert m['hisparse_kv_slots_used{pool="device"}'] == m["hisparse_prefix_cache_tokens"] > 0  # kept for reuse
    assert m['hisparse_requests_rejected_total{status="400"}'] >= 1
