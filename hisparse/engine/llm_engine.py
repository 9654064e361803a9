"""The engine loop: admit, schedule, run, turn tokens into text, retire.

Not thread-safe by design: exactly one thread drives `step()`; the server talks to it through a queue.
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import torch

from hisparse.attention.hisparse import HiSparseKVCache
from hisparse.attention.paged import PagedKVCache
from hisparse.distributed.tensor_parallel import TensorParallel, join_group, leave_group, remove_shared_files
from hisparse.engine.cpu_share import CpuShare
from hisparse.engine.data_parallel import Placement, StepReport, summed
from hisparse.engine.engine_config import EngineConfig
from hisparse.engine.errors import RequestError
from hisparse.engine.model_runner import ModelRunner, SamplingError, StepFailed
from hisparse.engine.request import Request, RequestStatus
from hisparse.engine.sampling_params import SamplingParams
from hisparse.engine.scheduler import Scheduler
from hisparse.engine.workers import WorkerGroup, bind_cpus, cpu_shares, free_init_addr
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
    def __init__(self, config: EngineConfig | None = None, model=None, tokenizer: Tokenizer | None = None,
                 rank: int = 0):
        """Everything that can refuse the config (the cache's sizing, the HiSparse checks, the trace folder) runs
        on the model's config before its weights load, so a bad budget costs the seconds of reading the config,
        not the ten of loading (except on a GPU with no budget given, where what the weights leave decides it).
        Every registered architecture (`models.loader.ARCHITECTURES`) goes through the same steps.

        With tp_size > 1 this engine is rank 0: it starts the other ranks of its machine (`engine.workers`), each
        a replica of this engine on its shard (rank: theirs); a rank whose start raises refuses the start with
        its error (a rank that dies ends the process with a line naming it). The engine is bound to the calling
        thread's CPUs: step it from the thread that made it (the server does). `close()` ends the ranks.

        With enable_dp_attention (a DSA model) each rank is also a data-parallel rank with requests of its own:
        rank 0 places each request on one rank (`engine.data_parallel`) and every rank steps its own batch."""
        self.config = config or EngineConfig()
        c = self.config
        self.tp = TensorParallel(rank, c.tp_size, dp_attention=c.enable_dp_attention and c.tp_size > 1,
                                 expert_parallel=c.ep_size > 1)
        self.device = c.rank_device(rank) if c.tp_size == 1 else c.device  # with several ranks, set below
        self.workers: WorkerGroup | None = None
        self._pending: list[tuple[str, tuple]] = []  # rank 0: commands the other ranks have not seen yet
        self.placement = Placement(self.dp_size, c.load_balance_method) if self.dp_size > 1 and rank == 0 else None
        if self.tp.size == 1:
            self._prepare(model, tokenizer)
            self._load(model, tokenizer)
            self.rank_pools = [self._pool_bytes()]
            return
        if model is not None or tokenizer is not None:
            raise ValueError("a tensor-parallel engine loads each rank's shard itself: pass no model or tokenizer")
        if rank == 0:
            if self.config.node_rank != 0:
                raise ValueError(f"node_rank {self.config.node_rank} runs ranks, not an engine: start it with "
                                 "`python -m hisparse.launch_server --node-rank N ...`")
            if self.config.dist_init_addr is None:
                self.config = dataclasses.replace(self.config, dist_init_addr=free_init_addr())
            self._saved_cpus = os.sched_getaffinity(0), torch.get_num_threads(), numba.get_num_threads()
            self._cpu_shares = cpu_shares(self.config.ranks_per_node)
            bind_cpus(self._cpu_shares[0])
        try:
            error = self._start_rank()
            join_group(self.tp, self.config.dist_init_addr, same_machine=self.config.nnodes == 1,
                       cuda=self.device.startswith("cuda"))
            reports = self.tp.all_gather_object(error or {**self._pool_bytes(), "config": self._shared_config()})
        except BaseException:  # rank 0 refused the config, or the ranks never met: end those started
            if rank == 0:
                self._abandon_ranks()
            raise
        self.rank_pools = [{k: v for k, v in r.items() if k != "config"} for r in reports if isinstance(r, dict)]
        failed = [(r, e) for r, e in enumerate(reports) if isinstance(e, str)]
        if not failed:
            failed = [(r, f"its config differs from rank 0's: {e['config']} against {reports[0]['config']}")
                      for r, e in enumerate(reports) if e["config"] != reports[0]["config"]]
        if failed:
            self._stop_ranks()
            if rank == 0:
                raise ValueError(f"rank {failed[0][0]} could not start: {failed[0][1]}")
            raise RuntimeError(failed[0][1])

    def _shared_config(self) -> str:
        """What every rank must agree on (another machine's rank was started from its own command line)."""
        fields = dataclasses.asdict(self.config)
        for own in ("node_rank", "model"):  # a path may differ by machine; the weights' shapes are checked
            fields.pop(own)
        return repr({**fields, "model_dtype": str(self.config.model_dtype), "layers": self.model.config.num_layers,
                     "vocab": self.model.config.vocab_size, "capacity": self.cache.capacity_tokens})

    def _abandon_ranks(self) -> None:
        """Rank 0's start failed after the other ranks were started: end them, give the CPUs back."""
        if self.workers is not None:
            self.workers.kill()
        remove_shared_files()
        leave_group()
        self._restore_cpus()

    def _start_rank(self) -> str | None:
        """Rank 0 starts the other ranks of its machine first (each takes seconds to import torch and open the
        model), then refuses a bad config at once, ending them. A failure to load is reported to the group
        instead of raised, so that every rank learns it and leaves."""
        if self.tp.rank == 0:
            self.workers = WorkerGroup(self.config, list(range(1, self.config.ranks_per_node)), self._cpu_shares[1:])
            self.device = self.config.rank_device(0)
            self._prepare(None, None)  # raises: refused at once
        try:
            if self.tp.rank != 0:
                self.device = self.config.rank_device(self.tp.rank)
                self._prepare(None, None)
            self._load(None, None)
        except Exception as error:
            return f"{type(error).__name__}: {error}" if not isinstance(error, ValueError) else str(error)
        return None

    def _prepare(self, model, tokenizer) -> None:
        files = None if model is not None and tokenizer is not None else open_model(self.config.model)
        self._files = files
        key_kind = self.config.index_key_format
        if model is not None:
            mc, indexer, model_dtype = model.config, model.indexer_spec(key_kind), model.dtype
            where = next(model.parameters()).device
            if where != torch.device(self.device):
                raise ValueError(f"the model's weights are on {where}, the engine's device is {self.device}")
        else:  # what loading will build (the default model gets its shipped indexers)
            mc, indexer, model_dtype = files.config, files.indexer_spec(key_kind), self.config.model_dtype
            files.check_quantization(self.config.quantization)
        self.max_model_len = mc.max_position_embeddings
        kind = self.config.kv_kind(model_dtype)
        # Every rank can hold as many tokens: as many as the budget buys of the largest share's rows (rank 0's).
        layout = mc.for_rank(self.tp).row_layout(kind)
        self._layouts = layout, (mc.for_rank(dataclasses.replace(self.tp, rank=0)).row_layout(kind)
                                 if self.tp.size > 1 else None)
        sparse = self._sparse_attention(indexer, mc.num_layers)
        self._sparse = sparse
        if self.config.enable_hisparse and (sparse is None or sparse.dense_layers):
            raise ValueError("HiSparse needs a sparse-attention model with an indexer in every layer")
        if self.config.topk_trace_dir is not None:  # found unwritable now, not when the first request ends
            try:
                Path(self.config.topk_trace_dir).mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise ValueError(f"topk_trace_dir {str(self.config.topk_trace_dir)!r} cannot be created: "
                                 f"{error.strerror}") from None
        if torch.device(self.device).type == "cuda":  # Triton launches on the current device
            torch.cuda.set_device(torch.device(self.device))
        budget = self.config.kv_budget_before_weights()
        self._attention_scale = mc.attention_scale
        self.cache = None if budget is None else self._new_cache(budget)

    def _load(self, model, tokenizer) -> None:
        files = self._files
        self.model = model if model is not None else files.load(self.config.model_dtype, self.device, self.tp,
                                                                 self.config.quantization)
        if self.cache is None:
            weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            self.cache = self._new_cache(self.config.resolved_kv_budget(weight_bytes))
        self.tokenizer = tokenizer if tokenizer is not None else files.tokenizer()
        self.scheduler = Scheduler(self.cache, self.config.max_running_requests,
                                   self.config.chunked_prefill_size)
        self.runner = ModelRunner(self.model, self.cache, self.tp)
        # A tensor-parallel rank keeps the cores it was given; one engine alone on a CPU shares them (cpu_share).
        adapt = self.config.adaptive_threads and self.tp.size == 1 and self.device == "cpu"
        self.cpu_share = CpuShare() if adapt else None
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

    def _new_cache(self, budget: int):
        """The budget is per rank; `capacity_layout` (tensor parallel: the largest share's rows) decides how many
        tokens it buys, so that every rank can hold as many (tensor parallel: the same ones)."""
        (layout, capacity_layout), sparse, scale = self._layouts, self._sparse, self._attention_scale
        if self.config.enable_hisparse:
            hisparse = self.config.hisparse_config.with_model_top_k(sparse.top_k)
            return HiSparseKVCache(layout, hisparse, budget, sparse, self.config.max_running_requests,
                                   self.max_model_len, scale, self.device,
                                   self.config.swap_in_backend, self.config.enable_prefix_caching, capacity_layout)
        return PagedKVCache.from_budget(layout, budget, scale, self.device, sparse,
                                        self.config.enable_prefix_caching, capacity_layout)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, record_topk: bool | None = None, remote_prefill: bool = False,
                    hold_kv: bool = False) -> Request:
        """record_topk: record this request's top-k selections (None = EngineConfig.record_topk).
        remote_prefill, hold_kv: the request's part in prefill-decode disaggregation (`Request`).
        Under DP attention rank 0 places the request on a rank (`engine.data_parallel`), which alone runs it."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}",
                               "sampling_params")
        params.validate()
        if request_id is not None and request_id in self._detokenizers:  # rank 0 detokenizes every request
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
        if (remote_prefill or hold_kv) and self.tp.dp_attention:
            raise RequestError("prefill-decode disaggregation does not run with DP attention: one rank per instance",
                               "remote_prefill" if remote_prefill else "hold_kv")
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
        # Rank 0 detokenizes and ends every request, its stand-ins too, by the tokens their ranks report.
        self._detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer)
        args = ids, params, request.request_id, request.record_topk, remote_prefill, hold_kv
        if self.placement is None:
            self.scheduler.add(request)
            self._mirror("add_request", *args)
            return request
        rank = self.placement.place(request)
        if rank == 0:
            self.scheduler.add(request)
        self._mirror("_add_placed", rank, *args)
        return request

    def _add_placed(self, rank: int, *args) -> None:
        """A rank other than 0, under DP attention: add the request rank 0 placed if it placed it here."""
        if rank == self.tp.rank:
            self.add_request(*args)

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
        self._mirror("abort", request_id)
        request = self.scheduler.abort(request_id)
        self._detokenizers.pop(request_id, None)
        if self.placement is not None:
            remote = self.placement.forget(request_id)
            if remote is not None:
                self.scheduler.finish(remote, "abort")  # a stand-in sits in no queue: only its status changes
                return remote
        return request

    @property
    def dp_size(self) -> int:
        """Data-parallel attention ranks: each rank under DP attention, else one."""
        return self.config.dp_size

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self.placement is not None and bool(self.placement.remote)

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one step; return the requests that produced a token (finished ones included)."""
        if self.tp.size == 1:
            return self._step()
        if self.tp.comm is None:
            raise RuntimeError("this tensor-parallel engine has ended (closed, or interrupted mid-step)")
        try:
            return self._step()
        except StepFailed:  # every rank stopped at the same point: the step failed, the engine goes on
            raise
        except Exception as error:  # a step half run on some ranks: they are out of step for good
            if self.workers is None:
                raise
            self.workers.fail(f"rank {self.tp.rank}: {type(error).__name__}: {error}")
            raise
        except BaseException:  # Ctrl-C mid-step: the ranks can never pair their collectives again
            if self.workers is not None:
                self._abandon_ranks()
                self.tp.comm = None
            raise

    def _step(self) -> list[Request]:
        start = time.perf_counter()
        if self.cpu_share is not None:
            self.cpu_share.adjust()
        if self.tp.size > 1 and self.tp.rank == 0:
            self.tp.broadcast_object(("step", self._take_pending()))
        batch = self.scheduler.schedule()
        if self.tp.dp_attention:
            return self._step_data_parallel(batch, start)
        if self.tp.size > 1:
            self._check_same_batch(batch)
        if batch is None:
            return []
        produced = self._commit(batch, self.runner.run(batch))
        self._count_step(start, not batch.prefill_spans, len(produced))
        return produced

    def _commit(self, batch, tokens: list[int]) -> list[Request]:
        """The step ran: its rows are in the cache, its tokens go to their requests (which may end)."""
        self.scheduler.advance(batch)
        for request in _admitted_in(batch):
            self._count_prompt(request)
        now = time.perf_counter()
        for span, token in zip(batch.sample_spans, tokens, strict=True):
            self._append(span.request, token, now)
        return [s.request for s in batch.sample_spans]

    def _count_prompt(self, request: Request) -> None:
        self.stats.prompt_tokens += request.num_prompt_tokens
        self.stats.cached_prompt_tokens += request.num_cached_tokens

    def _count_step(self, start: float, decode_only: bool, tokens: int) -> None:
        elapsed = time.perf_counter() - start
        self.stats.steps += 1
        self.stats.step_seconds += elapsed
        if decode_only:
            self.stats.decode_steps += 1
            self.stats.decode_seconds += elapsed
            self.stats.decode_tokens += tokens

    def _step_data_parallel(self, batch, start: float) -> list[Request]:
        """Every rank runs its own batch (a rank with none still takes part in the MLPs' collectives) and reports
        what it sampled; only when every rank could sample does each commit its step, and rank 0 gives the
        other ranks' tokens to their stand-ins through the same `_append`, so it ends them as their ranks do.
        A rank that cannot sample makes every rank give the step up before anything changed."""
        rows = 0 if batch is None else len(batch.input_ids)
        counts = self.tp.all_gather_object((rows, batch is not None and bool(batch.prefill_spans)))
        rows_per_rank = [n for n, _ in counts]
        if not any(rows_per_rank):
            return []
        report = StepReport()
        try:
            tokens = self.runner.run(batch, rows_per_rank)
        except SamplingError as error:
            report.error = str(error)
        if batch is not None and self.tp.rank != 0:  # rank 0 reads the others' reports
            # admitted even when the step fails, as on one rank
            report.admitted = [(r.request_id, r.num_cached_tokens) for r in _admitted_in(batch)]
            if report.error is None:
                report.tokens = [(s.request.request_id, t) for s, t in zip(batch.sample_spans, tokens, strict=True)]
        reports = self.tp.all_gather_object(report)
        admitted = [] if self.placement is None else [r for rep in reports[1:] for r in self.placement.admitted(rep)]
        failed = next((r.error for r in reports if r.error is not None), None)
        if failed is not None:
            raise StepFailed(failed)
        produced = [] if batch is None else self._commit(batch, tokens)
        for request in admitted:
            self._count_prompt(request)
        if self.placement is not None:
            now = time.perf_counter()
            for report in reports[1:]:
                for request_id, token in report.tokens:
                    request = self.placement.remote[request_id]
                    self._append(request, token, now)
                    produced.append(request)
            running = len(self.scheduler.running) + self.placement.count(RequestStatus.RUNNING)
            self.scheduler.peak_running = max(self.scheduler.peak_running, running)  # every rank's
        self._count_step(start, not any(prefill for _, prefill in counts), len(produced))
        return produced

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
        stand_in = self.placement is not None and self.placement.forget(request.request_id) is not None
        if request.record_topk and self.config.topk_trace_dir is not None and not stand_in and (
                self.tp.rank == 0 or self.tp.dp_attention):  # the rank that ran it saves its selections
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
        self._mirror("start_decode", request_id, first_token)
        self.scheduler.start_decode(request)
        self._count_prompt(request)
        self._append(request, first_token, time.perf_counter())
        return request

    def release_held(self, request_id: str) -> None:
        """A finished hold_kv request's rows have been sent (or never will be): give its memory back."""
        self._mirror("release_held", request_id)
        self.scheduler.release_held(request_id)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (and nothing flushed) while a running request reuses a cached prefix.
        Under DP attention every rank flushes its own now: False when any could not (the others did)."""
        if self.placement is not None:
            return all(self._ask_ranks("_flush_own"))
        self._mirror("flush_cache")
        return self.cache.prefix.flush()

    def reset_stats(self) -> None:
        """Zero every counter stats_dict() reports (memory usage is live, not a counter), so that a server's
        metrics start from its first real request, not from its warm-up."""
        self._mirror("reset_stats")
        self.stats = EngineStats()
        self.runner.forward_seconds = 0.0
        self.scheduler.peak_running = len(self.scheduler.running)
        counters = getattr(self.cache, "counters", None)
        if counters is not None:
            counters.reset()

    def stats_dict(self) -> dict:
        """Engine counters, memory usage and (with HiSparse) hits, misses, evictions, bytes and seconds."""
        s = self.stats
        # Under DP attention each rank's pools are its own (rank 0's among them): their slots and counters add up.
        ranks = (self._ask_ranks("_rank_counters") if self.placement is not None and self.tp.comm is not None
                 else [self._rank_counters()])
        memory, swap_in = ranks[0] if len(ranks) == 1 else (
            summed([usage for usage, _ in ranks]), None if ranks[0][1] is None else summed([c for _, c in ranks]))
        out = {"steps": s.steps, "step_seconds": s.step_seconds, "forward_seconds": self.runner.forward_seconds,
               "prompt_tokens": s.prompt_tokens, "cached_prompt_tokens": s.cached_prompt_tokens,
               "generated_tokens": s.generated_tokens,
               "finished_requests": s.finished_requests, "decode_steps": s.decode_steps,
               "decode_seconds": s.decode_seconds, "decode_tokens": s.decode_tokens,
               "running": len(self.scheduler.running), "transferring": len(self.scheduler.transferring),
               "held": len(self.scheduler.held),
               "waiting": len(self.scheduler.waiting), "peak_running": self.scheduler.peak_running,
               "memory": memory, "tp_size": self.tp.size, "ranks": self.rank_pools}
        if swap_in is not None:
            out["swap_in"] = swap_in
        if self.placement is not None:  # every DP rank's requests
            for name, status in (("running", RequestStatus.RUNNING), ("waiting", RequestStatus.WAITING)):
                out[name] += self.placement.count(status)
            out["dp_size"] = self.dp_size
        return out

    # -- tensor parallel: rank 0 leads, the other ranks follow ------------------------------------------------

    def _pool_bytes(self) -> dict[str, int]:
        """The bytes of this rank's KV pools: on the device (rows and indexer keys) and in the host pool."""
        cache = self.cache

        def size(tensor) -> int:
            return tensor.numel() * tensor.element_size()

        index = 0 if cache.index_cache is None else size(cache.index_cache.rows)
        if isinstance(cache, HiSparseKVCache):
            return {"device_kv_bytes": size(cache.device_kv) + index, "host_kv_bytes": size(cache.host_kv)}
        return {"device_kv_bytes": size(cache.kv) + index, "host_kv_bytes": 0}

    def rank_usage(self) -> list[dict[str, int]]:
        """Every rank's `cache.usage()` (slots in use per pool), asked of the ranks now. Tensor-parallel ranks
        hold the same tokens, so a difference is a bug; DP-attention ranks hold their own requests'."""
        if self.tp.size == 1:
            return [self.cache.usage()]
        return [usage for usage, _ in self._ask_ranks("_rank_counters")]

    def _ask_ranks(self, method: str) -> list:
        """Rank 0: every rank's answer to its own `method()` (a follower answers in `follow`), in rank order."""
        self.tp.broadcast_object((method, self._take_pending()))
        return self.tp.all_gather_object(getattr(self, method)())

    def _rank_counters(self) -> tuple[dict, dict | None]:
        counters = getattr(self.cache, "counters", None)
        return self.cache.usage(), None if counters is None else counters.as_dict()

    def _flush_own(self) -> bool:
        return self.cache.prefix.flush()

    def _mirror(self, name: str, *args) -> None:
        """Rank 0: a call that changes the engine's state, for the other ranks to make before the next step."""
        if self.tp.size > 1 and self.tp.rank == 0:
            self._pending.append((name, args))

    def _take_pending(self) -> list[tuple[str, tuple]]:
        pending, self._pending = self._pending, []
        return pending

    def _check_same_batch(self, batch) -> None:
        """Every rank scheduled the same spans, or the ranks diverged: a step would mix requests' rows."""
        spans = [] if batch is None else [(s.request.request_id, s.start, s.length) for s in batch.spans]
        digests = self.tp.all_gather_object(zlib.crc32(repr(spans).encode()))
        if len(set(digests)) > 1:
            raise RuntimeError(f"the tensor-parallel ranks scheduled different batches (digests {digests})")

    def follow(self) -> None:
        """A rank other than 0: make rank 0's calls and steps, in its order, until it stops."""
        while True:
            kind, commands = self.tp.broadcast_object()
            for name, args in commands:
                getattr(self, name)(*args)
            if kind == "stop":
                break
            if kind != "step":  # a question `_ask_ranks` put to every rank
                self.tp.all_gather_object(getattr(self, kind)())
                continue
            try:
                self.step()
            except StepFailed:  # rank 0 fails the step's requests; their aborts come with its next command
                pass
        leave_group()

    def _stop_ranks(self) -> None:
        if self.tp.rank == 0:
            if self.workers is not None:  # after a failed start the ranks exit 1: not a death to report
                self.workers.closing.set()
            self.tp.broadcast_object(("stop", []))
            if self.workers is not None:
                self.workers.close()
            leave_group()
            self._restore_cpus()
        else:
            self.tp.broadcast_object()

    def _restore_cpus(self) -> None:
        """Rank 0's process gets back the CPUs and threads it had before it became a rank."""
        os.sched_setaffinity(0, self._saved_cpus[0])
        torch.set_num_threads(self._saved_cpus[1])
        numba.set_num_threads(self._saved_cpus[2])

    def close(self) -> None:
        """End the other ranks (tensor parallel); the engine takes no more calls. Idempotent."""
        if self.tp.size > 1 and self.tp.rank == 0 and self.tp.comm is not None:
            self._stop_ranks()
            self.tp.comm = None


def _admitted_in(batch) -> list[Request]:
    """The requests whose first prompt chunk the batch holds: admitted by this step's schedule."""
    return [s.request for s in batch.spans if s.start == s.request.num_cached_tokens]
