"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import pytest

from hisparse.models.default_model import default_model_path


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def llama(model_path):
    from hisparse.models.loader import load_llama

    return load_llama(model_path)


@pytest.fixture(scope="session")
def llama_bf16(model_path):
    """The same model in bfloat16, the dtype the engine picks on CPUs that multiply in it natively."""
    import torch

    from hisparse.models.loader import load_llama

    return load_llama(model_path, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own reading of the same GGUF: the independent reference for parity tests."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from hisparse.models.tokenizer import Tokenizer

    return Tokenizer.from_path(model_path)
