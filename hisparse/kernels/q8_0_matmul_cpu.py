"""Small-batch matmuls over Q8_0 weights with AVX-512 VNNI int8 dot products (llama.cpp's scheme).

Q8_0 is llama.cpp's 8-bit format: blocks of 32 inputs, one scale each; the default model's GGUF stores its
LM head (the tied embedding) so. A batch-1 decode step reads the head's 49152 x 576 weights once, and PyTorch's
int8 kernel (one scale per row) widens every byte to a float lane on the way. `q8_0_matmul_cpu.c` keeps the
weights as bytes: x is rounded to int8 per block (one scale per block) and one vpdpbusd multiplies 64 weights
by 64 inputs. In the engine's step the head took 1.44 ms against 1.96 for the int8 kernel; alone with the
caches flushed, 1.2 / 1.6 / 1.5 / 1.7 ms at batch 1 / 2 / 3 / 4 against 2.2-2.6 for the prepacked bfloat16
head. The cost is that rounding of the activations (the weights are the blocks themselves), which llama.cpp
pays too.

The C file is compiled once per machine with the system's gcc (`-O3 -march=native -fopenmp`, about a second)
into the package's `__pycache__` (or ~/.cache/hisparse when that is read-only), keyed by the source, the
command, gcc's version and the CPU's flags. Its OpenMP loop runs on the process's one libgomp: torch's team
(`numba_threads`). Without gcc, on a CPU without AVX-512 VNNI, or with HISPARSE_DISABLE_VNNI=1, `available()`
is False and callers keep PyTorch's kernels (a build that fails says so in a warning with gcc's message).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_suffix(".c")
BLOCK = 32  # inputs per block
MAX_BATCH = 4  # the C file's: from batch 5 the dense bfloat16 head is faster (2.4 against 2.5 ms at 6)
_REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
_COMMAND = ("gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_library: ctypes.PyDLL | None | bool = False  # False: not tried yet
_loading = threading.Lock()


@dataclass(frozen=True)
class Q8_0Weight:
    """q int8 [N, K / 32, 32] and scales [N, K / 32] float32: weight = q * scale. offsets = -128 scale sum(q) per
    block, the kernel's correction for reading x as unsigned bytes."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:  # the C kernel reads these as raw memory
        n, blocks, width = self.q.shape
        if (self.q.dtype != torch.int8 or width != BLOCK or n % 4 or not self.q.is_contiguous()
                or any(t.dtype != torch.float32 or t.shape != (n, blocks) or not t.is_contiguous()
                       for t in (self.scales, self.offsets))):
            raise ValueError(f"a Q8_0 weight is contiguous int8 q [N, K / {BLOCK}, {BLOCK}] with N a multiple of 4 "
                             f"and float32 scales and offsets [N, K / {BLOCK}]")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The weights [N, K] float32 these blocks hold."""
        return (self.q.float() * self.scales[..., None]).view(self.shape)


def quantize_q8_0(weight: torch.Tensor) -> Q8_0Weight:
    """llama.cpp's Q8_0 quantizer: per block of 32 inputs the largest magnitude maps to 127. A float32 weight
    dequantized from a GGUF file's Q8_0 tensor comes back as its own blocks (a bfloat16 one near them: q * scale
    needs up to 18 bits)."""
    if not fits(weight):
        raise ValueError(f"a Q8_0 weight needs a multiple of 4 rows and of {BLOCK} columns, got {tuple(weight.shape)}")
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127
    q = torch.round(blocks / torch.where(scales > 0, scales, 1.0)[..., None]).clamp_(-127, 127).to(torch.int8)
    offsets = -128 * scales * q.sum(dim=-1, dtype=torch.int32).float()
    return Q8_0Weight(q.contiguous(), scales.contiguous(), offsets.contiguous())


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes a weight of this shape: whole blocks of inputs, rows in fours."""
    out, width = weight.shape
    return out % 4 == 0 and width % BLOCK == 0


def available() -> bool:
    """Whether the compiled kernel is loaded (compiling it on first use)."""
    return _load() is not None


def q8_0_matmul(x: torch.Tensor, weight: Q8_0Weight) -> torch.Tensor:
    """x [B, K] (float32 or bfloat16, B <= MAX_BATCH) @ weight.T -> [B, N] in x's dtype, x rounded per block. No
    rows (a step of prompt chunks that samples nothing) give no rows."""
    library = _load()
    if library is None:
        raise RuntimeError("the Q8_0 kernel is not available on this machine (see q8_0_matmul_cpu.available)")
    n, k = weight.shape
    if (x.dim() != 2 or x.shape[1] != k or x.shape[0] > MAX_BATCH
            or x.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"x must be [0..{MAX_BATCH}, {k}] float32 or bfloat16, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    if library.q8_0_matmul(x.data_ptr(), x.shape[0], k, weight.q.data_ptr(), weight.scales.data_ptr(),
                           weight.offsets.data_ptr(), n, out.data_ptr(), x.dtype == torch.bfloat16):
        raise MemoryError("the Q8_0 kernel could not allocate its rounded copy of x")
    return out


def q8_0_matmul_reference(x: torch.Tensor, weight: Q8_0Weight) -> torch.Tensor:
    """What the kernel computes, in plain PyTorch: x rounded per block to int8 as the kernel rounds it (in float32,
    times 127 / max |x|), then the products in float64."""
    n, k = weight.shape
    blocks = x.float().reshape(x.shape[0], k // BLOCK, BLOCK)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    q = torch.round(blocks * torch.where(top > 0, 127 / top, 0.0))
    rounded = (q.double() * (top / 127).double()).view(x.shape[0], k)
    return (rounded @ weight.dequantize().double().t()).to(x.dtype)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _load() -> ctypes.PyDLL | None:
    global _library
    with _loading:  # one build per process, whichever thread asks first
        if _library is False:
            _library = _build_and_load()
    return _library


def _build_and_load() -> ctypes.PyDLL | None:
    """The compiled kernel, built first where no build of this source, command and CPU is found; None (with a
    warning carrying gcc's message when it failed) where it cannot be."""
    flags = _cpu_flags()
    if os.environ.get("HISPARSE_DISABLE_VNNI") == "1" or not all(f in flags for f in _REQUIRED_FLAGS):
        return None
    try:
        source = SOURCE.read_bytes()
        compiler = subprocess.run(["gcc", "-dumpfullversion"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None  # no source in this install, or no gcc
    key = hashlib.sha256(b"\0".join([source, " ".join(_COMMAND).encode(), compiler.encode(),
                                     " ".join(sorted(flags)).encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hisparse"
    failure = None
    for folder in (SOURCE.parent / "__pycache__", cache):  # the second where the package's folder is read-only
        path = folder / f"{SOURCE.stem}-{key}.so"
        try:
            if not path.exists():
                folder.mkdir(parents=True, exist_ok=True)
                handle, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
                os.close(handle)
                try:
                    subprocess.run([*_COMMAND, "-o", partial, str(SOURCE)], check=True, capture_output=True,
                                   text=True, timeout=120)
                    os.replace(partial, path)  # whole files only: another process may be building it too
                finally:
                    if os.path.exists(partial):
                        os.remove(partial)
            # PyDLL keeps the GIL, as torch's and numba's kernels do: released, another thread could run torch
            # ops on a second OpenMP team meanwhile
            library = ctypes.PyDLL(str(path))
        except subprocess.CalledProcessError as error:
            failure = error.stderr.strip()
            break  # the same source fails in any folder
        except (OSError, subprocess.SubprocessError) as error:
            failure = str(error)
            continue
        library.q8_0_matmul.restype = ctypes.c_int
        library.q8_0_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_int]
        return library
    warnings.warn(f"the Q8_0 kernel could not be built or loaded, so the LM head reads per-row int8: {failure}",
                  RuntimeWarning, stacklevel=3)
    return None
