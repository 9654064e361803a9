"""Work shares claimed at run time, for numba parallel loops whose threads may start late.

Numba cuts a `prange` into one equal share per thread before the loop starts. On our 2 cores the
second thread of a loop that follows a torch op or a pause (every layer's swap-in does) often wakes
tens of microseconds after the first, and a fixed half leaves the first thread idle at the end while the
late one finishes. A loop of one iteration per thread whose threads claim chunks from a shared counter
(`claim`, an atomic fetch-and-add) lets whoever runs take the next chunk. Measured on a gather of 16k
random 768-byte rows in chunks of 256, each call after a torch op and a 2 ms pause: 1808 against 1898 us
and 3449 against 3842 us (two runs, calls alternating).

Numba's disk cache checks the source file of each cached function, not this one: after editing this
file, delete the kernels' `__pycache__` so that their compiled code picks the change up.
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def claim(typingctx, counters, index):
    """Atomically `counters[index] += 1` (a 1-D int64 array) and return the value before: the next
    unclaimed chunk. Monotonic ordering: the counter orders nothing else, the loop's end is the barrier."""
    if not (isinstance(counters, types.Array) and counters.ndim == 1 and counters.dtype == types.int64
            and isinstance(index, types.Integer)):
        return None
    sig = types.int64(counters, index)

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        data = context.make_array(array_type)(context, builder, args[0])
        position = context.cast(builder, args[1], signature.args[1], types.intp)
        pointer = cgutils.get_item_pointer(context, builder, array_type, data, [position])
        return builder.atomic_rmw("add", pointer, context.get_constant(types.int64, 1), "monotonic")

    return sig, codegen
