"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import pytest

from hisparse.models.default_model import default_model_path


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def model_files(model_path):
    """The default model's GGUF opened once (3 s each time): its config, weights and tokenizer come from it."""
    from hisparse.models.loader import open_model

    return open_model(model_path)


@pytest.fixture(scope="session")
def llama(model_files):
    from hisparse.models.loader import load_llama

    return load_llama(model_files)


@pytest.fixture(scope="session")
def llama_bf16(model_files):
    """The same model in bfloat16, the dtype the engine picks on CPUs that multiply in it natively."""
    import torch

    from hisparse.models.loader import load_llama

    return load_llama(model_files, dtype=torch.bfloat16)


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
def tokenizer(model_files):
    return model_files.tokenizer()


@pytest.fixture(scope="session")
def model_config(model_files):
    """The default model's config: commands read it to check their flags."""
    return model_files.config


@pytest.fixture
def opened_model(monkeypatch, model_files):
    """opened_model(*modules): the modules' `open_model` (and the loader's) hand out the session's opened model,
    so that a command checking its flags does not spend seconds reading the GGUF."""

    def patch(*modules) -> None:
        import hisparse.models.loader as loader

        for module in (loader, *modules):
            monkeypatch.setattr(module, "open_model", lambda model=None: model_files)

    return patch


@pytest.fixture
def run_command(capsys):
    """run_command(main, argv, prog) -> (exit status, stdout, stderr lines) of `main(argv)` run as its
    `python -m` block runs it: through `cli_args.run_main`, a refusal by the parser exiting."""
    from hisparse.cli_args import run_main

    def run(main, argv: list[str], prog: str) -> tuple[int, str, list[str]]:
        try:
            code = run_main(main, argv, prog)
        except SystemExit as done:
            code = done.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err.splitlines()

    return run


@pytest.fixture
def assert_refused(run_command):
    """assert_refused(main, argv, prog, words): the command ends with exit status 2 and exactly one line on
    stderr, `<prog>: error: ...` holding `words`, no traceback. Returns what it printed on stdout."""

    def check(main, argv: list[str], prog: str, words: str) -> str:
        code, out, lines = run_command(main, argv, prog)
        assert code == 2, lines
        assert len(lines) == 1 and "Traceback" not in lines[0], lines
        assert lines[0].startswith(f"{prog}: error:") and words in lines[0], lines[0]
        return out

    return check


@pytest.fixture
def forbid(monkeypatch):
    """forbid(target, *names): calling any of `target`'s `names` fails the test (work a refused flag must never
    start: loading a model, recording, timing, starting a server)."""

    def patch(target, *names: str) -> None:
        for name in names:
            what = f"{getattr(target, '__name__', target)}.{name}"

            def call(*args, what=what, **kwargs):
                raise AssertionError(f"{what} was called: a bad flag must be refused before it")

            monkeypatch.setattr(target, name, call)

    return patch


@pytest.fixture(scope="session")
def tiny_dsa_dir(tmp_path_factory, model_files):
    """tiny_dsa_dir(arch): a small random checkpoint of `arch` ("glm-5", "deepseek-v3.2") written once by
    `python -m hisparse.tools.random_checkpoint`, DSA-shaped per token (latent 512 + 64, indexer key 128 dims)
    with index_topk 16, in float32."""
    import hisparse.models.loader as loader
    from hisparse.tools import random_checkpoint

    written = {}

    def write(arch: str):
        if arch not in written:
            out = tmp_path_factory.mktemp(arch)
            with pytest.MonkeyPatch.context() as patch:  # the tokenizer from the session's opened default model
                patch.setattr(loader, "open_model", lambda model=None: model_files)
                assert random_checkpoint.main(["--arch", arch, "--out", str(out), "--layers", "2", "--hidden", "64",
                                               "--heads", "2", "--experts", "4", "--index-topk", "16",
                                               "--index-heads", "16", "--max-context", "1024",
                                               "--dtype", "float32"]) == 0
            written[arch] = out
        return written[arch]

    return write
