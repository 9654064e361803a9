"""Dense matmuls with the weight prepacked once for oneDNN, as inductor's freezing packs it: bfloat16 and float32.

`x @ W.T` on a plain bfloat16 tensor lets oneDNN reorder W into its blocked layout on every call: a decode step
at small batch then reads each weight twice and writes it once. Packed once at load, the default model's whole
stack of linears takes about two thirds of the time at batch 1 to 32 on our CPU (AMX), three quarters at 128 to
256 tokens; from about 384 tokens the plain tensor is faster, so a caller keeps both
(`layers.linear.InferenceWeight`). In float32 a plain tensor goes to MKL's sgemm instead, slower than the packed
weights at every batch measured.
The reference is the plain matmul.
"""

from __future__ import annotations

import torch

PACK_BATCH_HINT = 64  # the batch oneDNN chooses the packed layout for


def packing_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bfloat16 or float32 -> an opaque oneDNN tensor for `packed_matmul`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [N, in] @ W.T -> [N, out], x in the packed weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
