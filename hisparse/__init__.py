"""hisparse: sparse-attention LLM inference with a host/device KV memory hierarchy."""

from hisparse.engine.sampling_params import SamplingParams
from hisparse.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
