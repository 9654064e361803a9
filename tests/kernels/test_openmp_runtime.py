"""numba's parallel loops share torch's OpenMP team only when hisparse loads the runtime first, and then torch's
settings stay torch's: nested parallelism off and its own thread count.

Each case runs in a fresh interpreter: which libgomp a process binds to is decided once, at its first import
of either library, so it cannot be tested in the pytest process (which has imported both long ago).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, sys
{first}
import torch
import numba
from hisparse.kernels.numba_threads import choose_threading_layer
from hisparse.kernels.openmp_runtime import loaded_openmp_runtimes
layer = choose_threading_layer()

@numba.njit(parallel=True, cache=False)
def total(x):
    s = 0.0
    for i in numba.prange(x.shape[0]):
        s += x[i]
    return s

import numpy as np
assert total(np.ones(4096)) == 4096.0
levels = None
if layer == "omp":
    import ctypes
    levels = ctypes.CDLL("libgomp.so.1").omp_get_max_active_levels()
# torch's own parallel op after numba's loop: still right
x = torch.randn(256, 256)
assert torch.allclose(x @ torch.eye(256), x)
print(json.dumps({{"layer": numba.threading_layer(), "runtimes": loaded_openmp_runtimes(), "levels": levels,
                  "torch_threads": torch.get_num_threads(), "numba_threads": numba.get_num_threads()}}))
"""


def environ(**env: str) -> dict[str, str]:
    """This process's environment without a threading layer of its own, plus `env`."""
    return {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"} | env


def probe(first: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env=environ(**env), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def omp_layer_loads() -> None:
    done = subprocess.run([sys.executable, "-c", "import numba.np.ufunc.omppool"], env=environ(),
                          capture_output=True, timeout=120)
    if done.returncode != 0:
        pytest.skip("numba's omp layer cannot load here (no system libgomp)")


def test_hisparse_first_puts_numba_on_torchs_one_runtime_with_nesting_off(omp_layer_loads):
    seen = probe("import hisparse")
    assert seen["layer"] == "omp"
    assert len(seen["runtimes"]) == 1, seen["runtimes"]
    assert seen["levels"] == 1  # why: openmp_runtime's docstring


def test_torch_keeps_its_thread_count_and_numba_takes_the_same(omp_layer_loads):
    seen = probe("import hisparse", OMP_NUM_THREADS="1")
    assert seen["layer"] == "omp"
    assert seen["torch_threads"] == seen["numba_threads"] == 1


def test_torch_first_keeps_numba_off_a_second_openmp_runtime():
    seen = probe("")  # torch is imported before hisparse
    assert seen["layer"] != "omp"


def test_a_users_threading_layer_wins():
    seen = probe("import hisparse", NUMBA_THREADING_LAYER="workqueue")
    assert seen["layer"] == "workqueue"
