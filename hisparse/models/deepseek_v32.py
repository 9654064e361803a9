"""The DSA model family: DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 / GLM-5.1
(`GlmMoeDsaForCausalLM`). One implementation serves both; the architectures differ only in shapes,
in the RoPE layout of the indexer (half-split in DeepSeek-V3.2, interleaved in GLM-5) and in GLM's
optional "shared" layers that reuse the previous layer's top-k instead of running an indexer.

The engine drives one sequence at a time through `forward(input_ids, positions, cache)`:
- prefill: all prompt tokens at once (T > 1); attention reads the whole context through the
  page table with the indexer's selection as a mask;
- decode: one token (T = 1); per layer the indexer picks top-k positions, `cache.locate` maps them
  to slots (the swap-in hook of a memory hierarchy) and attention reads exactly those rows.
Per token per layer the cache keeps one contiguous latent row (c_kv + k_pe) and one indexer key row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hisparse.layers.dsa_indexer import IndexKeyFormat, LightningIndexer, index_scores, select_runners_up, select_topk
from hisparse.layers.mla import (
    LatentFormat,
    MultiHeadLatentAttention,
    masked_mla_attention,
    sparse_mla_attention,
)
from hisparse.layers.moe import MoE, SwiGLU, TopkRouter
from hisparse.layers.norm import RMSNorm
from hisparse.layers.rotary import RotaryEmbedding, yarn_get_mscale, yarn_inv_freq
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


class LatentCache:
    """The KV cache of one sequence, as rows.

    latent[layer] is a pool of slots of `latent_format.row_bytes`; `page_table[position]` is the slot
    where a token's row is written. index_k[layer] is indexed by position: the indexer must score
    every past token, so its keys stay resident. `locate` is where a memory hierarchy plugs in: it
    returns the slots holding the requested positions, swapping rows in first if it has to
    (`hisparse.memory.hisparse_latent_cache.HiSparseLatentSequence` has this interface over HiSparse).
    """

    num_next_ranks = 0  # runners-up `locate` wants with a decode step's selection (a hierarchy's policy may)

    def __init__(self, num_layers: int, capacity: int, latent_format: LatentFormat,
                 index_format: IndexKeyFormat, device: torch.device | str = "cpu") -> None:
        self.latent_format = latent_format
        self.index_format = index_format
        self.capacity = capacity
        rows = dict(dtype=torch.uint8, device=device)
        self.latent = torch.zeros(num_layers, capacity, latent_format.row_bytes, **rows)
        self.index_k = torch.zeros(num_layers, capacity, index_format.row_bytes, **rows)
        self.page_table = torch.arange(capacity, device=device)
        self.seq_len = 0

    def extend(self, positions: torch.Tensor) -> None:
        end = int(positions.max()) + 1
        if end > self.capacity:
            raise ValueError(f"position {end - 1} does not fit a cache of {self.capacity} tokens")
        if int(positions.min()) > self.seq_len:
            raise ValueError(f"positions start at {int(positions.min())} "
                             f"but the cache holds {self.seq_len} tokens")
        self.seq_len = max(self.seq_len, end)

    def write(self, layer: int, positions: torch.Tensor, latent: torch.Tensor,
              index_k: torch.Tensor | None) -> None:
        self.latent[layer, self.page_table[positions]] = self.latent_format.pack(latent)
        if index_k is not None:
            self.index_k[layer, positions] = self.index_format.pack(index_k)

    def locate(self, layer: int, positions: torch.Tensor, runners_up: torch.Tensor | None = None) -> torch.Tensor:
        """Slots of `positions` (any shape, -1 = padding, kept as -1) in latent[layer]. `runners_up`: the
        positions ranked just below a decode step's selection, when `num_next_ranks` asks for them."""
        return torch.where(positions >= 0, self.page_table[positions.clamp_min(0)], positions)

    def read_latent(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """float32 latent rows of `slots` (-1 reads slot 0; the caller masks it)."""
        return self.latent_format.unpack(self.latent[layer, slots.clamp_min(0)])

    def read_index_k(self, layer: int, length: int) -> torch.Tensor:
        return self.index_format.unpack(self.index_k[layer, :length])


@dataclass
class DsaTrace:
    """What the indexer did in one forward, per layer: selected positions [T, K] and the scores [T, S]
    (None on GLM's shared layers, which reuse the previous layer's selection)."""

    selections: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor | None] = field(default_factory=list)


@dataclass
class IndexerChoice:
    """What a layer's indexer chose: the selected positions [T, K], and for a one-token forward whose cache
    asks for them (`num_next_ranks`), the runners-up [1, M]; GLM's shared layers reuse the previous one."""

    selection: torch.Tensor
    runners_up: torch.Tensor | None = None


class DsaAttention(MultiHeadLatentAttention):
    def __init__(self, cfg: DsaConfig, layer_idx: int) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                         cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.softmax_scale)
        self.layer_idx = layer_idx
        self.indexer = None
        if cfg.indexer_types[layer_idx] == "full":
            self.indexer = LightningIndexer(cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads,
                                            cfg.index_head_dim, cfg.qk_rope_head_dim,
                                            cfg.indexer_rope_interleaved, cfg.index_topk)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache, prev_choice: IndexerChoice | None, trace: DsaTrace | None
                ) -> tuple[torch.Tensor, IndexerChoice]:
        layer = self.layer_idx
        q_resid, q_nope, q_pe = self.project_q(x, cos, sin)
        idx_k = self.indexer.keys(x, cos, sin) if self.indexer is not None else None
        cache.write(layer, positions, self.project_latent(x, cos, sin), idx_k)
        context = cache.seq_len

        scores = None
        if self.indexer is not None:
            q_idx = cache.index_format.prepare_query(self.indexer.queries(q_resid, cos, sin))
            scores = index_scores(q_idx, self.indexer.head_weights(x), cache.read_index_k(layer, context))
            selection = select_topk(scores, positions, self.indexer.top_k)
            num_next = cache.num_next_ranks if x.shape[0] == 1 else 0
            runners_up = select_runners_up(scores, positions, selection, num_next) if num_next else None
            choice = IndexerChoice(selection, runners_up)
        elif prev_choice is None:
            raise ValueError(f"layer {layer} shares the top-k of a previous layer but none ran an indexer")
        else:
            choice = prev_choice
            selection = choice.selection
        if trace is not None:
            trace.selections.append(selection)
            trace.scores.append(scores)

        q_lat = self.absorb_q(q_nope)
        if x.shape[0] == 1:
            rows = cache.read_latent(layer, cache.locate(layer, selection, choice.runners_up))
            o_lat = sparse_mla_attention(q_lat, q_pe, rows, selection >= 0, self.softmax_scale)
        else:
            rows = cache.read_latent(layer, cache.locate(layer, torch.arange(context, device=x.device)))
            # Padding (-1) scatters into a spare last column, which is then dropped.
            allowed = torch.zeros(x.shape[0], context + 1, dtype=torch.bool, device=x.device)
            allowed.scatter_(1, torch.where(selection >= 0, selection, context), True)
            allowed = allowed[:, :context]
            o_lat = masked_mla_attention(q_lat, q_pe, rows, allowed, self.softmax_scale)
        return self.output(o_lat, x.dtype), choice


class DsaDecoderLayer(nn.Module):
    def __init__(self, cfg: DsaConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DsaAttention(cfg, layer_idx)
        if cfg.mlp_layer_types[layer_idx] == "dense":
            self.mlp: nn.Module = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        else:
            router = TopkRouter(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group,
                                cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
            self.mlp = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts,
                           cfg.n_shared_experts, router)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache, prev_choice: IndexerChoice | None, trace: DsaTrace | None
                ) -> tuple[torch.Tensor, IndexerChoice]:
        attn, choice = self.self_attn(self.input_layernorm(h), positions, cos, sin, cache, prev_choice, trace)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h)), choice


class DsaModel(nn.Module):
    def __init__(self, cfg: DsaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DsaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DsaForCausalLM(nn.Module):
    def __init__(self, cfg: DsaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DsaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rotary: RotaryEmbedding | None = None  # built on first use: never on the meta device

    @property
    def rotary(self) -> RotaryEmbedding:
        if self._rotary is None:
            self._rotary = self.config.rotary()
        return self._rotary

    def new_cache(self, capacity: int, latent_kind: str = "bfloat16", index_kind: str = "fp8",
                  device: torch.device | str = "cpu") -> LatentCache:
        cfg = self.config
        return LatentCache(cfg.num_hidden_layers, capacity,
                           LatentFormat(latent_kind, cfg.kv_lora_rank, cfg.qk_rope_head_dim),
                           IndexKeyFormat(index_kind, cfg.index_head_dim), device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: LatentCache, *,
                last_only: bool = False, trace: DsaTrace | None = None) -> torch.Tensor:
        """input_ids, positions: [T] of one sequence; positions must continue the cache (no gaps).
        Returns logits [T, vocab] (or [1, vocab] with last_only) in float32."""
        cache.extend(positions)
        cos, sin = self.rotary.cos_sin(positions.cpu())
        cos, sin = cos.to(input_ids.device), sin.to(input_ids.device)
        h = self.model.embed_tokens(input_ids)
        choice = None
        for layer in self.model.layers:
            h, choice = layer(h, positions, cos, sin, cache, choice, trace)
        h = self.model.norm(h)
        if last_only:
            h = h[-1:]
        return self.lm_head(h).float()


def _fp32_name(name: str) -> bool:
    """Tensors DeepSeek's reference keeps in float32 whatever the compute dtype: the router, and the
    indexer's head weights and LayerNorm (transformers runs the LayerNorm in the model dtype)."""
    return name.endswith(("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight",
                          "indexer.k_norm.weight", "indexer.k_norm.bias"))


def load_dsa_model(path: str | Path, dtype: torch.dtype = torch.float32) -> DsaForCausalLM:
    """Build the model named by `architectures` in `path`/config.json and load its safetensors.

    Multi-token-prediction layers (index >= num_hidden_layers) are skipped: the engine decodes one
    token per step.
    """
    cfg = DsaConfig.from_hf(read_config(path))

    def keep(name: str) -> bool:
        parts = name.split(".")
        return not (len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= cfg.num_hidden_layers)

    state = load_state_dict(path, dtype, keep=keep, fp32_names=_fp32_name, block=cfg.fp8_block)
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = DsaForCausalLM(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
