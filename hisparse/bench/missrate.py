"""Miss rates of the hot-buffer eviction policies on recorded top-k traces, against Belady's optimum.

Each request's trace (per layer, per decode step, the positions the indexer selected; see
`hisparse.engine.topk_trace`) is replayed through the engine's own CPU swap-in, driven as the HiSparse pools
drive it (`hisparse.memory.hisparse_pools`):

- while the newest position p is below the buffer size S the buffer holds every token (the fast path:
  no swap-in, no misses, and those steps are not counted);
- at the first step with p >= S the buffer is reset to the last S positions before p, in order, the
  oldest first to go (`reset_row`), and the policy forgets its history;
- the newest token lives in the reserved slot and is never passed to swap-in, so the previous step's
  newest token is a miss when selected;
- each step loads the selected positions not in the buffer (misses) into slots chosen by the policy
  among those not selected this step.

Online policies (every entry of `EVICTION_POLICIES`) run the engine's kernel, so there is no copy of their
rules here; the replay agrees with the `swap_in` reference miss for miss (tests/bench/test_missrate.py).
`score_lru` and `lrfu` read the positions the indexer ranked just below the top-k, which the traces record
too (`next_{i}`). Belady's offline optimum
evicts, for each miss, the unselected slot whose position is next selected farthest in the future (per
layer, per request); with all of a step's selections demanded at once this is still optimal (the usual
exchange argument), so no online policy beats it.

    python -m hisparse.bench_missrate [--trace-dir DIR] [--num-requests 4] [--context 2048] [--steps 1024]
        [--top-k 256] [--buffers 1,1.5,2,3] [--split heldout] [--out missrate_results] [--tune]

Traces are recorded once with the real default model (greedy decode, all layers sparse, as under
HiSparse) on the Python-documentation corpus and cached in --trace-dir: `heldout` text for the reported
numbers, `train` text for choosing `score_lru`'s constants and `lrfu`'s decay and rank bonus (`--split train
--tune`). `--synthetic` replays generated traces instead (no model needed; for tests and smoke runs).

Each row also says what share of LRU's excess over the optimum `lrfu` and `score_lru` remove:
(lru - policy) / (lru - optimum).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numba import njit, prange

from hisparse.cli_args import OneLineParser, comma_list, float_in, int_in, one_of, output_dir, positive_int, run_main
from hisparse.engine.engine_config import resolve_model_dtype
from hisparse.engine.topk_trace import TopkTrace, load_topk_trace, save_topk_trace
from hisparse.formats.sparse_attention import TRACE_NEXT_PER_TOP_K
from hisparse.kernels.numba_threads import choose_threading_layer
from hisparse.memory.eviction import (
    EVICTION_POLICIES,
    EvictionPolicy,
    LRFUPolicy,
    ScoreLRUPolicy,
    new_slot_tables,
    reset_row,
)
from hisparse.memory.host_memory import check_fits_in_memory
from hisparse.memory.swap_in import bound_swap_in

choose_threading_layer()

OPTIMUM = "optimum"
POLICIES: dict[str, type[EvictionPolicy]] = dict(EVICTION_POLICIES)  # all compared
CHALLENGERS = (LRFUPolicy.name, ScoreLRUPolicy.name)  # the policies whose share of LRU's gap each row reports
_NEVER = np.iinfo(np.int32).max  # next use of a position that is not selected again
DEFAULT_TRACE_DIR = Path.home() / ".cache" / "hisparse" / "traces"
PROG = "python -m hisparse.bench_missrate"
MAX_REQUESTS = 1024  # recorded in one batch; far beyond the 4-8 the figures use
SYNTHETIC_MAX_TOKENS = 1 << 16  # context + steps of a synthetic trace (a recorded one: the model's context)
SYNTHETIC_LAYERS, SYNTHETIC_NEXT_PER_TOP_K = 2, 4  # synthetic_trace's defaults


# -- Belady's optimum and the replay --------------------------------------------------------------


@njit(cache=True)
def _reset(slot_pos, order, pos_slot, state, first, num_slots, held_state):
    """reset_row(positions=range(first, first + S)): slot i holds first + i, slot 0 first to go; the
    policy's state of a held slot is `held_state` (score_lru's age of a never-selected token, else 0)."""
    for i in range(num_slots):
        old = slot_pos[i]
        if old >= 0:
            pos_slot[old] = -1
        slot_pos[i] = first + i
        pos_slot[first + i] = i
        order[i] = i
        state[i] = held_state


@njit(cache=True)
def _simulate_optimum(sel, seq_lens, num_slots, misses):
    """Belady's MIN for one layer of one request: a miss evicts the unselected slot used farthest ahead."""
    steps, width = sel.shape
    context = 1
    for t in range(steps):
        context = max(context, seq_lens[t])
    # next_use[t, j]: the next step after t that selects sel[t, j]; first[p]: p's first selection
    next_use = np.full((steps, width), _NEVER, np.int64)
    first = np.full(context, _NEVER, np.int64)
    for t in range(steps - 1, -1, -1):
        newest = seq_lens[t] - 1
        for j in range(width):
            p = sel[t, j]
            if p < 0 or p == newest:
                continue
            next_use[t, j] = first[p]
            first[p] = t
    upcoming = first  # upcoming[p]: the next step from now on that selects p
    slot_pos = np.full(num_slots, -1, np.int64)
    pos_slot = np.full(context, -1, np.int64)
    order = np.arange(num_slots).astype(np.int64)
    state = np.zeros(num_slots, np.int64)
    selected = np.zeros(num_slots, np.uint8)
    evictable = np.empty(num_slots, np.int64)
    keys = np.empty(num_slots, np.int64)
    live = False
    for t in range(steps):
        newest = seq_lens[t] - 1
        if newest < num_slots:
            misses[t] = -1
        else:
            if not live:
                _reset(slot_pos, order, pos_slot, state, newest - num_slots, num_slots, 0)
                live = True
            n_miss = 0
            for j in range(width):
                p = sel[t, j]
                if p < 0 or p == newest:
                    continue
                if pos_slot[p] >= 0:
                    selected[pos_slot[p]] = 1
                else:
                    n_miss += 1
            if n_miss:
                n_ev = 0
                for s in range(num_slots):
                    if selected[s] == 0:
                        evictable[n_ev] = s
                        keys[n_ev] = -(_NEVER + 1) if slot_pos[s] < 0 else -upcoming[slot_pos[s]]
                        n_ev += 1
                ranked = np.argsort(keys[:n_ev])  # farthest next use (or empty) first
                v = 0
                for j in range(width):
                    p = sel[t, j]
                    if p < 0 or p == newest or pos_slot[p] >= 0:
                        continue
                    s = evictable[ranked[v]]
                    v += 1
                    if slot_pos[s] >= 0:
                        pos_slot[slot_pos[s]] = -1
                    slot_pos[s] = p
                    pos_slot[p] = s
            selected[:] = 0
            misses[t] = n_miss
        for j in range(width):
            p = sel[t, j]
            if p >= 0 and p != newest:
                upcoming[p] = next_use[t, j]


@njit(parallel=True, cache=True)
def _optimum_layers(sel, seq_lens, num_slots):
    """Belady's optimum in every layer of one request ([L, T, K]), in parallel. Misses [L, T]."""
    out = np.empty((sel.shape[0], sel.shape[1]), np.int64)
    for layer in prange(sel.shape[0]):
        _simulate_optimum(sel[layer], seq_lens, num_slots, out[layer])
    return out


def make_policy(name: str, num_rows: int, num_slots: int, **overrides) -> EvictionPolicy:
    """A policy by its name in POLICIES, for tables of `num_rows` rows, with `simulate`'s overrides of its
    constants set on it (so that it also says how many runners-up it reads)."""
    policy = POLICIES[name](num_rows, num_slots)
    for key, value in overrides.items():
        attribute = CONSTANT_NAMES[key]
        if value is not None and hasattr(policy, attribute):
            setattr(policy, attribute, value)
    return policy


# simulate()'s keyword overrides -> the policy constants they set (score_lru's first three, lrfu's others)
CONSTANT_NAMES = {"touch": "TOUCH_AGE_PER_RANK", "load_steps": "LOAD_AGE_STEPS",
                  "next_per_spare": "NEXT_RANKS_PER_SPARE_SLOT", "decay_shift": "DECAY_SHIFT",
                  "rank_bonus": "RANK_BONUS", "ghost_decay_shift": "GHOST_DECAY_SHIFT",
                  "ghost_weight_quarters": "GHOST_WEIGHT_QUARTERS"}


def replay(traces: list[TopkTrace], num_slots: int, policy: str, **overrides) -> list[np.ndarray]:
    """Misses per layer and decode step [L, T] of each request's trace; -1 on fast-path steps.

    An online policy is replayed through the engine's own CPU swap-in (`memory.swap_in.bound_swap_in`), every
    (request, layer) a row of one set of slot tables, as the engine drives it: a request's row is reset to
    its last `num_slots` positions at its first step past the buffer (`reset_row`, the engine's take-over),
    and its newest position is never swapped in (it lives in the reserved slot). "optimum" is Belady's.
    `overrides` (keys of CONSTANT_NAMES) change the policy's constants, for tuning."""
    if policy == OPTIMUM:
        return [_optimum_layers(np.ascontiguousarray(np.stack(t.layers).astype(np.int64)),
                                np.asarray(t.seq_lens, dtype=np.int64), num_slots) for t in traces]
    if policy not in POLICIES:
        raise ValueError(f"no eviction policy {policy!r}; known: {', '.join(POLICIES)}, {OPTIMUM}")
    unknown = sorted(set(overrides) - set(CONSTANT_NAMES))
    if unknown:
        raise ValueError(f"unknown policy constant {unknown[0]!r}; known: {', '.join(CONSTANT_NAMES)}")
    if len({t.top_k for t in traces}) > 1:
        raise ValueError("the traces were recorded with different top_k: replay them apart")
    rows = [(i, layer) for i, t in enumerate(traces) for layer in range(t.num_layers)]
    chosen = make_policy(policy, len(rows), num_slots, **overrides)
    num_next = chosen.num_next_ranks(traces[0].top_k)
    for t in traces if num_next else ():
        recorded = 0 if t.next_ranked is None else t.next_ranked[0].shape[1]
        if recorded < min(num_next, int(np.max(t.seq_lens))):  # fewer columns are fine if they rank every position
            raise ValueError(f"{policy} reads {num_next} next-ranked positions per step but the trace "
                             f"{t.request_id or ''} holds {recorded}: record it again")
    context = max(int(np.max(t.seq_lens)) for t in traces)
    slot_pos, lru = new_slot_tables(len(rows), num_slots)
    device_rows = torch.arange(num_slots, dtype=torch.int64).repeat(len(rows), 1)
    host_rows = torch.arange(context, dtype=torch.int64).repeat(len(rows), 1)
    # One-byte rows: the replay counts misses, the copies only have to be legal.
    host_kv, device_kv = torch.zeros(context, 1, dtype=torch.uint8), torch.zeros(num_slots, 1, dtype=torch.uint8)
    swap_in = bound_swap_in("cpu", chosen, slot_pos, lru, device_rows, host_rows, host_kv, device_kv)
    out = [np.full((t.num_layers, t.num_steps), -1, np.int64) for t in traces]
    live = np.zeros(len(rows), bool)
    for step in range(max(t.num_steps for t in traces)):
        active = []
        for r, (i, _) in enumerate(rows):
            t = traces[i]
            if step >= t.num_steps or t.seq_lens[step] - 1 < num_slots:
                continue
            if not live[r]:  # the first step past the buffer: it holds the last num_slots positions
                newest = int(t.seq_lens[step]) - 1
                reset_row(slot_pos, lru, r, range(newest - num_slots, newest), chosen)
                live[r] = True
            active.append(r)
        if not active:
            continue
        sel = np.stack([traces[i].layers[layer][step] for i, layer in (rows[r] for r in active)]).astype(np.int64)
        newest = np.array([traces[rows[r][0]].seq_lens[step] - 1 for r in active])
        sel[sel == newest[:, None]] = -1
        nxt = None
        if num_next:
            nxt = torch.from_numpy(np.ascontiguousarray(np.stack(
                [traces[i].next_ranked[layer][step, :num_next] for i, layer in (rows[r] for r in active)]
            ).astype(np.int64)))
        result = swap_in(torch.from_numpy(sel), torch.tensor(active, dtype=torch.int64), nxt)
        for r, misses in zip(active, result.misses.tolist(), strict=True):
            i, layer = rows[r]
            out[i][layer, step] = misses
    return out


def simulate(trace: TopkTrace, num_slots: int, policy: str, **overrides) -> np.ndarray:
    """`replay` of one request's trace: misses [L, T]."""
    return replay([trace], num_slots, policy, **overrides)[0]


def misses_per_step_per_layer(traces: list[TopkTrace], num_slots: int, policy: str, **params) -> float:
    """Total misses over total swap-in (non-fast-path) steps x layers, over all requests."""
    total = counted = 0
    for m in replay(traces, num_slots, policy, **params):
        total += int(m[m >= 0].sum())
        counted += int((m >= 0).sum())
    return total / max(counted, 1)


# -- traces -----------------------------------------------------------------------------------------


def synthetic_trace(seed: int, num_layers: int = SYNTHETIC_LAYERS, context: int = 600, steps: int = 24,
                    top_k: int = 32, sinks: int = 4, window: int = 16,
                    next_per_top_k: int = SYNTHETIC_NEXT_PER_TOP_K) -> TopkTrace:
    """A made-up trace with the shape of real ones: sink tokens and a local window always selected, the
    rest by a persistent per-position importance plus noise that drifts from step to step; the next
    `next_per_top_k` x top_k positions by that score are recorded as the next-ranked ones."""
    rng = np.random.default_rng(seed)
    layers, following = [], []
    seq_lens = np.arange(context + 1, context + steps + 1, dtype=np.int32)
    num_next = next_per_top_k * top_k
    for _ in range(num_layers):
        base = rng.standard_normal(context + steps) * 1.5
        noise = rng.standard_normal(context + steps)
        rows = np.full((steps, top_k), -1, dtype=np.int32)
        ranked_rows = np.full((steps, num_next), -1, dtype=np.int32)
        for t, seq_len in enumerate(seq_lens):
            noise = 0.8 * noise + 0.6 * rng.standard_normal(noise.size)
            score = base[:seq_len] + noise[:seq_len]
            score[:sinks] = np.inf
            score[max(0, seq_len - window):] = np.inf
            ranked = np.argsort(-score, kind="stable")
            picked = np.sort(ranked[:top_k])
            rows[t, :picked.size] = picked
            runners_up = ranked[top_k:top_k + num_next]
            ranked_rows[t, :runners_up.size] = runners_up
        layers.append(rows)
        following.append(ranked_rows)
    return TopkTrace(layers, seq_lens, top_k, context, (), True, f"synthetic-{seed}", following)


def prompt_ids(tokenizer, split: str, index: int, num_requests: int, context: int) -> list[int]:
    """Request `index` of `num_requests`: `context` tokens of the split's text, starts spread evenly."""
    from hisparse.data.pydoc_corpus import corpus_tokens

    ids = corpus_tokens(tokenizer, split)
    start = index * len(ids) // num_requests
    while len(ids) < start + context:
        ids = ids + ids
    return ids[start:start + context]


def load_or_record(trace_dir: Path, split: str, num_requests: int, context: int, steps: int,
                   top_k: int, progress: bool = True) -> list[TopkTrace]:
    """The split's traces from `trace_dir`, recording (in one batch on the real model) those missing."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    tag = indexer_tag()
    # The recording engine runs the model and its K/V cache in this dtype; greedy decode in another one may
    # write other tokens, so its traces are other traces.
    dtype = str(resolve_model_dtype()).removeprefix("torch.")
    num_next = TRACE_NEXT_PER_TOP_K * top_k  # traces without as many next ranks are not reused
    paths = [trace_dir / (f"{split}_ctx{context}_steps{steps}_k{top_k}_next{num_next}_idx{tag}_{dtype}"
                          f"_{i}of{num_requests}.npz")
             for i in range(num_requests)]
    missing = [i for i, p in enumerate(paths) if not p.exists()]
    if missing:
        record_batch(paths, missing, split, num_requests, context, steps, top_k, dtype, progress)
    return [load_topk_trace(p) for p in paths]


def indexer_tag() -> str:
    """A short digest of the shipped indexer weights: traces of other weights are not reused."""
    import hashlib

    from hisparse.layers.indexer import SHIPPED_WEIGHTS

    if not SHIPPED_WEIGHTS.exists():
        return "none"
    return hashlib.sha1(SHIPPED_WEIGHTS.read_bytes()).hexdigest()[:8]


def record_batch(paths: list[Path], missing: list[int], split: str, num_requests: int, context: int,
                 steps: int, top_k: int, dtype: str, progress: bool = True) -> None:
    from tqdm import tqdm

    from hisparse.engine.engine_config import EngineConfig
    from hisparse.engine.llm_engine import LLMEngine
    from hisparse.engine.sampling_params import SamplingParams
    from hisparse.engine.topk_trace import trace_from_request
    from hisparse.layers.indexer import SHIPPED_WEIGHTS

    if not SHIPPED_WEIGHTS.exists():
        raise FileNotFoundError(f"recording traces needs the trained indexer ({SHIPPED_WEIGHTS}); "
                                "use --synthetic to try the benchmark without it")
    # All layers sparse, as under HiSparse; greedy decode of held-out (or train) text.
    engine = LLMEngine(EngineConfig(top_k=top_k, dense_layers=(), chunked_prefill_size=1024,
                                    max_running_requests=len(missing), dtype=dtype))
    if engine.cache.sparse is None:
        raise ValueError("the model has no lightning indexer: there is no top-k to record")
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    requests = {i: engine.add_request(prompt_ids(engine.tokenizer, split, i, num_requests, context), params,
                                      request_id=f"{split}-{i}", record_topk=True) for i in missing}
    total = len(missing) * (context + steps)
    with tqdm(total=total, desc=f"recording {len(missing)} {split} traces", unit="tok", disable=not progress) as bar:
        done = 0
        while engine.has_unfinished:
            engine.step()
            now = sum(r.num_computed_tokens for r in requests.values())
            bar.update(now - done)
            done = now
    for i, request in requests.items():
        save_topk_trace(paths[i], trace_from_request(request, engine.cache.sparse))


# -- the benchmark ----------------------------------------------------------------------------------


@dataclass
class Result:
    buffer_factor: float
    num_slots: int
    misses: dict[str, float]  # policy -> misses per step per layer


def run(traces: list[TopkTrace], top_k: int, factors: list[float], policies: list[str],
        progress: bool = True) -> list[Result]:
    from tqdm import tqdm

    results = []
    jobs = [(f, p) for f in factors for p in [*policies, OPTIMUM]]
    with tqdm(total=len(jobs), desc="replaying", disable=not progress) as bar:
        for factor in factors:
            num_slots = int(round(factor * top_k))
            row = {}
            for policy in [*policies, OPTIMUM]:
                row[policy] = misses_per_step_per_layer(traces, num_slots, policy)
                bar.update(1)
            results.append(Result(factor, num_slots, row))
    return results


TUNE_GRID = {"touch": [2, 4, 8, 16], "load_steps": [0, 2, 4, 8], "next_per_spare": [1, 2]}


def tune_score_lru(traces: list[TopkTrace], results: list[Result]) -> dict[tuple[int, int, int], list[float]]:
    """For every (touch, load_steps, next_per_spare) in TUNE_GRID, score_lru's share of LRU's gap closed
    at each buffer size of `results` that has a gap (LRU and the optimum are taken from there)."""
    sized = [r for r in results if _has_gap(r)]
    grid = {}
    for touch in TUNE_GRID["touch"]:
        for load in TUNE_GRID["load_steps"]:
            for per in TUNE_GRID["next_per_spare"]:
                shares = []
                for r in sized:
                    misses = misses_per_step_per_layer(traces, r.num_slots, ScoreLRUPolicy.name, touch=touch,
                                                       load_steps=load, next_per_spare=per)
                    shares.append(_share(r, ScoreLRUPolicy.name, misses))
                grid[(touch, load, per)] = shares
    return grid


LRFU_DECAY_SHIFTS = [3, 4, 5]  # decays of 7/8, 15/16 and 31/32 a step
LRFU_RANK_BONUSES = [0, 2, 4, 6]  # the first runner-up's credit, in selections (0: no credit)


def tune_lrfu(traces: list[TopkTrace], results: list[Result]) -> dict[tuple[int, int], list[float]]:
    """For every (DECAY_SHIFT, RANK_BONUS in selections) of LRFU_DECAY_SHIFTS x LRFU_RANK_BONUSES, lrfu's
    share of LRU's gap closed at each buffer size of `results` that has a gap."""
    return _lrfu_grid(traces, results, LRFU_DECAY_SHIFTS, LRFU_RANK_BONUSES,
                      lambda shift, bonus: {"decay_shift": shift, "rank_bonus": bonus * LRFUPolicy.HIT})


LRFU_GHOST_DECAY_SHIFTS = [2, 3, 4]  # ghosts keeping 3/4, 7/8 and 15/16 of their value a step
LRFU_GHOST_WEIGHTS = [0, 4, 6, 8]  # a returning ghost's share of its value, in quarters (0: no ghosts)


def tune_lrfu_ghosts(traces: list[TopkTrace], results: list[Result]) -> dict[tuple[int, int], list[float]]:
    """For every (GHOST_DECAY_SHIFT, GHOST_WEIGHT_QUARTERS) of the two lists above, lrfu's share of LRU's
    gap closed at each buffer size of `results` that has a gap (its other constants as they are)."""
    return _lrfu_grid(traces, results, LRFU_GHOST_DECAY_SHIFTS, LRFU_GHOST_WEIGHTS,
                      lambda shift, weight: {"ghost_decay_shift": shift, "ghost_weight_quarters": weight})


def _lrfu_grid(traces: list[TopkTrace], results: list[Result], firsts: list[int], seconds: list[int],
               overrides) -> dict[tuple[int, int], list[float]]:
    """lrfu's share of LRU's gap per buffer size with a gap, for each (first, second): `overrides(first,
    second)` `replay`'s keyword overrides."""
    sized = [r for r in results if _has_gap(r)]
    return {(a, b): [_share(r, LRFUPolicy.name, misses_per_step_per_layer(traces, r.num_slots, LRFUPolicy.name,
                                                                          **overrides(a, b)))
                     for r in sized]
            for a in firsts for b in seconds}


def _print_grid(title: str, headers: tuple[str, ...], grid: dict[tuple, list[float]], sizes: list[str],
                cells, best_is) -> tuple:
    """Print a tuning grid as a Markdown table (`cells(key)`: the key's leading cells) and the key of the
    best mean share (`best_is(key)` says it in words); return that key."""
    print(f"\n{title}\n")
    print("| " + " | ".join(headers) + " | " + " | ".join(sizes) + " | mean |\n|"
          + "---|" * (len(headers) + len(sizes) + 1))
    for key, shares in grid.items():
        print("| " + " | ".join(str(c) for c in cells(key)) + " | " + " | ".join(f"{x:.0%}" for x in shares)
              + f" | {np.mean(shares):.1%} |")
    best = max(grid, key=lambda key: float(np.mean(grid[key])))
    print(f"\nbest: {best_is(best)}: {np.mean(grid[best]):.1%} on average")
    return best


def _with_decay(key: tuple[int, int]) -> tuple:
    """A (decay shift, x) grid key's cells: the shift, the share kept a step, x."""
    return key[0], f"{1 - 2.0 ** -key[0]:.4g}", key[1]


def _has_gap(result: Result) -> bool:
    return result.misses["lru"] - result.misses[OPTIMUM] > 1e-9


def _share(result: Result, policy: str, misses: float) -> float | None:
    return gap_closed(Result(result.buffer_factor, result.num_slots, {**result.misses, policy: misses}), policy)


def gap_closed(result: Result, policy: str) -> float | None:
    """The share of LRU's excess over the optimum that `policy` removes (None when LRU has no excess)."""
    misses = result.misses
    if "lru" not in misses or policy not in misses:
        return None
    gap = misses["lru"] - misses[OPTIMUM]
    return (misses["lru"] - misses[policy]) / gap if gap > 1e-9 else None


def markdown_table(results: list[Result], policies: list[str]) -> str:
    cols = [*policies, OPTIMUM]
    challengers = [c for c in CHALLENGERS if c in policies and "lru" in policies]
    lines = ["| buffer | slots | " + " | ".join(cols) + " | " + " | ".join(f"{p} excess" for p in policies)
             + "".join(f" | {c} closes of LRU's gap" for c in challengers) + " |",
             "|" + "---|" * (2 + len(cols) + len(policies) + len(challengers))]
    for r in results:
        opt = r.misses[OPTIMUM]
        closed = [gap_closed(r, c) for c in challengers]
        lines.append(f"| {r.buffer_factor:g}x | {r.num_slots} | " + " | ".join(f"{r.misses[c]:.2f}" for c in cols)
                     + " | " + " | ".join(f"+{r.misses[p] - opt:.2f} ({r.misses[p] / opt:.2f}x)" if opt > 0
                                          else f"+{r.misses[p] - opt:.2f}" for p in policies)
                     + "".join(f" | {x:.0%}" if x is not None else " | -" for x in closed) + " |")
    return "\n".join(lines)


def plot(results: list[Result], policies: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [r.buffer_factor for r in results]
    for policy in [*policies, OPTIMUM]:
        ax.plot(xs, [r.misses[policy] for r in results], marker="o", label=policy,
                linestyle="--" if policy == OPTIMUM else "-", color="black" if policy == OPTIMUM else None)
    ax.set_xlabel("device buffer size (x top_k)")
    ax.set_ylabel("misses per step per layer")
    ax.set_xticks(xs)
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace-dir", type=output_dir, default=DEFAULT_TRACE_DIR, help="recorded traces (cache)")
    parser.add_argument("--num-requests", type=int_in(1, MAX_REQUESTS), default=4, help=f"at most {MAX_REQUESTS}")
    parser.add_argument("--context", type=positive_int, default=2048,
                        help="prompt tokens per request (with --steps, at most the model's context)")
    parser.add_argument("--steps", type=positive_int, default=1024,
                        help="decode steps recorded per request (1024: a long generation, as the issue measures)")
    parser.add_argument("--top-k", type=positive_int, default=256)
    parser.add_argument("--buffers", type=comma_list(float_in(1.0)), default="1,1.5,2,3",
                        help="device buffer sizes in units of top_k (each >= 1: the buffer must hold the top_k)")
    parser.add_argument("--split", choices=("heldout", "train"), default="heldout",
                        help="text the traces are recorded on (tune on train, report on heldout)")
    parser.add_argument("--policies", type=comma_list(one_of(*POLICIES)), default=",".join(POLICIES))
    parser.add_argument("--tune", action="store_true",
                        help="also grid-search score_lru's constants and lrfu's decay and rank bonus "
                             "(needs lru in --policies)")
    parser.add_argument("--synthetic", action="store_true", help="replay generated traces (no model needed)")
    parser.add_argument("--out", type=output_dir, default="missrate_results")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """What the flags get wrong together, as a ValueError, before a trace is recorded or replayed."""
    if args.tune and "lru" not in args.policies:
        raise ValueError("--tune measures shares of LRU's gap: it needs lru in --policies")
    tokens = args.context + args.steps
    if args.synthetic:
        most, layers, next_per_top_k = SYNTHETIC_MAX_TOKENS, SYNTHETIC_LAYERS, SYNTHETIC_NEXT_PER_TOP_K
        if tokens > most:
            raise ValueError(f"--context + --steps is {tokens}; synthetic traces hold at most {most} tokens")
    else:
        from hisparse.models.loader import read_model_config

        config = read_model_config(None)
        most, layers, next_per_top_k = config.max_position_embeddings, config.num_layers, TRACE_NEXT_PER_TOP_K
        if tokens > most:
            raise ValueError(f"--context + --steps is {tokens}, beyond the model's context of {most} tokens")
    largest = int(round(max(args.buffers) * args.top_k))
    if largest >= tokens:
        raise ValueError(f"a buffer of {max(args.buffers):g} x --top-k {args.top_k} = {largest} slots holds every one "
                         f"of the {tokens} tokens (--context + --steps): no step would swap anything in")
    one_request = layers * args.steps * args.top_k * (1 + next_per_top_k) * 4  # int32 selections and runners-up
    check_fits_in_memory((args.num_requests + 4) * one_request,  # + one request's int64 copies as it is replayed
                         f"{args.num_requests} traces of {layers} layers x {args.steps} steps x top_k {args.top_k}")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as error:
        parser.error(str(error))
    factors, policies = args.buffers, args.policies
    started = time.perf_counter()
    if args.synthetic:
        traces = [synthetic_trace(i, context=args.context, steps=args.steps, top_k=args.top_k)
                  for i in range(args.num_requests)]
        source = "synthetic"
    else:
        traces = load_or_record(args.trace_dir, args.split, args.num_requests, args.context, args.steps, args.top_k,
                                progress=not args.no_progress)
        source = f"SmolLM2-135M + indexer, {args.split} text"
    recorded = time.perf_counter()
    top_k = traces[0].top_k
    results = run(traces, top_k, factors, policies, progress=not args.no_progress)
    title = (f"{source}: {len(traces)} requests x {args.context} ctx x {args.steps} steps, "
             f"top_k {top_k}, {traces[0].num_layers} layers")
    table = markdown_table(results, policies)
    p = ScoreLRUPolicy
    constants = {p.name: {"touch_age_per_rank": p.TOUCH_AGE_PER_RANK, "load_age_steps": p.LOAD_AGE_STEPS,
                          "next_ranks_per_spare_slot": p.NEXT_RANKS_PER_SPARE_SLOT},
                 LRFUPolicy.name: {"decay_shift": LRFUPolicy.DECAY_SHIFT,
                                   "rank_bonus_selections": LRFUPolicy.RANK_BONUS / LRFUPolicy.HIT,
                                   "ranks_per_top_k": LRFUPolicy.RANKS_PER_TOP_K,
                                   "ghost_decay_shift": LRFUPolicy.GHOST_DECAY_SHIFT,
                                   "ghost_weight_quarters": LRFUPolicy.GHOST_WEIGHT_QUARTERS}}
    described = (f"{p.name}: touch {p.TOUCH_AGE_PER_RANK}, load age {p.LOAD_AGE_STEPS} steps, "
                 f"{p.NEXT_RANKS_PER_SPARE_SLOT} next ranks per spare slot; "
                 f"{LRFUPolicy.name}: decay 1 - 2^-{LRFUPolicy.DECAY_SHIFT} a step, runners-up credited from "
                 f"{LRFUPolicy.RANK_BONUS / LRFUPolicy.HIT:g} selections down to 0 at rank "
                 f"{LRFUPolicy.RANKS_PER_TOP_K} x top_k, ghosts decaying 1 - 2^-{LRFUPolicy.GHOST_DECAY_SHIFT} a "
                 f"step, returning with {LRFUPolicy.GHOST_WEIGHT_QUARTERS}/4 of their value")
    print(f"\nmisses per step per layer ({title}; {described})\n")
    print(table)
    report = {"source": source, "split": args.split, "num_requests": len(traces), "context": args.context,
              "steps": args.steps, "top_k": top_k, "num_layers": traces[0].num_layers, "constants": constants,
              "results": [{"buffer_factor": r.buffer_factor, "num_slots": r.num_slots, "misses": r.misses,
                           "excess_over_optimum": {p: r.misses[p] - r.misses[OPTIMUM] for p in policies},
                           **{f"{c}_gap_closed": gap_closed(r, c) for c in CHALLENGERS if c in r.misses}}
                          for r in results]}
    if args.tune:
        grid = tune_score_lru(traces, results)
        sizes = [f"{r.buffer_factor:g}x" for r in results if _has_gap(r)]
        best = _print_grid(f"{ScoreLRUPolicy.name}'s share of LRU's gap closed, per buffer size and on average",
                           ("touch", "load age", "next per spare slot"), grid, sizes, lambda key: key,
                           lambda key: f"touch {key[0]}, load age {key[1]}, {key[2]} next ranks per spare slot")
        decays = tune_lrfu(traces, results)
        best_lrfu = _print_grid(f"{LRFUPolicy.name}'s share of LRU's gap closed",
                                ("decay shift", "decay a step", "rank bonus (selections)"), decays, sizes,
                                _with_decay, lambda key: f"decay shift {key[0]}, rank bonus {key[1]} selections")
        ghosts = tune_lrfu_ghosts(traces, results)
        best_ghosts = _print_grid(f"{LRFUPolicy.name}'s share of LRU's gap closed, by its ghosts' decay and weight",
                                  ("ghost decay shift", "decay a step", "weight (quarters)"), ghosts, sizes,
                                  _with_decay, lambda key: f"ghost decay shift {key[0]}, weight {key[1]} quarters")
        names = ("touch", "load_steps", "next_per_spare")
        report["tune"] = {"sizes": sizes, "best": dict(zip(names, best, strict=True)),
                          "grid": [{"touch": t, "load_steps": x, "next_per_spare": n, "gap_closed": v}
                                   for (t, x, n), v in grid.items()],
                          LRFUPolicy.name: {"best_decay_shift": best_lrfu[0], "best_rank_bonus": best_lrfu[1],
                                            "grid": [{"decay_shift": k, "rank_bonus": n, "gap_closed": v}
                                                     for (k, n), v in decays.items()],
                                            "best_ghost_decay_shift": best_ghosts[0],
                                            "best_ghost_weight_quarters": best_ghosts[1],
                                            "ghost_grid": [{"ghost_decay_shift": k, "ghost_weight_quarters": w,
                                                            "gap_closed": v} for (k, w), v in ghosts.items()]}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "missrate.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "missrate.md").write_text(f"Misses per step per layer ({title}; {described})\n\n{table}\n")
    plot(results, policies, args.out / "missrate.png", title)
    print(f"\nwrote {args.out}/missrate.{{json,md,png}} (traces {recorded - started:.0f} s, "
          f"replay {time.perf_counter() - recorded:.0f} s)")


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
