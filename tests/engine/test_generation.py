"""The engine on the real model: batching, sampling parameters, stops, memory accounting."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hisparse import SamplingParams
from hisparse.attention.paged import PagedKVCache
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.errors import RequestError
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.request import Request
from hisparse.engine.scheduler import Scheduler
from hisparse.formats.index_key import IndexKeyFormat
from hisparse.formats.kv_layout import KVLayout
from hisparse.formats.sparse_attention import SparseAttention
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
    with pytest.raises(RequestError, match=name) as refused:
        SamplingParams(**kwargs)
    assert refused.value.field == name


@pytest.mark.parametrize("prompt, max_tokens, field, code, words", [
    ([], 4, "prompt", None, "empty"), ([1, 10**9], 4, "prompt", None, "token ids"),
    ([1] * 8190, 10, "max_tokens", "context_length_exceeded", "context length"),  # the prompt alone would fit
    ([1] * 8192, 1, "prompt", "context_length_exceeded", "context length"),  # it would not
])
def test_invalid_prompts_are_refused_naming_the_field(llm, prompt, max_tokens, field, code, words):
    with pytest.raises(RequestError, match=words) as refused:
        llm.generate([prompt], SamplingParams(max_tokens=max_tokens))
    assert (refused.value.field, refused.value.code) == (field, code)
    assert not llm.engine.has_unfinished


def holds_only_the_prefix_cache(engine) -> bool:
    """Every slot in use is the prefix cache's, and no request references it."""
    tree = engine.cache.prefix.tree
    return engine.cache.allocator.num_used == tree.total_size and tree.protected_size == 0


def test_admission_is_bounded_by_the_budget_and_nothing_leaks(llama, tokenizer):
    # Room for exactly two requests of 8 + 24 tokens: the other two wait, none fails mid-step.
    per_token = llama.config.num_layers * 2 * llama.config.kv_size * llama.embed_tokens.weight.element_size()
    llm = make_llm(llama, tokenizer, device_kv_budget=per_token * 70)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8 + i] for i in range(4)]
    outs = llm.generate(prompts, GREEDY)
    assert all(len(o.token_ids) == 24 for o in outs)
    assert llm.engine.scheduler.peak_running == 2
    assert holds_only_the_prefix_cache(llm.engine)
    with pytest.raises(ValueError, match="capacity"):
        llm.generate([[1] * 60], GREEDY)


def test_a_budget_that_buys_no_token_is_refused_at_start(llama, tokenizer):
    # A server started with it would refuse every request, each with a 400 blaming the client.
    with pytest.raises(ValueError, match="buys no token slot"):
        make_llm(llama, tokenizer, device_kv_budget=1)


def test_a_budget_beyond_the_machine_is_refused_at_start(llama, tokenizer, monkeypatch):
    from hisparse.attention import paged

    monkeypatch.setattr(paged, "available_host_memory", lambda: 1 << 20)
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
    assert holds_only_the_prefix_cache(llm.engine) and not llm.engine.has_unfinished


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
    assert holds_only_the_prefix_cache(llm.engine) and not llm.engine.has_unfinished
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
    assert holds_only_the_prefix_cache(engine) and engine.cache.prefix.tree.total_size > 0  # its computed rows
    assert not engine.has_unfinished


def test_an_aborted_request_id_can_be_used_again(llm):
    engine = llm.engine
    waiting = engine.add_request(PROMPTS[0], GREEDY, request_id="again")
    engine.abort("again")
    running = engine.add_request(PROMPTS[1], GREEDY, request_id="again")  # the aborted one left nothing behind
    assert running is not waiting
    engine.step()
    engine.abort("again")
    assert engine.add_request(PROMPTS[2], GREEDY, request_id="again").finish_reason is None
    engine.abort("again")
    assert not engine.has_unfinished and holds_only_the_prefix_cache(engine)


def test_a_request_of_exactly_the_context_length_is_accepted(llm, monkeypatch):
    monkeypatch.setattr(llm.engine, "max_model_len", 40)  # the check, without a cache of 8192 tokens
    request = llm.engine.add_request([1] * 30, SamplingParams(max_tokens=10))
    llm.engine.abort(request.request_id)
    with pytest.raises(ValueError, match="exceeds the model's context length of 40 tokens"):
        llm.engine.add_request([1] * 31, SamplingParams(max_tokens=10))


def test_a_request_that_needs_the_whole_cache_is_accepted_and_runs(llama, tokenizer):
    per_token = llama.config.num_layers * 2 * llama.config.kv_size * llama.embed_tokens.weight.element_size()
    llm = make_llm(llama, tokenizer, device_kv_budget=per_token * 8)
    engine, capacity = llm.engine, llm.engine.cache.capacity_tokens
    request = engine.add_request([1] * (capacity - 2), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    for _ in range(4):  # a prefill and two decodes, or it was left waiting
        engine.step()
    assert request.finish_reason == "length" and holds_only_the_prefix_cache(engine)
    with pytest.raises(ValueError, match="capacity"):
        llm.generate([[1] * (capacity - 1)], SamplingParams(max_tokens=2))


def test_text_cut_mid_character_by_max_tokens_is_what_decode_gives(llm, monkeypatch):
    """The last tokens hold two of an emoji's three bytes: the held-back bytes end the text, as decode renders them."""
    tokens = llm.tokenizer.encode("Hi ") + llm.tokenizer.encode("\U0001F600")[:2]
    assert llm.tokenizer.decode(tokens).endswith("\ufffd")
    forced = iter(tokens)
    monkeypatch.setattr(llm.engine.runner, "run", lambda batch: [next(forced) for _ in batch.sample_spans])
    out = llm.generate("x", SamplingParams(max_tokens=len(tokens), ignore_eos=True))[0]
    assert (out.finish_reason, out.token_ids) == ("length", tokens)
    assert out.text == llm.tokenizer.decode(tokens)


# -- the scheduler on its own: a tiny paged cache, no model ----------------------------------------------


def tiny_cache(num_slots: int) -> PagedKVCache:
    """A baseline cache of `num_slots` one-float tokens with an indexer-key slot per token, as the default model's."""
    return PagedKVCache(KVLayout(1, 1, 1), num_slots, 1.0, sparse=SparseAttention(IndexKeyFormat("float32", 1)))


def run_scheduler(scheduler: Scheduler, requests: list[Request], max_steps: int = 500):
    """Step as LLMEngine.step does (a token 0 for each span that completes its prompt or decodes) until every
    request has ended, yielding each step's spans and running requests as scheduled, before the step runs.
    Fails at a step limit: a request left waiting forever."""
    for request in requests:
        scheduler.add(request)
    for _ in range(max_steps):
        if not scheduler.has_work:
            return
        batch = scheduler.schedule()
        assert batch is not None, "work waiting but nothing scheduled"
        yield batch.spans, list(scheduler.running)
        scheduler.advance(batch)
        for span in batch.sample_spans:
            span.request.output_token_ids.append(0)
            if len(span.request.output_token_ids) >= span.request.params.max_tokens:
                scheduler.finish(span.request, "length")
    raise AssertionError("requests left waiting forever")


@settings(max_examples=60, deadline=None)
@given(jobs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6)), min_size=1, max_size=8),
       max_running=st.integers(1, 4), chunk=st.integers(1, 24), spare=st.integers(0, 30))
@example(jobs=[(30, 2), (3, 1)], max_running=2, chunk=16, spare=0)  # the first request needs the whole cache
@example(jobs=[(2, 2)] * 3, max_running=2, chunk=8, spare=20)  # memory for three, places for two
@example(jobs=[(1, 4), (12, 1)], max_running=2, chunk=4, spare=0)  # a decode and a prompt chunk share a step
def test_scheduler_admits_in_order_spends_the_step_budget_exactly_and_frees_everything(jobs, max_running, chunk,
                                                                                        spare):
    """First come first served, at most max_running_requests at once, each step's tokens: one per decoding
    request, then prompt chunks filling what is left of chunked_prefill_size; a request may need the whole cache."""
    cache = tiny_cache(max(p + m for p, m in jobs) + spare)
    scheduler = Scheduler(cache, max_running, chunk)
    requests = [Request(list(range(1, p + 1)), SamplingParams(max_tokens=m)) for p, m in jobs]
    admitted = []
    for spans, running in run_scheduler(scheduler, requests):
        admitted += [r for r in running if all(r is not a for a in admitted)]
        assert len(running) <= max_running
        assert cache.allocator.num_used == sum(r.max_total_tokens for r in running)
        assert cache.index_cache.allocator.num_used == cache.allocator.num_used
        decodes = [s.length for s in spans if not s.request.in_prefill]
        assert decodes == [1] * len(decodes)
        prompt_tokens = sum(s.length for s in spans if s.request.in_prefill)
        left_in_prompts = sum(r.num_prompt_tokens - r.num_computed_tokens for r in running if r.in_prefill)
        assert prompt_tokens == min(max(chunk - len(decodes), 0), left_in_prompts)
    assert [r.request_id for r in admitted] == [r.request_id for r in requests], "admitted out of arrival order"
    assert all(r.finish_reason == "length" and r.kv is None for r in requests)
    assert cache.allocator.num_used == 0 and cache.index_cache.allocator.num_used == 0


def test_aborting_a_waiting_request_frees_nothing_it_never_held_and_never_runs_it():
    cache = tiny_cache(10)
    scheduler = Scheduler(cache, 1, 8)
    first, second = Request([1, 2, 3], SamplingParams(max_tokens=2)), Request([4, 5], SamplingParams(max_tokens=2))
    scheduler.add(first)
    scheduler.add(second)
    scheduler.schedule()
    assert scheduler.abort(second.request_id) is second and second.finish_reason == "abort"
    assert not scheduler.waiting and scheduler.running == [first]
    assert cache.allocator.num_used == first.max_total_tokens
