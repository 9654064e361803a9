"""hisparse: sparse-attention LLM inference with a host/device KV memory hierarchy."""

from hisparse.kernels.openmp_runtime import share_torch_openmp

share_torch_openmp()  # before anything imports torch: see openmp_runtime

from hisparse.engine.sampling_params import SamplingParams  # noqa: E402
from hisparse.llm import LLM, RequestOutput  # noqa: E402

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
