"""Runs one ForwardBatch through the model and samples: the only place the model is called."""

from __future__ import annotations

import time

import torch

from hisparse.engine.sampler import sample
from hisparse.formats.forward_batch import ForwardBatch


class ModelRunner:
    def __init__(self, model, cache) -> None:
        self.model = model
        self.cache = cache
        self.forward_seconds = 0.0

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> list[int]:
        start = time.perf_counter()
        backend = self.cache.bind(batch)
        hidden = self.model(batch.input_ids, batch.positions, backend)
        logits = self.model.compute_logits(hidden[batch.sample_indices])
        self.forward_seconds += time.perf_counter() - start
        return sample(logits.float(), [s.request for s in batch.sample_spans])
