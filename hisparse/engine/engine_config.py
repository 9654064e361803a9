"""Every knob of the engine in one validated place, shared by the offline API, the CLI and the server."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from hisparse.cli_args import DEVICE
from hisparse.engine.data_parallel import LOAD_BALANCE_METHODS
from hisparse.layers.linear import QUANTIZATIONS
from hisparse.memory.host_memory import GIB

DTYPES = ("auto", "float32", "bfloat16")  # what `dtype` accepts (and its CLI flag)
# What `kv_cache_dtype` accepts: fp8_e4m3 is the DSA models' 656-byte latent layout, as SGLang names it.
KV_CACHE_DTYPES = (*DTYPES, "fp8_e4m3")
INDEX_KEY_FORMATS = ("auto", "float32", "int8", "fp8")  # "auto": the model's own (fp8 for DSA)


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF file or Hugging Face directory; None = the embedded default model
    device_kv_budget: int | None = None  # bytes of device memory for the KV cache; None = the default
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    kv_cache_dtype: str = "auto"  # the cache's rows: auto (the model's dtype), float32, bfloat16 or fp8_e4m3
    dtype: str = "auto"  # the model's weights and activations: auto, float32 or bfloat16 (see model_dtype)
    device: str = "cpu"
    quantization: str = "none"  # weight-only: none, int8 (Q8_0's blocks of 32) or int4 (GGUF's Q4_1)
    enable_prefix_caching: bool = True  # finished requests leave their KV in a radix tree for later prompts
    adaptive_threads: bool = False  # on a CPU, step with fewer threads while other processes use the cores
    # Sparse attention (models with a lightning indexer, e.g. the default model with its shipped indexer):
    sparse_attention: bool = True  # decode attends to the indexer's top_k positions; False = dense decode
    top_k: int = 256
    dense_layers: tuple[int, ...] | None = None  # layers that decode densely; None = the indexer's own choice
    index_key_format: str = "auto"  # how indexer keys are stored: auto (the model's), float32, int8 or fp8
    record_topk: bool = False  # record every request's selected positions per layer per decode step
    topk_trace_dir: str | None = None  # where finished requests' traces are written (<request_id>.npz)
    # HiSparse: full K/V in a host pool, a hot buffer per request on the device, swap-in per decode step.
    enable_hisparse: bool = False
    hisparse_config: str | dict | None = None  # JSON text or dict: top_k, device_buffer_size, ...
    swap_in_backend: str = "auto"  # "auto", "cpu", "reference" or "triton"
    # Parallelism, as SGLang names it (docs/parallelism.md): one process per rank, started by the engine.
    tp_size: int = 1  # ranks: a Llama model's heads, MLP columns and vocabulary split over them
    dp_size: int = 1  # data-parallel attention groups (with enable_dp_attention: one per rank, dp_size = tp_size)
    enable_dp_attention: bool = False  # a DSA model: each rank attends over its own requests, the MLPs split
    ep_size: int = 1  # 1: each MoE expert's columns split over the ranks; tp_size: the experts split over them
    load_balance_method: str = "round_robin"  # DP attention: which rank a request goes to (or shortest_queue)
    nnodes: int = 1  # machines the ranks run on, tp_size / nnodes on each
    node_rank: int = 0  # this machine's place among them; 0 runs the engine's scheduler and the server
    dist_init_addr: str | None = None  # HOST:PORT where the ranks meet (rank 0's machine); None: a free local port

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

        for name in ("model", "topk_trace_dir"):
            if not (getattr(self, name) is None or isinstance(getattr(self, name), (str, os.PathLike))):
                raise ValueError(f"{name} must be a path, got {getattr(self, name)!r}")
        positive_int("max_running_requests")
        positive_int("chunked_prefill_size")
        positive_int("top_k")
        for name in ("tp_size", "dp_size", "ep_size", "nnodes"):
            positive_int(name)
        self._check_parallel()
        for name in ("sparse_attention", "record_topk", "enable_hisparse", "enable_prefix_caching", "adaptive_threads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.dense_layers is not None:
            if not (isinstance(self.dense_layers, (list, tuple)) and all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in self.dense_layers)):
                raise ValueError(f"dense_layers must be a list of layer numbers >= 0, got {self.dense_layers!r}")
            self.dense_layers = tuple(self.dense_layers)
        if self.swap_in_backend not in ("auto", "cpu", "reference", "triton"):
            raise ValueError(f"swap_in_backend must be auto, cpu, reference or triton, got {self.swap_in_backend!r}")
        if self.enable_hisparse:
            from hisparse.memory.hisparse_config import HiSparseConfig

            # The buffer is checked against top_k when the model is known: a DSA model's index_topk wins.
            self.hisparse_config = HiSparseConfig.parse(self.hisparse_config, self.top_k, check_buffer=False)
            self.top_k = self.hisparse_config.top_k
            if not self.sparse_attention:
                raise ValueError("enable_hisparse needs sparse_attention: dense decode reads every token")
            if self.record_topk:  # traces are the indexer's choices, the same with the memory hierarchy or not
                raise ValueError("record_topk records from the baseline cache: record with enable_hisparse off")
        elif self.hisparse_config is not None:
            raise ValueError("hisparse_config is given but enable_hisparse is off")
        if self.device_kv_budget is not None:
            positive_int("device_kv_budget")
        for name, allowed in (("dtype", DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("index_key_format", INDEX_KEY_FORMATS), ("quantization", QUANTIZATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        check_device(self.device)
        if self.quantization != "none" and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization} runs PyTorch's CPU weight-only kernels: use it with "
                             "device cpu")

    def _check_parallel(self) -> None:
        if not isinstance(self.node_rank, int) or isinstance(self.node_rank, bool) or not \
                0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be an integer in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if not isinstance(self.enable_dp_attention, bool):
            raise ValueError(f"enable_dp_attention must be True or False, got {self.enable_dp_attention!r}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} does not split over nnodes {self.nnodes}: each machine runs "
                             "tp_size / nnodes ranks")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(f"dp_size {self.dp_size} without enable_dp_attention (whole replicas of the engine) is "
                             "not implemented: run several servers behind sglang-router, or, for a DSA model, add "
                             "--enable-dp-attention")
        if self.enable_dp_attention and self.dp_size != self.tp_size:
            raise ValueError(f"enable_dp_attention with dp_size {self.dp_size} and tp_size {self.tp_size}: each rank "
                             f"is one DP group here (attention is not split within a group), so dp_size must equal "
                             f"tp_size, e.g. --tp-size {max(self.dp_size, self.tp_size)} --dp-size "
                             f"{max(self.dp_size, self.tp_size)}")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"ep_size must be 1 (each expert's columns split over the ranks) or tp_size "
                             f"({self.tp_size}: the experts split over the ranks), got {self.ep_size}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load_balance_method must be one of {', '.join(LOAD_BALANCE_METHODS)}, got "
                             f"{self.load_balance_method!r}")
        if self.dist_init_addr is not None:
            host, _, port = str(self.dist_init_addr).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")
        elif self.nnodes > 1:
            raise ValueError("nnodes > 1 needs dist_init_addr: the HOST:PORT of node 0, where the ranks meet")
        if self.tp_size > 1 and self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r} with tp_size > 1: pass cpu, or cuda (each rank takes the GPU of "
                             "its place on its machine, cuda:0, cuda:1, ...)")
        if self.tp_size > 1 and self.device == "cuda" and self.device_kv_budget is None:
            raise ValueError("device_kv_budget is needed with tp_size > 1 on CUDA (per rank): what each GPU leaves "
                             "free differs, and every rank must size its cache alike")

    def rank_device(self, rank: int) -> str:
        """The device rank `rank` runs on: the config's, with a GPU index always (a bare "cuda" is the current
        GPU: torch.cuda.set_device refuses a device without one, and a model's weights on cuda:0 are not on
        torch.device("cuda")), or with several CUDA ranks the GPU of its place on its machine, cuda:<local rank>
        (NCCL's one rank per GPU)."""
        if self.device != "cuda":
            return self.device
        if self.tp_size == 1:
            return f"cuda:{torch.cuda.current_device()}"
        count = torch.cuda.device_count()
        if count < self.ranks_per_node:
            raise ValueError(f"tp_size {self.tp_size} puts {self.ranks_per_node} ranks on this machine, one per GPU, "
                             f"and it has {count}")
        return f"cuda:{rank % self.ranks_per_node}"

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The ranks this machine (node_rank) runs."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    @property
    def model_dtype(self) -> torch.dtype:
        return resolve_model_dtype(self.dtype, self.device)

    def without_hisparse(self) -> EngineConfig:
        """The baseline of a HiSparse comparison: this config with the full K/V on the device, selecting the
        same top_k (a HiSparse config's top_k wins over the engine's)."""
        return dataclasses.replace(self, enable_hisparse=False, hisparse_config=None)

    def kv_kind(self, model_dtype: torch.dtype) -> str:
        """The cache rows' kind for a model running in `model_dtype` (a model's `row_layout` takes it). "auto"
        stores rows in the dtype that computed them: a bfloat16 model's K/V lose nothing in a bfloat16 cache,
        and a float32 cache would only double the bytes every decode step reads and every swap-in copies
        (batch 16 at 1.5k context: 148 vs 176 ms per step without HiSparse, 187 vs 209 ms with it)."""
        return str(model_dtype).removeprefix("torch.") if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def kv_budget_before_weights(self) -> int | None:
        """The budget when the weights do not decide it (the user's, or the CPU's 1 GiB, since there device
        memory is only a budget), so that the engine can size its cache before it loads them; else None."""
        if self.device_kv_budget is not None:
            return self.device_kv_budget
        return None if self.device.startswith("cuda") else GIB

    def resolved_kv_budget(self, weight_bytes: int) -> int:
        """On a GPU with no budget given, a fraction of what the weights leave free (like
        --mem-fraction-static)."""
        budget = self.kv_budget_before_weights()
        if budget is not None:
            return budget
        free, _ = torch.cuda.mem_get_info()
        return int(0.85 * free) - weight_bytes


def check_device(device: object) -> None:
    """ValueError unless `device` names cpu or a CUDA device this machine has (cuda: its current one)."""
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                         "device(s)")


def resolve_model_dtype(dtype: str = "auto", device: str = "cpu") -> torch.dtype:
    """"auto" is bfloat16 where matrix multiplies run natively in it (CUDA; CPUs with AVX512-BF16 or AMX,
    where the prefill-bound quality report runs in 32 s instead of 60 s on our 2 cores), else float32. The default
    model's GGUF weights are 4-bit, so bfloat16 holds them with room to spare."""
    if dtype != "auto":
        return getattr(torch, dtype)
    return torch.bfloat16 if device.startswith("cuda") or native_cpu_bfloat16() else torch.float32


def native_cpu_bfloat16() -> bool:
    """Whether oneDNN runs bfloat16 matrix multiplies natively on this CPU (AVX512-BF16 / AMX)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
