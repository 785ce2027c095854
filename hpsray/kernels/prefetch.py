"""Cache prefetch hints for numba kernels (LLVM's ``prefetch``), so that the cache misses of a
loop's coming iterations overlap instead of stalling one at a time.

:func:`prefetch` hints a read of ``arr[i]`` (a 1-d array); :func:`prefetch_write` hints a write
to the byte at address ``addr`` (fetched for ownership, so the store that follows does not wait).
Both are hints only: no effect on results, none on an address outside any mapping.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["prefetch", "prefetch_write"]


def _call_prefetch(builder: Any, ptr: Any, write: int) -> None:
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8"
    )
    # rw, locality 3 (keep in all levels), data cache
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, write), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _prefetch_intrinsic(typingctx, arr, i):
    sig = types.void(arr, i)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        _call_prefetch(builder, ptr, 0)
        return context.get_dummy_value()

    return sig, codegen


def _prefetch_write_intrinsic(typingctx, addr):
    sig = types.void(addr)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        _call_prefetch(builder, ptr, 1)
        return context.get_dummy_value()

    return sig, codegen


prefetch: Any = intrinsic(_prefetch_intrinsic)
"""``prefetch(arr, i)``: hint that ``arr[i]`` will be read."""
prefetch_write: Any = intrinsic(_prefetch_write_intrinsic)
"""``prefetch_write(addr)``: hint that the byte at integer address ``addr`` will be written."""
