"""Compiling and launching Numba CUDA kernels with little host overhead.

A Numba launch costs ~35-50 us of Python per call (argument typing, ctypes
conversion, and a stream sync for every CuPy argument).  On a real GPU a
``Kernel`` is compiled once by Numba to PTX for its one signature, loaded as a
CuPy module and launched through CuPy, with the arguments flattened the way
Numba's ABI lays them out (an array is meminfo, parent, size, itemsize, data,
shape..., strides...).  The simulator launches through Numba as usual.

Compilation waits for the first launch, so importing needs no GPU; ``KERNELS``
lists every (python function, signature) so tests can compile them to PTX.
"""
import os
import re

import numpy as np
from numba import cuda, types
from numba.core import sigutils

from ._backend import SIM, as_numba

KERNELS = {}
launches = 0  # kernels launched so far (the benchmark reports launches per step)
# NUMBASPLAT_LAUNCH=numba launches through Numba's own dispatcher (slower; for comparison),
# NUMBASPLAT_SYNC_CHECK=1 synchronises after every launch so a fault names its kernel.
VIA_NUMBA = os.environ.get("NUMBASPLAT_LAUNCH", "cupy") == "numba"
SYNC_CHECK = os.environ.get("NUMBASPLAT_SYNC_CHECK", "0") == "1"


def _array_params(a, _cache={}):
    key = (a.data.ptr, a.shape, a.strides, a.dtype.itemsize)
    p = _cache.get(key)
    if p is None:
        if len(_cache) > 4096:
            _cache.clear()
        p = tuple(np.uint64(x) for x in (0, 0, a.size, a.dtype.itemsize, a.data.ptr, *a.shape, *a.strides))
        _cache[key] = p
    return p


def _scalar(ty):
    if ty == types.boolean:
        return np.bool_
    if ty == types.float32:
        return np.float32
    if ty == types.float64:
        return np.float64
    if isinstance(ty, types.Integer):
        return np.dtype(str(ty)).type
    raise TypeError(f"unsupported kernel argument type {ty}")


class Kernel:
    """A kernel compiled for exactly one signature, launched as ``k[grid, block](*args)``."""

    def __init__(self, fn, sig):
        self.fn = fn
        self.sig = sig
        self._launch = None
        KERNELS[f"{fn.__module__}.{fn.__name__}"] = (fn, sig)

    def _compile(self):
        if SIM or VIA_NUMBA:
            k = cuda.jit(self.fn) if SIM else cuda.jit(self.sig)(self.fn)
            return lambda grid, block, args, shared=0: k[grid, block, 0, shared](*(as_numba(a) for a in args))
        import cupy
        argtypes, _ = sigutils.normalize_signature(self.sig)
        cc = cupy.cuda.Device().compute_capability
        ptx, _ = cuda.compile_ptx(self.fn, self.sig, cc=(int(cc[:-1]), int(cc[-1])))
        entry = re.search(r"\.entry\s+(\w+)\s*\(", ptx)
        n_params = len(re.findall(r"\.param\s", ptx[entry.end():ptx.index(")", entry.end())]))
        expected = sum(5 + 2 * t.ndim if isinstance(t, types.Array) else 1 for t in argtypes)
        if n_params != expected:
            raise RuntimeError(f"{self.fn.__name__}: PTX takes {n_params} parameters, expected {expected}; "
                               "this numba-cuda lays kernel arguments out differently")
        module = cupy.cuda.function.Module()
        module.load(ptx.encode())
        func = module.get_function(entry.group(1))
        casts = [None if isinstance(t, types.Array) else _scalar(t) for t in argtypes]

        def launch(grid, block, args, shared=0):
            if shared > 48 * 1024 and shared > func.max_dynamic_shared_size_bytes:
                func.max_dynamic_shared_size_bytes = shared  # opt in above the default 48 KB
            flat = []
            for cast, a in zip(casts, args):
                if cast is None:
                    flat.extend(_array_params(a))
                else:
                    flat.append(cast(a))
            func(grid, block, tuple(flat), shared_mem=shared)
            if SYNC_CHECK:
                try:
                    cupy.cuda.runtime.deviceSynchronize()
                except Exception as e:
                    raise RuntimeError(f"kernel {self.fn.__name__} failed: {e}") from e

        launch.module = module  # keep the module loaded
        launch.static_shared_bytes = func.shared_size_bytes
        return launch

    def static_shared_bytes(self):
        """Shared memory the kernel declares statically (its fixed layout), 0 in the simulator."""
        if self._launch is None:
            self._launch = self._compile()
        return getattr(self._launch, "static_shared_bytes", 0)

    def __getitem__(self, config):
        """``k[grid, block]`` or ``k[grid, block, dynamic_shared_bytes]``."""
        if self._launch is None:
            self._launch = self._compile()
        grid, block, shared = config if len(config) == 3 else (*config, 0)
        grid = grid if isinstance(grid, tuple) else (grid,)
        block = block if isinstance(block, tuple) else (block,)
        global launches
        launches += 1
        launch = self._launch
        return lambda *args: launch(grid, block, args, shared)


def kernel(*argtypes):
    """Decorator: ``@kernel("float32[::1]", "int64", ...)`` for a void CUDA kernel."""
    return lambda fn: Kernel(fn, "void(" + ", ".join(argtypes) + ")")
