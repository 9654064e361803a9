"""The DSA model family: DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 / GLM-5.1
(`GlmMoeDsaForCausalLM`). One implementation serves both; the architectures differ only in shapes,
in the RoPE layout of the indexer (half-split in DeepSeek-V3.2, interleaved in GLM-5) and in GLM's
optional "shared" layers that reuse the previous layer's top-k instead of running an indexer.

`forward` takes the engine's flat batch (prompt chunks and decode tokens of many requests) and one
attention backend, as every model here does. Each layer hands the backend its absorbed MLA query
(q_nope W_UK, then q_pe) and its latent row (c_kv + k_pe) as the single K head, with its indexer's
query, key and head weights; the backend selects each query's top-k (in prefill too: DSA attends
sparsely from the first token) and attends over those latent rows, wherever the cache keeps them.

Over several ranks (`tp`) each rank holds its share of every MLP (its experts under expert parallelism, else its
columns of every expert; its columns of the dense MLPs and shared experts), whose outputs the ranks sum. Tensor
parallel: every rank runs the same tokens with its share of the attention heads (and so every token's latent
row: MLA has one K head) and of the vocabulary. DP attention: each rank attends over its own requests' tokens
with the whole attention and its own latent cache; before each MLP the ranks' tokens are gathered, and the sum
comes back to each rank for its own tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hisparse.attention.backend import AttentionBackend
from hisparse.distributed.tensor_parallel import TensorParallel
from hisparse.formats.index_key import IndexKeyFormat
from hisparse.formats.latent import LatentFormat, LatentLayout
from hisparse.formats.sparse_attention import IndexerSpec
from hisparse.layers.dsa_indexer import LightningIndexer
from hisparse.layers.mla import MultiHeadLatentAttention
from hisparse.layers.moe import MoE, SwiGLU, TopkRouter
from hisparse.layers.norm import RMSNorm
from hisparse.layers.rotary import RotaryEmbedding, yarn_get_mscale, yarn_inv_freq
from hisparse.layers.vocab_parallel import embed_vocab_share
from hisparse.models.hf_checkpoint import load_state_dict, read_config, weight_block_size

ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


@dataclass
class DsaConfig:
    """The fields of a DSA config.json that the forward pass depends on."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: list[str]
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    indexer_rope_interleaved: bool
    indexer_types: list[str]
    tie_word_embeddings: bool = False
    fp8_block: int = 128
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_hf(cls, cfg: dict) -> DsaConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"not a DSA checkpoint: architectures {archs}, expected one of {ARCHITECTURES}")
        glm = arch == "GlmMoeDsaForCausalLM"
        layers = cfg["num_hidden_layers"]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not implemented (only silu)")
        if cfg.get("attention_bias", False):
            raise ValueError("attention_bias=true is not implemented")
        routing = (cfg.get("scoring_func", "sigmoid"), cfg.get("topk_method", "noaux_tc"))
        if routing != ("sigmoid", "noaux_tc"):
            raise ValueError("only sigmoid scoring with noaux_tc routing is implemented")
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            dense = min(cfg.get("first_k_dense_replace", 3), layers)
            freq = cfg.get("moe_layer_freq", 1)
            mlp_types = ["dense" if i < dense or i % freq else "sparse" for i in range(layers)]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=cfg["num_attention_heads"],
            q_lora_rank=cfg["q_lora_rank"],
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            n_routed_experts=cfg["n_routed_experts"],
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            mlp_layer_types=list(mlp_types),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_parameters=_rope_parameters(cfg),
            max_position_embeddings=cfg["max_position_embeddings"],
            index_topk=cfg["index_topk"],
            index_head_dim=cfg["index_head_dim"],
            index_n_heads=cfg["index_n_heads"],
            indexer_rope_interleaved=bool(cfg.get("indexer_rope_interleave", glm)),
            indexer_types=_indexer_types(cfg, layers) if glm else ["full"] * layers,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            fp8_block=weight_block_size(cfg) if cfg.get("quantization_config") else 128,
        )

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    def for_rank(self, tp: TensorParallel) -> DsaConfig:
        """`LlamaConfig.for_rank`'s counterpart: the part of the attention rank `tp.rank` holds. Tensor parallel
        splits the heads (each rank keeps every token's latent row: MLA has one K head); DP attention keeps them
        whole. The cache's rows are the same either way."""
        if tp.expert_parallel and self.n_routed_experts < tp.size:
            raise ValueError(f"ep_size {tp.size} is more than the model's {self.n_routed_experts} routed experts: "
                             "each rank holds at least one")
        if tp.size == 1 or tp.dp_attention:
            return self
        if tp.size > self.num_attention_heads:
            raise ValueError(f"tp_size {tp.size} is more than the model's {self.num_attention_heads} attention heads: "
                             "each rank holds at least one (or run DP attention: --enable-dp-attention --dp-size "
                             f"{tp.size})")
        return dataclasses.replace(self, num_attention_heads=tp.share(self.num_attention_heads)[1])

    def experts_of(self, tp: TensorParallel) -> range:
        """The routed experts rank `tp.rank` holds: its share under expert parallelism, else all of them."""
        if not tp.expert_parallel:
            return range(self.n_routed_experts)
        start, n = tp.share(self.n_routed_experts)
        return range(start, start + n)

    def shard_weight(self, name: str, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """The part of checkpoint tensor `name` that rank `tp.rank` holds: the rows of gate/up and the columns of
        down of its share of the dense MLPs', the shared experts' and (without expert parallelism) every expert's
        columns; under tensor parallel also its heads' rows of q_b_proj and kv_b_proj, their columns of o_proj and
        its rows of the embedding and the LM head; everything else whole (a rank's experts under expert
        parallelism come whole, the others not at all: `load_dsa_model`)."""
        parts = name.split(".")
        if tp.size == 1:
            return weight
        if not tp.dp_attention and parts[-2] in ("q_b_proj", "kv_b_proj", "o_proj", "lm_head", "embed_tokens"):
            if parts[-2] in ("lm_head", "embed_tokens"):
                return weight.narrow(0, *tp.share(self.vocab_size)).contiguous()
            start, heads = tp.share(self.num_attention_heads)
            per_head = {"q_b_proj": self.qk_nope_head_dim + self.qk_rope_head_dim,
                        "kv_b_proj": self.qk_nope_head_dim + self.v_head_dim, "o_proj": self.v_head_dim}[parts[-2]]
            return weight.narrow(1 if parts[-2] == "o_proj" else 0, start * per_head, heads * per_head).contiguous()
        if "mlp" not in parts or parts[-2] not in ("gate_proj", "up_proj", "down_proj"):
            return weight
        if "shared_experts" in parts:
            total = self.moe_intermediate_size * self.n_shared_experts
        elif "experts" in parts:
            if tp.expert_parallel:
                return weight
            total = self.moe_intermediate_size
        else:
            total = self.intermediate_size
        return weight.narrow(1 if parts[-2] == "down_proj" else 0, *tp.share(total)).contiguous()

    @property
    def attention_scale(self) -> float:
        return self.softmax_scale

    def row_layout(self, kind: str) -> LatentLayout:
        """The cache's latent rows: kind float32 (exact, for parity), bfloat16 (1152 bytes at DSA's shape)
        or fp8_e4m3 (the 656-byte FP8 layout)."""
        latent_kind = {"float32": "float32", "bfloat16": "bfloat16", "fp8_e4m3": "fp8"}.get(kind)
        if latent_kind is None:
            raise ValueError(f"kv_cache_dtype {kind!r} is not a latent layout: float32, bfloat16 or fp8_e4m3")
        return LatentLayout(self.num_hidden_layers, LatentFormat(latent_kind, self.kv_lora_rank, self.qk_rope_head_dim))

    def indexer_spec(self, key_kind: str = "auto") -> IndexerSpec:
        """The indexers as the reference runs them: the model's index_topk, in prefill as in decode, keys in
        the FP8 layout ("auto": 132 bytes at 128 dims; `key_kind` float32 scores exactly, as transformers
        does)."""
        key_kind = "fp8" if key_kind == "auto" else key_kind
        shared = tuple(i for i, kind in enumerate(self.indexer_types) if kind == "shared")
        return IndexerSpec(IndexKeyFormat(key_kind, self.index_head_dim), top_k=self.index_topk,
                           shared_layers=shared, sparse_prefill=True, select_newest=False)

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(all_dim)^2 under YaRN."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rp = self.rope_parameters
        if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
            m = yarn_get_mscale(rp["factor"], rp["mscale_all_dim"])
            scale *= m * m
        return scale

    def rotary(self, max_positions: int | None = None) -> RotaryEmbedding:
        rp = self.rope_parameters
        dim, theta = self.qk_rope_head_dim, float(rp.get("rope_theta", 10000.0))
        n = max_positions or self.max_position_embeddings
        kind = rp.get("rope_type", "default")
        if kind == "default":
            return RotaryEmbedding(dim, n, theta)
        if kind != "yarn":
            raise ValueError(f"rope_type {kind!r} is not implemented (default or yarn)")
        factor = float(rp["factor"])
        inv = yarn_inv_freq(dim, theta, factor, int(rp["original_max_position_embeddings"]),
                            float(rp.get("beta_fast") or 32), float(rp.get("beta_slow") or 1),
                            bool(rp.get("truncate", True)))
        attention_factor = rp.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_get_mscale(factor)
        return RotaryEmbedding(dim, n, theta, inv_freq=inv, attention_scale=float(attention_factor))


def _rope_parameters(cfg: dict) -> dict:
    """transformers 5 writes `rope_parameters`; released checkpoints write rope_theta + rope_scaling."""
    if cfg.get("rope_parameters"):
        return dict(cfg["rope_parameters"])
    rp = dict(cfg.get("rope_scaling") or {})
    if "type" in rp and "rope_type" not in rp:
        rp["rope_type"] = rp.pop("type")
    rp.setdefault("rope_type", "default")
    rp["rope_theta"] = cfg.get("rope_theta", 10000.0)
    return rp


def _indexer_types(cfg: dict, layers: int) -> list[str]:
    """GLM's per-layer indexer mode, derived as transformers' GlmMoeDsaConfig does."""
    if cfg.get("indexer_types"):
        return list(cfg["indexer_types"])
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        return list(pattern)
    freq = max(cfg.get("index_topk_freq", 1), 1)
    offset = cfg.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


class DsaAttention(MultiHeadLatentAttention):
    """cfg: the rank's share (`DsaConfig.for_rank`): its heads; under tensor parallel the output projection's sums
    are all-reduced. The latent row and the indexer are whole on every rank, which computes them alike."""

    def __init__(self, cfg: DsaConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                         cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.softmax_scale)
        self.tp = tp
        self.layer_idx = layer_idx
        self.indexer = None
        if cfg.indexer_types[layer_idx] == "full":
            self.indexer = LightningIndexer(cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads,
                                            cfg.index_head_dim, cfg.qk_rope_head_dim,
                                            cfg.indexer_rope_interleaved, cfg.index_topk)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        q_resid, q_nope, q_pe = self.project_q(x, cos, sin)
        index = {}
        if self.indexer is not None:  # GLM's shared layers have none: the backend reuses the last top-k
            index = {"index_q": self.indexer.queries(q_resid, cos, sin), "index_k": self.indexer.keys(x, cos, sin),
                     "index_w": self.indexer.head_weights(x)}
        q = torch.cat([self.absorb_q(q_nope), q_pe.float()], dim=-1)  # [T, H, kv_lora_rank + rope]
        latent = self.project_latent(x, cos, sin).unsqueeze(1)  # [T, 1, kv_lora_rank + rope]: the one K head
        o_lat = backend.attend(self.layer_idx, q, latent, None, **index)
        out = self.output(o_lat.float(), x.dtype)
        return out if self.tp.dp_attention else self.tp.all_reduce(out)


class DsaDecoderLayer(nn.Module):
    """cfg: the rank's share (`DsaConfig.for_rank`: its heads); the MLPs take their shares here."""

    def __init__(self, cfg: DsaConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.self_attn = DsaAttention(cfg, layer_idx, tp)
        if cfg.mlp_layer_types[layer_idx] == "dense":
            self.mlp: nn.Module = SwiGLU(cfg.hidden_size, tp.share(cfg.intermediate_size)[1])
        else:
            router = TopkRouter(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group,
                                cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
            expert_size = cfg.moe_intermediate_size if tp.expert_parallel else tp.share(cfg.moe_intermediate_size)[1]
            self.mlp = MoE(cfg.hidden_size, expert_size, tp.share(cfg.moe_intermediate_size * cfg.n_shared_experts)[1],
                           router, cfg.experts_of(tp))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend | None, rows_per_rank: list[int] | None = None) -> torch.Tensor:
        """rows_per_rank: every rank's token count this step (DP attention). A rank with none still takes part
        in the MLP's collectives."""
        if h.shape[0]:
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, backend)
        return h + self._mlp_over_ranks(self.post_attention_layernorm(h), rows_per_rank)

    def _mlp_over_ranks(self, x: torch.Tensor, rows_per_rank: list[int] | None) -> torch.Tensor:
        tp = self.tp
        if tp.size == 1:
            return self.mlp(x)
        if not tp.dp_attention:  # every rank has the same tokens
            return tp.all_reduce(self.mlp(x))
        everyone = tp.all_gather_rows(x, rows_per_rank)
        out = tp.all_reduce(self.mlp(everyone))
        start = sum(rows_per_rank[:tp.rank])
        return out[start:start + x.shape[0]]


class DsaModel(nn.Module):
    def __init__(self, cfg: DsaConfig, tp: TensorParallel, vocab: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DsaDecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DsaForCausalLM(nn.Module):
    """tp: this rank's place among the ranks (`DsaConfig.for_rank`); one rank by default. Under tensor parallel
    `compute_logits` returns the rank's slice of the vocabulary, under DP attention the whole."""

    def __init__(self, cfg: DsaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TensorParallel()
        self.vocab_start, vocab = (0, cfg.vocab_size) if tp.dp_attention else tp.share(cfg.vocab_size)
        self.vocab_tp = TensorParallel() if tp.dp_attention else tp  # the ranks the vocabulary splits over
        self.model = DsaModel(cfg.for_rank(tp), tp, vocab)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        self._rotary: RotaryEmbedding | None = None  # built on first use: never on the meta device

    @property
    def rotary(self) -> RotaryEmbedding:
        if self._rotary is None:
            self._rotary = self.config.rotary()
        return self._rotary

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def indexer_spec(self, key_kind: str = "auto") -> IndexerSpec:
        return self.config.indexer_spec(key_kind)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend | None,
                rows_per_rank: list[int] | None = None) -> torch.Tensor:
        """Final hidden states [N, hidden] for N packed tokens at their absolute positions. rows_per_rank: every
        rank's N this step, under DP attention (a rank with none passes no backend)."""
        if self.tp.dp_attention and (rows_per_rank is None or len(rows_per_rank) != self.tp.size):
            raise ValueError(f"a DP-attention step needs every rank's token count, got {rows_per_rank}")
        cos, sin = self.rotary.cos_sin(positions)
        h = embed_vocab_share(self.model.embed_tokens, input_ids, self.vocab_start, self.vocab_tp)
        for layer in self.model.layers:
            h = layer(h, cos, sin, backend, rows_per_rank)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _fp32_name(name: str) -> bool:
    """Tensors DeepSeek's reference keeps in float32 whatever the compute dtype: the router, and the
    indexer's head weights and LayerNorm (transformers runs the LayerNorm in the model dtype)."""
    return name.endswith(("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight",
                          "indexer.k_norm.weight", "indexer.k_norm.bias"))


def load_dsa_model(path: str | Path, dtype: torch.dtype = torch.float32,
                   tp: TensorParallel | None = None) -> DsaForCausalLM:
    """Build the model named by `architectures` in `path`/config.json and load its safetensors.

    Multi-token-prediction layers (index >= num_hidden_layers) are skipped: the engine decodes one
    token per step. tp: the rank whose share to load (`DsaConfig.shard_weight`); each tensor is cut as it is
    read, and a rank never reads the experts it does not hold.
    """
    cfg = DsaConfig.from_hf(read_config(path))
    tp = tp or TensorParallel()
    experts = cfg.experts_of(tp)

    def keep(name: str) -> bool:
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= cfg.num_hidden_layers:
            return False
        return not (len(parts) > 5 and parts[4] == "experts" and int(parts[5]) not in experts)

    def local_name(name: str) -> str:
        """model.layers.3.mlp.experts.E.* -> the E-th of this rank's experts."""
        parts = name.split(".")
        if len(parts) > 5 and parts[4] == "experts":
            parts[5] = str(int(parts[5]) - experts.start)
        return ".".join(parts)

    state = load_state_dict(path, dtype, keep=keep, fp32_names=_fp32_name, block=cfg.fp8_block,
                            shard=lambda name, weight: cfg.shard_weight(name, weight, tp))
    state = {local_name(name): weight for name, weight in state.items()}
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # the same rows of the vocabulary
    with torch.device("meta"):
        model = DsaForCausalLM(cfg, tp)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
