"""HiSparse for the DSA models (DeepSeek-V3.2, GLM-5): the packed MLA latent row is what is offloaded.

Per token per layer a DSA model caches one latent row (c_kv + k_pe: 1152 bytes in bf16, 656 in the FP8
layout, as `LatentFormat` packs it) and one indexer key (132 bytes). As in the reference, the latent rows
go to the host pool and the per-request hot buffers while the indexer keys stay on the device for every
token (`HiSparsePools`: the same hot buffer, swap-in, counters and admission as the default model's).
Rows are uint8 bytes, so swap-in copies them without knowing the format, and attention unpacks exactly
the bytes the plain `LatentCache` would hold: offloading changes no result.

`HiSparseLatentCache` is shared by all sequences; `open` admits one and returns its
`HiSparseLatentSequence`, which `DsaForCausalLM.forward` takes in place of a `LatentCache`:
- a forward of several tokens (prefill) writes their rows to the host pool and attends over the host
  pool; the hot buffer is (re)loaded with the newest tokens before the next decode step;
- a one-token forward (decode) writes the newest row to the host pool and to the device (slot p while
  the sequence fits its buffer, the reserved slot after), and `locate` turns each layer's selection into
  device rows, swapping missed rows in first.
The model runs one sequence per forward; sequences share the pools, so many can be open at once.
"""

from __future__ import annotations

import dataclasses

import torch

from hisparse.layers.dsa_indexer import IndexKeyFormat
from hisparse.layers.mla import LatentFormat
from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.memory.hisparse_pools import DecodeStep, HiSparseAllocation, HiSparsePools
from hisparse.memory.rows import gather_rows


class HiSparseLatentCache(HiSparsePools):
    """Host pool and hot buffers of packed latent rows, indexer keys on the device, for many sequences."""

    def __init__(self, num_layers: int, latent_format: LatentFormat, index_format: IndexKeyFormat,
                 config: HiSparseConfig, budget_bytes: int, max_sequences: int, max_context: int,
                 device: str = "cpu", swap_in_backend: str = "auto") -> None:
        if index_format.kind != "fp8":
            raise ValueError(f"HiSparse keeps the indexer keys on the device in the FP8 layout "
                             f"({index_format.head_dim} e4m3 + an fp32 scale); got index format {index_format.kind!r}")
        super().__init__(num_layers, latent_format.row_bytes, torch.uint8, index_format, config,
                         budget_bytes, max_sequences, max_context, device, swap_in_backend)
        self.latent_format = latent_format
        self.index_format = self.index_cache.format

    @classmethod
    def for_model(cls, model, hisparse_config: str | dict | HiSparseConfig | None = None, *, budget_bytes: int,
                  max_sequences: int, max_context: int, latent_kind: str = "bfloat16", device: str = "cpu",
                  swap_in_backend: str = "auto") -> HiSparseLatentCache:
        """The cache for a `DsaForCausalLM`. The model's own `index_topk` wins over the config's top_k, as
        in the reference; the hot buffer defaults to 2 x index_topk."""
        cfg = model.config
        config = HiSparseConfig.parse(hisparse_config, default_top_k=cfg.index_topk)
        if config.top_k != cfg.index_topk:
            config = dataclasses.replace(config, top_k=cfg.index_topk)
        return cls(cfg.num_hidden_layers, LatentFormat(latent_kind, cfg.kv_lora_rank, cfg.qk_rope_head_dim),
                   IndexKeyFormat("fp8", cfg.index_head_dim), config, budget_bytes, max_sequences, max_context,
                   device, swap_in_backend)

    def open(self, max_total_tokens: int) -> HiSparseLatentSequence:
        """Admit a sequence that will hold at most `max_total_tokens` tokens (prompt + output)."""
        if max_total_tokens > self.logical_capacity:
            raise ValueError(f"a sequence of {max_total_tokens} tokens exceeds the logical capacity of "
                             f"{self.logical_capacity} tokens; raise the device KV budget or host_to_device_ratio")
        if not self.can_allocate(max_total_tokens):
            device, logical = self._needs(max_total_tokens)
            raise ValueError(
                f"cannot admit a sequence of {max_total_tokens} tokens now: it needs {device} device rows "
                f"({self.device_allocator.num_free} free), {logical} host rows ({self.host_allocator.num_free} free), "
                f"{logical} indexer slots ({self.index_cache.allocator.num_free} free) and a table row "
                f"({self.row_allocator.num_free} free); close a sequence first")
        return HiSparseLatentSequence(self, self.allocate(max_total_tokens), max_total_tokens)

    def close(self, sequence: HiSparseLatentSequence) -> None:
        """Give back everything the sequence held; closing twice is a no-op."""
        if sequence.alloc is not None:
            self.free(sequence.alloc)
            sequence.alloc = None


class HiSparseLatentSequence:
    """One open sequence of a HiSparseLatentCache, with `LatentCache`'s interface for the model."""

    def __init__(self, cache: HiSparseLatentCache, alloc: HiSparseAllocation, capacity: int) -> None:
        self.cache = cache
        self.alloc: HiSparseAllocation | None = alloc
        self.capacity = capacity
        self.latent_format = cache.latent_format
        self.index_format = cache.index_format
        self.host_rows = torch.from_numpy(alloc.host_rows)
        self.index_slots = torch.from_numpy(alloc.index_slots).to(cache.device)
        self.seq_len = 0
        self.step: DecodeStep | None = None  # set by a one-token forward, None during prefill

    def extend(self, positions: torch.Tensor) -> None:
        if self.alloc is None:
            raise ValueError("this sequence is closed; open a new one")
        start, n = self.seq_len, positions.numel()
        if n == 0 or not torch.equal(positions.cpu(), torch.arange(start, start + n)):
            raise ValueError(f"positions must continue the sequence from {start} without gaps or rewrites, "
                             f"got {positions.tolist()}")
        if start + n > self.capacity:
            raise ValueError(f"position {start + n - 1} does not fit this sequence's {self.capacity} tokens "
                             f"(max_total_tokens when it was opened)")
        self.seq_len = start + n
        if n == 1:
            self.step = self.cache.begin_decode([self.alloc], [start])
        else:  # the hot buffer does not hold these rows: load it again before the next decode step
            self.step = None
            self.alloc.loaded = False

    def write(self, layer: int, positions: torch.Tensor, latent: torch.Tensor,
              index_k: torch.Tensor | None) -> None:
        rows = self.latent_format.pack(latent)
        host = self.cache.host_kv[layer]
        host.index_copy_(0, self.host_rows[positions.cpu()], rows.to(host.device))  # the backup (async on a GPU)
        if self.step is not None:
            self.cache.device_kv[layer].index_copy_(0, self.step.device_write.to(rows.device), rows)
        if index_k is not None:
            self.cache.index_cache.write(layer, self.index_slots[positions], index_k)

    @property
    def num_next_ranks(self) -> int:
        """Runners-up the eviction policy reads, wanted with a decode step's selection when it swaps in."""
        return self.cache.num_next_ranks if self.step is not None and self.step.has_swapping else 0

    def locate(self, layer: int, positions: torch.Tensor, runners_up: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill: host rows of `positions`. Decode: device rows of the selection [1, K], swapped in;
        `runners_up` [1, M] go to the eviction policy (`num_next_ranks`)."""
        if self.step is None:
            return torch.where(positions >= 0, self.host_rows[positions.clamp_min(0).cpu()].to(positions.device),
                               positions)
        return self.cache.page_table(layer, self.step, positions, runners_up)

    def read_latent(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """float32 latent rows of what `locate` returned (-1 reads row 0; the caller masks it)."""
        pool = self.cache.host_kv[layer] if self.step is None else self.cache.device_kv[layer]
        return self.latent_format.unpack(gather_rows(pool, slots.clamp_min(0).to(pool.device)))

    def read_index_k(self, layer: int, length: int) -> torch.Tensor:
        return self.cache.index_cache.keys(layer, self.index_slots[:length])
