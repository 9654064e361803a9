"""Our C kernels: compiled once per machine by the system's gcc and loaded with ctypes.

A C file next to its Python module is built (`gcc -O3 -march=native -fopenmp`, about a second) into the
package's `__pycache__`, or ~/.cache/hisparse where that is read-only, keyed by the source and the headers
beside it (`bfloat16.h`), the command, gcc's version and the CPU's flags, so that a changed file, compiler or
machine builds anew. Builds write a temporary
file and rename it, so processes building at once never load half a library. OpenMP loops in them run on the
process's one libgomp: torch's team (`numba_threads`).

`HISPARSE_DISABLE_C_KERNELS=1` keeps every one of them unloaded, and `eager()` within a block, so that each
caller runs its PyTorch fallback: the eager model the kernels must agree with (tests/engine/test_compiled_vs_eager.py).

Libraries load as `ctypes.PyDLL`, which keeps the GIL during a call as torch's and numba's kernels do: released,
another thread could run torch ops on a second OpenMP team meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

COMMAND = ("gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# The argument types the kernels' signatures use: a tensor's data_ptr(), an int64_t, an int (a flag), a float.
POINTER, INT64, INT, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
DISABLE_ALL_ENV = "HISPARSE_DISABLE_C_KERNELS"


def autograd_records(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an op on these tensors. The C kernels' outputs carry no gradient, so callers
    keep PyTorch's ops then (an engine step runs under inference mode: the first test settles it)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


class LayerAddresses:
    """The address of each layer of a [L, ...] contiguous pool: a call bound for a whole decode step (the kernels'
    `bind_*` that take pools) passes one layer's per call. Keeps the pool alive."""

    def __init__(self, pools: torch.Tensor) -> None:
        if not pools.is_contiguous():
            raise ValueError("a pool of layers must be contiguous")
        self.pools = pools
        self.base, self.stride, self.count = pools.data_ptr(), pools.stride(0) * pools.element_size(), pools.shape[0]

    def address(self, layer: int) -> int:
        if not 0 <= layer < self.count:
            raise IndexError(f"layer {layer} is not one of the pool's {self.count}")
        return self.base + layer * self.stride


LIBRARIES: list[CLibrary] = []  # every kernel's library, as its module declared it
_eager = False  # within `eager()`: libraries declared meanwhile start unavailable too


@contextlib.contextmanager
def eager():
    """Every C kernel unavailable within the block, those of modules first imported in it too: callers built
    inside it run PyTorch's ops (an engine binds some kernels when it is built, so build it inside)."""
    global _eager
    before = len(LIBRARIES)
    saved = [library._library for library in LIBRARIES]
    for library in LIBRARIES:
        library._library = None
    _eager = True
    try:
        yield
    finally:
        _eager = False
        for library, state in zip(LIBRARIES, saved + [False] * (len(LIBRARIES) - before), strict=True):
            library._library = state


class CLibrary:
    """One C file's library, built and loaded on first use by whichever thread asks first.

    functions: each exported function's (result type, argument types), None for void. `load()` is None where the
    library cannot be had: no gcc, no source in this install, a missing CPU flag, or `disable_env` (or
    DISABLE_ALL_ENV) set to 1; a failed build also warns with gcc's message, naming `fallback` (what callers do
    instead)."""

    def __init__(self, source: Path, functions: dict[str, tuple[type | None, list[type]]], fallback: str,
                 required_flags: tuple[str, ...] = (), disable_env: str | None = None) -> None:
        self.source = source
        self.functions = functions
        self.fallback = fallback
        self.required_flags = required_flags
        self.disable_env = disable_env
        self._library: ctypes.PyDLL | None | bool = None if _eager else False  # False: not tried yet
        self._loading = threading.Lock()
        LIBRARIES.append(self)

    def load(self) -> ctypes.PyDLL | None:
        if self._library is False:  # the lock only until the first answer: a decode step asks thousands of times
            with self._loading:
                if self._library is False:
                    self._library = self._build_and_load()
        return self._library

    def available(self) -> bool:
        """Whether the library is loaded (building it on first use)."""
        return self.load() is not None

    def _build_and_load(self) -> ctypes.PyDLL | None:
        flags = cpu_flags()
        if (os.environ.get(DISABLE_ALL_ENV) == "1" or (self.disable_env and os.environ.get(self.disable_env) == "1")
                or not all(f in flags for f in self.required_flags)):
            return None
        try:
            # the headers beside it too: a changed header builds anew
            source = b"\0".join(path.read_bytes() for path in [self.source, *sorted(self.source.parent.glob("*.h"))])
            compiler = subprocess.run(["gcc", "-dumpfullversion"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None  # no source in this install, or no gcc
        key = hashlib.sha256(b"\0".join([source, " ".join(COMMAND).encode(), compiler.encode(),
                                         " ".join(sorted(flags)).encode()])).hexdigest()[:16]
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hisparse"
        failure = None
        for folder in (self.source.parent / "__pycache__", cache):  # the second where the first is read-only
            path = folder / f"{self.source.stem}-{key}.so"
            try:
                if not path.exists():
                    folder.mkdir(parents=True, exist_ok=True)
                    handle, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
                    os.close(handle)
                    try:
                        subprocess.run([*COMMAND, "-o", partial, str(self.source)], check=True, capture_output=True,
                                       text=True, timeout=120)
                        os.replace(partial, path)  # whole files only: another process may be building it too
                    finally:
                        if os.path.exists(partial):
                            os.remove(partial)
                library = ctypes.PyDLL(str(path))
            except subprocess.CalledProcessError as error:
                failure = error.stderr.strip()
                break  # the same source fails in any folder
            except (OSError, subprocess.SubprocessError) as error:
                failure = str(error)
                continue
            for name, (result, arguments) in self.functions.items():
                function = getattr(library, name)
                function.restype, function.argtypes = result, arguments
            return library
        warnings.warn(f"{self.source.name} could not be built or loaded, so {self.fallback}: {failure}",
                      RuntimeWarning, stacklevel=4)
        return None
