"""One step's worth of work for the model, laid out flat.

The runner builds this once per step; every layer's attention reads the same metadata, so nothing is
recomputed per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class BatchedRequest(Protocol):
    """What a batch and the attention backends read of a request (the engine's `Request`)."""

    kv: Any  # the cache's allocation
    prompt_token_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    max_total_tokens: int  # what the cache must hold for it by the time it ends
    in_prefill: bool
    record_topk: bool
    topk_trace: list | None

    def token_at(self, position: int) -> int: ...


@dataclass
class SequenceSpan:
    """The new tokens of one request in this step: positions [start, start + length)."""

    request: BatchedRequest
    offset: int  # index of its first token in the flat batch
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N]
    spans: list[SequenceSpan]
    sample_indices: torch.Tensor  # rows of N whose logits are sampled (the last token of each span that
    sample_spans: list[SequenceSpan]  # completes its prompt or decodes), and their spans

    @property
    def decode_spans(self) -> list[SequenceSpan]:
        return [s for s in self.spans if s.length == 1 and not s.request.in_prefill]

    @property
    def prefill_spans(self) -> list[SequenceSpan]:
        return [s for s in self.spans if s.length > 1 or s.request.in_prefill]

    @classmethod
    def build(cls, spans: list[tuple[BatchedRequest, int]]) -> ForwardBatch:
        """spans: (request, number of new tokens) pairs, new tokens starting at num_computed_tokens."""
        ids: list[int] = []
        positions: list[int] = []
        built: list[SequenceSpan] = []
        sample_indices: list[int] = []
        sample_spans: list[SequenceSpan] = []
        for request, length in spans:
            start = request.num_computed_tokens
            span = SequenceSpan(request, len(ids), start, length)
            built.append(span)
            ids.extend(request.token_at(p) for p in range(start, start + length))
            positions.extend(range(start, start + length))
            if start + length >= request.num_prompt_tokens:
                sample_indices.append(len(ids) - 1)
                sample_spans.append(span)
        return cls(torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                   built, torch.tensor(sample_indices, dtype=torch.int64), sample_spans)
