"""One OpenMP runtime for torch and numba, when hisparse is imported before torch.

Torch runs its CPU ops on OpenMP: libtorch asks for `libgomp.so.1`, which its wheel bundles. Numba's "omp"
threading layer asks for the system's `libgomp.so.1.0.0` by file name. The binding is one-sided: a system
libgomp already in the process carries the SONAME `libgomp.so.1` and satisfies torch's request, while torch's
copy never satisfies numba's. So loading numba's layer first leaves one runtime, and numba's parallel loops run
on torch's own thread team: no second pool of busy-waiting workers fighting it for the cores, and a parallel
region costs a wake-up of spinning threads instead of a hand-off to another pool. Torch first, two runtimes
sit in the process, and numba's omp layer would make both spin against each other; `choose_threading_layer`
then keeps numba on TBB.

Two settings of numba's omp start are process-wide and have to be put back:
- it enables nested parallelism (`omp_set_nested(1)`, 255 active levels). Torch's ops call MKL inside their own
  parallel regions (the flash-attention kernel of a prefill does, once per block), and with nesting on, every
  such call starts a nested team with fresh threads on cores that are already busy: in the server a
  1536-token prompt's first token came after 12 s instead of 2.7 s once a decode had run numba's loops
  (an ad-hoc probe, py-spy showing GOMP barrier waits and pthread_create inside cpu_flash_attention);
- it sets the team size to numba's thread count (all CPUs), overriding torch's (OMP_NUM_THREADS or the
  physical cores). Numba is started with torch's count instead, so that both use teams of one size: libgomp
  ends surplus threads when a team shrinks and creates them again when it grows.

Numba's omp layer cannot survive a fork: a forked child that runs a parallel loop is terminated. Nothing in
hisparse forks; a program that does should use the spawn start method or set NUMBA_THREADING_LAYER=tbb.
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
    """Start numba's omp layer now, on torch's team size, then put back the settings its start changes (see
    the module docstring). Numba starts its layer at the first parallel loop, and that start is what changes
    them, so it is made here, once, before any loop runs."""
    import torch
    from numba.np.ufunc import parallel

    threads = torch.get_num_threads()
    if "NUMBA_NUM_THREADS" not in os.environ:
        # numba's own count, read at its import, is what its start passes to omp_set_num_threads
        parallel.NUM_THREADS = min(threads, parallel.NUM_THREADS)
    parallel._launch_threads()  # numba's own lazy start, made eagerly; idempotent
    gomp = ctypes.CDLL("libgomp.so.1")
    gomp.omp_set_num_threads(threads)
    gomp.omp_set_max_active_levels(1)
