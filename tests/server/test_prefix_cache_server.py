"""Prefix caching through the server: OpenAI's cached_tokens, the metrics, SGLang's /flush_cache."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_openai_api import metric_values

from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine

MODEL_NAME = "test-model"
PROMPT = "A radix tree keeps every prefix of the prompts it has seen, so a prompt that starts the same way"
MESSAGES = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}]


@pytest.fixture(scope="module")
def server(llama, tokenizer, start_server):
    engine = LLMEngine(EngineConfig(max_running_requests=2), model=llama, tokenizer=tokenizer)
    with start_server(engine, MODEL_NAME) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)


def flush(server) -> httpx.Response:
    return httpx.post(f"{server.base_url}/flush_cache", timeout=30)


def test_a_repeated_prompt_reports_its_cached_tokens(server, client):
    assert flush(server).status_code == 200
    first = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    before = metric_values(server.base_url)
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    after = metric_values(server.base_url)
    assert (after["hisparse_cached_prompt_tokens_total"] - before["hisparse_cached_prompt_tokens_total"]
            == again.usage.prompt_tokens - 1)
    assert after["hisparse_prefix_cache_tokens"] >= again.usage.prompt_tokens
    assert after["hisparse_prefix_cache_evictable_tokens"] == after["hisparse_prefix_cache_tokens"]
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == first.choices[0].text
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_a_chat_shares_its_system_prompt_with_the_next_one(server, client):
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0)
    other = [MESSAGES[0], {"role": "user", "content": "Grass colour?"}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=other, max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and first.usage.prompt_tokens > cached


def test_flush_cache_empties_the_tree_and_is_refused_while_a_request_uses_it(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()  # kept open: leaving the loop over it would close the connection
        for _ in range(4):
            next(lines)
        refused = flush(server)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "cache_in_use"
    server.wait_idle()  # the stream's request aborted, then the tree flushed: no slot held at all
    flushed = flush(server)
    assert flushed.status_code == 200 and flushed.text == "Cache flushed.\n"
    assert metric_values(server.base_url)["hisparse_prefix_cache_tokens"] == 0
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_without_the_radix_cache_nothing_is_reused(llama, tokenizer, start_server):
    from hisparse.server.args import parse_args

    config = parse_args(["--disable-radix-cache"]).engine_config()
    assert not config.enable_prefix_caching and EngineConfig().enable_prefix_caching
    engine = LLMEngine(EngineConfig(enable_prefix_caching=False), model=llama, tokenizer=tokenizer)
    with start_server(engine, MODEL_NAME) as running:
        client = openai.OpenAI(base_url=running.v1, api_key="x", max_retries=0, timeout=120)
        for _ in range(2):
            out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0)
            assert out.usage.prompt_tokens_details.cached_tokens == 0
        assert running.engine_loop.stats()["memory"]["prefix_cache_tokens"] == 0
