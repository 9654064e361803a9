"""Capacity planner: how many requests fit on the device, with and without HiSparse.

    python -m hisparse.plan --model glm-5.1 --gpu-memory-gb 141 --tp 8 --input-len 32768 \
        --output-len 8192 \
        --hisparse-config '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8}'

The sizing is the reference system's (SGLang HiSparse):
  device cell per slot   = layers x (kv_bytes + ratio x indexer_bytes)   (the indexer key cache is sized
                           for the logical capacity and stays on the device)
  device slots S         = budget / cell;  logical (host) capacity = S x ratio
  HiSparse requests      = min(S / (device_buffer_size + 1), logical capacity / context)
  baseline requests      = budget / (layers x (kv_bytes + indexer_bytes)) / context
where budget = gpu_memory x mem_fraction_static - weights per GPU.

MLA keeps one latent head, so tensor parallelism does not split the KV cache: every rank of an
attention-TP group holds the same rows. Each attention data-parallel group (--dp) is one independent
KV pool; each rank keeps its own host pool. Under DP attention the attention weights, the embedding and the
LM head are whole in every group (the engine's `--enable-dp-attention`; SGLang replicates the embedding, and
the LM head with --enable-dp-lm-head), the MLPs split over all --tp ranks.
This module imports no torch, so it can run anywhere.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from hisparse.cli_args import OneLineParser, float_in, int_in, positive_float, positive_int, run_main
from hisparse.memory.hisparse_config import HiSparseConfig
from hisparse.memory.hisparse_pools import PoolSizing

GIB = 1 << 30
FP8_BLOCK = 128
PROG = "python -m hisparse.plan"
# Caps on flags no model bounds, far above any machine of today: they only stop absurd figures.
MAX_GPU_MEMORY_GB = 1024
MAX_TP = 1024
MAX_GPUS = 1 << 16


def fp8(rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] e4m3 weight with an fp32 scale per 128x128 block."""
    return rows * cols + 4 * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)


class PlanError(ValueError):
    """A configuration that cannot run; the message is one line for the user."""


@dataclass(frozen=True)
class ModelShape:
    """The shapes that decide weight and KV-cache bytes of a DSA model."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    first_k_dense_replace: int
    context_length: int | None = None  # max_position_embeddings: input + output must fit (None: unchecked)

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str | None = None) -> ModelShape:
        return cls(
            name=name or cfg.get("model_type", "dsa"),
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            vocab_size=cfg["vocab_size"],
            num_heads=cfg["num_attention_heads"],
            q_lora_rank=cfg["q_lora_rank"],
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            index_n_heads=cfg["index_n_heads"],
            index_head_dim=cfg["index_head_dim"],
            index_topk=cfg["index_topk"],
            n_routed_experts=cfg["n_routed_experts"],
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            moe_intermediate_size=cfg["moe_intermediate_size"],
            intermediate_size=cfg["intermediate_size"],
            first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
            context_length=cfg.get("max_position_embeddings"),
        )

    def kv_bytes(self, kv_cache_dtype: str) -> int:
        """One latent row per token per layer: bf16, or the FP8 sparse layout (e4m3 + fp32 tile scales
        + bf16 rope), 1152 / 656 bytes for kv_lora 512 + rope 64."""
        if kv_cache_dtype == "bfloat16":
            return 2 * (self.kv_lora_rank + self.qk_rope_head_dim)
        if kv_cache_dtype == "fp8_e4m3":
            return self.kv_lora_rank + 4 * math.ceil(self.kv_lora_rank / 128) + 2 * self.qk_rope_head_dim
        raise PlanError(f"unknown kv cache dtype {kv_cache_dtype!r} (bfloat16 or fp8_e4m3)")

    @property
    def indexer_bytes(self) -> int:
        """The indexer key: e4m3 + one fp32 scale (132 bytes for 128 dims)."""
        return self.index_head_dim + 4

    def weight_bytes(self) -> tuple[int, int]:
        """(attention bytes, other bytes) of the FP8 checkpoint without its MTP layers: linear
        weights in e4m3 with an fp32 scale per 128x128 block; embeddings, norms, router and the
        indexer's head weights in bf16. Attention is apart because DP attention replicates it."""
        h = self.hidden_size
        whole = (  # per layer: what attention-TP ranks do not split (`attention_head_bytes` is the rest)
            fp8(self.q_lora_rank, h)
            + fp8(self.kv_lora_rank + self.qk_rope_head_dim, h)
            + fp8(self.index_n_heads * self.index_head_dim, self.q_lora_rank)
            + fp8(self.index_head_dim, h)
            + 2 * (self.index_n_heads * h + 2 * self.index_head_dim + self.q_lora_rank + self.kv_lora_rank)
        )
        dense = 3 * fp8(self.intermediate_size, h)
        moe = (
            (self.n_routed_experts + self.n_shared_experts) * 3 * fp8(self.moe_intermediate_size, h)
            + 2 * self.n_routed_experts * h
            + 4 * self.n_routed_experts
        )
        n_dense = min(self.first_k_dense_replace, self.num_layers)
        other = (
            n_dense * dense
            + (self.num_layers - n_dense) * moe
            + self.num_layers * 2 * 2 * h
            + self.vocabulary_bytes()
            + 2 * h
        )
        return self.num_layers * whole + self.attention_head_bytes(), other

    def attention_head_bytes(self) -> int:
        """The part of `weight_bytes`' attention that splits by heads over attention-TP ranks (q_b_proj,
        kv_b_proj, o_proj); the latent and query down-projections and the indexer are whole on every rank."""
        h, qk = self.hidden_size, self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.num_layers * (fp8(self.num_heads * qk, self.q_lora_rank)
                                  + fp8(self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
                                  + fp8(h, self.num_heads * self.v_head_dim))

    def vocabulary_bytes(self) -> int:
        """The embedding and the LM head (bf16), part of `weight_bytes`' other bytes."""
        return 2 * 2 * self.vocab_size * self.hidden_size


MODELS = {
    "deepseek-v3.2": ModelShape(
        name="deepseek-v3.2",
        num_layers=61,
        hidden_size=7168,
        vocab_size=129280,
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        moe_intermediate_size=2048,
        intermediate_size=18432,
        first_k_dense_replace=3,
        context_length=163840,
    ),
    "glm-5.1": ModelShape(
        name="glm-5.1",
        num_layers=78,
        hidden_size=6144,
        vocab_size=154880,
        num_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        moe_intermediate_size=2048,
        intermediate_size=12288,
        first_k_dense_replace=3,
        context_length=202752,
    ),
}


@dataclass(frozen=True)
class CapacityPlan:
    """Figures per KV pool (one attention-DP group) unless named *_total."""

    model: str
    num_layers: int
    kv_cache_dtype: str
    kv_bytes: int
    indexer_bytes: int
    top_k: int
    device_buffer_size: int
    host_to_device_ratio: int
    context_len: int
    weights_bytes_per_gpu: int
    budget_bytes_per_gpu: int
    baseline_bytes_per_token: int
    hisparse_cell_bytes: int
    host_bytes_per_token: int
    device_slots: int
    logical_capacity: int
    requests_by_slots: int
    requests_by_logical: int
    max_requests_hisparse: int
    max_requests_baseline: int
    kv_pools: int
    num_gpus: int
    host_bytes_per_gpu: int

    @property
    def max_requests_hisparse_total(self) -> int:
        return self.max_requests_hisparse * self.kv_pools

    @property
    def max_requests_baseline_total(self) -> int:
        return self.max_requests_baseline * self.kv_pools

    @property
    def host_bytes_total(self) -> int:
        return self.host_bytes_per_gpu * self.num_gpus


def _check_positive(flag: str, value: float) -> None:
    """A size in GiB must be a positive finite number: NaN passes every comparison and inf overflows `int`."""
    if not (math.isfinite(value) and value > 0):
        raise PlanError(f"--{flag} must be a positive finite number, got {value}")


@dataclass(frozen=True)
class PoolRequests:
    """How many requests of one context one KV pool holds at once, with and without HiSparse."""

    sizing: PoolSizing  # HiSparse's pools for the budget
    baseline_bytes_per_token: int
    context: int
    by_slots: int  # hot buffers (buffer + the reserved slot each) the device slots hold
    by_logical: int  # whole contexts the host pool and the indexer keys hold

    @property
    def hisparse(self) -> int:
        return min(self.by_slots, self.by_logical)

    @property
    def baseline(self) -> int:
        return self.sizing.budget_bytes // self.baseline_bytes_per_token // self.context


def requests_within(shape: ModelShape, hisparse: HiSparseConfig, budget_bytes: int, context: int,
                    kv_cache_dtype: str = "bfloat16") -> PoolRequests:
    """The requests of `context` tokens a KV budget holds, sized as the engine sizes its pools."""
    kv, idx = shape.kv_bytes(kv_cache_dtype), shape.indexer_bytes
    sizing = PoolSizing(shape.num_layers, kv, idx, hisparse, budget_bytes)  # the engine's own sizing
    return PoolRequests(sizing, shape.num_layers * (kv + idx), context,
                        sizing.device_slots // (hisparse.device_buffer_size + 1), sizing.logical_capacity // context)


def plan_capacity(
    shape: ModelShape,
    hisparse: HiSparseConfig,
    *,
    gpu_memory_gb: float,
    tp: int = 1,
    dp: int = 1,
    num_gpus: int | None = None,
    mem_fraction_static: float = 0.85,
    weights_gb: float | None = None,
    host_memory_gb: float | None = None,
    input_len: int,
    output_len: int,
    kv_cache_dtype: str = "bfloat16",
) -> CapacityPlan:
    """Size the device and host pools; raise PlanError for a configuration that cannot run."""
    num_gpus = tp if num_gpus is None else num_gpus
    for name, value in (("tp", tp), ("dp", dp), ("num-gpus", num_gpus), ("input-len", input_len)):
        if value < 1:
            raise PlanError(f"--{name} must be at least 1, got {value}")
    if output_len < 0:
        raise PlanError(f"--output-len must not be negative, got {output_len}")
    if num_gpus % tp:
        raise PlanError(f"--num-gpus {num_gpus} is not a multiple of --tp {tp}")
    if tp % dp:
        raise PlanError(f"--dp {dp} must divide --tp {tp} (attention data parallelism within the TP group)")
    if tp // dp > shape.num_heads:
        raise PlanError(f"--tp {tp} / --dp {dp} splits attention over {tp // dp} ranks, more than the "
                        f"{shape.num_heads} attention heads of {shape.name}")
    context = input_len + output_len
    if shape.context_length is not None and context > shape.context_length:
        raise PlanError(f"--input-len {input_len} + --output-len {output_len} = {context:,} tokens exceeds the "
                        f"context of {shape.name} ({shape.context_length:,} tokens)")
    if not 0 < mem_fraction_static <= 1:
        raise PlanError(f"--mem-fraction-static must be in (0, 1], got {mem_fraction_static}")
    _check_positive("gpu-memory-gb", gpu_memory_gb)
    if host_memory_gb is not None:
        _check_positive("host-memory-gb", host_memory_gb)
    if hisparse.device_buffer_size < hisparse.top_k:
        raise PlanError(
            f"device_buffer_size {hisparse.device_buffer_size} is smaller than top_k {hisparse.top_k}"
        )
    if shape.context_length is not None:
        try:
            hisparse.check_context(shape.context_length)
        except ValueError as error:
            raise PlanError(str(error)) from None
    if hisparse.device_buffer_size < shape.index_topk:
        raise PlanError(
            f"device_buffer_size {hisparse.device_buffer_size} is smaller than the model's "
            f"index_topk {shape.index_topk}, which wins over top_k"
        )

    if weights_gb is None:
        attn, other = shape.weight_bytes()
        heads = shape.attention_head_bytes()  # the rest of the attention is whole on every rank
        vocab = shape.vocabulary_bytes() if dp > 1 else 0  # whole in each DP group
        weights = attn - heads + heads // (tp // dp) + vocab + (other - vocab) // tp
    else:
        _check_positive("weights-gb", weights_gb)
        weights = int(weights_gb * GIB) // tp
    static = int(gpu_memory_gb * mem_fraction_static * GIB)
    if weights >= static:
        raise PlanError(
            f"weights need {weights / GIB:.1f} GiB per GPU but only {static / GIB:.1f} GiB is static "
            f"memory ({gpu_memory_gb} GiB x {mem_fraction_static}); add GPUs or raise --tp"
        )
    budget = static - weights

    pools = requests_within(shape, hisparse, budget, context, kv_cache_dtype)
    if pools.by_slots < 1:
        raise PlanError(
            f"the KV budget of {budget / GIB:.2f} GiB per GPU holds {pools.sizing.device_slots} slots, fewer "
            f"than one request's hot buffer ({hisparse.device_buffer_size} + 1)"
        )
    layers, kv, idx = shape.num_layers, pools.sizing.row_bytes, shape.indexer_bytes
    ratio = hisparse.host_to_device_ratio
    plan = CapacityPlan(
        model=shape.name,
        num_layers=layers,
        kv_cache_dtype=kv_cache_dtype,
        kv_bytes=kv,
        indexer_bytes=idx,
        top_k=shape.index_topk,
        device_buffer_size=hisparse.device_buffer_size,
        host_to_device_ratio=ratio,
        context_len=context,
        weights_bytes_per_gpu=weights,
        budget_bytes_per_gpu=budget,
        baseline_bytes_per_token=pools.baseline_bytes_per_token,
        hisparse_cell_bytes=pools.sizing.cell_bytes,
        host_bytes_per_token=layers * kv,
        device_slots=pools.sizing.device_slots,
        logical_capacity=pools.sizing.logical_capacity,
        requests_by_slots=pools.by_slots,
        requests_by_logical=pools.by_logical,
        max_requests_hisparse=pools.hisparse,
        max_requests_baseline=pools.baseline,
        kv_pools=dp * (num_gpus // tp),
        num_gpus=num_gpus,
        host_bytes_per_gpu=pools.sizing.host_bytes,
    )
    if host_memory_gb is not None and plan.host_bytes_total > host_memory_gb * GIB:
        raise PlanError(
            f"host pools need {plan.host_bytes_total / GIB:.1f} GiB ({num_gpus} x "
            f"{plan.host_bytes_per_gpu / GIB:.1f} GiB) but --host-memory-gb is {host_memory_gb}; "
            f"lower host_to_device_ratio or --mem-fraction-static"
        )
    return plan


def format_plan(
    p: CapacityPlan,
    shape: ModelShape,
    tp: int,
    dp: int,
    gpu_memory_gb: float,
    mem_fraction_static: float,
    weights_derived: bool,
    host_memory_gb: float | None,
) -> str:
    def gib(n: int) -> str:
        return f"{n / GIB:,.1f} GiB"

    ratio = p.max_requests_hisparse / p.max_requests_baseline if p.max_requests_baseline else float("inf")
    weights_from = "FP8, derived from shapes" if weights_derived else "given"
    layers, kv, idx, r = p.num_layers, p.kv_bytes, p.indexer_bytes, p.host_to_device_ratio
    of_host = f" (of {host_memory_gb} GiB)" if host_memory_gb is not None else ""
    rows = [
        ("model", f"{p.model}: {layers} layers, latent {shape.kv_lora_rank} + rope {shape.qk_rope_head_dim}, "
                  f"indexer {shape.index_head_dim} dims fp8 + fp32 scale, index_topk {shape.index_topk}"),
        ("gpus", f"{p.num_gpus} x {gpu_memory_gb} GiB, tp {tp}, dp {dp}: {p.kv_pools} KV pool(s), "
                 f"latent replicated over {tp // dp} attention-TP rank(s)"),
        ("weights per GPU", f"{gib(p.weights_bytes_per_gpu)} ({weights_from})"),
        ("KV budget per GPU", f"{gib(p.budget_bytes_per_gpu)} "
                              f"({gpu_memory_gb} x {mem_fraction_static} - weights)"),
        ("per-token bytes", f"kv {kv} B ({p.kv_cache_dtype}) + indexer {idx} B, per layer"),
        ("  device, baseline", f"{p.baseline_bytes_per_token:,} B = {layers} x ({kv} + {idx})"),
        ("  device, hisparse", f"{p.hisparse_cell_bytes:,} B per slot = {layers} x ({kv} + {r} x {idx})"),
        ("  host", f"{p.host_bytes_per_token:,} B = {layers} x {kv}"),
        ("hisparse config", f"top_k {p.top_k}, device_buffer_size {p.device_buffer_size}, "
                            f"host_to_device_ratio {r}"),
        ("device slots", f"{p.device_slots:,} per pool"),
        ("logical capacity", f"{p.logical_capacity:,} tokens per pool (slots x {r})"),
        ("context", f"{p.context_len:,} tokens per request"),
        ("max requests", f"baseline {p.max_requests_baseline:,} per pool, "
                         f"{p.max_requests_baseline_total:,} in all"),
        ("", f"hisparse {p.max_requests_hisparse:,} per pool, {p.max_requests_hisparse_total:,} in all "
             f"= min(slots / {p.device_buffer_size + 1} = {p.requests_by_slots:,}, "
             f"logical / context = {p.requests_by_logical:,}), {ratio:.2f}x"),
        ("host memory", f"{gib(p.host_bytes_per_gpu)} per GPU, {gib(p.host_bytes_total)} in all{of_host}"),
    ]
    lines = [f"{label:<20}{text}" for label, text in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Every flag is checked as it is read (one line and exit status 2); what depends on the model (its
    context, its heads) is checked by `plan_capacity`."""
    ap = OneLineParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--gpu-memory-gb", type=float_in(0, MAX_GPU_MEMORY_GB, low_open=True), required=True,
                    help=f"memory of one GPU, GiB (at most {MAX_GPU_MEMORY_GB})")
    ap.add_argument(
        "--num-gpus", type=int_in(1, MAX_GPUS), default=None,
        help=f"GPUs in all (a multiple of --tp; default --tp; at most {MAX_GPUS})"
    )
    ap.add_argument("--tp", type=int_in(1, MAX_TP), default=1,
                    help=f"tensor-parallel size of one model instance (at most {MAX_TP})")
    ap.add_argument("--dp", type=positive_int, default=1, help="attention data-parallel groups within --tp")
    ap.add_argument(
        "--weights-gb",
        type=positive_float,
        default=None,
        help="checkpoint size in GiB, split over --tp (default: FP8 bytes derived from the shapes)",
    )
    ap.add_argument(
        "--mem-fraction-static",
        type=float_in(0, 1, low_open=True),
        default=0.85,
        help="share of GPU memory for weights and KV pools, in (0, 1] (default 0.85)",
    )
    ap.add_argument("--host-memory-gb", type=positive_float, default=None, help="host memory available in all, GiB")
    ap.add_argument("--input-len", type=positive_int, required=True,
                    help="prompt tokens per request (input + output must fit the model's context)")
    ap.add_argument("--output-len", type=int_in(0), required=True)
    ap.add_argument("--kv-cache-dtype", choices=["bfloat16", "fp8_e4m3"], default="bfloat16")
    ap.add_argument(
        "--hisparse-config",
        default=None,
        help='JSON, e.g. \'{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8}\'',
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shape = MODELS[args.model]
    try:
        try:
            hisparse = HiSparseConfig.parse(args.hisparse_config, shape.index_topk)
        except ValueError as e:
            raise PlanError(f"--hisparse-config: {e}") from None
        plan = plan_capacity(
            shape,
            hisparse,
            gpu_memory_gb=args.gpu_memory_gb,
            tp=args.tp,
            dp=args.dp,
            num_gpus=args.num_gpus,
            mem_fraction_static=args.mem_fraction_static,
            weights_gb=args.weights_gb,
            host_memory_gb=args.host_memory_gb,
            input_len=args.input_len,
            output_len=args.output_len,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    except PlanError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if hisparse.top_k != shape.index_topk:
        print(
            f"note: top_k {hisparse.top_k} differs from the model's index_topk {shape.index_topk}; "
            f"the model's wins at run time"
        )
    print(
        format_plan(
            plan,
            shape,
            args.tp,
            args.dp,
            args.gpu_memory_gb,
            args.mem_fraction_static,
            args.weights_gb is None,
            args.host_memory_gb,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
