"""The decorator for math that both backends share.

A ``@numba.njit(inline="always")`` function can be called from CPU ``njit``
kernels and from ``@cuda.jit`` kernels alike, so the projection and SH math is
written once.  Such functions take and return scalars and tuples only: under the
CUDA simulator kernel arguments are fake arrays that ``njit`` cannot type.
"""
import numba

shared = numba.njit(inline="always", cache=False, fastmath=False)
