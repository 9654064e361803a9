"""Read a Llama-architecture GGUF file: its shape from the metadata, its weights dequantized to float32.

llama.cpp's converter permutes the rows of the Q and K projections so that its RoPE can rotate adjacent
pairs of values; our attention (like Hugging Face's) rotates the two halves of each head, so the permutation
is undone here, once, at load time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from hisparse.models.config import LlamaConfig

SUPPORTED_TYPES = {
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q5_0,
    gguf.GGMLQuantizationType.Q5_1,
    gguf.GGMLQuantizationType.Q6_K,
    gguf.GGMLQuantizationType.Q4_K,
}

# GGUF tensor name (per block, after "blk.N.") -> our parameter name.
_LAYER_NAMES = {
    "attn_norm.weight": "input_norm.weight",
    "attn_q.weight": "attn.q_proj.weight",
    "attn_k.weight": "attn.k_proj.weight",
    "attn_v.weight": "attn.v_proj.weight",
    "attn_output.weight": "attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise ValueError(f"GGUF file lacks the metadata field '{key}'")
    return field.contents()


def read_config(reader: gguf.GGUFReader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture '{arch}': only 'llama' is supported")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    vocab = reader.fields.get("llama.vocab_size")
    vocab_size = int(vocab.contents()) if vocab else len(reader.fields["tokenizer.ggml.tokens"].data)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        tie_word_embeddings=not has_output,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", -1)),
    )


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a Q or K projection: pairs back to halves within each head."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise ValueError(f"tensor '{tensor.name}' has unsupported GGUF type {tensor.tensor_type.name}")
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-first; numpy's shape is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.array(values.reshape(shape), dtype=np.float32)  # a writable copy, never the memory map


def load_gguf(source: str | Path | gguf.GGUFReader, keep: Callable | None = None
              ) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The config and a state dict in our parameter names (float32). Pass the reader when you have one:
    opening it again costs seconds. keep(name, tensor, config): the part of each tensor to hold (a
    tensor-parallel rank's shard), taken as each is read, so the whole model is never in memory at once."""
    reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(str(source))
    config = read_config(reader)
    state: dict[str, torch.Tensor] = {}

    def put(name: str, values: np.ndarray) -> None:
        tensor = torch.from_numpy(values)
        state[name] = tensor if keep is None else keep(name, tensor, config)

    for tensor in reader.tensors:
        name = tensor.name
        values = dequantize(tensor)
        if name == "token_embd.weight":
            put("embed_tokens.weight", values)
        elif name == "output_norm.weight":
            put("norm.weight", values)
        elif name == "output.weight":
            put("lm_head.weight", values)
        elif name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES:
                continue  # e.g. rope_freqs: recomputed from the metadata
            if rest == "attn_q.weight":
                values = unpermute_rope_rows(values, config.num_heads)
            elif rest == "attn_k.weight":
                values = unpermute_rope_rows(values, config.num_kv_heads)
            put(f"layers.{index}.{_LAYER_NAMES[rest]}", values)
    return config, state
