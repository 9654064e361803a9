"""Llama architecture (SmolLM2 and friends) in plain PyTorch.

The forward pass works on a flat batch of N tokens from any mix of sequences: the engine packs prefill
chunks and decode tokens together and the attention backend sorts out which token sees which.
For inference (`prepare_for_inference`) Q/K/V, gate/up and a lightning indexer's three projections are each
fused into one matmul, in the weight layout `layers.linear.InferenceWeight` chooses (dense, or weight-only
int8 as Q8_0 blocks / int4 with `quantization`). The nn.Linear parameters stay views of the same memory, so training and
tests still see ordinary modules.

Tensor parallel (`tp`, Megatron's split): each rank holds the Q heads of its share of the KV heads, its share of
the MLP's columns and of the vocabulary; one all-reduce follows the output projection and one the down
projection, and the embedding sums its ranks' rows the same way. KV heads split as evenly as they go (the
default model's 3 over 2 ranks: 2 and 1), so `tp.size` may be any number up to num_kv_heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hisparse.attention.backend import AttentionBackend
from hisparse.distributed.tensor_parallel import TensorParallel
from hisparse.formats.sparse_attention import IndexerSpec
from hisparse.kernels import swiglu_cpu
from hisparse.kernels.c_library import autograd_records
from hisparse.layers.linear import SMALL_WEIGHT_DENSE_FROM, InferenceWeight, linear_kind
from hisparse.layers.norm import RMSNorm
from hisparse.layers.rotary import HalfSplitRotation, RotaryEmbedding
from hisparse.layers.vocab_parallel import embed_vocab_share
from hisparse.models import llama_decode
from hisparse.models.config import LlamaConfig


def shard_weight(name: str, weight: torch.Tensor, config: LlamaConfig, tp: TensorParallel) -> torch.Tensor:
    """The part of the whole model's parameter `name` (our names, [out, in]) that rank `tp.rank` holds: rows of
    the vocabulary, the Q/K/V rows of its heads, the gate/up rows of its MLP columns, and the matching input
    columns of the output and down projections; norms whole."""
    if tp.size == 1:
        return weight
    kind = name.split(".")[-2]  # "layers.3.attn.q_proj.weight" -> "q_proj", "lm_head.weight" -> "lm_head"
    group, head_dim = config.num_heads // config.num_kv_heads, config.head_dim
    kv_start, kv_heads = tp.share(config.num_kv_heads)
    mlp_start, mlp = tp.share(config.intermediate_size)
    rows = {"embed_tokens": tp.share(config.vocab_size), "lm_head": tp.share(config.vocab_size),
            "q_proj": (kv_start * group * head_dim, kv_heads * group * head_dim),
            "k_proj": (kv_start * head_dim, kv_heads * head_dim), "v_proj": (kv_start * head_dim, kv_heads * head_dim),
            "gate_proj": (mlp_start, mlp), "up_proj": (mlp_start, mlp)}
    columns = {"o_proj": rows["q_proj"], "down_proj": (mlp_start, mlp)}
    if kind in rows:
        return weight.narrow(0, *rows[kind]).contiguous()
    if kind in columns:
        return weight.narrow(1, *columns[kind]).contiguous()
    return weight


class LlamaAttention(nn.Module):
    """config: the rank's share (`LlamaConfig.for_rank`): its heads; the output projection's sums are all-reduced."""

    def __init__(self, config: LlamaConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp or TensorParallel()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=False)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.qkv: InferenceWeight | None = None  # set by prepare_for_inference
        self.o: InferenceWeight | None = None
        self.indexer: nn.Module | None = None  # a lightning indexer, when the model is made sparse
        self.index_proj: InferenceWeight | None = None  # its projections, fused (see prepare_for_inference)
        self.index_key_proj: InferenceWeight | None = None  # the key's rows alone
        self._prepared_indexer: nn.Module | None = None

    def prepare_for_inference(self, quantization: str = "none") -> None:
        """The indexer's projections are fused in the model's dtype, and quantized to int8 at most: they decide
        what attention reads; the key's rows alone besides, for steps that read no queries (a dense prompt chunk
        needs 64 of the 324 columns). They are a copy: prepare again after changing or replacing the indexer."""
        # Rounded once to int8 where the kernel rounds x, the attention's inputs cost most: decode perplexity over six
        # held-out texts, int4, +0.90% against bfloat16 with every linear's x rounded once, +0.35% with x exact in
        # these two (the MLP's rounding showed nothing); rounded twice here, +0.16% (int8 as Q8_0: +0.10%).
        kind = linear_kind(quantization)
        self.qkv = InferenceWeight.fused(self.q_proj, self.k_proj, self.v_proj, quantization=kind, round_x_twice=True)
        self.o = InferenceWeight.fused(self.o_proj, quantization=kind, round_x_twice=True)
        self._prepared_indexer = self.indexer
        self.index_key_proj = None
        if self.indexer is not None:
            weight = self.indexer.projection_weight().to(self.q_proj.weight.dtype)
            index_kind = "none" if quantization == "none" else "int8"
            self.index_proj = InferenceWeight(weight, index_kind, dense_from=SMALL_WEIGHT_DENSE_FROM)
            start = self.indexer.n_heads * self.indexer.head_dim  # int8: one scale per row, the same key bits
            self.index_key_proj = InferenceWeight(weight[start:start + self.indexer.head_dim], index_kind,
                                                  dense_from=SMALL_WEIGHT_DENSE_FROM)

    def forward(self, x: torch.Tensor, rope: HalfSplitRotation, index_rope: HalfSplitRotation | None,
                backend: AttentionBackend) -> torch.Tensor:
        """rope, index_rope: the batch's rotations of the heads and of the indexer (`LlamaForCausalLM.forward`)."""
        n = x.shape[0]
        qkv = self.qkv(x) if self.qkv is not None else torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        # Q and K heads rotate together: one RoPE call instead of two.
        qk = rope(qkv[:, :q_size + kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(n, self.num_kv_heads, self.head_dim)
        index = {} if self.indexer is None else self.indexer_inputs(x, index_rope, backend)
        out = backend.attend(self.layer, q, k, v, **index).reshape(n, q_size)
        return self.tp.all_reduce(self.o(out) if self.o is not None else self.o_proj(out))

    def indexer_inputs(self, x: torch.Tensor, rope: HalfSplitRotation, backend: AttentionBackend) -> dict:
        """The indexer's part of this step's attention: its keys always (later steps score them), its queries and
        head weights where the attention reads them (`AttentionBackend.index_query_rows`). Where it reads none, or
        those of some rows, every key comes from the key's rows alone (`prepare_for_inference`)."""
        prepared = self.indexer is self._prepared_indexer
        reads_queries, rows = backend.reads_index_queries, backend.index_query_rows
        if (not reads_queries or rows is not None) and prepared and self.index_key_proj is not None:
            index = {"index_k": self.indexer.key_from_projection(self.index_key_proj(x), rope, start=0)}
            if reads_queries:
                index_q, index_w = self.indexer.queries_from_projection(self.index_proj(x[rows]), rope.rows(rows))
                index.update(index_q=index_q, index_w=index_w)
            return index
        projected = self.index_proj(x) if prepared else F.linear(x.float(), self.indexer.projection_weight())
        if not reads_queries:
            return {"index_k": self.indexer.key_from_projection(projected, rope)}
        index_q, index_k, index_w = self.indexer.from_projection(projected, rope)
        if rows is not None:
            index_q, index_w = index_q[rows], index_w[rows]
        return {"index_q": index_q, "index_k": index_k, "index_w": index_w}


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up: InferenceWeight | None = None  # set by prepare_for_inference
        self.down: InferenceWeight | None = None

    def prepare_for_inference(self, quantization: str = "none") -> None:
        kind = linear_kind(quantization)
        self.gate_up = InferenceWeight.fused(self.gate_proj, self.up_proj, quantization=kind)
        self.down = InferenceWeight.fused(self.down_proj, quantization=kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.tp.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))
        gate_up = self.gate_up(x)
        if swiglu_cpu.takes(gate_up) and not autograd_records(gate_up) and swiglu_cpu.available():
            return self.tp.all_reduce(self.down(swiglu_cpu.swiglu(gate_up)))  # one pass (`kernels.swiglu_cpu`)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.tp.all_reduce(self.down(F.silu(gate) * up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = LlamaAttention(config, layer, tp)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, x, rope, index_rope, backend):
        x, h = self.post_attention_norm.add_and_norm(x, self.attn(self.input_norm(x), rope, index_rope, backend))
        return x + self.mlp(h)


class LlamaForCausalLM(nn.Module):
    """config: the whole model's; with `tp` each rank builds its share (`LlamaConfig.for_rank`), and its
    `compute_logits` returns its slice of the vocabulary."""

    def __init__(self, config: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        self.config = config
        shard = config.for_rank(tp)
        self.vocab_start, vocab = tp.share(config.vocab_size)
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(shard, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.lm_head_weight: InferenceWeight | None = None
        # Decode-only steps run on buffers and calls made once per batch size (`models.llama_decode`); False runs
        # every step through the layers' own forward (tests compare the two).
        self.reuse_decode_steps = True
        self._decode_steps: dict[int, llama_decode.LlamaDecodeStep] = {}

    @property
    def attention_scale(self) -> float:
        return self.config.attention_scale

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def indexer_spec(self, key_kind: str = "auto") -> IndexerSpec | None:
        """The attached lightning indexers as the engine runs them; None for a dense model."""
        config = getattr(self, "indexer_config", None)
        return None if config is None else config.spec(key_kind)

    def prepare_for_inference(self, quantization: str = "none") -> None:
        """Fused weights in their inference layout (`layers.linear`), quantized as asked. The LM head, the largest
        single read of a decode step, goes to 8 bits at most: Q8_0 blocks, as the GGUF stores it (per-row int8
        where the Q8_0 kernel cannot run). When tied, the embedding keeps its own table for token lookups."""
        for layer in self.layers:
            layer.attn.prepare_for_inference(quantization)
            layer.mlp.prepare_for_inference(quantization)
        self.lm_head_weight = InferenceWeight(self.lm_head.weight, "none" if quantization == "none" else "q8_0")
        self._decode_steps = {}  # bound to the weights just replaced

    def _apply(self, fn, recurse=True):
        """`.to()`, `.float()` and the like replace the parameters the decode steps read by address: drop them."""
        self._decode_steps = {}
        return super()._apply(fn, recurse)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        """Final hidden states [N, hidden] for N packed tokens at their absolute positions."""
        n = input_ids.shape[0]
        if self.reuse_decode_steps and llama_decode.runs(self, backend, n):
            step = self._decode_steps.get(n)
            if step is None or not step.is_current():
                step = self._decode_steps[n] = llama_decode.LlamaDecodeStep(self, n)
            return step.run(input_ids, positions, backend)
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        rope = HalfSplitRotation.of(cos, sin, self.dtype)
        indexer = next((layer.attn.indexer for layer in self.layers if layer.attn.indexer is not None), None)
        index_rope = None if indexer is None else indexer.rotation(cos, sin)  # every layer's indexer is alike
        for layer in self.layers:
            x = layer(x, rope, index_rope, backend)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_vocab_share(self.embed_tokens, input_ids, self.vocab_start, self.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head_weight(hidden) if self.lm_head_weight is not None else self.lm_head(hidden)
