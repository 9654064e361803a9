"""A software prefetch for numba code: ask for a cache line before the loop that reads it gets there.

The swap-in's copy reads scattered rows of a few hundred bytes from a host pool far larger than the
caches. Each row is a handful of cache lines the hardware prefetcher cannot guess (it learns a stream
only after several misses, and a row ends first), so a plain copy loop has about one row in flight and
waits out the memory latency row after row. Prefetching the rows a few iterations ahead keeps several
in flight. Into L2 (`llvm.prefetch` locality 2, `prefetcht1` on x86): measured on our 2-core EPYC VM,
a gather of 16k random 768-byte rows from 1 GiB took 0.72x the time of the plain loop, against 0.82x
when prefetching into L1 (locality 3), whose few miss buffers the copy's own loads need.

Numba's disk cache checks the source file of each cached function, not this one: after editing this
file, delete the kernels' `__pycache__` so that their compiled code picks the change up.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

CACHE_LINE = 64  # bytes
_READ = 0
_L2 = 2  # llvm.prefetch locality: 3 keeps the line in every level, 2 from L2 out
_DATA = 1


@intrinsic
def prefetch_to_l2(typingctx, array, row, col):
    """Prefetch the cache line of `array[row, col]` (a 2-D array) for reading; no effect on results."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and isinstance(row, types.Integer)
            and isinstance(col, types.Integer)):
        return None
    sig = types.void(array, row, col)

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        data = context.make_array(array_type)(context, builder, args[0])
        index = [context.cast(builder, value, ty, types.intp)
                 for value, ty in zip(args[1:], signature.args[1:], strict=True)]
        pointer = cgutils.get_item_pointer(context, builder, array_type, data, index)
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]), "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(pointer, byte_pointer), ir.Constant(i32, _READ), ir.Constant(i32, _L2),
                          ir.Constant(i32, _DATA)])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def line_step(array):
    """Elements of a 2-D `array` per cache line: the stride of `prefetch_row_to_l2` (work it out once per
    loop, not per row)."""
    return max(CACHE_LINE // array.itemsize, 1)


@njit(cache=True)
def prefetch_row_to_l2(array, row, step):
    """Prefetch every cache line of `array[row]` (a 2-D array; `step` = `line_step(array)`): one per line
    from the row's start, and its last element, in case the row is not aligned to the lines."""
    words = array.shape[1]
    for w in range(0, words, step):
        prefetch_to_l2(array, row, w)
    prefetch_to_l2(array, row, words - 1)
