"""Runs one ForwardBatch through the model and samples: the only place the model is called."""

from __future__ import annotations

import time

import torch

from hisparse.distributed.tensor_parallel import TensorParallel
from hisparse.engine.sampler import sample
from hisparse.formats.forward_batch import ForwardBatch


class StepFailed(RuntimeError):
    """A tensor-parallel step that every rank gave up at the same point (rank 0 could not sample), so the ranks
    stay in step: rank 0's caller fails the step's requests as after any failed step."""


class SamplingError(RuntimeError):
    """This DP-attention rank could not sample its requests' tokens: its step report tells the other ranks, and
    every rank gives the step up (StepFailed)."""


class ModelRunner:
    def __init__(self, model, cache, tp: TensorParallel | None = None) -> None:
        self.model = model
        self.cache = cache
        self.tp = tp or TensorParallel()
        self.device = torch.device(cache.device)  # where the weights and the cache are
        self.forward_seconds = 0.0

    @torch.inference_mode()
    def run(self, batch: ForwardBatch | None, rows_per_rank: list[int] | None = None) -> list[int]:
        """The step's tokens go to the device once; the sampled tokens come back once. The other waits for the
        device are named where they are: a DSA model's MoE counting its tokens per expert, HiSparse's backup of
        the newest rows to the host pool (both once per layer).

        rows_per_rank: every rank's token count this step under DP attention, where each rank samples its own
        requests and a rank with no batch still runs the model on no tokens, for the MLPs' collectives."""
        start = time.perf_counter()
        if batch is None:
            nothing = torch.zeros(0, dtype=torch.long, device=self.device)
            self.model(nothing, nothing, None, rows_per_rank)
            return []
        backend = self.cache.bind(batch)
        extra = () if rows_per_rank is None else (rows_per_rank,)
        hidden = self.model(batch.input_ids.to(self.device), batch.positions.to(self.device), backend, *extra)
        logits = self.model.compute_logits(hidden[batch.sample_indices.to(self.device)])
        if self.device.type == "cuda":  # the forward's time, not its launches' (sampling waits for it next anyway)
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - start
        requests = [s.request for s in batch.sample_spans]
        if self.tp.size == 1:
            return sample(logits.float(), requests)
        if self.tp.dp_attention:  # this rank's requests, from the whole vocabulary
            try:
                return sample(logits.float(), requests)
            except Exception as error:
                raise SamplingError(f"{type(error).__name__}: {error}") from error
        # Tensor parallel: each rank has its slice of the vocabulary; rank 0 samples, every rank takes its tokens.
        logits = self.tp.gather_last_dim(logits.float(), self.model.config.vocab_size)
        tokens = None
        if self.tp.rank == 0:
            try:
                tokens = sample(logits, requests)
            except Exception as error:
                tokens = f"{type(error).__name__}: {error}"
        tokens = self.tp.broadcast_object(tokens)
        if isinstance(tokens, str):
            raise StepFailed(tokens)
        return tokens
