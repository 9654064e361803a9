"""A request and everything the engine knows about it, in one place.

The request knows its tokens, how many of them the model has already seen, and the memory the cache
manager gave it (`kv`, opaque to the engine); the cache manager alone allocates and frees.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hisparse.engine.sampling_params import SamplingParams

_ids = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFERRING = "transferring"  # admitted; its prompt's rows are arriving from a prefill instance
    FINISHED = "finished"


@dataclass
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens whose K/V were reused from the prefix cache at admission
    finish_reason: str | None = None
    output_text: str = ""
    kv: Any = None  # the cache manager's allocation
    record_topk: bool = False
    topk_trace: list | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    generator: torch.Generator | None = None
    # Prefill-decode disaggregation. remote_prefill (decode side): admitted without a prefill, its prompt's rows
    # written into its memory by a prefill instance. hold_kv (prefill side): once finished, its rows stay
    # allocated until `LLMEngine.release_held`, so that they can be sent.
    remote_prefill: bool = False
    hold_kv: bool = False

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens the cache must be able to hold for this request by the time it ends."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, position: int) -> int:
        n = self.num_prompt_tokens
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]
