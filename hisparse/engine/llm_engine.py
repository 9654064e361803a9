"""The engine loop: admit, schedule, run, turn tokens into text, retire.

Not thread-safe by design: exactly one thread drives `step()`; the server talks to it through a queue.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hisparse.attention.hisparse import HiSparseKVCache
from hisparse.attention.paged import PagedKVCache
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.errors import RequestError
from hisparse.engine.model_runner import ModelRunner
from hisparse.engine.request import Request, RequestStatus
from hisparse.engine.sampling_params import SamplingParams
from hisparse.engine.scheduler import Scheduler
from hisparse.formats.kv_layout import RowLayout
from hisparse.formats.sparse_attention import IndexerSpec, SparseAttention
from hisparse.models.loader import open_model
from hisparse.models.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens reused from the prefix cache instead of computed
    generated_tokens: int = 0
    finished_requests: int = 0
    # Steps that only decoded (no prompt chunk in the batch): their tokens over their time is the decode
    # throughput, the figure HiSparse's larger batches improve, free of the prefill work both modes share.
    decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    extra: dict = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, model=None, tokenizer: Tokenizer | None = None):
        """Everything that can refuse the config (the cache's sizing, the HiSparse checks, the trace folder) runs
        on the model's config before its weights load, so a bad budget costs the seconds of reading the config,
        not the ten of loading (except on a GPU with no budget given, where what the weights leave decides it).
        Every registered architecture (`models.loader.ARCHITECTURES`) goes through the same steps."""
        self.config = config or EngineConfig()
        files = None if model is not None and tokenizer is not None else open_model(self.config.model)
        key_kind = self.config.index_key_format
        if model is not None:
            mc, indexer, model_dtype = model.config, model.indexer_spec(key_kind), model.dtype
            where = next(model.parameters()).device
            if where != torch.device(self.config.device):
                raise ValueError(f"the model's weights are on {where}, the engine's device is {self.config.device}")
        else:  # what loading will build (the default model gets its shipped indexers)
            mc, indexer, model_dtype = files.config, files.indexer_spec(key_kind), self.config.model_dtype
        self.max_model_len = mc.max_position_embeddings
        layout = mc.row_layout(self.config.kv_kind(model_dtype))
        sparse = self._sparse_attention(indexer, mc.num_layers)
        if self.config.enable_hisparse and (sparse is None or sparse.dense_layers):
            raise ValueError("HiSparse needs a sparse-attention model with an indexer in every layer")
        if self.config.topk_trace_dir is not None:  # found unwritable now, not when the first request ends
            try:
                Path(self.config.topk_trace_dir).mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise ValueError(f"topk_trace_dir {str(self.config.topk_trace_dir)!r} cannot be created: "
                                 f"{error.strerror}") from None
        if torch.device(self.config.device).type == "cuda":  # Triton launches on the current device
            torch.cuda.set_device(torch.device(self.config.device))
        budget = self.config.kv_budget_before_weights()
        self.cache = None if budget is None else self._new_cache(layout, sparse, budget, mc.attention_scale)
        self.model = model if model is not None else files.load(model_dtype, self.config.device)
        if self.cache is None:
            weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            self.cache = self._new_cache(layout, sparse, self.config.resolved_kv_budget(weight_bytes),
                                         mc.attention_scale)
        self.tokenizer = tokenizer if tokenizer is not None else files.tokenizer()
        self.scheduler = Scheduler(self.cache, self.config.max_running_requests,
                                   self.config.chunked_prefill_size)
        self.runner = ModelRunner(self.model, self.cache)
        self.stats = EngineStats()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # one per unfinished request

    def _sparse_attention(self, indexer: IndexerSpec | None, num_layers: int) -> SparseAttention | None:
        """How attention uses the model's lightning indexers (None: a dense model). A model's own top_k (DSA's
        index_topk) wins over the engine's, as in the reference."""
        if indexer is None:
            return None
        sparse = SparseAttention.from_spec(indexer, self.config.sparse_attention, self.config.top_k,
                                           self.config.dense_layers)
        bad = [layer for layer in sparse.dense_layers if layer >= num_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} out of range: the model has {num_layers} layers")
        for layer in sparse.shared_layers:  # a dense layer selects nothing for the shared layers after it
            source = sparse.selecting_layer(layer)
            if layer not in sparse.dense_layers and source in sparse.dense_layers:
                raise ValueError(f"dense_layers has layer {source}, whose top-k the shared layer {layer} reuses: make "
                                 f"layer {layer} dense too, or layer {source} sparse")
        return sparse

    def _new_cache(self, layout: RowLayout, sparse: SparseAttention | None, budget: int, attention_scale: float):
        if self.config.enable_hisparse:
            hisparse = self.config.hisparse_config.with_model_top_k(sparse.top_k)
            return HiSparseKVCache(layout, hisparse, budget, sparse, self.config.max_running_requests,
                                   self.max_model_len, attention_scale, self.config.device,
                                   self.config.swap_in_backend, self.config.enable_prefix_caching)
        return PagedKVCache.from_budget(layout, budget, attention_scale, self.config.device, sparse,
                                        self.config.enable_prefix_caching)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, record_topk: bool | None = None, remote_prefill: bool = False,
                    hold_kv: bool = False) -> Request:
        """record_topk: record this request's top-k selections (None = EngineConfig.record_topk).
        remote_prefill, hold_kv: the request's part in prefill-decode disaggregation (`Request`)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}",
                               "sampling_params")
        params.validate()
        if request_id is not None and request_id in self._detokenizers:
            raise RequestError(f"request_id {request_id!r} is already in use by an unfinished request", "request_id")
        vocab = self.model.config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias))):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise RequestError(f"{name} must name token ids in [0, {vocab}), got {bad[0]}", name)
        ids = self._prompt_ids(prompt)
        request = Request(ids, params) if request_id is None else Request(ids, params, request_id)
        request.record_topk = self.config.record_topk if record_topk is None else record_topk
        request.remote_prefill, request.hold_kv = remote_prefill, hold_kv
        if request.record_topk and self.config.enable_hisparse:
            raise RequestError("record_topk records from the baseline cache: record with enable_hisparse off",
                               "record_topk")
        # Blamed on the prompt when it alone leaves no room for a token, else on max_tokens.
        if request.max_total_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                               f"model's context length of {self.max_model_len} tokens",
                               "prompt" if len(ids) >= self.max_model_len else "max_tokens", "context_length_exceeded")
        if request.max_total_tokens > self.cache.capacity_tokens:
            raise RequestError(f"prompt + max_tokens ({request.max_total_tokens} tokens) exceeds the KV cache "
                               f"capacity of {self.cache.capacity_tokens} tokens; raise the device KV budget",
                               "prompt" if len(ids) >= self.cache.capacity_tokens else "max_tokens",
                               "context_length_exceeded")
        self._detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(request)
        return request

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids must be in [0, {self.model.config.vocab_size}), got {bad[0]}",
                                   "prompt")
        else:
            raise RequestError("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise RequestError("prompt must not be empty", "prompt")
        return ids

    def abort(self, request_id: str) -> Request | None:
        request = self.scheduler.abort(request_id)
        self._detokenizers.pop(request_id, None)
        return request

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one step; return the requests that produced a token (finished ones included)."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        decode_only = not batch.prefill_spans
        tokens = self.runner.run(batch)
        self.scheduler.advance(batch)
        for span in batch.spans:
            if span.start == span.request.num_cached_tokens:  # its first prompt chunk
                self.stats.prompt_tokens += span.request.num_prompt_tokens
                self.stats.cached_prompt_tokens += span.request.num_cached_tokens
        now = time.perf_counter()
        for span, token in zip(batch.sample_spans, tokens, strict=True):
            self._append(span.request, token, now)
        elapsed = time.perf_counter() - start
        self.stats.steps += 1
        self.stats.step_seconds += elapsed
        if decode_only:
            self.stats.decode_steps += 1
            self.stats.decode_seconds += elapsed
            self.stats.decode_tokens += len(tokens)
        return [s.request for s in batch.sample_spans]

    def _append(self, request: Request, token: int, now: float) -> None:
        params = request.params
        if request.first_token_time is None:
            request.first_token_time = now
        request.output_token_ids.append(token)
        self.stats.generated_tokens += 1
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.stop_token_ids)
        if token in stop_ids:
            return self._finish(request, "stop")
        detok = self._detokenizers[request.request_id]
        checked = len(request.output_text)
        request.output_text += detok.add_token(token)
        # A new match ends in the new text (the text before it was checked last time), however long that is:
        # one token can be 80 characters. The earliest match of any stop string wins.
        cuts = [request.output_text.find(stop, max(0, checked - len(stop) + 1)) for stop in params.stop]
        cut = min((c for c in cuts if c >= 0), default=-1)
        if cut >= 0:
            request.output_text = request.output_text[:cut]
            return self._finish(request, "stop", flush=False)
        if len(request.output_token_ids) >= params.max_tokens:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str, flush: bool = True) -> None:
        if flush:  # text held back for an unfinished character; never after a stop string's cut
            request.output_text += self._detokenizers[request.request_id].flush()
        self._detokenizers.pop(request.request_id, None)
        self.scheduler.finish(request, reason)
        self.stats.finished_requests += 1
        if request.record_topk and self.config.topk_trace_dir is not None:
            from hisparse.engine.topk_trace import save_request_trace

            save_request_trace(self.config.topk_trace_dir, request, self.cache.sparse)

    # -- prefill-decode disaggregation -----------------------------------------------------------------

    def row_pools(self) -> list[tuple[str, torch.Tensor]]:
        """The pools a request's rows live in, each [layers, rows, row width], in the order of `row_slots`."""
        return self.cache.row_pools()

    def row_slots(self, request: Request) -> np.ndarray:
        """int64 [max_total_tokens, len(row_pools())]: the row of each of the request's positions in each pool."""
        return request.kv.claim.slots

    def find_request(self, request_id: str) -> Request | None:
        """An unfinished request, or a finished one whose rows are held."""
        s = self.scheduler
        held = s.held.get(request_id)
        return held or next((r for r in (*s.running, *s.transferring, *s.waiting) if r.request_id == request_id), None)

    def start_decode(self, request_id: str, first_token: int) -> Request:
        """A transferring request's prompt rows are in its memory: take the first token the prefill instance
        sampled (it may end the request) and decode from the next step."""
        request = self.find_request(request_id)
        if request is None or request.status is not RequestStatus.TRANSFERRING:
            raise KeyError(f"no request {request_id!r} is waiting for its prompt's rows")
        self.scheduler.start_decode(request)
        self.stats.prompt_tokens += request.num_prompt_tokens
        self.stats.cached_prompt_tokens += request.num_cached_tokens
        self._append(request, first_token, time.perf_counter())
        return request

    def release_held(self, request_id: str) -> None:
        """A finished hold_kv request's rows have been sent (or never will be): give its memory back."""
        self.scheduler.release_held(request_id)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (and nothing flushed) while a running request reuses a cached prefix."""
        return self.cache.prefix.flush()

    def reset_stats(self) -> None:
        """Zero every counter stats_dict() reports (memory usage is live, not a counter), so that a server's
        metrics start from its first real request, not from its warm-up."""
        self.stats = EngineStats()
        self.runner.forward_seconds = 0.0
        self.scheduler.peak_running = len(self.scheduler.running)
        counters = getattr(self.cache, "counters", None)
        if counters is not None:
            counters.reset()

    def stats_dict(self) -> dict:
        """Engine counters, memory usage and (with HiSparse) hits, misses, evictions, bytes and seconds."""
        s = self.stats
        out = {"steps": s.steps, "step_seconds": s.step_seconds, "forward_seconds": self.runner.forward_seconds,
               "prompt_tokens": s.prompt_tokens, "cached_prompt_tokens": s.cached_prompt_tokens,
               "generated_tokens": s.generated_tokens,
               "finished_requests": s.finished_requests, "decode_steps": s.decode_steps,
               "decode_seconds": s.decode_seconds, "decode_tokens": s.decode_tokens,
               "running": len(self.scheduler.running), "transferring": len(self.scheduler.transferring),
               "held": len(self.scheduler.held),
               "waiting": len(self.scheduler.waiting), "peak_running": self.scheduler.peak_running,
               "memory": self.cache.usage()}
        counters = getattr(self.cache, "counters", None)
        if counters is not None:
            out["swap_in"] = counters.as_dict()
        return out
