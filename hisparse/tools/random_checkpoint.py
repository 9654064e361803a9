"""Write a small random DeepSeek-V3.2 or GLM-5 checkpoint in the real format, for anyone to serve here.

The models HiSparse exists for are hundreds of gigabytes; this writes one of their architectures as their
releases are laid out (config.json with `architectures`, safetensors with the release's tensor names,
optionally block-FP8 weights with their `weight_scale_inv`, a tokenizer) but with few layers and a small
hidden size. Per token it is DSA-shaped by default: a latent of kv_lora_rank 512 + rope 64 (1152 bytes in
bfloat16, 656 in FP8) and an indexer key of 128 dims (132 bytes in FP8), so the cache arithmetic, the
swap-in and the capacity figures are the real models'. The tokenizer is the default model's (SmolLM2's
49152-token BPE with its chat template), so prompts are real text. transformers reads the folder too.

    python -m hisparse.tools.random_checkpoint --arch glm-5 --out /tmp/tiny-glm
    python -m hisparse.launch_server --model-path /tmp/tiny-glm --enable-hisparse
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from hisparse.cli_args import OneLineParser, int_in, output_dir, run_main
from hisparse.formats.fp8 import block_quant
from hisparse.models.deepseek_v32 import DsaConfig, DsaForCausalLM

PROG = "python -m hisparse.tools.random_checkpoint"
ARCHS = {  # our flag -> (architectures entry, model_type, what differs between the two families)
    "deepseek-v3.2": ("DeepseekV32ForCausalLM", "deepseek_v32", {"n_group": 2, "topk_group": 1, "rms_norm_eps": 1e-6}),
    "glm-5": ("GlmMoeDsaForCausalLM", "glm_moe_dsa", {"n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5}),
}
WEIGHT_STD = 0.02  # the releases' initializer_range
DEFAULT_MAX_CONTEXT = 8192


def dsa_config(arch: str, *, vocab_size: int, layers: int = 4, hidden: int = 256, heads: int = 8,
               q_lora_rank: int = 256, kv_lora_rank: int = 512, rope_dim: int = 64, nope_dim: int = 64,
               v_dim: int = 64, experts: int = 8, experts_per_token: int = 2, moe_intermediate: int = 128,
               intermediate: int = 512, index_topk: int = 256, index_head_dim: int = 128, index_heads: int = 16,
               max_context: int = DEFAULT_MAX_CONTEXT, shared_indexer_layers: tuple[int, ...] = (),
               bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None) -> dict:
    """A config.json of `arch` ("deepseek-v3.2" or "glm-5") with these shapes, the fields named as the releases
    and transformers 5 name them. The first layer's MLP is dense, the rest mixtures of experts."""
    name, model_type, family = ARCHS[arch]
    cfg = {
        "architectures": [name], "model_type": model_type, "vocab_size": vocab_size, "hidden_size": hidden,
        "intermediate_size": intermediate, "moe_intermediate_size": moe_intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": nope_dim,
        "qk_head_dim": nope_dim + rope_dim, "head_dim": rope_dim, "v_head_dim": v_dim, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": experts_per_token, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 1,
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1), "hidden_act": "silu",
        "max_position_embeddings": max_context, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "index_topk": index_topk, "index_head_dim": index_head_dim, "index_n_heads": index_heads,
        "attention_bias": False, "tie_word_embeddings": False, "initializer_range": WEIGHT_STD,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "dtype": "bfloat16", **family,
    }
    if model_type == "glm_moe_dsa":
        cfg["indexer_types"] = ["shared" if i in shared_indexer_layers else "full" for i in range(layers)]
    elif shared_indexer_layers:
        raise ValueError("only GLM-5 has layers that share the previous layer's top-k (--shared-indexer-layers)")
    return cfg


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the model `cfg` describes, by the release's names: matrices and embeddings drawn from
    N(0, 0.02) as the releases initialise them, norms at 1 and biases at 0 but for a small jitter, so that
    no weight keeps a value that would hide a mistake in reading it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in DsaForCausalLM(DsaConfig.from_hf(cfg)).state_dict().items()}
    out = {}
    for name, shape in shapes.items():
        if name.endswith(("norm.weight", "layernorm.weight")):
            out[name] = 1.0 + 0.01 * torch.randn(shape, generator=gen)
        elif name.endswith(("norm.bias", "e_score_correction_bias")):
            out[name] = 0.01 * torch.randn(shape, generator=gen)
        else:
            out[name] = WEIGHT_STD * torch.randn(shape, generator=gen)
    return out


def quantized_in_release(name: str) -> bool:
    """What DeepSeek's FP8 release quantizes: the linear weights of attention, indexer and MLPs; not the
    embeddings, lm_head, norms, the router or the indexer's head weights."""
    return (name.endswith("proj.weight") or name.endswith(("indexer.wq_b.weight", "indexer.wk.weight"))) \
        and "weights_proj" not in name


def write_checkpoint(out: Path, cfg: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16,
                     fp8: bool = False) -> None:
    """config.json and model.safetensors in `out`; with fp8 the release's block-FP8 weights (e4m3 in 128 x 128
    blocks with their fp32 `weight_scale_inv`), the router and indexer head weights in float32 as released."""
    tensors = {}
    for name, t in weights.items():
        if fp8 and quantized_in_release(name):
            tensors[name], tensors[name + "_scale_inv"] = block_quant(t)
        elif name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
            tensors[name] = t.float().contiguous()
        else:
            tensors[name] = t.to(dtype).contiguous()
    if fp8:
        cfg = {**cfg, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [128, 128]}}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", required=True, choices=sorted(ARCHS))
    ap.add_argument("--out", required=True, type=output_dir, help="folder to write (created)")
    ap.add_argument("--layers", type=int_in(1, 256), default=4)
    ap.add_argument("--hidden", type=int_in(8), default=256, help="hidden size")
    ap.add_argument("--heads", type=int_in(1), default=8, help="attention heads")
    ap.add_argument("--kv-lora-rank", type=int_in(1), default=512, help="the latent's c_kv width (DSA: 512)")
    ap.add_argument("--rope-dim", type=int_in(2), default=64, help="the latent's k_pe width (DSA: 64)")
    ap.add_argument("--experts", type=int_in(2), default=8)
    ap.add_argument("--index-topk", type=int_in(1), default=256, help="tokens each query attends to (DSA: 2048)")
    ap.add_argument("--index-head-dim", type=int_in(2), default=128, help="indexer key dims (DSA: 128)")
    ap.add_argument("--index-heads", type=int_in(1), default=16, help="indexer heads (DSA: 64, GLM-5: 32)")
    ap.add_argument("--max-context", type=int_in(16), default=DEFAULT_MAX_CONTEXT, help="max_position_embeddings")
    ap.add_argument("--shared-indexer-layers", type=int_in(1), nargs="*", default=[],
                    help="GLM-5 layers that reuse the previous layer's top-k instead of an indexer of their own")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights, as the FP8 releases store them")
    ap.add_argument("--seed", type=int_in(0), default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rope_dim % 2 or args.index_head_dim < args.rope_dim:
        parser.error(f"--rope-dim ({args.rope_dim}) must be even and at most --index-head-dim "
                     f"({args.index_head_dim}): the indexer rotates that many of its dims")
    if args.index_head_dim & (args.index_head_dim - 1):
        parser.error(f"--index-head-dim ({args.index_head_dim}) must be a power of two: the FP8 indexer key is "
                     "rotated by a Hadamard matrix (DSA: 128)")
    if args.experts < 2 * ARCHS[args.arch][2]["n_group"]:
        parser.error(f"--experts ({args.experts}) must give each of the {ARCHS[args.arch][2]['n_group']} expert "
                     "groups at least two")
    bad = [layer for layer in args.shared_indexer_layers if layer >= args.layers]
    if bad:
        parser.error(f"--shared-indexer-layers {bad} out of range: the model has {args.layers} layers")
    from hisparse.models.loader import open_model

    tokenizer = open_model(None).tokenizer()
    cfg = dsa_config(args.arch, vocab_size=tokenizer.vocab_size, layers=args.layers, hidden=args.hidden,
                     heads=args.heads, kv_lora_rank=args.kv_lora_rank, rope_dim=args.rope_dim, experts=args.experts,
                     index_topk=args.index_topk, index_head_dim=args.index_head_dim, index_heads=args.index_heads,
                     max_context=args.max_context, shared_indexer_layers=tuple(args.shared_indexer_layers),
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    write_checkpoint(args.out, cfg, random_weights(cfg, args.seed), getattr(torch, args.dtype), args.fp8)
    tokenizer.save_pretrained(args.out)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {ARCHS[args.arch][0]} to {args.out}: {args.layers} layers, hidden {args.hidden}, "
          f"{size / 2**20:.1f} MiB; serve it with python -m hisparse.launch_server --model-path {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
