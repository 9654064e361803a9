"""The HiSparse memory hierarchy for any kind of token row: host pool, device hot buffers, indexer keys.

A row is what one token caches in one layer, and nothing here looks inside one: for the default model it
is the K and V of every KV head, for the DSA models the packed MLA latent, bf16 or the FP8 layout, as
uint8 bytes (the cache's `formats.kv_layout.RowLayout`; `attention.hisparse.HiSparseKVCache` is the one
cache over these pools). Swap-in copies rows as raw machine words, so both ride the same kernels.

Per request the device holds `device_buffer_size` hot slots per layer plus one reserved slot for the
newest token (written by the forward pass, never evicted), and the lightning indexer's key for every
token (it is what lets selection run without the big cache); the host pool holds every row. Each decode
step, per layer, the model's indexer picks the top-k positions and `page_table` turns them into device
rows: while a request's length fits its buffer, position p simply lives in slot p (the fast path: no
swap-in at all); after that `swap_in` brings the missing positions from the host pool into the hot
buffer, evicting by the configured policy, and the newest position reads the reserved slot.

Sizing follows the reference: one device "cell" = layers x (row_bytes + ratio x indexer_bytes), so the
budget buys `device_slots` rows and `device_slots x ratio` logical tokens (host rows and indexer keys).
A request is admitted only when its hot buffer, its host rows and its indexer slots are all free; host rows
and indexer keys of a prefix cached by an earlier request are reused (`memory.prefix_cache`).

Co-located flow: prefill writes the prompt's rows to the host pool and attends over them there (on a GPU
this is where the reference stages prefill on the device before the backup); before the first decode
step `load_prompt` fills the hot buffer with the prompt's last tokens, and from then on the request costs
the device only its hot buffer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hisparse.formats.index_key import IndexKeyFormat
from hisparse.memory.eviction import get_policy, new_slot_tables, reset_row
from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.memory.host_memory import GIB, available_host_memory, host_empty
from hisparse.memory.indexer_cache import IndexerKeyCache
from hisparse.memory.prefix_cache import PrefixCache, PrefixClaim
from hisparse.memory.slot_allocator import SlotAllocator
from hisparse.memory.swap_in import bound_swap_in


@dataclass
class HiSparseAllocation:
    row: int  # this request's row of the slot tables
    device_rows: np.ndarray  # device row of each hot slot, then (if it can outgrow them) the reserved one
    host_rows: np.ndarray  # host row of every position it may hold
    index_slots: np.ndarray  # indexer-key slot of every position
    claim: PrefixClaim  # host_rows and index_slots, as the prefix cache gave them (a reused prefix's first)
    loaded: bool = False  # its prompt's tail has been copied into the hot buffer
    buffered: bool = False  # its slot tables are live (it has outgrown the fast path)


def hit_rate(hits: int, misses: int) -> float | None:
    """The share of lookups the hot buffers answered; None before any lookup."""
    lookups = hits + misses
    return hits / lookups if lookups else None


class SwapInCounters:
    """Per-layer hits, misses, evictions, bytes copied host -> device and swap-in seconds.

    Hits, misses and evictions add up where the swap-in runs (`totals`, a tensor on the pools' device), so
    no layer waits for a GPU to count them; `as_dict` reads them (the server does after every step: one
    wait per step). The seconds are the host's time in the swap-in call: on a GPU, the time to queue it.
    """

    def __init__(self, num_layers: int, row_bytes: int, device: str = "cpu") -> None:
        self.row_bytes = row_bytes
        self.totals = torch.zeros(num_layers, 3, dtype=torch.int64, device=device)  # hits, misses, evictions
        self.seconds = np.zeros(num_layers, dtype=np.float64)
        self.fast_path = torch.zeros((), dtype=torch.int64, device=device)  # selections served without swap-in
        self.prompt_load_bytes = 0  # prompt tails copied into hot buffers after prefill

    def reset(self) -> None:
        """Zero every counter in place: the swap-in kernels hold views of `totals` and `seconds`."""
        self.totals.zero_()
        self.seconds[:] = 0.0
        self.fast_path.zero_()
        self.prompt_load_bytes = 0

    def as_dict(self) -> dict:
        counts = torch.cat((self.totals.flatten(), self.fast_path.view(1))).cpu().numpy()  # one device read
        hits, misses, evictions = counts[:-1].reshape(-1, 3).T
        fast_path = int(counts[-1])
        bytes_h2d = misses * self.row_bytes
        return {
            "hits": int(hits.sum()),
            "misses": int(misses.sum()),
            "evictions": int(evictions.sum()),
            "bytes_host_to_device": int(bytes_h2d.sum()),
            "swap_in_seconds": float(self.seconds.sum()),
            "hit_rate": hit_rate(int(hits.sum()), int(misses.sum())),
            "fast_path_lookups": fast_path,
            "prompt_load_bytes": self.prompt_load_bytes,
            "per_layer": {"hits": hits.tolist(), "misses": misses.tolist(), "evictions": evictions.tolist(),
                          "bytes_host_to_device": bytes_h2d.tolist(), "swap_in_seconds": self.seconds.tolist()},
        }


@dataclass
class DecodeStep:
    """One decode step's per-request facts, worked out once and read by every layer: which requests are
    still on the fast path and which swap in is fixed for the step, so layers do not split the batch. The
    split is known on the host (`swapping`), so no layer waits for the device to find it out."""

    rows: torch.Tensor  # int64 [B]: each request's row of the slot tables
    lengths: torch.Tensor  # int64 [B]: context length, the newest token included
    device_write: torch.Tensor  # int64 [B]: device row the newest token's row is written to
    swapping: list[bool]  # per request: it has outgrown its buffer
    has_fast: bool = field(init=False)
    has_swapping: bool = field(init=False)
    fast_index: torch.Tensor = field(init=False)  # [Bf]: the batch entries on the fast path
    swap_index: torch.Tensor = field(init=False)  # [Bs]: those that swap in
    fast_rows: torch.Tensor = field(init=False)  # [Bf, 1]
    swap_rows: torch.Tensor = field(init=False)  # [Bs]
    swap_newest: torch.Tensor = field(init=False)  # [Bs]: the newest position of each swapping request
    swap_reserved: torch.Tensor = field(init=False)  # [Bs]: its reserved device row

    def __post_init__(self) -> None:
        on_device = {"dtype": torch.int64, "device": self.rows.device}
        self.has_fast, self.has_swapping = not all(self.swapping), any(self.swapping)
        if not self.has_fast:  # the usual case once contexts outgrow their buffers: the whole batch, no gathers
            self.swap_index = torch.arange(len(self.swapping), **on_device)
            self.fast_index, self.fast_rows = self.swap_index[:0], self.swap_index[:0].view(0, 1)
            self.swap_rows, self.swap_reserved = self.rows, self.device_write
            self.swap_newest = self.lengths - 1
            return
        self.fast_index = torch.tensor([b for b, s in enumerate(self.swapping) if not s], **on_device)
        self.swap_index = torch.tensor([b for b, s in enumerate(self.swapping) if s], **on_device)
        self.fast_rows = self.rows[self.fast_index].unsqueeze(1)
        self.swap_rows = self.rows[self.swap_index]
        self.swap_newest = self.lengths[self.swap_index] - 1
        self.swap_reserved = self.device_write[self.swap_index]


@dataclass(frozen=True)
class PoolSizing:
    """The reference's sizing of the pools for a device budget: one device cell = layers x (row_bytes + ratio x
    indexer_bytes), so the budget buys `device_slots` hot rows and `device_slots x ratio` logical tokens (host
    rows and indexer keys). Its own class so that a caller can check a budget before building the pools (the
    serving benchmark does, before it starts a server)."""

    num_layers: int
    row_bytes: int  # one token, one layer
    index_row_bytes: int
    config: HiSparseConfig
    budget_bytes: int

    @property
    def cell_bytes(self) -> int:
        return self.num_layers * (self.row_bytes + self.config.host_to_device_ratio * self.index_row_bytes)

    @property
    def device_slots(self) -> int:
        return self.budget_bytes // self.cell_bytes

    @property
    def logical_capacity(self) -> int:
        return self.device_slots * self.config.host_to_device_ratio

    @property
    def host_bytes(self) -> int:
        return self.num_layers * self.logical_capacity * self.row_bytes

    def check(self, device: str, max_context: int) -> None:
        """ValueError, naming the fields, unless a request of `max_context` tokens can outgrow the buffer, the
        budget buys one request's buffer and the pools fit in the memory this machine has (on the CPU the
        "device" pools are host memory too)."""
        self.config.check_context(max_context)
        ratio, buffer = self.config.host_to_device_ratio, self.config.device_buffer_size
        if self.device_slots < buffer + 1:
            raise ValueError(f"the device KV budget ({self.budget_bytes} bytes) buys {self.device_slots} hot slots, "
                             f"fewer than one request's buffer ({buffer} + 1): each slot costs {self.cell_bytes} "
                             f"bytes, its row in {self.num_layers} layers and the indexer keys of "
                             f"host_to_device_ratio ({ratio}) tokens; raise the budget or lower host_to_device_ratio")
        on_cpu = device == "cpu"
        needed = self.host_bytes + (self.budget_bytes if on_cpu else 0)
        available = available_host_memory()
        if available is not None and needed > available:
            raise ValueError(f"the host pool needs {self.host_bytes / GIB:.1f} GiB (host_to_device_ratio {ratio} x "
                             f"{self.device_slots} device slots x {self.num_layers} layers x {self.row_bytes} B)"
                             + (f" and the device pools {self.budget_bytes / GIB:.1f} GiB" if on_cpu else "")
                             + f", but this machine has {available / GIB:.1f} GiB available; lower "
                             f"host_to_device_ratio or the device KV budget")


class HiSparsePools:
    """Device hot buffers, host pool, indexer keys, slot tables, eviction policies and counters.

    Rows are `row_width` elements of `row_dtype` per token per layer; indexer keys are rows of the
    `index_key` format. Requests are `HiSparseAllocation`s; `attention.hisparse.HiSparseKVCache` serves every
    model over these pools.
    """

    def __init__(self, num_layers: int, row_width: int, row_dtype: torch.dtype, index_key: IndexKeyFormat,
                 config: HiSparseConfig, budget_bytes: int, max_requests: int, max_context: int,
                 device: str = "cpu", swap_in_backend: str = "auto", prefix_caching: bool = False,
                 sizing_row_bytes: int | None = None) -> None:
        """sizing_row_bytes: the row size that decides how many rows the budget buys, when the rows are smaller
        (a tensor-parallel rank with fewer KV heads than rank 0 holds as many tokens as rank 0)."""
        self.num_layers = num_layers
        self.config = config
        self.device = device
        self.max_context = max_context
        self.row_bytes = row_width * row_dtype.itemsize  # one token, one layer
        self.index_row_bytes = index_key.row_bytes
        sizing = PoolSizing(num_layers, sizing_row_bytes or self.row_bytes, self.index_row_bytes, config, budget_bytes)
        sizing.check(device, max_context)
        self.cell_bytes, self.device_slots = sizing.cell_bytes, sizing.device_slots
        self.logical_capacity = sizing.logical_capacity
        buffer = config.device_buffer_size
        # A request holds at least one device slot, so no more than device_slots can ever be admitted: the
        # slot tables need no more rows (host_rows alone is rows x max_context int64).
        max_requests = min(max_requests, self.device_slots)
        pin = device != "cpu" and torch.cuda.is_available()
        self.device_kv = torch.zeros(num_layers, self.device_slots, row_width, dtype=row_dtype, device=device)
        # Never zeroed: a host row is always written (prefill or decode) before anything reads it, and
        # touching gigabytes of fresh pages would cost seconds at start-up.
        self.host_kv = host_empty((num_layers, self.logical_capacity, row_width), row_dtype, pin=pin,
                                  pages=config.host_pages)
        self.index_cache = IndexerKeyCache(num_layers, self.logical_capacity, index_key, device=device)
        self.device_allocator = SlotAllocator(self.device_slots)
        self.host_allocator = SlotAllocator(self.logical_capacity)
        self.row_allocator = SlotAllocator(max_requests)
        # A cached prefix is its host rows and indexer keys; hot buffers are never shared.
        self.prefix = PrefixCache([self.host_allocator, self.index_cache.allocator], prefix_caching)
        tables = [new_slot_tables(max_requests, buffer, device) for _ in range(num_layers)]
        self.slot_pos = torch.stack([t[0] for t in tables])  # [L, R, S]
        self.lru = torch.stack([t[1] for t in tables])  # [L, R, S]
        self.device_rows = torch.zeros(max_requests, buffer, dtype=torch.int64, device=device)
        self.host_rows = torch.zeros(max_requests, max_context, dtype=torch.int64, device=device)
        policy = config.policy_for(device)
        self.policies = [get_policy(policy, max_requests, buffer, device) for _ in range(num_layers)]
        # Positions ranked below the top-k that the policy reads (score_lru, lrfu), asked of the indexer per step.
        self.num_next_ranks = self.policies[0].num_next_ranks(config.top_k)
        # Bound once per layer: every argument of a step's swap-in is built here, so the per-call checks are skipped.
        self.counters = SwapInCounters(num_layers, self.row_bytes, device)
        self.swap_in = [bound_swap_in(swap_in_backend, self.policies[layer], self.slot_pos[layer], self.lru[layer],
                                      self.device_rows, self.host_rows, self.host_kv[layer], self.device_kv[layer],
                                      self.counters.totals[layer])
                        for layer in range(num_layers)]

    # -- admission --------------------------------------------------------------------------------

    def _needs(self, total_tokens: int) -> tuple[int, int]:
        """(device rows, logical tokens) a request of `total_tokens` takes for its whole life."""
        buffer = self.config.device_buffer_size
        return (total_tokens if total_tokens <= buffer else buffer + 1), total_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.logical_capacity

    def can_allocate(self, total_tokens: int) -> bool:
        """Whether a request of `total_tokens` fits now, reusing nothing (cached prefixes nobody uses are free)."""
        device, logical = self._needs(total_tokens)
        return (device <= self.device_allocator.num_free and logical <= self.prefix.num_free
                and self.row_allocator.num_free > 0)

    def allocate(self, total_tokens: int, prompt: Sequence[int] = ()) -> HiSparseAllocation | None:
        """Everything a request of at most `total_tokens` tokens will hold, its host rows and indexer keys
        reusing the longest cached prefix of `prompt`; None when it does not fit now."""
        if total_tokens < 1 or total_tokens > self.max_context:
            raise ValueError(f"a request must hold between 1 and {self.max_context} tokens (max_context), "
                             f"got {total_tokens}")
        device, logical = self._needs(total_tokens)
        if device > self.device_allocator.num_free or self.row_allocator.num_free == 0:
            return None
        claim = self.prefix.claim(prompt, logical)
        if claim is None:
            return None
        row = int(self.row_allocator.allocate(1)[0])
        alloc = HiSparseAllocation(row, self.device_allocator.allocate(device), claim.column(0), claim.column(1),
                                   claim)
        hot = alloc.device_rows[:self.config.device_buffer_size]
        self.device_rows[row, :hot.size] = torch.from_numpy(hot)
        self.host_rows[row, :logical] = torch.from_numpy(alloc.host_rows)
        return alloc

    def free(self, alloc: HiSparseAllocation, computed: Sequence[int] = ()) -> None:
        """Give back a request's hot buffer and table row; the host rows and indexer keys of its `computed`
        tokens stay in the prefix cache (with it on), the rest go back."""
        self.device_allocator.free(alloc.device_rows)
        self.prefix.release(alloc.claim, computed)
        for layer in range(self.num_layers):
            reset_row(self.slot_pos[layer], self.lru[layer], alloc.row, (), self.policies[layer])
        self.row_allocator.free(np.array([alloc.row]))

    def usage(self) -> dict[str, int]:
        return {"device_slots_total": self.device_allocator.num_slots,
                "device_slots_used": self.device_allocator.num_used,
                "host_slots_total": self.host_allocator.num_slots,
                "host_slots_used": self.host_allocator.num_used,
                "indexer_slots_total": self.index_cache.allocator.num_slots,
                "indexer_slots_used": self.index_cache.allocator.num_used, **self.prefix.usage()}

    # -- the hot buffer ---------------------------------------------------------------------------

    def load_prompt(self, alloc: HiSparseAllocation, length: int) -> None:
        """Bring a prompt's last tokens (up to the buffer size) from the host pool into the hot slots, in
        order, before the first decode step; a prompt longer than the buffer also makes its slot tables
        live, its oldest loaded position first to go."""
        first = max(0, length - self.config.device_buffer_size)
        src = torch.from_numpy(alloc.host_rows[first:length])
        dst = self.device_rows[alloc.row, :length - first]
        for layer in range(self.num_layers):
            self.device_kv[layer].index_copy_(0, dst, self.host_kv[layer].index_select(0, src).to(self.device))
        self.counters.prompt_load_bytes += (length - first) * self.num_layers * self.row_bytes
        alloc.loaded = True
        if first > 0 or length == self.config.device_buffer_size:
            self.take_over(alloc, length)

    def take_over(self, alloc: HiSparseAllocation, length: int) -> None:
        """Leave the fast path: slots 0..S-1 hold the last S positions in order, in every layer."""
        positions = torch.arange(length - self.config.device_buffer_size, length)
        for layer in range(self.num_layers):
            reset_row(self.slot_pos[layer], self.lru[layer], alloc.row, positions, self.policies[layer])
        alloc.buffered = True

    def begin_decode(self, allocs: list[HiSparseAllocation], starts: list[int]) -> DecodeStep:
        """Prepare one decode step of requests whose newest token sits at position `starts[i]`: load
        prompts not yet in their hot buffer, take over buffers the step outgrows, and say where each
        newest row goes (slot p while it fits the buffer, else the reserved slot)."""
        buffer = self.config.device_buffer_size
        for alloc, start in zip(allocs, starts, strict=True):
            if not alloc.loaded:
                self.load_prompt(alloc, start)
            elif start >= buffer and not alloc.buffered:
                self.take_over(alloc, start)
        on_device = {"device": self.device}  # the step's tensors index device tensors only
        return DecodeStep(
            rows=torch.tensor([a.row for a in allocs], **on_device),
            lengths=torch.tensor([s + 1 for s in starts], **on_device),
            device_write=torch.tensor([int(a.device_rows[s] if s < buffer else a.device_rows[-1])
                                       for a, s in zip(allocs, starts, strict=True)], **on_device),
            swapping=[s >= buffer for s in starts],
        )

    def page_table(self, layer: int, step: DecodeStep, selected: torch.Tensor,
                   next_ranked: torch.Tensor | None = None) -> torch.Tensor:
        """Device rows [B, K] of the selected positions [B, K] (-1 padding stays -1), swapping missed
        rows in first; the newest position, when selected, reads its reserved slot. `next_ranked` [B, M]:
        the positions ranked just below the selection, for a policy that reads them (`num_next_ranks`)."""
        every = step.has_swapping and not step.has_fast  # the usual case: no boolean-mask gathers and scatters
        page = None if every else torch.full_like(selected, -1)
        if step.has_fast:  # the buffer holds every token: position p is in hot slot p
            fast_sel = selected[step.fast_index]
            valid = fast_sel >= 0
            page[step.fast_index] = torch.where(valid, self.device_rows[step.fast_rows, fast_sel.clamp(min=0)], -1)
            self.counters.fast_path += valid.sum()
        if step.has_swapping:
            swap_sel = selected if every else selected[step.swap_index]
            if next_ranked is not None and not every:
                next_ranked = next_ranked[step.swap_index]
            start = time.perf_counter()
            swapped = self.swap_in[layer].page_table(swap_sel, step.swap_rows, step.swap_newest, step.swap_reserved,
                                                     next_ranked)
            self.counters.seconds[layer] += time.perf_counter() - start
            if every:
                return swapped
            page[step.swap_index] = swapped
        return page
