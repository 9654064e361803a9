"""The lightning indexer that makes a Llama-family model (SmolLM2) a sparse-attention model.

DeepSeek-V3.2's indexer, fitted to a model without a query latent:

    I[t, s] = sum_h w_h(x_t) * ReLU(q_{t,h} . k_s) / sqrt(d_I),   w = W_w x / sqrt(H_I)

with x the layer's attention input (the hidden state after the input RMSNorm), q = W_q x in H_I heads
of d_I dims, and one key per token k = LayerNorm(W_k x), shared by all heads. The first `rope_dim`
dims of q and k are rotated (half-split, like the model's own attention); the rest carry content
only. The rotation reuses the model's cos/sin table: taking every `stride`-th of its frequencies is
exactly a RoPE of `rope_dim` dims with the same theta, so the indexer needs no table of its own.

The projections, the score and the causal top-k are the DSA indexer's (`dsa_indexer`): only the query
input differs (x here, the q latent there). The default sizes (4 heads of 64, RoPE on 32) keep the
key cache at 68 bytes per token per layer (64 int8 and one fp32 scale), 1/22 of SmolLM2's float32
K+V (1/11 of bf16); `key_format` "fp8" (the same bytes, as DSA stores it) is the choice for a GPU,
see `IndexKeyFormat`.
`hisparse.train_indexer` trains them, `hisparse/weights/smollm2_indexer.safetensors` ships them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hisparse.formats.index_key import IndexKeyFormat
from hisparse.formats.sparse_attention import IndexerSpec
from hisparse.kernels import indexer_key_cpu
from hisparse.kernels.c_library import autograd_records
from hisparse.layers.dsa_indexer import LightningIndexer
from hisparse.layers.rotary import HalfSplitRotation

SHIPPED_WEIGHTS = Path(__file__).resolve().parent.parent / "weights" / "smollm2_indexer.safetensors"

__all__ = ["IndexerConfig", "LlamaIndexer", "attach_indexers", "check_indexer_weights", "load_indexer_weights",
           "save_indexer_weights", "SHIPPED_WEIGHTS"]


@dataclass
class IndexerConfig:
    n_heads: int = 4
    head_dim: int = 64
    rope_dim: int = 32
    top_k: int = 256
    dense_layers: list[int] = field(default_factory=list)  # layers whose decode should stay dense
    key_format: str = "int8"  # how the key cache stores a key (an IndexKeyFormat kind)

    @property
    def key_layout(self) -> IndexKeyFormat:
        return IndexKeyFormat(self.key_format, self.head_dim)

    def spec(self, key_kind: str = "auto") -> IndexerSpec:
        """These indexers as the engine runs them: at decode only (prefill stays dense), the newest token
        always selected, keys stored as `key_kind` ("auto": as trained, `key_format`)."""
        kind = self.key_format if key_kind == "auto" else key_kind
        return IndexerSpec(IndexKeyFormat(kind, self.head_dim), dense_layers=tuple(self.dense_layers))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> IndexerConfig:
        return cls(**json.loads(text))


class LlamaIndexer(LightningIndexer):
    """One layer's indexer. `wq_b` reads x directly (its "q latent" is the attention input)."""

    def __init__(self, hidden_size: int, model_head_dim: int, config: IndexerConfig) -> None:
        if config.rope_dim % 2 or model_head_dim % config.rope_dim:
            raise ValueError(f"rope_dim ({config.rope_dim}) must be even and divide the model's head dim "
                             f"({model_head_dim})")
        if config.rope_dim > config.head_dim:
            raise ValueError(f"rope_dim ({config.rope_dim}) exceeds the indexer head dim ({config.head_dim})")
        super().__init__(hidden_size, hidden_size, config.n_heads, config.head_dim, config.rope_dim,
                         rope_interleaved=False, top_k=config.top_k)
        self.rope_stride = model_head_dim // config.rope_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, hidden]; cos/sin [N, model_head_dim / 2] -> q [N, H, d], k [N, d], w [N, H] (fp32).

        w carries both 1/sqrt(H) and the 1/sqrt(d) score scale, so I = sum_h w_h ReLU(q_h . k). A bfloat16
        model's activations are widened first: the indexer runs in float32.
        """
        x, cos, sin = x.float(), cos.float(), sin.float()
        cos, sin = cos[..., ::self.rope_stride], sin[..., ::self.rope_stride]
        return self.queries(x, cos, sin), self.keys(x, cos, sin), self.head_weights(x)

    def projection_weight(self) -> torch.Tensor:
        """The three projections' weights as one [H * d + d + H, hidden]: all read x, so inference runs them as
        one matmul (`from_projection`)."""
        return torch.cat([self.wq_b.weight, self.wk.weight, self.weights_proj.weight]).detach()

    def rotation(self, cos: torch.Tensor, sin: torch.Tensor) -> HalfSplitRotation:
        """The rotation `from_projection` applies, from the model's cos/sin: built once per batch."""
        return HalfSplitRotation.of(cos[..., ::self.rope_stride], sin[..., ::self.rope_stride], torch.float32,
                                    self.head_dim)

    def from_projection(self, projected: torch.Tensor, rotation: HalfSplitRotation):
        """`forward`'s q, k, w from x @ projection_weight().T [N, H * d + d + H] (any float dtype)."""
        q, w = self.queries_from_projection(projected, rotation)
        return q, self.key_from_projection(projected, rotation), w

    def queries_from_projection(self, projected: torch.Tensor, rotation: HalfSplitRotation):
        """`from_projection`'s q and w alone, for rows whose keys come from the key's rows (`key_from_projection`)."""
        n, heads, dim = projected.shape[0], self.n_heads, self.head_dim
        q, w = projected[:, :heads * dim].float(), projected[:, heads * dim + dim:]
        return rotation(q.view(n, heads, dim)), self.finish_weights(w)

    def key_from_projection(self, projected: torch.Tensor, rotation: HalfSplitRotation,
                            start: int | None = None) -> torch.Tensor:
        """`from_projection`'s key alone, for a step whose attention reads no indexer queries
        (`AttentionBackend.reads_index_queries`); start: the key's first column in `projected` (default: after the
        query heads, as projection_weight() orders them; 0 for the key's rows projected alone). On the CPU one
        compiled call (`kernels.indexer_key_cpu`) derives it, whether the queries are computed or not, so a key's
        bytes never depend on the step."""
        norm = self.k_norm
        start = self.n_heads * self.head_dim if start is None else start
        if (projected.is_cpu and projected.dtype in (torch.bfloat16, torch.float32) and rotation.cos.is_cpu
                and not autograd_records(norm.weight, projected) and indexer_key_cpu.available()):
            return indexer_key_cpu.indexer_key(projected, start, norm.weight, norm.bias, norm.eps, rotation.cos,
                                               rotation.sin, rotation.half)
        k = projected[:, start:start + self.head_dim].float()
        return rotation(norm(k).unsqueeze(1))[:, 0]


def attach_indexers(model, config: IndexerConfig) -> list[LlamaIndexer]:
    """Give every attention layer of `model` a fresh (untrained, float32) indexer; return them in order."""
    mc = model.config
    indexers = []
    for layer in model.layers:
        indexer = LlamaIndexer(mc.hidden_size, mc.head_dim, config)
        layer.attn.indexer = indexer
        indexers.append(indexer)
    model.indexer_config = config
    return indexers


def save_indexer_weights(path: str | Path, indexers: list[LlamaIndexer], config: IndexerConfig,
                         dtype: torch.dtype = torch.bfloat16, extra: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    tensors = {f"layers.{i}.{name}": p.detach().to(dtype).contiguous()
               for i, indexer in enumerate(indexers) for name, p in indexer.state_dict().items()}
    save_file(tensors, str(path), metadata={"indexer_config": config.to_json(), **(extra or {})})


def read_indexer_config(path: str | Path = SHIPPED_WEIGHTS) -> IndexerConfig:
    """The IndexerConfig a weights file was saved with, from its metadata alone: what the engine needs to size
    the indexer-key cache before it loads anything."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{str(path)!r} is not a safetensors file ({error})") from None
    try:
        return IndexerConfig.from_json(metadata["indexer_config"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{str(path)!r} has no indexer_config: not indexer weights") from None


def check_indexer_weights(path: str | Path, num_layers: int) -> None:
    """ValueError unless `path` holds indexer weights (`save_indexer_weights`'s file) for `num_layers` layers:
    a command checks its flags with it before it loads the model or captures anything."""
    from safetensors import safe_open

    read_indexer_config(path)
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())
    layers = {name.split(".")[1] for name in names if name.startswith("layers.")}
    if layers != {str(i) for i in range(num_layers)}:
        raise ValueError(f"{str(path)!r} holds indexers of {len(layers)} layers; the model has {num_layers}")


def load_indexer_weights(model, path: str | Path = SHIPPED_WEIGHTS) -> IndexerConfig:
    """Attach indexers to `model` and fill them from a file written by `save_indexer_weights` (float32)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        config = IndexerConfig.from_json(f.metadata()["indexer_config"])
        state = {name: f.get_tensor(name).float() for name in f.keys()}
    indexers = attach_indexers(model, config)
    if len(state) != sum(len(ix.state_dict()) for ix in indexers):
        raise ValueError(f"'{path}' holds {len(state)} tensors; the model's {len(indexers)} indexers need "
                         f"{sum(len(ix.state_dict()) for ix in indexers)}")
    for i, indexer in enumerate(indexers):
        prefix = f"layers.{i}."
        indexer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        indexer.eval().requires_grad_(False)
    return config
