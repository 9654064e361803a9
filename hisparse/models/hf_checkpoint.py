"""Read a Hugging Face model directory: config.json and safetensors shards.

FP8 checkpoints (DeepSeek-V3.x, GLM-5-FP8) carry `<name>.weight` in e4m3 next to
`<name>.weight_scale_inv` (one fp32 per 128x128 block); the pair may sit in different shards, so
names are resolved through the whole directory before any tensor is read. Weights come out
dequantized to the requested dtype: the CPU engine computes in float, and the capacity arithmetic
that FP8 weights matter for lives in `hisparse.plan`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from hisparse.formats.fp8 import WEIGHT_BLOCK, block_dequant

SCALE_SUFFIX = "_scale_inv"


def read_config(path: str | Path) -> dict:
    with open(Path(path) / "config.json") as f:
        return json.load(f)


def safetensors_files(path: str | Path) -> list[Path]:
    """The shards of a checkpoint: the ones its index names, else every *.safetensors file."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return files


def weight_block_size(config: dict) -> int:
    """The block of the FP8 scales; DeepSeek writes [128, 128] in quantization_config."""
    block = (config.get("quantization_config") or {}).get("weight_block_size", [WEIGHT_BLOCK, WEIGHT_BLOCK])
    if len(block) != 2 or block[0] != block[1]:
        raise ValueError(f"unsupported FP8 weight_block_size {block}: only square blocks are implemented")
    return int(block[0])


def load_state_dict(path: str | Path, dtype: torch.dtype = torch.float32,
                    keep: Callable[[str], bool] = lambda name: True,
                    fp32_names: Callable[[str], bool] = lambda name: False,
                    block: int = WEIGHT_BLOCK,
                    shard: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, t: t) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint whose name passes `keep`, FP8 pairs dequantized, each cut by `shard` (a
    rank's part) as soon as it is read.

    Floating tensors are cast to `dtype`, except names for which `fp32_names` is true (router
    weights and biases, which the reference keeps in float32).
    """
    where: dict[str, Path] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                where[name] = file
    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        file = where[name]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        return handles[file].get_tensor(name)

    out: dict[str, torch.Tensor] = {}
    for name in where:
        if name.endswith(SCALE_SUFFIX) or not keep(name):
            continue
        t = get(name)
        target = torch.float32 if fp32_names(name) else dtype
        if t.dtype == torch.float8_e4m3fn:
            scale_name = name + SCALE_SUFFIX
            if scale_name not in where:
                raise ValueError(f"FP8 tensor {name} has no {scale_name} in the checkpoint")
            t = block_dequant(t, get(scale_name), block=block, dtype=target)
        elif t.is_floating_point():
            t = t.to(target)
        out[name] = shard(name, t)
    return out
