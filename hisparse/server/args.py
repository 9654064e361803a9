"""Command-line flags of `python -m hisparse.launch_server` / `hisparse serve`, named as SGLang names them.

Everything a flag can get wrong is checked here, before the model loads, so a typo costs a second and one
line on stderr rather than a traceback after half a minute of loading.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
from dataclasses import dataclass

from hisparse.cli_args import OneLineParser, device_flag, float_in, positive_int, size_flag
from hisparse.engine.data_parallel import LOAD_BALANCE_METHODS
from hisparse.engine.engine_config import DTYPES, KV_CACHE_DTYPES, EngineConfig
from hisparse.layers.linear import QUANTIZATIONS

DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake",)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a 160k-token prompt of text is a few MB


@dataclass
class ServerArgs:
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    enable_hisparse: bool = False
    hisparse_config: str | None = None
    max_running_requests: int = 64
    max_queued_requests: int = 256
    chunked_prefill_size: int = 512
    device_kv_budget: int | None = None
    top_k: int = 256
    disable_sparse_attention: bool = False
    disable_radix_cache: bool = False
    swap_in_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    quantization: str = "none"
    disable_adaptive_threads: bool = False
    device: str = "cpu"
    log_level: str = "info"
    skip_server_warmup: bool = False
    api_key: str | None = None
    graceful_shutdown_timeout: float = 5.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_timeout: float = 300.0
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    ep_size: int = 1
    load_balance_method: str = "round_robin"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    def engine_config(self) -> EngineConfig:
        """Raises ValueError naming the field, like EngineConfig itself."""
        return EngineConfig(model=self.model_path, device_kv_budget=self.device_kv_budget,
                            max_running_requests=self.max_running_requests,
                            chunked_prefill_size=self.chunked_prefill_size, kv_cache_dtype=self.kv_cache_dtype,
                            dtype=self.dtype, quantization=self.quantization, device=self.device,
                            adaptive_threads=not self.disable_adaptive_threads,
                            sparse_attention=not self.disable_sparse_attention,
                            top_k=self.top_k,
                            enable_hisparse=self.enable_hisparse, hisparse_config=self.hisparse_config,
                            swap_in_backend=self.swap_in_backend,
                            enable_prefix_caching=not self.disable_radix_cache, tp_size=self.tp_size,
                            dp_size=self.dp_size, enable_dp_attention=self.enable_dp_attention, ep_size=self.ep_size,
                            load_balance_method=self.load_balance_method, nnodes=self.nnodes,
                            node_rank=self.node_rank, dist_init_addr=self.dist_init_addr)

    def model_name(self) -> str:
        """What clients put in `model`: the flag, else the model file's or folder's name."""
        if self.served_model_name:
            return self.served_model_name
        if self.model_path in (None, "", "default"):
            from hisparse.models.default_model import DEFAULT_MODEL_NAME

            return DEFAULT_MODEL_NAME
        from pathlib import Path

        path = Path(self.model_path)
        return path.stem if path.is_file() else path.name


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {value}")
    return value


def build_parser(prog: str = "python -m hisparse.launch_server") -> argparse.ArgumentParser:
    d = ServerArgs()
    ap = OneLineParser(prog=prog, description="OpenAI-compatible HTTP server for hisparse.",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model-path", "--model", dest="model_path", default=d.model_path,
                    help="GGUF file, or a Hugging Face folder of LlamaForCausalLM, DeepseekV32ForCausalLM or "
                         "GlmMoeDsaForCausalLM (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--host", default=d.host, help="address to listen on")
    ap.add_argument("--port", type=_port, default=d.port)
    ap.add_argument("--served-model-name", default=d.served_model_name,
                    help="the `model` clients must send (default: the model's name)")
    ap.add_argument("--enable-hisparse", action="store_true",
                    help="full KV in a host pool, a small hot buffer per request on the device")
    ap.add_argument("--hisparse-config", default=d.hisparse_config,
                    help='JSON, e.g. \'{"top_k": 256, "device_buffer_size": 512, "host_to_device_ratio": 8, '
                         '"eviction_policy": "lrfu"}\'; eviction_policy: auto (default: lrfu on a GPU, '
                         'lru on the CPU), lrfu, score_lru, lru, fifo or clock')
    ap.add_argument("--max-running-requests", type=positive_int, default=d.max_running_requests)
    ap.add_argument("--max-queued-requests", type=positive_int, default=d.max_queued_requests,
                    help="requests allowed to wait for a running slot; more get HTTP 429 at once")
    ap.add_argument("--chunked-prefill-size", type=positive_int, default=d.chunked_prefill_size,
                    help="tokens per step (decodes first, then prompt chunks)")
    ap.add_argument("--device-kv-budget", type=size_flag, default=d.device_kv_budget,
                    help="device memory for the KV cache: bytes or e.g. 512MiB, 2GiB (default: 1 GiB on the "
                         "CPU, 85%% of free GPU memory less the weights on a GPU)")
    ap.add_argument("--top-k", type=positive_int, default=d.top_k,
                    help="tokens each sparse decode step attends to (a DSA model's own index_topk wins)")
    ap.add_argument("--disable-sparse-attention", action="store_true",
                    help="decode densely even when the model has an indexer")
    ap.add_argument("--disable-radix-cache", action="store_true",
                    help="do not keep finished requests' KV for prompts that start with the same tokens (prefix "
                         "caching, on by default)")
    ap.add_argument("--swap-in-backend", choices=["auto", "cpu", "reference", "triton"], default=d.swap_in_backend)
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                    help="the cache's rows (auto: the model's dtype); fp8_e4m3 is the DSA models' 656-byte latent")
    ap.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                    help="the model's weights and activations (auto: bfloat16 where the device multiplies in it "
                         "natively, else float32)")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=d.quantization,
                    help="weight-only quantization of the linear layers, used below a batch size where it is faster "
                         "(a dense copy serves larger batches): int8 in llama.cpp's Q8_0 blocks of 32, or int4 in "
                         "groups of 32 (the default model's own Q4_1 weights); the LM head in Q8_0 either way. "
                         "Llama models on the CPU")
    ap.add_argument("--device", type=device_flag, default=d.device, help="cpu, cuda or cuda:N")
    ap.add_argument("--disable-adaptive-threads", action="store_true",
                    help="on a CPU, keep every core's thread even while other processes use the cores (by default "
                         "a step runs on the cores they leave, at least one: an OpenMP team waits for its slowest "
                         "thread at every op)")
    ap.add_argument("--log-level", choices=LOG_LEVELS, default=d.log_level, type=str.lower)
    ap.add_argument("--api-key", default=d.api_key,
                    help="every request but /health must send Authorization: Bearer KEY (default: none asked; a "
                         "server bound beyond loopback without one serves anyone who reaches the port)")
    ap.add_argument("--max-request-bytes", type=size_flag, default=d.max_request_bytes,
                    help="the largest request body taken; larger ones get 413 before they are read (default 16MiB)")
    ap.add_argument("--graceful-shutdown-timeout", type=float_in(0.0), default=d.graceful_shutdown_timeout,
                    help="seconds running requests may go on after SIGTERM or SIGINT (new ones get 503); then they "
                         "are aborted and the server exits. A second signal exits at once")
    ap.add_argument("--skip-server-warmup", action="store_true",
                    help="serve without first running one short request through the engine (which compiles its "
                         "kernels, or loads them from numba's cache, before the first user request)")
    pd = ap.add_argument_group("prefill-decode disaggregation (behind sglang-router --pd-disaggregation)")
    pd.add_argument("--disaggregation-mode", choices=DISAGGREGATION_MODES, default=d.disaggregation_mode,
                    help="prefill: compute prompts and write their KV into the decode instance's memory; decode: "
                         "take each prompt's KV from the prefill instance and generate; null: serve requests whole")
    pd.add_argument("--disaggregation-transfer-backend", choices=TRANSFER_BACKENDS,
                    default=d.disaggregation_transfer_backend,
                    help="what moves the KV rows: Mooncake's transfer engine (TCP here, RDMA where MC_PROTOCOL=rdma)")
    pd.add_argument("--disaggregation-bootstrap-port", type=_port, default=d.disaggregation_bootstrap_port,
                    help="the prefill instance's bootstrap server, where decode instances claim their requests' rows")
    pd.add_argument("--disaggregation-timeout", type=float_in(0.1), default=d.disaggregation_timeout,
                    help="seconds a request's two halves may take to meet and its rows to arrive; then it fails on "
                         "both sides and its memory is freed")
    par = ap.add_argument_group("parallelism (docs/parallelism.md)")
    par.add_argument("--tp-size", "--tp", dest="tp_size", type=positive_int, default=d.tp_size,
                     help="ranks, one process each: a Llama model's heads, MLP and vocabulary split over them; "
                          "a DSA model's MLPs (with --enable-dp-attention)")
    par.add_argument("--dp-size", "--dp", dest="dp_size", type=positive_int, default=d.dp_size,
                     help="data-parallel attention groups, with --enable-dp-attention: equal to --tp-size")
    par.add_argument("--enable-dp-attention", action="store_true",
                     help="a DSA model: each rank attends over its own requests with its own cache and HiSparse "
                          "pools; the MLPs run over every rank's tokens")
    par.add_argument("--ep-size", dest="ep_size", type=positive_int, default=d.ep_size,
                     help="1: each MoE expert's columns split over the ranks; --tp-size: the experts split")
    par.add_argument("--load-balance-method", choices=LOAD_BALANCE_METHODS, default=d.load_balance_method,
                     help="DP attention: the rank each new request goes to")
    par.add_argument("--nnodes", type=positive_int, default=d.nnodes, help="machines the ranks run on")
    par.add_argument("--node-rank", type=int, default=d.node_rank,
                     help="this machine's place among them: 0 serves, the others run their ranks only")
    par.add_argument("--dist-init-addr", default=d.dist_init_addr,
                     help="HOST:PORT on node 0 where the ranks meet (needed with --nnodes > 1)")
    return ap


def parse_args(argv: list[str] | None = None, prog: str = "python -m hisparse.launch_server") -> ServerArgs:
    """Flags -> ServerArgs, or one line on stderr and exit status 2."""
    ns = build_parser(prog).parse_args(argv)
    return ServerArgs(**vars(ns))


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port_free(host: str, port: int) -> None:
    """Fail before loading the model, not after, when the address is taken or not ours."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve --host {host!r}: {error.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as error:
            raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None


# EngineConfig's fields -> the flags that set them, to point a refusal at what the user typed.
_FLAGS = {"model": "--model-path", "device_kv_budget": "--device-kv-budget", "top_k": "--top-k",
          "max_running_requests": "--max-running-requests", "chunked_prefill_size": "--chunked-prefill-size",
          "kv_cache_dtype": "--kv-cache-dtype", "dtype": "--dtype", "device": "--device",
          "quantization": "--quantization",
          "enable_hisparse": "--enable-hisparse", "hisparse_config": "--hisparse-config",
          "swap_in_backend": "--swap-in-backend", "tp_size": "--tp-size", "dp_size": "--dp-size",
          "ep_size": "--ep-size", "nnodes": "--nnodes", "node_rank": "--node-rank",
          "dist_init_addr": "--dist-init-addr", "enable_dp_attention": "--enable-dp-attention"}


def fail(prog: str, message: str) -> int:
    field = re.match(r"[a-z_]+", message)
    flag = _FLAGS.get(field.group(0)) if field else None
    print(f"{prog}: error: {flag + ': ' if flag else ''}{message}", file=sys.stderr)
    return 2
