"""Drive a server with streaming OpenAI completions at a fixed concurrency and time every token.

Prompts go as token ids (`prompt: [ids]`, which the OpenAI completions API accepts) so both modes see
exactly the same prompt lengths, and `ignore_eos` (a vLLM/SGLang extension our server also takes) makes
every request produce exactly `max_tokens` tokens: throughput then compares equal work. Times are taken
on the client as chunks arrive, as SGLang's bench_serving does: TTFT from sending to the first text chunk
(queueing for a running slot included), ITL between consecutive text chunks.

While a level runs, /metrics is polled for the running-requests gauge, so the report shows how many
requests the server actually ran at once, not how many it could have.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from hisparse.bench.serving_server import parse_metrics

RUNNING_GAUGE = "hisparse_num_running_requests"


@dataclass
class RequestResult:
    prompt_tokens: int  # the server's usage count once it has answered (the client's before)
    output_tokens: int = 0  # the server's usage count
    cached_tokens: int = 0  # prompt tokens the server reused from its prefix cache (usage.prompt_tokens_details)
    text: str = ""
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between consecutive text chunks
    latency: float = 0.0  # seconds from sending to the last chunk
    error: str | None = None


@dataclass
class LevelRun:
    results: list[RequestResult]
    seconds: float  # from the first request sent to the last one done
    max_running: int  # the largest running-requests gauge seen while the level ran


async def stream_completion(client: httpx.AsyncClient, base_url: str, model: str, prompt: list[int],
                            max_tokens: int, on_chunk: Callable[[int], None]) -> RequestResult:
    """One streamed completion of `prompt`; on_chunk(n) reports n more tokens as they are known."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    return await stream_request(client, f"{base_url}/v1/completions", body, on_chunk, len(prompt))


async def stream_request(client: httpx.AsyncClient, url: str, body: dict, on_chunk: Callable[[int], None],
                         prompt_tokens: int = 0) -> RequestResult:
    """One streamed completion or chat completion (`body` asks for the usage chunk), timed chunk by chunk."""
    result = RequestResult(prompt_tokens=prompt_tokens)
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    break
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                text = "".join(choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                               for choice in chunk.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.text += text
                    chunks += 1
                    on_chunk(1)
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    result.latency = time.perf_counter() - start
    if result.error is None and not result.output_tokens:
        result.error = "the stream ended without a usage chunk"
    on_chunk(max(0, result.output_tokens - chunks))  # a chunk can carry several tokens
    return result


async def _poll_running(client: httpx.AsyncClient, base_url: str, interval: float, seen: list[int],
                        stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            response = await client.get(f"{base_url}/metrics")
            seen.append(int(parse_metrics(response.text).get(RUNNING_GAUGE, 0)))
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def _run_level(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                     on_chunk: Callable[[int], None], poll_interval: float) -> LevelRun:
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0), limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)
        seen: list[int] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_running(client, base_url, poll_interval, seen, stop))

        async def one(prompt: list[int]) -> RequestResult:
            async with gate:
                return await stream_completion(client, base_url, model, prompt, max_tokens, on_chunk)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
        stop.set()
        await poller
    return LevelRun(list(results), seconds, max(seen, default=0))


def run_level(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
              on_chunk: Callable[[int], None] = lambda n: None, poll_interval: float = 0.5) -> LevelRun:
    """All `prompts`, at most `concurrency` in flight at once. The running gauge is polled every
    `poll_interval` seconds: requests run for many seconds, and each poll costs the server a /metrics page
    (polling every 0.1 s made a batch-1 step about 10% slower: 61-67 ms between tokens without it, 70-73
    ms with it)."""
    return asyncio.run(_run_level(base_url, model, prompts, max_tokens, concurrency, on_chunk, poll_interval))


async def send_all(url: str, bodies: list[tuple[str, dict]], on_chunk: Callable[[int], None]
                   ) -> tuple[list[RequestResult], float]:
    """Every (path, body) streamed to `url` at once; their results and the seconds until the last ended."""
    limits = httpx.Limits(max_connections=len(bodies) + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_request(client, f"{url}{path}", body, on_chunk)
                                         for path, body in bodies))
        return list(results), time.perf_counter() - start
