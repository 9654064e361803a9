"""Llama architecture (SmolLM2 and friends) in plain PyTorch.

The forward pass works on a flat batch of N tokens from any mix of sequences: the engine packs prefill
chunks and decode tokens together and the attention backend sorts out which token sees which.
Q/K/V and gate/up projections are fused into single matmuls: on a CPU the decode step is bound by
reading weights, and fewer, larger matmuls read them once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hisparse.layers.attention import AttentionBackend
from hisparse.layers.norm import RMSNorm
from hisparse.layers.rotary import RotaryEmbedding, apply_rope_half
from hisparse.models.config import LlamaConfig


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
        self.qkv_weight: torch.Tensor | None = None
        self.indexer: nn.Module | None = None  # a lightning indexer, when the model is made sparse

    def fuse(self) -> None:
        self.qkv_weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        if self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight)
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
        out = backend.attend(self.layer, q, k, v, **index)
        return self.o_proj(out.reshape(n, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None

    def fuse(self) -> None:
        self.gate_up_weight = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


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

    @property
    def attention_scale(self) -> float:
        return self.config.head_dim ** -0.5

    def fuse_projections(self) -> None:
        """Concatenate Q/K/V and gate/up weights for inference (training keeps them apart)."""
        for layer in self.layers:
            layer.attn.fuse()
            layer.mlp.fuse()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        """Final hidden states [N, hidden] for N packed tokens at their absolute positions."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
