"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, as vLLM and SGLang users know it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tqdm import tqdm

from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.llm_engine import LLMEngine
from hisparse.engine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument {', '.join(map(repr, unknown))}; the engine takes "
                             f"{', '.join(sorted(known - {'model'}))}")
        config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a non-empty string, token-id list, or list of them")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        requests = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                requests.append(self.engine.add_request(prompt, p or SamplingParams()))
            with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
                while any(not r.finished for r in requests):
                    bar.update(sum(r.finished for r in self.engine.step()))
        except BaseException:  # a refused prompt, a failed step, Ctrl-C: none may keep memory or poison the engine
            for request in requests:
                if not request.finished:
                    self.engine.abort(request.request_id)
            raise
        return [RequestOutput(r.request_id, r.prompt_token_ids, r.output_text, list(r.output_token_ids),
                              r.finish_reason) for r in requests]

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """messages: one conversation (a list of {role, content}) or a list of conversations."""
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not (isinstance(messages, list) and messages and all(isinstance(c, list) for c in messages)):
            raise ValueError("messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) or "
                             f"a non-empty list of conversations, got {type(messages).__name__}")
        prompts = [self.tokenizer.encode_chat(conversation) for conversation in messages]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        return self.engine.stats_dict()

    def close(self) -> None:
        """End the engine's other ranks (tp_size > 1; they also end with this process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
