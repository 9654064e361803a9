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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hisparse.attention.backend import AttentionBackend
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


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
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
        return out @ self.o_t if self.o_t is not None else self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
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
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = (x @ self.gate_up_t).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down_t


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = LlamaAttention(config, layer)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, backend):
        x = x + self.attn(self.input_norm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_norm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
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
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head_t if self.lm_head_t is not None else self.lm_head(hidden)
