"""One OpenMP runtime for torch and numba, when hisparse is imported before torch.

Torch runs its CPU ops on OpenMP (its wheel bundles `torch/lib/libgomp.so.1`); numba's "omp" threading layer
links the system's `libgomp.so.1` by file name. Both libraries have the same SONAME, so whichever the process
loads first is the one both bind to, and numba's parallel loops then run on torch's own thread team: no
second pool of busy-waiting workers fighting it for the cores, and a parallel region costs a wake-up of
spinning threads instead of a hand-off to another pool. Loaded the other way round (torch first), two runtimes
sit in the process, and numba's omp layer would make both spin against each other; `choose_threading_layer`
then keeps numba on TBB.

One setting of numba's omp layer has to be undone: starting its threads, it enables nested parallelism
(`omp_set_nested(1)`, 255 active levels), a process-wide setting. Torch's ops call MKL inside their own
parallel regions (the flash-attention kernel of a prefill does, once per block), and with nesting on, every such
call starts a nested team with fresh threads on cores that are already busy: a 1536-token prefill took 2.1 s
instead of 0.7 s (offline, after one decode with swap-in had run numba's loops).
"""

from __future__ import annotations

import ctypes
import os
import sys

_shared = False


def share_torch_openmp() -> bool:
    """Load numba's omp layer (and with it the system libgomp) before torch; True if torch will use it.

    Does nothing when torch is already imported, or when the user chose numba's layer themselves."""
    global _shared
    if _shared:
        return True
    if "torch" in sys.modules or "NUMBA_THREADING_LAYER" in os.environ:
        return False
    try:
        import numba.np.ufunc.omppool  # noqa: F401  (loads libgomp.so.1 into the process)
    except ImportError:  # no system libgomp: numba's omp layer cannot load, torch keeps its own
        return False
    _shared = True
    return True


def loaded_openmp_runtimes() -> list[str]:
    """Paths of the libgomp files mapped into this process (Linux); more than one means two thread teams."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return []
    return sorted(paths)


def openmp_is_shared() -> bool:
    """Whether numba's parallel loops can run on torch's OpenMP team: hisparse loaded the runtime before torch
    and the process maps exactly one libgomp."""
    return _shared and len(loaded_openmp_runtimes()) == 1


def start_shared_team() -> None:
    """Start numba's omp layer now, then turn nested parallelism back off (see the module docstring).

    Numba starts its layer at the first parallel loop, and that start is what enables nesting, so it is made
    here, once, before any loop runs."""
    from numba.np.ufunc import parallel

    parallel._launch_threads()  # numba's own lazy start, made eagerly; idempotent
    ctypes.CDLL("libgomp.so.1").omp_set_max_active_levels(1)
