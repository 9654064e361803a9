"""Llama architecture (SmolLM2 and friends) in plain PyTorch.

The forward pass works on a flat batch of N tokens from any mix of sequences: the engine packs prefill
chunks and decode tokens together and the attention backend sorts out which token sees which.
For inference (`prepare_for_inference`) Q/K/V and gate/up projections are fused into single matmuls and
every weight is used as `x @ w` with w [in, out]. In float32 w is stored transposed, [in, out] row-major:
on a CPU, decode is bound by reading weights, and BLAS runs that layout up to twice as fast as
`F.linear`'s `x @ W.T` at batch 8-32 (single thread, this machine: gate/up 2.0 -> 0.9 ms at batch 8,
lm_head 55 -> 41 ms). In bfloat16 w is a transposed view of an [out, in] row-major tensor, the layout
oneDNN's bfloat16 kernels want (2 cores, batch 16: gate/up 425 us in float32 [in, out], 185 us in
bfloat16 [out, in], 191 us in bfloat16 [in, out] at batch 4 but 2x slower at batch 16; the LM head
11.2 vs 2.4 ms). The nn.Linear parameters stay views of the same memory, so training and tests still see
ordinary modules.

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
from hisparse.layers.norm import RMSNorm
from hisparse.layers.rotary import RotaryEmbedding, apply_rope_half
from hisparse.models.config import LlamaConfig


def transposed_weight(*linears: nn.Linear) -> torch.Tensor:
    """The linears' weights concatenated on the output axis, as an [in, out] tensor (stored [in, out] in
    float32, [out, in] in bfloat16: see the module docstring); each linear's weight becomes a view into it,
    so the model holds one copy."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    fused = fused.t() if fused.dtype == torch.bfloat16 else fused.t().contiguous()
    start = 0
    for lin in linears:
        width = lin.weight.shape[0]
        lin.weight.data = fused[:, start:start + width].t()
        start += width
    return fused


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
        self.qkv_t: torch.Tensor | None = None  # [hidden, q + 2 kv], set by prepare_for_inference
        self.o_t: torch.Tensor | None = None
        self.indexer: nn.Module | None = None  # a lightning indexer, when the model is made sparse

    def prepare_for_inference(self) -> None:
        self.qkv_t = transposed_weight(self.q_proj, self.k_proj, self.v_proj)
        self.o_t = transposed_weight(self.o_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        if self.qkv_t is not None:
            qkv = x @ self.qkv_t
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        # Q and K heads rotate together: one RoPE call instead of two.
        qk = apply_rope_half(qkv[:, :q_size + kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim),
                             cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(n, self.num_kv_heads, self.head_dim)
        index = {}
        if self.indexer is not None:
            index_q, index_k, index_w = self.indexer(x, cos, sin)
            index = {"index_q": index_q, "index_k": index_k, "index_w": index_w}
        out = backend.attend(self.layer, q, k, v, **index).reshape(n, q_size)
        return self.tp.all_reduce(out @ self.o_t if self.o_t is not None else self.o_proj(out))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_t: torch.Tensor | None = None  # [hidden, 2 intermediate], set by prepare_for_inference
        self.down_t: torch.Tensor | None = None

    def prepare_for_inference(self) -> None:
        self.gate_up_t = transposed_weight(self.gate_proj, self.up_proj)
        self.down_t = transposed_weight(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_t is None:
            return self.tp.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))
        gate, up = (x @ self.gate_up_t).chunk(2, dim=-1)
        return self.tp.all_reduce((F.silu(gate) * up) @ self.down_t)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = LlamaAttention(config, layer, tp)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, x, cos, sin, backend):
        x = x + self.attn(self.input_norm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_norm(x))


class LlamaForCausalLM(nn.Module):
    """config: the whole model's; with `tp` each rank builds its share (`LlamaConfig.for_rank`), and its
    `compute_logits` returns its slice of the vocabulary."""

    def __init__(self, config: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        self.config = config
        shard = config.for_rank(tp.rank, tp.size)
        self.vocab_start, vocab = tp.share(config.vocab_size)
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(shard, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.lm_head_t: torch.Tensor | None = None

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

    def prepare_for_inference(self) -> None:
        """Fused, transposed weights (see the module docstring). In float32 the LM head gets its own
        transposed copy: when tied, the embedding keeps its row-major table for token lookups (in bfloat16
        that table already is the layout)."""
        for layer in self.layers:
            layer.attn.prepare_for_inference()
            layer.mlp.prepare_for_inference()
        head = self.lm_head.weight.detach()
        self.lm_head_t = head.t() if head.dtype == torch.bfloat16 else head.t().contiguous()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        """Final hidden states [N, hidden] for N packed tokens at their absolute positions."""
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the tokens of its slice of the vocabulary (zeros for the others); the sum is every
        token's row."""
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(self.dtype)
        return self.tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head_t if self.lm_head_t is not None else self.lm_head(hidden)
