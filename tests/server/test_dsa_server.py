"""A DSA checkpoint served as a user serves it (`--model-path DIR --enable-hisparse`), called with the official
openai client: chat, completions, four concurrent streams, the swap-in visible in /metrics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from test_hisparse_server import metrics

from hisparse.engine.llm_engine import LLMEngine
from hisparse.server.args import parse_args

PROMPT = ("Sparse attention reads only the tokens its indexer selects, so the rest of the cache can wait in "
          "host memory until a step needs it. ") * 4


@pytest.fixture(scope="module")
def served(tiny_dsa_dir, start_server):
    args = parse_args(["--model-path", str(tiny_dsa_dir("glm-5")), "--enable-hisparse", "--hisparse-config",
                       '{"device_buffer_size": 32}', "--max-running-requests", "4", "--device-kv-budget", "32MiB",
                       "--dtype", "float32"])
    engine = LLMEngine(args.engine_config())
    with start_server(engine, args.model_name()) as running:
        yield running, args.model_name()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].v1, api_key="x", max_retries=0, timeout=120)


def test_the_models_endpoint_names_the_folder(served, client):
    _, name = served
    assert [m.id for m in client.models.list().data] == [name]


def test_chat_and_completion_answer_and_swap_in(served, client):
    server, name = served
    before = metrics(server.base_url)
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hello!"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens > 32 and out.usage.completion_tokens == 16  # past the 32-slot hot buffer
    after = metrics(server.base_url)
    assert after["hisparse_swap_in_misses_total"] > before.get("hisparse_swap_in_misses_total", 0)
    server.wait_idle()


def test_four_concurrent_streams_each_get_their_greedy_answer(served, client):
    server, name = served
    prompts = [f"{PROMPT} Request {i}:" for i in range(4)]

    def whole(prompt):
        return client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def streamed(prompt):
        chunks = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks)

    alone = [whole(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(streamed, prompts))
    assert together == alone
    assert server.engine_loop.stats()["peak_running"] >= 2  # the streams really ran together
    server.wait_idle()
