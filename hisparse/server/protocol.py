"""The OpenAI wire format: what clients send and what they get back, as pydantic models.

Requests are parsed strictly (`"max_tokens": "5"` is a type error, not 5), so a client bug is reported at
the door with the field named instead of being guessed at. Fields the OpenAI API has and we do not use
(user, metadata, ...) are ignored, as the official client may send them; ones that would change the answer
and that we cannot honour (n > 1, logprobs, echo, response_format, tools, best_of, suffix) are refused by the
server with a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_serializer


def _encodable(text: str) -> str:
    """JSON can spell a lone UTF-16 surrogate ("\\ud800"), which is no character: the tokenizer cannot take
    it, so it is refused here, naming its field, rather than failing deep inside."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"must be valid Unicode text, but holds a lone surrogate at index {error.start}") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields both endpoints share; top_k, ignore_eos and stop_token_ids are vLLM/SGLang extensions."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias
    # Prefill-decode disaggregation: sglang-router adds them, a list (one per prompt) for a list of prompts.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    # Fields that would change the answer and that the server cannot honour: refused with a 400 when set.
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    best_of: Any = None
    suffix: Any = None


class CompletionRequest(_SamplingFields):
    prompt: Text | list[int] | list[Text]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


# -- responses --------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _delta(self, delta: ChatDelta) -> dict:
        """OpenAI sends only the delta's keys that change: {"content": "x"}, not {"role": null, ...}."""
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hisparse"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

    @classmethod
    def of(cls, status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
        """OpenAI's body for an HTTP status: its `type` follows from the status."""
        kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
        return cls(error=ErrorInfo(message=message, type=kind, param=param, code=code))
