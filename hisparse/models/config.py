"""The shape of a Llama-architecture model, read from whichever file format carries it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hisparse.distributed.tensor_parallel import TensorParallel, split_sizes
from hisparse.formats.kv_layout import KVLayout


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def for_rank(self, tp: TensorParallel) -> LlamaConfig:
        """The part of the model one of `tp.size` tensor-parallel ranks holds: its share of the KV heads (as even
        as they split) with their Q heads, and of the MLP's columns. The vocabulary stays the model's."""
        if tp.dp_attention or tp.expert_parallel:
            raise ValueError("DP attention and expert parallelism are for the DSA models (MLA, MoE): a Llama model "
                             "runs tensor-parallel, with --tp-size alone")
        rank, size = tp.rank, tp.size
        if size == 1:
            return self
        if size > self.num_kv_heads:
            raise ValueError(f"tp_size {size} is more than the model's {self.num_kv_heads} KV heads: each rank "
                             "holds at least one")
        kv_heads, mlp = split_sizes(self.num_kv_heads, size)[rank], split_sizes(self.intermediate_size, size)[rank]
        return dataclasses.replace(self, num_heads=kv_heads * (self.num_heads // self.num_kv_heads),
                                   num_kv_heads=kv_heads, intermediate_size=mlp)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def kv_row_size(self) -> int:
        """Values per token per layer in the KV cache: one row holds the token's K then its V."""
        return 2 * self.kv_size

    def row_layout(self, kind: str) -> KVLayout:
        """The cache's K/V rows: kind float32 or bfloat16."""
        if kind not in ("float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype {kind!r} is not a K/V layout of a Llama model: float32 or bfloat16 "
                             "(fp8_e4m3 is the DSA models' latent layout)")
        return KVLayout.of(self, getattr(torch, kind))
