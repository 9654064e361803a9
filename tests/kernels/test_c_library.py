"""Our C kernels are built wherever gcc is (a build that fails falls back quietly but for a warning, so these are
what notices a broken C file), and a failing build says why."""

from __future__ import annotations

import ctypes
import shutil
import warnings

import pytest

from hisparse.kernels import (
    block_matmul_cpu,
    decode_attention_cpu,
    index_keys_cpu,
    index_scores_cpu,
    indexer_key_cpu,
    kv_rows_cpu,
    rms_norm_cpu,
    rotary_cpu,
)
from hisparse.kernels.c_library import LIBRARIES, CLibrary, cpu_flags, eager

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc here")


@needs_gcc
@pytest.mark.parametrize("kernel", [rms_norm_cpu, indexer_key_cpu, rotary_cpu, kv_rows_cpu, index_keys_cpu,
                                    index_scores_cpu, decode_attention_cpu])
def test_the_kernels_are_built_wherever_gcc_is(kernel):
    assert kernel.available()


@needs_gcc
def test_the_block_kernel_is_built_wherever_gcc_and_vnni_are():
    if not all(f in cpu_flags() for f in block_matmul_cpu.REQUIRED_FLAGS):
        pytest.skip("no AVX-512 VNNI here")
    assert block_matmul_cpu.available()


@needs_gcc
def test_a_source_that_does_not_compile_warns_with_gccs_message_and_gives_none(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "broken.c"
    source.write_text("int broken(void) { return missing_name; }\n")
    library = CLibrary(source, {}, "we do without")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert library.load() is None
    assert any("broken.c could not be built" in str(w.message) and "missing_name" in str(w.message)
               and "we do without" in str(w.message) for w in caught)
    assert library.load() is None  # tried once


def test_a_missing_cpu_flag_or_the_switch_gives_none_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "never.c"
    source.write_text("int never(void) { return 0; }\n")  # a build would leave a __pycache__ folder
    assert CLibrary(source, {}, "x", required_flags=("no_such_flag",)).load() is None
    monkeypatch.setenv("HISPARSE_TEST_SWITCH", "1")
    assert CLibrary(source, {}, "x", disable_env="HISPARSE_TEST_SWITCH").load() is None
    monkeypatch.setenv("HISPARSE_DISABLE_C_KERNELS", "1")  # every library's switch
    assert CLibrary(source, {}, "x").load() is None
    assert [p.name for p in tmp_path.iterdir()] == ["never.c"]


@needs_gcc
def test_eager_unloads_every_library_for_the_block_only(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    library = CLibrary(source, {"one": (ctypes.c_int, [])}, "x")
    assert library in LIBRARIES and library.load().one() == 1
    with eager():
        assert not library.available()
        declared_within = CLibrary(source, {"one": (ctypes.c_int, [])}, "x")  # a module first imported in the block
        assert not declared_within.available()
    assert library.load().one() == 1 and declared_within.load().one() == 1
