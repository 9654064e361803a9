"""Copies that stream past the caches, for numba code: whole 64-byte lines stored non-temporally.

A large swap-in writes its rows to scattered destination lines. An ordinary store first reads each line
into the cache (to own it) and later writes it back, so every copied byte crosses the memory bus three
times; a non-temporal store writes the line straight to memory, twice. That is how a large `memcpy`
moves memory (glibc switches to these stores past a size near the cache's), and so it is how the plain
copy the swap-in benchmark measures against moves it. Measured on our 2-core EPYC VM (an ad-hoc script,
medians of 15 gathers of 16k random 768-byte rows from a 1 GiB pool into a 25 MB one, five runs): 0.83-1.05x
the GB/s of a plain 256 MiB copy with these stores, against 0.47-0.58x with ordinary ones. The stores must
be whole aligned vectors: numba's scalar loop marked non-temporal became 8-byte `movnti` stores, no faster.

The lines written this way leave the caches, so a copy whose rows are read right after and would have
stayed cached (a small swap-in, read by the same layer's attention) should keep ordinary stores.

Non-temporal stores are weakly ordered: `store_fence` makes them visible before anything after it, and a
copy must end with one before another thread reads its rows.

Numba's disk cache checks the source file of each cached function, not this one: after editing this
file, delete the kernels' `__pycache__` so that their compiled code picks the change up.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

LINE_BYTES = 64
_X86 = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def _copy_line_past_caches(typingctx, dst, dst_row, src, src_row, col):
    """The 64 bytes from src[src_row, col] to dst[dst_row, col] (2-D arrays of one element type), stored
    non-temporally. The destination must be 64-byte aligned there (see `rows_can_stream`); the source needs
    no alignment."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.ndim == 2 and src.ndim == 2
            and dst.dtype == src.dtype):
        return None
    sig = types.void(dst, dst_row, src, src_row, col)

    def codegen(context, builder, signature, args):
        dst_type, dst_row_type, src_type, src_row_type, col_type = signature.args

        def pointer(array_type, array, row, row_type):
            data = context.make_array(array_type)(context, builder, array)
            index = [context.cast(builder, row, row_type, types.intp),
                     context.cast(builder, args[4], col_type, types.intp)]
            return cgutils.get_item_pointer(context, builder, array_type, data, index)

        line = ir.VectorType(ir.IntType(64), LINE_BYTES // 8).as_pointer()
        value = builder.load(builder.bitcast(pointer(src_type, args[2], args[3], src_row_type), line), align=8)
        store = builder.store(value, builder.bitcast(pointer(dst_type, args[0], args[1], dst_row_type), line),
                              align=LINE_BYTES)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_fence(typingctx):
    """Order the non-temporal stores before it ahead of every store after it (x86 `sfence`; elsewhere a
    full fence)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse.sfence")
            builder.call(fn, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def copy_row_past_caches(dst, dst_row, src, src_row):
    """One row, line by line, stored non-temporally (rows of whole lines: see `rows_can_stream`)."""
    for col in range(0, src.shape[1], max(LINE_BYTES // src.itemsize, 1)):
        _copy_line_past_caches(dst, dst_row, src, src_row, col)


def rows_can_stream(src: np.ndarray, dst: np.ndarray) -> bool:
    """Whether `copy_row_past_caches` may copy rows of `src` into rows of `dst`: 2-D arrays of one element
    type, of contiguous rows of the same whole number of lines, every destination row aligned to a line (an
    unaligned non-temporal vector store faults)."""
    if src.ndim != 2 or dst.ndim != 2 or src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        return False
    row_bytes = src.shape[1] * src.itemsize
    return (row_bytes % LINE_BYTES == 0 and src.flags.c_contiguous and dst.flags.c_contiguous
            and dst.ctypes.data % LINE_BYTES == 0)
