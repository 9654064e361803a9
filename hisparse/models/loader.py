"""Build a model from a path: a GGUF file, a Hugging Face directory, or nothing (the default model).

`ARCHITECTURES` is the registry: the `architectures` name of a config.json (a GGUF file's architecture maps
onto one too) -> how to read its config and load its weights. Everything else about a model (its cache rows,
its indexers) the engine asks the config and the model, the same way for every architecture.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hisparse.distributed.tensor_parallel import TensorParallel
from hisparse.formats.sparse_attention import IndexerSpec
from hisparse.layers.linear import QUANTIZATIONS
from hisparse.models.config import LlamaConfig
from hisparse.models.deepseek_v32 import DsaConfig, load_dsa_model
from hisparse.models.default_model import default_model_path
from hisparse.models.gguf_loader import load_gguf
from hisparse.models.llama import LlamaForCausalLM, shard_weight

# Hugging Face parameter names (after "model.layers.N.") -> ours.
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None or str(model) in ("", "default"):
        return default_model_path()
    path = Path(model)
    if not path.exists():
        raise ValueError(f"model path '{model}' does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        raise ValueError(f"model directory '{model}' has no config.json")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file '{model}' is not a .gguf file")
    return path


class ModelFiles:
    """A checkpoint opened once: its config at once, its weights and tokenizer when asked.

    Opening a GGUF file costs about 3 s (its reader indexes every element of the vocabulary arrays), and the
    config, the weights and the tokenizer all come from it: the engine opened it twice and the commands that
    check their flags against the model three times, 6-7 s before the first token. The config also comes first
    so that the engine can refuse a budget or a HiSparse config before it spends seconds on the weights.
    """

    def __init__(self, path: Path, config: LlamaConfig | DsaConfig, reader=None,
                 architecture: str = "LlamaForCausalLM") -> None:
        self.path = path
        self.config = config
        self.reader = reader  # the GGUF file's reader; None for a Hugging Face folder
        self.architecture = architecture
        self._tokenizer = None

    def load(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             tp: TensorParallel | None = None, quantization: str = "none") -> nn.Module:
        """The model in eval mode, its weights in `dtype` on `device` (the shard of rank `tp`), quantized as
        asked, as its architecture's loader builds it."""
        self.check_quantization(quantization)
        return ARCHITECTURES[self.architecture].load(self, dtype, device, tp or TensorParallel(), quantization)

    def check_quantization(self, quantization: str) -> None:
        """ValueError unless this architecture's loader applies `quantization`: said before any weight loads."""
        allowed = ARCHITECTURES[self.architecture].quantizations
        if quantization not in allowed:
            raise ValueError(f"quantization {quantization!r} is not available for {self.architecture} (it takes "
                             f"{', '.join(allowed)}); DSA checkpoints carry their own FP8 weights")

    def indexer_spec(self, key_kind: str = "auto") -> IndexerSpec | None:
        """The model's lightning indexers as the engine will run them (None: a dense model), from the files'
        metadata alone. key_kind: how their keys are stored, "auto" for the model's own choice."""
        if isinstance(self.config, DsaConfig):
            return self.config.indexer_spec(key_kind)
        shipped = self.default_indexer_config()
        return None if shipped is None else shipped.spec(key_kind)

    def tokenizer(self):
        """Built on first use and kept: it is immutable, so engines on the same files can share it."""
        if self._tokenizer is None:
            from hisparse.models.tokenizer import Tokenizer

            if self.reader is not None:
                self._tokenizer = Tokenizer.from_gguf(self.reader)
            else:
                try:
                    self._tokenizer = Tokenizer.from_hf_dir(self.path)
                except FileNotFoundError as error:
                    raise ValueError(f"model directory '{self.path}' has no tokenizer ({error}): write one beside "
                                     "the weights (tokenizer.json, tokenizer_config.json)") from None
        return self._tokenizer

    def default_indexer_weights(self) -> Path | None:
        """The lightning indexers `load_llama` attaches unless told otherwise: the shipped ones, which are trained
        for the default model only."""
        from hisparse.layers.indexer import SHIPPED_WEIGHTS

        return SHIPPED_WEIGHTS if self.path == default_model_path() and SHIPPED_WEIGHTS.exists() else None

    def default_indexer_config(self):
        """The IndexerConfig of `default_indexer_weights` from its metadata alone (None: the model stays dense),
        for sizing the indexer-key cache before any weight loads."""
        from hisparse.layers.indexer import read_indexer_config

        shipped = self.default_indexer_weights()
        return None if shipped is None else read_indexer_config(shipped)


def open_model(model: str | Path | ModelFiles | None = None) -> ModelFiles:
    """A GGUF file, a Hugging Face folder of a registered architecture, or None for the default model."""
    if isinstance(model, ModelFiles):
        return model
    path = resolve_model_path(model)
    if path.is_dir():
        cfg = _read_hf_config(path)
        name = architecture_of(cfg, path)
        try:
            config = ARCHITECTURES[name].read_config(cfg)
        except KeyError as missing:
            raise ValueError(f"'{path}/config.json' lacks the field {missing.args[0]!r} that {name} needs") from None
        return ModelFiles(path, config, architecture=name)
    import gguf

    from hisparse.models.gguf_loader import read_config

    reader = gguf.GGUFReader(str(path))
    return ModelFiles(path, read_config(reader), reader)


def read_model_config(model: str | Path | None = None) -> LlamaConfig | DsaConfig:
    """The model's config without its weights (GGUF metadata or config.json): what a command needs to check
    its flags (a prompt longer than the context) before spending seconds on loading."""
    return open_model(model).config


def _read_hf_config(folder: Path) -> dict:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"'{folder}/config.json' is not valid JSON: {error.msg} at line {error.lineno}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"'{folder}/config.json' is not a JSON object")
    return cfg


def architecture_of(cfg: dict, folder: Path) -> str:
    """The registered architecture a config.json names, or a ValueError listing the ones served."""
    archs = cfg.get("architectures") or []
    name = next((a for a in archs if a in ARCHITECTURES), None)
    if name is None:
        raise ValueError(f"'{folder}' is {archs}; the engine serves {', '.join(ARCHITECTURES)}")
    return name


def _llama_config(cfg: dict) -> LlamaConfig:
    heads = cfg["num_attention_heads"]
    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id") if isinstance(cfg.get("eos_token_id"), int) else None,
    )


def load_hf_llama(folder: Path, keep: Callable | None = None) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """keep(name, tensor, config): the part of each tensor to hold (`load_gguf`'s)."""
    from safetensors import safe_open

    config = _llama_config(_read_hf_config(folder))
    keep = keep or (lambda name, tensor, config: tensor)
    state: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"'{folder}' holds no .safetensors files")
    for file in files:
        with safe_open(str(file), "pt") as f:  # one tensor at a time: a rank holds its shards, not the file
            for name in f.keys():
                state.update(_hf_llama_entry(name, f.get_tensor(name).float(), config, keep))
    return config, state


def _hf_llama_entry(name: str, tensor: torch.Tensor, config: LlamaConfig, keep) -> dict[str, torch.Tensor]:
    """One Hugging Face tensor in our name (nothing for a tensor we do not use), its part `keep` holds."""
    ours = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
            "lm_head.weight": "lm_head.weight"}.get(name)
    if ours is None and name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        ours = f"layers.{index}.{_HF_LAYER_NAMES[rest]}" if rest in _HF_LAYER_NAMES else None
    return {} if ours is None else {ours: keep(ours, tensor, config)}


def load_llama(model: str | Path | ModelFiles | None = None, indexer: bool | str | Path | None = None,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               tp: TensorParallel | None = None, quantization: str = "none") -> LlamaForCausalLM:
    """Load weights into a model of `dtype` (float32 or bfloat16) in eval mode, projections fused for
    inference. The lightning indexers stay float32 whatever the model's dtype: they are small, and their
    scores decide which tokens attention reads.

    model: a path, None for the default model, or `open_model`'s result (which saves opening the file again).
    indexer: None (default) attaches the shipped trained lightning indexers when `model` is the default
    model (which makes it the sparse-attention model); True requires them; False loads none; a path
    loads indexer weights from that file.
    tp: the tensor-parallel rank whose shard to load (`llama.shard_weight`); the indexers are whole on every rank.
    quantization: "none", "int8" or "int4": the weight-only quantization of the linear layers (`layers.linear`).
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"model dtype must be float32 or bfloat16, got {dtype}")
    files = open_model(model)
    path = files.path
    if files.architecture != "LlamaForCausalLM":
        raise ValueError(f"'{path}' is {files.architecture}, not a Llama model: load it with ModelFiles.load")
    tp = tp or TensorParallel()
    keep = None if tp.size == 1 else (lambda name, tensor, config: shard_weight(name, tensor, config, tp))
    config, state = load_gguf(files.reader, keep) if files.reader is not None else load_hf_llama(path, keep)
    with torch.device("meta"):
        net = LlamaForCausalLM(config, tp)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    net.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    missing = [n for n, p in net.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint '{path}' lacks weights: {missing[:5]}")
    net.eval().requires_grad_(False)
    net.to(dtype).to(device)  # before the fused weights are made: they are views of these
    if indexer is not False:
        from hisparse.layers.indexer import SHIPPED_WEIGHTS, load_indexer_weights

        if indexer is None or indexer is True:
            shipped = files.default_indexer_weights()
            if shipped is not None:
                load_indexer_weights(net, shipped)
            elif indexer is True:
                raise ValueError(f"no shipped indexer weights for '{path}' ({SHIPPED_WEIGHTS} is for the default "
                                 "model); pass a file")
        else:
            load_indexer_weights(net, indexer)
        for layer in net.layers:
            if layer.attn.indexer is not None:
                layer.attn.indexer.to(device)
    net.prepare_for_inference(quantization)  # after the indexers: their projections are fused too
    return net


@dataclass(frozen=True)
class Architecture:
    """One registered architecture: its config from config.json, its model from the opened files."""

    read_config: Callable[[dict], LlamaConfig | DsaConfig]
    load: Callable[[ModelFiles, torch.dtype, str | torch.device, TensorParallel, str], nn.Module]
    quantizations: tuple[str, ...] = ("none",)  # the weight-only quantizations its loader can apply


def _load_llama(files: ModelFiles, dtype: torch.dtype, device: str | torch.device, tp: TensorParallel,
                quantization: str) -> nn.Module:
    return load_llama(files, dtype=dtype, device=device, tp=tp, quantization=quantization)


def _load_dsa(files: ModelFiles, dtype: torch.dtype, device: str | torch.device, tp: TensorParallel,
              quantization: str) -> nn.Module:
    return load_dsa_model(files.path, dtype, tp).to(device)


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(_llama_config, _load_llama, QUANTIZATIONS),
    "DeepseekV32ForCausalLM": Architecture(DsaConfig.from_hf, _load_dsa),
    "GlmMoeDsaForCausalLM": Architecture(DsaConfig.from_hf, _load_dsa),
}
