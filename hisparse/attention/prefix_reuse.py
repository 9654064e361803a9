"""Which of a retiring request's tokens a cache may leave for prefix reuse."""

from __future__ import annotations

from hisparse.formats.forward_batch import BatchedRequest
from hisparse.formats.sparse_attention import SparseAttention


def reusable_tokens(request: BatchedRequest, sparse: SparseAttention | None) -> list[int]:
    """The tokens whose cached rows a later prompt of the same tokens may reuse: every computed one, or only
    the prompt's where decode attends differently from prefill (`SparseAttention.decode_matches_prefill`)."""
    n = request.num_computed_tokens
    if sparse is not None and not sparse.decode_matches_prefill:
        n = min(n, request.num_prompt_tokens)
    return [request.token_at(p) for p in range(n)]
