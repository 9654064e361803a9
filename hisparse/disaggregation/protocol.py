"""The control channel's messages: what a decode instance tells the prefill instance's bootstrap server.

`PUT /rooms/{room}` carries a `Destination` and answers, once the rows are written, `{"first_token": id}`
(or an OpenAI-style error body); `DELETE /rooms/{room}` cancels a room and answers once no write into the
decode side's memory is in flight any more. The room is the router's `bootstrap_room`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from hisparse.disaggregation.row_transfer import PoolSpec, decode_runs, encode_runs


def prompt_digest(token_ids: list[int]) -> str:
    """Both sides tokenize the same body; the digest proves they got the same prompt."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


@dataclass(frozen=True)
class Destination:
    session_id: str  # the decode instance's transfer engine
    pools: list[PoolSpec]
    rows: np.ndarray  # int64 [num_prompt_tokens - start, pools]: where positions start.. go in each pool
    start: int  # positions before it the decode side holds already (its prefix cache)
    num_prompt_tokens: int
    prompt_digest: str

    def to_json(self) -> dict:
        return {"session_id": self.session_id, "pools": [p.to_json() for p in self.pools],
                "rows": [encode_runs(self.rows[:, i]) for i in range(self.rows.shape[1])],
                "start": self.start, "num_prompt_tokens": self.num_prompt_tokens,
                "prompt_digest": self.prompt_digest}

    @classmethod
    def from_json(cls, data: dict) -> Destination:
        """ValueError naming the problem for a malformed message."""
        try:
            pools = [PoolSpec.from_json(p) for p in data["pools"]]
            columns = [decode_runs(runs) for runs in data["rows"]]
            start, total = int(data["start"]), int(data["num_prompt_tokens"])
            if len(columns) != len(pools) or any(c.size != total - start for c in columns) or not 0 <= start < total:
                raise ValueError("rows do not cover positions start..num_prompt_tokens of every pool")
            rows = np.stack(columns, axis=1) if columns else np.empty((total - start, 0), np.int64)
            return cls(str(data["session_id"]), pools, rows, start, total, str(data["prompt_digest"]))
        except (KeyError, TypeError) as error:
            raise ValueError(f"malformed destination: {type(error).__name__}: {error}") from None
