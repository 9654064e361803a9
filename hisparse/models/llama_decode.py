"""A Llama decode-only step whose tensors are allocated once per batch size and whose kernels are checked once.

At batch 1 the default model's decode step spent more time in Python than in its kernels (int4: 4.5 ms of C in a
9.2 ms step): each of a layer's dozen kernel calls sat behind a module call, a wrapper's checks and an allocation.
gpt-fast and vLLM capture their decode step once (CUDA graphs, torch.compile's static buffers) and replay it; here
the step's activations live in buffers made once per batch size, every kernel is bound to them once (the kernels'
`bind_*`), and a layer is those prebound calls plus the attention backend's, which the backend binds once per step
where it can (`AttentionBackend.bind_decode`: its page tables change every step). It runs what
`LlamaForCausalLM.forward` runs, on the same kernels in the same order, so its hidden states are the same bits
(tests/models/test_llama_decode.py). The residual add after each MLP is folded into the next norm's (`rms_norm_cpu`'s
delta), which rounds the sum as PyTorch's add does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hisparse.kernels import indexer_key_cpu, rms_norm_cpu, rotary_cpu, swiglu_cpu
from hisparse.kernels.indexer_key_cpu import bind_indexer_key, bind_indexer_weights
from hisparse.kernels.rms_norm_cpu import bind_rms_norm
from hisparse.kernels.rotary_cpu import RotationTables
from hisparse.kernels.swiglu_cpu import bind_swiglu
from hisparse.layers.rotary import HalfSplitRotation

MAX_BATCH = 64  # larger batches spend little of their step in Python: they run the model's own forward


def runs(model, backend, batch: int) -> bool:
    """Whether `LlamaDecodeStep` takes this step of `model` (a `LlamaForCausalLM`): a decode-only batch of at most
    MAX_BATCH in bfloat16 on the CPU, no gradient, one rank, every layer prepared for inference (its indexer too)
    and every kernel the step binds built."""
    if not (0 < batch <= MAX_BATCH and backend.decode_only and model.tp.size == 1
            and model.dtype == torch.bfloat16 and model.embed_tokens.weight.is_cpu and not torch.is_grad_enabled()):
        return False
    attention = [layer.attn for layer in model.layers]
    if any(a.qkv is None or a.indexer is not a._prepared_indexer or (a.indexer is not None and a.index_key_proj is None)
           or layer.mlp.gate_up is None for a, layer in zip(attention, model.layers, strict=True)):
        return False
    indexers = any(a.indexer is not None for a in attention)
    return (rms_norm_cpu.available() and rotary_cpu.available() and swiglu_cpu.available()
            and (not indexers or indexer_key_cpu.available()))


def prepared_weights(model) -> list:
    """The prepared weights (`InferenceWeight`, None where a layer has none) a `LlamaDecodeStep` of `model` binds,
    in a fixed order."""
    weights = []
    for layer in model.layers:
        attn = layer.attn
        weights += [attn.qkv, attn.o, attn.index_proj, attn.index_key_proj, layer.mlp.gate_up, layer.mlp.down]
    return weights


class LlamaDecodeStep:
    """One batch size's decode step of a prepared `LlamaForCausalLM` (`runs` true of it): its buffers and bound
    calls. Bound to the model's weights as they are: the model makes new steps when it is prepared again or moved."""

    def __init__(self, model, batch: int) -> None:
        config, dtype = model.config, model.dtype
        self.model = model
        # What the bound calls read by address, kept alive with them (a parameter given new data by hand leaves the
        # step stale, never dangling). A model prepared again or given other prepared weights makes a new step
        # (`is_current`); one moved or converted (`nn.Module._apply`) drops its steps.
        self.prepared = prepared_weights(model)
        self.kept_parameters = [p.detach() for p in model.parameters()]  # their memory, whatever comes of them
        self.batch = batch
        hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        empty = lambda *shape, dtype=dtype: torch.empty(batch, *shape, dtype=dtype)  # noqa: E731
        self.x = empty(hidden)  # the residual stream, updated in place
        self.h = empty(hidden)  # a norm's output, the next matmul's input
        self.delta = empty(hidden)  # what the attention or the MLP adds to the residual
        self.qkv = empty(q_size + 2 * kv_size)
        self.qk = empty(heads + kv_heads, head_dim)  # Q and K heads rotated together
        self.q, self.k = self.qk[:, :heads], self.qk[:, heads:]
        self.v = self.qkv[:, q_size + kv_size:].view(batch, kv_heads, head_dim)
        self.attention_out = empty(q_size)
        self.gate_up = empty(2 * config.intermediate_size)
        self.activation = empty(config.intermediate_size)
        # The rotations' tables, filled each step (`run`); their shapes and halves as the model builds them.
        cos, sin = model.rotary.cos_sin(torch.zeros(batch, dtype=torch.long))
        rope = HalfSplitRotation.of(cos, sin, dtype)
        self.rope = RotationTables(rope.cos.clone(), rope.sin.clone(), rope.half)
        indexer = next((layer.attn.indexer for layer in model.layers if layer.attn.indexer is not None), None)
        self.every_layer_indexes = all(layer.attn.indexer is not None for layer in model.layers)
        if indexer is not None:  # its outputs, as `LlamaIndexer.from_projection` gives them (float32)
            index_rope = indexer.rotation(cos, sin)
            self.index_rope = RotationTables(index_rope.cos.clone(), index_rope.sin.clone(), index_rope.half)
            self.index_key = torch.empty(batch, indexer.head_dim)
            self.index_queries = torch.empty(batch, indexer.n_heads, indexer.head_dim)
            self.index_weights = torch.empty(batch, indexer.n_heads)
        rotated = self.qkv[:, :q_size + kv_size].view(batch, heads + kv_heads, head_dim)
        self.layer_buffers: list[torch.Tensor] = []  # a layer's own buffers, alive as long as the step
        self.layers = [self._bind_layer(layer, i, rotated) for i, layer in enumerate(model.layers)]
        self.final_norm = bind_rms_norm(self.x, model.norm.weight, model.norm.eps, self.h, self.delta, self.x)

    def is_current(self) -> bool:
        """Whether the model's prepared weights are still the ones this step's calls were bound to."""
        return all(a is b for a, b in zip(self.prepared, prepared_weights(self.model), strict=True))

    def _bind_layer(self, layer, index: int, rotated: torch.Tensor) -> dict[str, Callable[[], None] | None]:
        attn, mlp = layer.attn, layer.mlp
        norm = layer.input_norm
        # The embedding is the first layer's whole residual; later layers add the MLP's delta first.
        add = () if index == 0 else (self.delta, self.x)
        calls = {
            "input_norm": bind_rms_norm(self.x, norm.weight, norm.eps, self.h, *add),
            "qkv": attn.qkv.bind(self.h, self.qkv),
            "rope": self.rope.bind_rotate(rotated, self.qk),
            "o": attn.o.bind(self.attention_out, self.delta),
            "post_norm": bind_rms_norm(self.x, layer.post_attention_norm.weight, layer.post_attention_norm.eps,
                                       self.h, self.delta, self.x),
            "gate_up": mlp.gate_up.bind(self.h, self.gate_up),
            "swiglu": bind_swiglu(self.gate_up, self.activation),
            "down": mlp.down.bind(self.activation, self.delta),
            "index_key": None,  # with an indexer: its key alone, or its queries, key and head weights
            "index_all": None,
        }
        if attn.indexer is not None:
            calls.update(self._bind_indexer(attn))
        return calls

    def _bind_indexer(self, attn) -> dict[str, Callable[[], None]]:
        """The layer's indexer as `LlamaAttention.indexer_inputs` runs it in a decode-only step: the key from the
        key's rows alone where the attention reads no queries, else all three from the whole projection."""
        indexer, norm = attn.indexer, attn.indexer.k_norm
        heads, dim, rope = indexer.n_heads, indexer.head_dim, self.index_rope
        key_rows = torch.empty(self.batch, dim, dtype=self.h.dtype)
        projected = torch.empty(self.batch, attn.index_proj.t.shape[1], dtype=self.h.dtype)
        self.layer_buffers += [key_rows, projected]  # the calls below hold their addresses alone
        project_key = attn.index_key_proj.bind(self.h, key_rows)
        key_alone = bind_indexer_key(key_rows, 0, norm.weight, norm.bias, norm.eps, rope.cos, rope.sin, rope.half,
                                     self.index_key)
        project = attn.index_proj.bind(self.h, projected)
        key = bind_indexer_key(projected, heads * dim, norm.weight, norm.bias, norm.eps, rope.cos, rope.sin, rope.half,
                               self.index_key)
        # the queries widened to float32 as the rotation reads them, from the projection's rows
        rotate = rope.bind_rotate(projected[:, :heads * dim].view(self.batch, heads, dim), self.index_queries)
        weights = bind_indexer_weights(projected, heads * dim + dim, indexer.weight_scales, self.index_weights)

        def index_key() -> None:
            project_key()
            key_alone()

        def index_all() -> None:
            project()
            key()
            rotate()
            weights()
        return {"index_key": index_key, "index_all": index_all}

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, backend) -> torch.Tensor:
        """`LlamaForCausalLM.forward` of this decode batch: the final hidden states [B, hidden] (a new tensor)."""
        model = self.model
        self.x.copy_(model.embed(input_ids))
        cos, sin = model.rotary.cos_sin(positions)
        rope = HalfSplitRotation.of(cos, sin, model.dtype)
        self.rope.cos.copy_(rope.cos)
        self.rope.sin.copy_(rope.sin)
        index_rope = None
        reads_queries = backend.reads_index_queries
        index = ({"index_q": self.index_queries, "index_k": self.index_key, "index_w": self.index_weights}
                 if reads_queries else {"index_k": self.index_key})
        # The backend's calls bound once for the whole step, where it has them and every layer has an indexer
        attend = None if not self.every_layer_indexes else backend.bind_decode(
            self.q, self.k, self.v, index.get("index_q"), self.index_key, index.get("index_w"),
            self.attention_out.view(self.q.shape))
        for layer, calls in zip(model.layers, self.layers, strict=True):
            attn = layer.attn
            calls["input_norm"]()
            calls["qkv"]()
            calls["rope"]()
            if attn.indexer is not None:
                if index_rope is None:
                    index_rope = attn.indexer.rotation(cos, sin)
                    self.index_rope.cos.copy_(index_rope.cos)
                    self.index_rope.sin.copy_(index_rope.sin)
                calls["index_all" if reads_queries else "index_key"]()
            if attend is not None:
                attend(attn.layer)  # into attention_out
            else:
                out = backend.attend(attn.layer, self.q, self.k, self.v, **(index if attn.indexer is not None else {}))
                self.attention_out.view(out.shape).copy_(out)
            calls["o"]()
            calls["post_norm"]()
            calls["gate_up"]()
            calls["swiglu"]()
            calls["down"]()
        self.final_norm()
        return self.h.clone()
