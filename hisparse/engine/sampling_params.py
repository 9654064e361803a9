"""What a caller may ask of one generation, checked once at the door."""

from __future__ import annotations

from dataclasses import dataclass, field

from hisparse.engine.errors import RequestError


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # OpenAI's: subtracted from a token's logit once it has been generated (presence), and per time it has
    # (frequency); logit_bias adds to the logits of the token ids it names.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field and make `stop` a list. The engine calls it again when a request is added: the
        object may have been changed since (`params.max_tokens = -5` once reached the allocator)."""
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise RequestError(f"{name} {why}, got {getattr(self, name)!r}", name)

        if self.stop is None or isinstance(self.stop, str):
            self.stop = [self.stop] if self.stop else []
        check(isinstance(self.stop, (list, tuple)), "stop", "must be a string or a list of strings")
        self.stop = list(self.stop)

        check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
              and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        check(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
              and 0.0 <= self.temperature <= 100.0, "temperature", "must be a number in [0, 100]")
        check(isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool)
              and 0.0 < self.top_p <= 1.0, "top_p", "must be a number in (0, 1]")
        check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
              and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 (off) or an integer >= 1")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
              and 0 <= self.seed < 2**63), "seed", "must be None or a non-negative integer")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(isinstance(self.stop_token_ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids", "must be a list of non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and -2.0 <= value <= 2.0, name,
                  "must be a number in [-2, 2]")
        check(isinstance(self.logit_bias, dict) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 and isinstance(b, (int, float))
            and not isinstance(b, bool) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()),
            "logit_bias", "must map token ids (integers >= 0) to numbers in [-100, 100]")

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling changes the model's logits first (penalties, logit_bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
