"""The sampler returns a token its filters keep for every value SamplingParams accepts, extremes included.

A request's parameters are checked at the door, so whatever passes there must sample: a NaN in one row
fails the whole batch's step (every request in it), which once happened for temperatures below 1e-38
and top_p below float32's smallest number.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse.engine.request import Request
from hisparse.engine.sampler import adjusted, sample
from hisparse.engine.sampling_params import SamplingParams

VOCAB = 64

temperatures = st.one_of(st.sampled_from([5e-324, 1e-300, 1e-39, 1e-30, 1e-3, 1.0, 100.0]),
                         st.floats(min_value=5e-324, max_value=100.0))
top_ps = st.one_of(st.sampled_from([5e-324, 1e-300, 1e-45, 0.5, 1.0]), st.floats(min_value=5e-324, max_value=1.0))
top_ks = st.one_of(st.just(-1), st.integers(min_value=1, max_value=VOCAB + 5))
logit_rows = st.lists(st.floats(min_value=-1e4, max_value=1e4, width=32), min_size=VOCAB, max_size=VOCAB)


@settings(max_examples=300, deadline=None)
@given(temperature=temperatures, top_p=top_ps, top_k=top_ks, rows=st.lists(logit_rows, min_size=1, max_size=3),
       seed=st.integers(min_value=0, max_value=2**32))
def test_every_accepted_parameter_samples_a_kept_token(temperature, top_p, top_k, rows, seed):
    logits = torch.tensor(rows, dtype=torch.float32)
    requests = [Request([1], SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed + i))
                for i in range(len(rows))]
    tokens = sample(logits, requests)
    for row, token in zip(logits, tokens, strict=True):
        assert 0 <= token < VOCAB
        if top_k > 0:  # top-k keeps the k largest (and ties with the k-th)
            assert row[token] >= torch.topk(row, min(top_k, VOCAB)).values[-1]


@given(temperature=st.sampled_from([5e-324, 1e-300, 1e-39]), top_p=top_ps,
       rows=st.lists(logit_rows, min_size=1, max_size=3))
def test_a_vanishing_temperature_or_top_p_samples_the_largest_logit(temperature, top_p, rows):
    logits = torch.tensor(rows, dtype=torch.float32)
    requests = [Request([1], SamplingParams(temperature=temperature, top_p=top_p, seed=i)) for i in range(len(rows))]
    for row, token in zip(logits, sample(logits, requests), strict=True):
        assert row[token] == row.max()
    tiny_top_p = [Request([1], SamplingParams(temperature=1.0, top_p=5e-324, seed=i)) for i in range(len(rows))]
    for row, token in zip(logits, sample(logits, tiny_top_p), strict=True):
        assert row[token] == row.max()


def test_draws_follow_the_distribution_and_never_pick_a_token_of_probability_zero():
    # probabilities 0.5 / 0.25 / 0.15 / 0.1 / 0 (the last logit is -inf, as after a top-k or top-p filter)
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.cat([probs.log(), torch.tensor([float("-inf")])]).unsqueeze(0)
    request = Request([1], SamplingParams(temperature=1.0, seed=7))
    draws = torch.tensor([sample(logits, [request])[0] for _ in range(20000)])
    counts = torch.bincount(draws, minlength=5).double() / len(draws)
    assert counts[4] == 0
    # 20000 draws: the standard error of a share of 0.5 is 0.0035, so 0.015 is over 4 of them
    assert torch.allclose(counts[:4], probs.double(), atol=0.015), counts


def test_the_same_seed_draws_the_same_tokens_and_other_seeds_others():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        request = Request([1], SamplingParams(temperature=1.0, seed=seed))
        return [sample(logits, [request])[0] for _ in range(20)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_infinite_logit_raises_instead_of_drawing_a_token_past_the_vocabulary(bad):
    logits = torch.zeros(1, 8)
    logits[0, 3] = bad
    with pytest.raises(ValueError, match="cannot sample"):
        sample(logits, [Request([1], SamplingParams(temperature=1.0, seed=0))])


def test_penalties_and_logit_bias_follow_openais_definitions():
    """logit_bias adds; a generated token loses presence_penalty once and frequency_penalty per time."""
    logits = torch.zeros(VOCAB)
    request = Request([1], SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, logit_bias={7: 3.0, 3: -1.0}))
    request.output_token_ids = [3, 3, 5]
    want = torch.zeros(VOCAB)
    want[7] += 3.0
    want[3] += -1.0 - 0.5 - 2 * 1.0
    want[5] += -0.5 - 1.0
    assert torch.equal(adjusted(logits, request), want)
    assert torch.equal(logits, torch.zeros(VOCAB))  # the batch's logits are not touched


def test_greedy_decoding_takes_the_adjusted_logits():
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0)  # token VOCAB - 1 wins unadjusted
    plain = Request([1], SamplingParams(temperature=0.0))
    biased = Request([1], SamplingParams(temperature=0.0, logit_bias={4: 100.0}))
    penalised = Request([1], SamplingParams(temperature=0.0, frequency_penalty=2.0))
    penalised.output_token_ids = [VOCAB - 1]  # one use costs 2: VOCAB - 2 wins now
    assert sample(logits.repeat(3, 1), [plain, biased, penalised]) == [VOCAB - 1, 4, VOCAB - 2]


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([-1.0, 0.0, 2.5, 7.0]), min_size=VOCAB, max_size=VOCAB), min_size=1,
                     max_size=4))
def test_greedy_tokens_are_argmax_ties_included(rows):
    """Greedy takes the first largest logit, as argmax does, ties (a few distinct values) included."""
    logits = torch.tensor(rows)
    requests = [Request([1], SamplingParams(temperature=0.0)) for _ in rows]
    assert sample(logits, requests) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kwargs, field", [({"presence_penalty": 2.5}, "presence_penalty"),
                                           ({"frequency_penalty": -3}, "frequency_penalty"),
                                           ({"logit_bias": {5: 101.0}}, "logit_bias"),
                                           ({"logit_bias": {-1: 1.0}}, "logit_bias")])
def test_out_of_range_penalties_and_biases_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
