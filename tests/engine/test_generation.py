"""The engine on the real model: batching, sampling parameters, stops, memory accounting."""

from __future__ import annotations

import pytest

from hisparse import SamplingParams
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.llm import LLM

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors: red,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_llm(llama, tokenizer, **engine_args) -> LLM:
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(EngineConfig(**engine_args), model=llama, tokenizer=tokenizer)
    llm.tokenizer = tokenizer
    return llm


@pytest.fixture(scope="module")
def llm(llama, tokenizer):
    return make_llm(llama, tokenizer, chunked_prefill_size=16)


def test_batching_does_not_change_greedy_tokens(llm):
    together = llm.generate(PROMPTS, GREEDY)
    alone = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in together)


def test_chat_answers_the_question(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_token_id_prompts_equal_text_prompts(llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    assert llm.generate(ids, GREEDY)[0].token_ids == llm.generate(PROMPTS[0], GREEDY)[0].token_ids


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=s, max_tokens=16, ignore_eos=True)
              for s in (1, 1, 2)]
    a, b, c = llm.generate([PROMPTS[2]] * 3, params)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_is_greedy(llm):
    sampled = SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=12, ignore_eos=True)
    assert llm.generate(PROMPTS[1], sampled)[0].token_ids == llm.generate(
        PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids


def test_stop_string_truncates_text(llm):
    full = llm.generate(PROMPTS[3], GREEDY)[0].text
    stop = full.strip().split()[1]
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert full.startswith(out.text)


def test_stop_token_ids_end_generation(llm):
    first = llm.generate(PROMPTS[0], GREEDY)[0].token_ids
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24,
                                                  stop_token_ids=[first[2]]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == first[:3]


@pytest.mark.parametrize("kwargs, name", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"seed": -5}, "seed"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
])
def test_invalid_sampling_params_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_invalid_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 10**9]], GREEDY)
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[1] * 8190], SamplingParams(max_tokens=10))
    assert not llm.engine.has_unfinished


def test_admission_is_bounded_by_the_budget_and_nothing_leaks(llama, tokenizer):
    # Room for exactly two requests of 8 + 24 tokens: the other two wait, none fails mid-step.
    per_token = llama.config.num_layers * 2 * llama.config.kv_size * llama.embed_tokens.weight.element_size()
    llm = make_llm(llama, tokenizer, device_kv_budget=per_token * 70)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8 + i] for i in range(4)]
    outs = llm.generate(prompts, GREEDY)
    assert all(len(o.token_ids) == 24 for o in outs)
    assert llm.engine.scheduler.peak_running == 2
    assert llm.engine.cache.allocator.num_free == llm.engine.cache.capacity_tokens
    with pytest.raises(ValueError, match="capacity"):
        llm.generate([[1] * 60], GREEDY)


def test_a_budget_that_buys_no_token_is_refused_at_start(llama, tokenizer):
    # A server started with it would refuse every request, each with a 400 blaming the client.
    with pytest.raises(ValueError, match="buys no token slot"):
        make_llm(llama, tokenizer, device_kv_budget=1)


def test_a_budget_beyond_the_machine_is_refused_at_start(llama, tokenizer, monkeypatch):
    from hisparse.memory import paged_kv_cache

    monkeypatch.setattr(paged_kv_cache, "available_host_memory", lambda: 1 << 20)
    with pytest.raises(ValueError, match="device KV budget .* more than this machine has available"):
        make_llm(llama, tokenizer, device_kv_budget=64 << 20)


LONG_TOKEN = 45855  # one token of 80 "#": a stop string can begin anywhere inside it


def test_a_stop_string_inside_a_long_token_is_found_and_the_earliest_wins(llm):
    prompt = (llm.tokenizer.encode("a") + [LONG_TOKEN]) * 12  # greedy decoding continues the pattern
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].text
    assert "a" + "#" * 80 + "a" in free  # the long token comes, so the stops below start inside it
    for stop in (["a#"], ["#"], ["##", "a###"], ["#" * 79 + "a"], ["#a", "a#"]):
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, stop=stop))[0]
        earliest = min(free.find(s) for s in stop if s in free)
        assert (out.finish_reason, out.text) == ("stop", free[:earliest]), stop


def test_a_request_is_checked_as_it_is_added(llm):
    params = SamplingParams(max_tokens=4)
    params.max_tokens = -5  # changed after its own checks: it once reached the allocator and broke the engine
    with pytest.raises(ValueError, match="max_tokens"):
        llm.engine.add_request(PROMPTS[0], params)
    params.max_tokens, params.stop = 4, "ab"  # one stop string, not two of one character
    assert llm.engine.add_request(PROMPTS[0], params, request_id="same").params.stop == ["ab"]
    with pytest.raises(ValueError, match="request_id 'same' is already in use"):
        llm.engine.add_request(PROMPTS[1], GREEDY, request_id="same")
    with pytest.raises(ValueError, match="stop must be a string or a list"):
        SamplingParams(stop=5)
    llm.engine.abort("same")
    assert llm.engine.cache.allocator.num_used == 0 and not llm.engine.has_unfinished


def test_a_failed_step_leaves_nothing_behind(llm, monkeypatch):
    real_run, calls = llm.engine.runner.run, []

    def failing_run(batch):
        calls.append(1)
        if len(calls) == 2:  # after the first step: the requests hold memory and have computed tokens
            raise RuntimeError("injected failure")
        return real_run(batch)

    monkeypatch.setattr(llm.engine.runner, "run", failing_run)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert llm.engine.cache.allocator.num_used == 0 and not llm.engine.has_unfinished
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == llm.generate(PROMPTS[0], GREEDY)[0].token_ids


@pytest.mark.parametrize("args, message", [
    ({"dense_layers": 5}, "dense_layers must be a list"), ({"model": 5}, "model must be a path"),
    ({"max_runing_requests": 4}, "unknown engine argument 'max_runing_requests'; the engine takes"),
    ({"record_topk": True, "enable_hisparse": True}, "record_topk records from the baseline cache"),
])
def test_bad_engine_arguments_name_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        LLM(**args)


@pytest.mark.parametrize("messages", [None, {"role": "user", "content": "hi"}, [], ["hi"]])
def test_chat_refuses_what_is_not_a_conversation(llm, messages):
    with pytest.raises(ValueError, match="messages must be a conversation"):
        llm.chat(messages)


def test_abort_frees_memory(llm):
    engine = llm.engine
    request = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    assert engine.cache.allocator.num_used > 0
    engine.abort(request.request_id)
    assert request.finish_reason == "abort"
    assert engine.cache.allocator.num_used == 0
    assert not engine.has_unfinished
