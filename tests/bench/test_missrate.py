"""The miss-rate benchmark: its replay (the engine's CPU swap-in, many requests and layers at once) agrees with
the swap-in reference driven one request and layer at a time, Belady's optimum is a lower bound, and the CLI
runs end to end on a synthetic trace."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse.bench.missrate import (
    CHALLENGERS,
    OPTIMUM,
    POLICIES,
    main,
    make_policy,
    replay,
    simulate,
    synthetic_trace,
)
from hisparse.engine.topk_trace import TopkTrace
from hisparse.memory.eviction import EVICTION_POLICIES, new_slot_tables, reset_row
from hisparse.memory.swap_in import swap_in

SCORE_LRU = "score_lru"


def engine_replay(trace: TopkTrace, num_slots: int, policy_name: str, **params: int) -> np.ndarray:
    """Misses [L, T] of the trace through the real swap_in reference, driven as HiSparseKVCache drives it:
    fast path while the newest position is below the buffer size, then the buffer reset to the last
    positions, the newest position (in the reserved slot) never passed to swap-in, and as many
    next-ranked positions as the policy asks for."""
    context = int(trace.seq_lens.max())
    out = np.full((trace.num_layers, trace.num_steps), -1)
    for layer in range(trace.num_layers):
        slot_pos, lru = new_slot_tables(1, num_slots)
        policy = make_policy(policy_name, 1, num_slots, **params)
        num_next = policy.num_next_ranks(trace.top_k)
        device_rows = torch.arange(num_slots).view(1, -1)
        host_rows = torch.arange(context).view(1, -1)
        host_kv, device_kv = torch.randn(context, 2), torch.zeros(num_slots, 2)
        live = False
        for t, seq_len in enumerate(trace.seq_lens.tolist()):
            newest = seq_len - 1
            if newest < num_slots:
                continue
            if not live:
                reset_row(slot_pos, lru, 0, range(newest - num_slots, newest), policy)
                live = True
            top_k = torch.from_numpy(trace.layers[layer][t].astype(np.int64)).view(1, -1)
            top_k = torch.where(top_k == newest, -1, top_k)
            following = None
            if trace.next_ranked is not None:
                following = torch.from_numpy(trace.next_ranked[layer][t, :num_next].astype(np.int64)).view(1, -1)
            res = swap_in(top_k, torch.tensor([0]), slot_pos, lru, device_rows, host_rows, host_kv, device_kv,
                          policy=policy, backend="reference", next_ranked=following)
            out[layer, t] = int(res.misses[0])
    return out


def random_trace(seed: int, num_layers: int, start: int, steps: int, top_k: int, keep: float) -> TopkTrace:
    """Uniformly random selections, each step keeping a share of the previous one; the next-ranked
    positions are a random order of all the rest (-1 padded)."""
    rng = np.random.default_rng(seed)
    seq_lens = np.arange(start + 1, start + steps + 1, dtype=np.int32)
    layers, following = [], []
    for _ in range(num_layers):
        rows = np.full((steps, top_k), -1, dtype=np.int32)
        ranked = np.full((steps, int(seq_lens[-1])), -1, dtype=np.int32)
        previous = np.array([], dtype=np.int64)
        for t, seq_len in enumerate(seq_lens):
            count = min(top_k, seq_len)
            kept = previous[rng.random(previous.size) < keep][:count]
            fresh = rng.permutation(np.setdiff1d(np.arange(seq_len), kept))[:count - kept.size]
            picked = np.sort(np.concatenate([kept, fresh]))
            rows[t, :picked.size] = picked
            rest = rng.permutation(np.setdiff1d(np.arange(seq_len), picked))
            ranked[t, :rest.size] = rest
            previous = picked
        layers.append(rows)
        following.append(ranked)
    return TopkTrace(layers, seq_lens, top_k, next_ranked=following)


def test_every_policy_is_replayed():
    assert set(EVICTION_POLICIES) == set(POLICIES)


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
def test_requests_replayed_together_miss_as_each_replayed_alone(policy):
    """One replay holds every request's every layer as rows of one set of tables: no row may touch another's."""
    traces = [random_trace(seed, 2, start, 12, 8, 0.6) for seed, start in ((1, 20), (2, 30), (3, 12))]
    together = replay(traces, 16, policy)
    for trace, misses in zip(traces, together, strict=True):
        np.testing.assert_array_equal(misses, engine_replay(trace, 16, policy))


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("num_slots", [16, 24, 40])
def test_replay_matches_swap_in_reference_miss_for_miss(policy, num_slots):
    # The context starts below the 24- and 40-slot buffers: fast path, then the switch to swap-in.
    trace = synthetic_trace(seed=num_slots, num_layers=2, context=20, steps=40, top_k=16, sinks=2, window=4)
    expected = engine_replay(trace, num_slots, policy)
    assert (expected >= 0).any()
    np.testing.assert_array_equal(simulate(trace, num_slots, policy), expected)


def test_replay_matches_swap_in_on_random_selections():
    trace = random_trace(3, num_layers=2, start=30, steps=25, top_k=12, keep=0.6)
    for policy in POLICIES:
        np.testing.assert_array_equal(simulate(trace, 18, policy), engine_replay(trace, 18, policy))


@pytest.mark.parametrize(("touch", "load_steps", "next_per_spare"), [(1, 0, 1), (4, 1, 2), (16, 4, 2), (2, 2, 0)])
def test_replay_matches_swap_in_for_score_lru_constants(touch, load_steps, next_per_spare):
    params = {"touch": touch, "load_steps": load_steps, "next_per_spare": next_per_spare}
    trace = synthetic_trace(seed=7, num_layers=2, context=60, steps=30, top_k=16, sinks=2, window=4)
    for num_slots in (16, 28):
        np.testing.assert_array_equal(simulate(trace, num_slots, SCORE_LRU, **params),
                                      engine_replay(trace, num_slots, SCORE_LRU, **params))


def test_score_lru_without_ranks_or_load_age_is_lru_on_traces():
    trace = synthetic_trace(seed=5, num_layers=2, context=120, steps=30, top_k=16)
    for num_slots in (20, 32):
        np.testing.assert_array_equal(simulate(trace, num_slots, SCORE_LRU, load_steps=0, next_per_spare=0),
                                      simulate(trace, num_slots, "lru"))


@pytest.mark.parametrize(("decay_shift", "rank_bonus", "ghost_decay_shift", "ghost_weight_quarters"),
                         [(1, 0, 1, 0), (3, 1 << 16, 2, 4), (5, 4 << 16, 3, 6), (6, 9 << 16, 5, 8)])
def test_replay_matches_swap_in_for_lrfu_decays(decay_shift, rank_bonus, ghost_decay_shift, ghost_weight_quarters):
    """Decays, rank credits (0: plain LRFU; the trace lists 4 x top_k runners-up, the policy reads 2 x) and
    ghosts (weight 0: none count), on a trace whose evicted tokens come back (the test asserts they do)."""
    trace = random_trace(11, num_layers=2, start=30, steps=25, top_k=12, keep=0.7)
    params = dict(decay_shift=decay_shift, rank_bonus=rank_bonus, ghost_decay_shift=ghost_decay_shift,
                  ghost_weight_quarters=ghost_weight_quarters)
    for num_slots in (14, 24):
        np.testing.assert_array_equal(simulate(trace, num_slots, "lrfu", **params),
                                      engine_replay(trace, num_slots, "lrfu", **params))
    if ghost_weight_quarters:  # the ghosts change what is evicted here, so the test above checks them
        assert any(not np.array_equal(simulate(trace, n, "lrfu", **params),
                                      simulate(trace, n, "lrfu", **{**params, "ghost_weight_quarters": 0}))
                   for n in (14, 24))


def test_score_lru_beats_lru_on_the_synthetic_traces():
    """The synthetic score drifts slowly, so its runners-up predict the next steps: the ranks must pay."""
    traces = [synthetic_trace(seed, num_layers=2, context=400, steps=40, top_k=32) for seed in range(3)]
    total = {p: sum(int(simulate(t, 64, p).clip(min=0).sum()) for t in traces) for p in ("lru", SCORE_LRU)}
    assert total[SCORE_LRU] < 0.95 * total["lru"]


def test_a_trace_without_enough_next_ranks_is_refused():
    trace = synthetic_trace(seed=1, num_layers=1, context=60, steps=5, top_k=16, next_per_top_k=1)
    with pytest.raises(ValueError, match="record it again"):
        simulate(trace, 32, SCORE_LRU)


def test_fast_path_steps_have_no_misses_and_are_marked():
    trace = synthetic_trace(seed=1, num_layers=1, context=20, steps=30, top_k=16, sinks=2, window=4)
    misses = simulate(trace, 32, "lru")
    newest = trace.seq_lens - 1
    assert (misses[0][newest < 32] == -1).all() and (misses[0][newest >= 32] >= 0).all()


def test_optimum_on_a_worked_example():
    # 3 slots holding 7, 8, 9 (7 first to go) when the newest position is 10.
    # t0 selects 3: both evict 8. t1 selects 9 and 10 (the previous newest): LRU evicts 3 (its oldest
    # unselected), the optimum 7 (never used again). t2 selects 3 again: a miss only for LRU.
    layers = [np.array([[3, 7], [9, 10], [3, -1]], dtype=np.int32)]
    trace = TopkTrace(layers, np.array([11, 12, 13], dtype=np.int32), 2)
    assert simulate(trace, 3, OPTIMUM)[0].tolist() == [1, 1, 0]
    assert simulate(trace, 3, "lru")[0].tolist() == [1, 1, 1]
    assert engine_replay(trace, 3, "lru")[0].tolist() == [1, 1, 1]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), top_k=st.integers(1, 24), extra=st.integers(0, 24),
       start=st.integers(0, 60), steps=st.integers(1, 30), keep=st.floats(0.0, 1.0))
def test_optimum_is_never_worse_than_an_online_policy(seed, top_k, extra, start, steps, keep):
    trace = random_trace(seed, num_layers=2, start=start, steps=steps, top_k=top_k, keep=keep)
    num_slots = top_k + extra
    best = simulate(trace, num_slots, OPTIMUM)
    assert ((best >= 0) == (simulate(trace, num_slots, "lru") >= 0)).all()
    for policy in POLICIES:
        online = simulate(trace, num_slots, policy)
        assert (best.clip(min=0).sum(axis=1) <= online.clip(min=0).sum(axis=1)).all(), policy  # per layer


def test_cli_runs_end_to_end_on_a_synthetic_trace(tmp_path, capsys):
    main(["--synthetic", "--num-requests", "2", "--context", "200", "--steps", "12", "--top-k", "16",
          "--buffers", "1,2", "--out", str(tmp_path), "--no-progress"])
    printed = capsys.readouterr().out
    assert "optimum" in printed and "lru excess" in printed
    assert all(f"{c} closes of LRU's gap" in printed for c in CHALLENGERS)
    report = json.loads((tmp_path / "missrate.json").read_text())
    assert [r["buffer_factor"] for r in report["results"]] == [1.0, 2.0]
    for r in report["results"]:
        assert set(r["misses"]) == {*POLICIES, OPTIMUM}
        assert all(v >= -1e-9 for v in r["excess_over_optimum"].values())
        for c in CHALLENGERS:
            assert r[f"{c}_gap_closed"] is None or r[f"{c}_gap_closed"] <= 1 + 1e-9
    table = (tmp_path / "missrate.md").read_text()
    assert "\n| 1x | 16 |" in table and "\n| 2x | 32 |" in table
    assert (tmp_path / "missrate.png").read_bytes()[:4] == b"\x89PNG"


def test_tune_grids_score_lru_constants_on_synthetic_traces(tmp_path, capsys):
    main(["--synthetic", "--num-requests", "1", "--context", "300", "--steps", "16", "--top-k", "32",
          "--buffers", "1,2", "--out", str(tmp_path), "--no-progress", "--tune"])
    printed = capsys.readouterr().out
    assert "best: touch" in printed and "best: decay shift" in printed
    tune = json.loads((tmp_path / "missrate.json").read_text())["tune"]
    assert tune["sizes"] == ["1x", "2x"] and len(tune["grid"]) == 4 * 4 * 2
    assert all(len(cell["gap_closed"]) == 2 for cell in tune["grid"])
    assert [(cell["decay_shift"], cell["rank_bonus"]) for cell in tune["lrfu"]["grid"]] == [
        (shift, bonus) for shift in (3, 4, 5) for bonus in (0, 2, 4, 6)]
    assert all(len(cell["gap_closed"]) == 2 for cell in tune["lrfu"]["grid"])
    assert "best: ghost decay shift" in printed
    assert [(cell["ghost_decay_shift"], cell["ghost_weight_quarters"]) for cell in tune["lrfu"]["ghost_grid"]] == [
        (shift, weight) for shift in (2, 3, 4) for weight in (0, 4, 6, 8)]
