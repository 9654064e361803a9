"""Which thread pool numba's parallel loops run on: torch's own OpenMP team when hisparse could load the
runtime before torch (see openmp_runtime), else TBB when the `tbb` wheel is there, else workqueue.

Our parallel loops (the cpu swap-in, top-k, the decode attention) share the cores
with torch and, in the server, with the HTTP thread. On torch's own team a loop costs a wake-up of threads that
are still spinning from torch's last op. Numba's "omp" layer beside torch's bundled runtime (torch imported
first) would be a second team of spinning threads fighting the first for the cores. Of the others, "workqueue"
hands each worker a fixed share of a loop: on a busy machine the loop waits for a worker the OS has not
scheduled yet (measured on our 2 cores with one core busy, a batch-16 swap-in that takes 0.2 ms on TBB took
13.6 ms on workqueue); TBB steals work, so the threads that run finish the shares of those that do not.

The `tbb` wheel puts libtbb in the environment's `lib` folder, where numba's loader does not look, so
we load it first. A user's NUMBA_THREADING_LAYER always wins.
"""

from __future__ import annotations

import ctypes
import os
from importlib import metadata

import numba

from hisparse.kernels.openmp_runtime import openmp_is_shared, start_shared_team

TBB_LIBRARY = "libtbb.so.12"


def _load_tbb() -> bool:
    try:
        files = metadata.files("tbb") or []
    except metadata.PackageNotFoundError:
        return False
    for file in files:
        if file.name == TBB_LIBRARY:
            try:
                ctypes.CDLL(str(file.locate()), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                return False
            return True
    return False


_chosen: str | None = None
_on_torch_team = False


def choose_threading_layer() -> str:
    """Set numba's threading layer (before its first parallel loop) and return it; a user who chose tbb gets the
    wheel's library loaded too (numba would not find it and fail at the first parallel loop). On torch's team
    it also starts the layer (openmp_runtime.start_shared_team). Decided once per process: every kernel module
    calls this at import, and a later call must not see another package's libgomp and pick again."""
    global _chosen, _on_torch_team
    if _chosen is not None:
        return _chosen
    chosen = os.environ.get("NUMBA_THREADING_LAYER")
    if chosen is None:
        if openmp_is_shared():
            numba.config.THREADING_LAYER = "omp"
            start_shared_team()
            _on_torch_team = True
        else:
            numba.config.THREADING_LAYER = "tbb" if _load_tbb() else "workqueue"
    elif chosen == "tbb":
        _load_tbb()
    _chosen = numba.config.THREADING_LAYER
    return _chosen


def on_torch_team() -> bool:
    """Whether numba's parallel loops run on torch's own OpenMP team: a parallel region is cheaper there than on
    TBB, so the kernels' thresholds for going parallel differ."""
    choose_threading_layer()
    return _on_torch_team
