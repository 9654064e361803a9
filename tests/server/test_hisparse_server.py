"""The server with HiSparse on, configured through the same flags a user types: a hot buffer smaller than the
prompt, so decoding must swap tokens in from the host pool, and /metrics must show it."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hisparse.engine.llm_engine import LLMEngine
from hisparse.layers.indexer import SHIPPED_WEIGHTS
from hisparse.server.args import parse_args

pytestmark = pytest.mark.skipif(not SHIPPED_WEIGHTS.exists(), reason="the default model's indexer is not trained yet")

MODEL_NAME = "hisparse-test-model"
# About 130 tokens: well over the 48 hot slots per request, so the top-32 selections miss.
PROMPT = ("The history of the printing press begins with movable type in East Asia and continues in Europe, "
          "where Johannes Gutenberg combined a press, oil-based ink and metal type around 1440. ") * 3 + \
         "In one sentence, the most important consequence of the printing press was"
SWAP_IN = ("hisparse_swap_in_hits_total", "hisparse_swap_in_misses_total", "hisparse_swap_in_bytes_total",
           "hisparse_swap_in_seconds_total")


@pytest.fixture(scope="module")
def server(llama, tokenizer, start_server):
    # A small budget keeps the host pool (8x the device's by default) quick to allocate.
    args = parse_args(["--enable-hisparse", "--hisparse-config", '{"top_k": 32, "device_buffer_size": 48}',
                       "--max-running-requests", "4", "--device-kv-budget", "64MiB"])
    try:
        engine = LLMEngine(args.engine_config(), model=llama, tokenizer=tokenizer)
    except ValueError as error:  # the session's model was loaded before the indexer weights existed
        pytest.skip(str(error))
    with start_server(engine, MODEL_NAME) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)


def metrics(base_url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for sample in family.samples:
            pool = sample.labels.get("pool")
            out[f"{sample.name}[{pool}]" if pool else sample.name] = sample.value
    return out


def test_prompt_longer_than_the_hot_buffer_swaps_in_and_metrics_move(server, client, tokenizer):
    assert len(tokenizer.encode(PROMPT)) > 100
    before = metrics(server.base_url)
    assert before["hisparse_kv_slots_total[host]"] > before["hisparse_kv_slots_total[device]"] > 0
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    after = metrics(server.base_url)
    for name in SWAP_IN:
        assert after[name] > before.get(name, 0), name
    assert 0 < after["hisparse_swap_in_hit_rate"] < 1
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    assert metrics(server.base_url)["hisparse_swap_in_misses_total"] > after["hisparse_swap_in_misses_total"]
    server.wait_idle()  # host pool, hot buffer and indexer slots all given back


def test_disconnect_frees_host_and_device_slots(server, client):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=120) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n == 4:
                break
        memory = server.engine_loop.stats()["memory"]
        assert memory["host_slots_used"] > 0 and memory["device_slots_used"] > 0
    stats = server.wait_idle()
    assert stats["memory"]["host_slots_used"] == stats["memory"]["device_slots_used"] == 0
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
