"""Top-k traces: the positions the indexer selected, per layer and decode step, for replay.

Like SGLang's `--enable-return-indexer-topk`, a request with `record_topk` keeps, for every decode step,
the context length and each layer's selected positions. A trace file (`.npz`) holds, for one request:

- `layer_{i}`: int32 [steps, top_k], the positions selected in layer i at each step, ascending, padded
  with -1 (a step whose context is shorter than top_k selects every position, then pads);
- `next_{i}` (optional): int32 [steps, m], the positions ranked just below the top-k in layer i by the
  indexer's scores at each step, the best first, padded with -1 (score-aware eviction uses them;
  `SparseAttention.trace_next_ranks` sets m, 4 x top_k by default);
- `seq_lens`: int32 [steps], the context length at each step (the newest position is seq_len - 1);
- `top_k`, `num_layers`, `prompt_len`, `dense_layers` (layers that attended densely; their rows hold
  what the indexer would have picked), `sparse_attention` (whether decode was sparse at all).

The memory-hierarchy and miss-rate benchmarks replay these with `load_topk_trace`. Record one with
`python -m hisparse.tools.topk_trace record ...`, or from code with `LLM(record_topk=True, topk_trace_dir=...)`
/ `LLMEngine.add_request(..., record_topk=True)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class TopkTrace:
    layers: list[np.ndarray]  # per layer int32 [steps, top_k], -1 padded
    seq_lens: np.ndarray  # int32 [steps]
    top_k: int
    prompt_len: int = 0
    dense_layers: tuple[int, ...] = ()
    sparse_attention: bool = True
    request_id: str = ""
    next_ranked: list[np.ndarray] | None = None  # per layer int32 [steps, m]: ranks top_k+1.., -1 padded

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_steps(self) -> int:
        return len(self.seq_lens)

    def selected(self, layer: int, step: int) -> np.ndarray:
        """The positions layer `layer` selected at decode step `step` (without padding)."""
        row = self.layers[layer][step]
        return row[row >= 0]


def trace_from_request(request, sparse) -> TopkTrace:
    """Assemble a finished request's recorded steps (PagedAttention fills `request.topk_trace`)."""
    steps = request.topk_trace or []
    num_layers = len(steps[0]["layers"]) if steps else 0
    top_k = sparse.top_k
    layers = []
    for layer in range(num_layers):
        arr = np.full((len(steps), top_k), -1, dtype=np.int32)
        for i, step in enumerate(steps):
            picked = step["layers"][layer]
            arr[i, :len(picked)] = picked
        layers.append(arr)
    next_ranked = None
    if steps and steps[0].get("next") is not None:
        next_ranked = [np.stack([step["next"][layer] for step in steps]).astype(np.int32)
                       for layer in range(num_layers)]
    return TopkTrace(layers, np.array([s["seq_len"] for s in steps], dtype=np.int32), top_k,
                     request.num_prompt_tokens, tuple(sparse.dense_layers), bool(sparse.enabled), request.request_id,
                     next_ranked)


def save_topk_trace(path: str | Path, trace: TopkTrace) -> None:
    arrays = {f"layer_{i}": a for i, a in enumerate(trace.layers)}
    arrays.update({f"next_{i}": a for i, a in enumerate(trace.next_ranked or [])})
    np.savez_compressed(path, seq_lens=trace.seq_lens, top_k=np.int32(trace.top_k),
                        num_layers=np.int32(trace.num_layers), prompt_len=np.int32(trace.prompt_len),
                        dense_layers=np.array(trace.dense_layers, dtype=np.int32),
                        sparse_attention=np.bool_(trace.sparse_attention), request_id=np.str_(trace.request_id),
                        **arrays)


def load_topk_trace(path: str | Path) -> TopkTrace:
    with np.load(path) as f:
        n = int(f["num_layers"])
        next_ranked = [f[f"next_{i}"] for i in range(n)] if "next_0" in f else None
        return TopkTrace([f[f"layer_{i}"] for i in range(n)], f["seq_lens"], int(f["top_k"]), int(f["prompt_len"]),
                         tuple(int(v) for v in f["dense_layers"]), bool(f["sparse_attention"]),
                         str(f["request_id"]), next_ranked)


def save_request_trace(folder: str | Path, request, sparse) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{request.request_id}.npz"
    save_topk_trace(path, trace_from_request(request, sparse))
    return path
