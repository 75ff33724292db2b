"""Compiling and launching Numba CUDA kernels with little host overhead.

A Numba launch spends much of a small kernel's time in Python (argument typing,
ctypes conversion, and a stream sync for every CuPy argument).  On a real GPU a
``Kernel`` is compiled once by Numba to PTX for its one signature, loaded as a
CuPy module and launched with ``cuLaunchKernel``, its arguments flattened the way
Numba's ABI lays them out (an array is meminfo, parent, size, itemsize, data,
shape..., strides...) and packed into one buffer at the offsets the PTX declares
(``param_layout``): one ``struct`` call, where CuPy's launch wraps each of a
kernel's hundred-odd scalars in an object.  The simulator launches through Numba
as usual.

Compilation waits for the first launch, so importing needs no GPU; ``KERNELS``
lists every (python function, signature) so tests can compile them to PTX.
The PTX is cached on disk (``NUMBASPLAT_CACHE``, default ~/.cache/numbasplat),
keyed by the source of the whole numbasplat package (every file a kernel
compiles from: the math lives in ``numbasplat.math``) and of the kernel's
module, the kernel, the GPU architecture and the Numba version, so only the
first run after a change pays the compilation.

Also here, for every CUDA kernel module: the signature type strings (``F1``...),
``array_module`` (where the kernels' arrays live) and ``as_numba``.
"""
import ctypes
import hashlib
import os
import re
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
from numba import cuda, types
from numba.core import sigutils

from ..math.jit import SIM, package_digest

F1 = "float32[::1]"
F2 = "float32[:, ::1]"
F3 = "float32[:, :, ::1]"
F4 = "float32[:, :, :, ::1]"
I1 = "int32[::1]"
I2 = "int32[:, ::1]"
U1 = "uint32[::1]"
L1 = "int64[::1]"
L2 = "int64[:, ::1]"

THREADS = 256  # threads per block of the kernels that run a thread per item (Gaussian, element)

KERNELS = {}
launches = 0  # kernels launched so far (the benchmark reports launches per step)
# NUMBASPLAT_LAUNCH=numba launches through Numba's own dispatcher (slower; for comparison),
# NUMBASPLAT_SYNC_CHECK=1 synchronises after every launch so a fault names its kernel.
VIA_NUMBA = os.environ.get("NUMBASPLAT_LAUNCH", "cupy") == "numba"
SYNC_CHECK = os.environ.get("NUMBASPLAT_SYNC_CHECK", "0") == "1"


def array_module():
    """CuPy on a GPU; numpy under the simulator, whose kernels take numpy arrays."""
    if SIM:
        return np
    import cupy
    return cupy


def per_item(n):
    """The (blocks, threads) of a launch that runs a thread per item, for ``n`` items."""
    return (n + THREADS - 1) // THREADS, THREADS


_views = {}


def as_numba(a):
    """A Numba device-array view of a CuPy array, for kernel launches.

    Numba's own conversion synchronises the stream for every array argument;
    this view has no owner and no sync (CuPy and Numba both use the legacy
    default stream) and is cached by (pointer, shape, strides, dtype), which
    CuPy's memory pool makes repeat from step to step.  Numpy arrays (the
    simulator) pass through.
    """
    if SIM or not type(a).__module__.startswith("cupy"):
        return a
    key = (a.data.ptr, a.shape, a.strides, a.dtype.char)
    v = _views.get(key)
    if v is None:
        from numba.cuda.cudadrv import devicearray, driver
        from numba.cuda import current_context
        if len(_views) > 4096:
            _views.clear()
        mem = driver.MemoryPointer(current_context(), driver.binding.CUdeviceptr(a.data.ptr), size=a.nbytes)
        v = devicearray.DeviceNDArray(a.shape, a.strides, a.dtype, gpu_data=mem, stream=0)
        _views[key] = v
    return v


def _array_params(a, _cache={}):
    key = (a.data.ptr, a.shape, a.strides, a.dtype.itemsize)
    p = _cache.get(key)
    if p is None:
        if len(_cache) > 4096:
            _cache.clear()
        p = (0, 0, a.size, a.dtype.itemsize, a.data.ptr, *a.shape, *a.strides)
        _cache[key] = p
    return p


_PARAM_FORMATS = {("f", 4): "f", ("f", 8): "d", ("s", 1): "b", ("s", 2): "h", ("s", 4): "i", ("s", 8): "q",
                  **{(k, n): c for k in "ub" for n, c in ((1, "B"), (2, "H"), (4, "I"), (8, "q"))}}


def param_layout(ptx):
    """The entry's parameters as one packed buffer (a ``struct.Struct``), each scalar at its own
    alignment, the layout ``cuLaunchKernel`` reads from ``CU_LAUNCH_PARAM_BUFFER_POINTER``.  64-bit
    integers pack signed (pointers and sizes fit; strides may be negative)."""
    entry = re.search(r"\.entry\s+\w+\s*\(", ptx)
    params = ptx[entry.end():ptx.index(")", entry.end())]
    fmt, offset = "<", 0
    for decl in re.findall(r"\.param\s+[^,]*", params):
        m = re.fullmatch(r"\.param\s+\.([fsub])(8|16|32|64)\s+(?:\.ptr\s+(?:\.\w+\s+)?(?:\.align\s+\d+\s+)?)?\S+\s*",
                         decl)  # (a pointer's state space and alignment, where a compiler writes them)
        if m is None:
            raise RuntimeError(f"kernel parameter {decl.strip()!r}: not a scalar of a known type")
        size = int(m.group(2)) // 8
        pad = -offset % size
        fmt += "x" * pad + _PARAM_FORMATS[m.group(1), size]
        offset += pad + size
    return struct.Struct(fmt)


_LAUNCH_PARAM_END, _LAUNCH_PARAM_BUFFER_POINTER, _LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2  # cuda.h's markers


def _scalar(ty):
    if ty == types.boolean:
        return int
    if ty == types.float32:
        return np.float32
    if ty == types.float64:
        return np.float64
    if isinstance(ty, types.Integer):
        return np.dtype(str(ty)).type
    raise TypeError(f"unsupported kernel argument type {ty}")


class Kernel:
    """A kernel compiled for exactly one signature, launched as ``k[grid, block](*args)``."""

    def __init__(self, fn, sig, fastmath=False, max_registers=None):
        self.fn = fn
        self.sig = sig
        self.fastmath = fastmath
        self.max_registers = max_registers
        self._launches = {}  # GPU id -> its launch (a module is loaded into one device's context)
        KERNELS[f"{fn.__module__}.{fn.__name__}"] = (fn, sig)

    def _compile(self):
        if SIM or VIA_NUMBA:
            k = cuda.jit(self.fn) if SIM else cuda.jit(self.sig, fastmath=self.fastmath,
                                                        max_registers=self.max_registers)(self.fn)
            return lambda grid, block, args, shared=0: k[grid, block, 0, shared](*(as_numba(a) for a in args))
        import cupy
        argtypes, _ = sigutils.normalize_signature(self.sig)
        cc = cupy.cuda.Device().compute_capability
        ptx = _cached_ptx(self.fn, self.sig, (int(cc[:-1]), int(cc[-1])), self.fastmath)
        entry = re.search(r"\.entry\s+(\w+)\s*\(", ptx)
        n_params = len(re.findall(r"\.param\s", ptx[entry.end():ptx.index(")", entry.end())]))
        ptx = with_max_registers(ptx, self.max_registers)
        expected = sum(5 + 2 * t.ndim if isinstance(t, types.Array) else 1 for t in argtypes)
        if n_params != expected:
            raise RuntimeError(f"{self.fn.__name__}: PTX takes {n_params} parameters, expected {expected}; "
                               "this numba-cuda lays kernel arguments out differently")
        layout = param_layout(ptx)
        module = cupy.cuda.function.Module()
        module.load(ptx.encode())
        func = module.get_function(entry.group(1))
        casts = [None if isinstance(t, types.Array) else _scalar(t) for t in argtypes]
        launch_kernel, current_stream = cupy.cuda.driver.launchKernel, cupy.cuda.get_current_stream
        opted = [0]

        def launch(grid, block, args, shared=0):
            if shared > opted[0]:  # the default limit is 48 KB less the static layout: opt in
                _set_max_dynamic_shared(func, shared)
                opted[0] = shared
            flat = []
            for cast, a in zip(casts, args):
                if cast is None:
                    flat.extend(_array_params(a))
                else:
                    flat.append(cast(a))
            # the buffer and its description live until the call returns: the driver copies them at launch
            buffer = ctypes.create_string_buffer(layout.pack(*flat), layout.size)
            size = ctypes.c_size_t(layout.size)
            extra = (ctypes.c_void_p * 5)(_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buffer),
                                          _LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size), _LAUNCH_PARAM_END)
            launch_kernel(func.ptr, *grid, *(1,) * (3 - len(grid)), *block, *(1,) * (3 - len(block)), shared,
                          current_stream().ptr, 0, ctypes.addressof(extra))
            if SYNC_CHECK:
                try:
                    cupy.cuda.runtime.deviceSynchronize()
                except Exception as e:
                    raise RuntimeError(f"kernel {self.fn.__name__} failed: {e}") from e

        launch.module, launch.func = module, func  # keep the module loaded
        launch.static_shared_bytes = lambda: _static_shared_bytes(func)
        return launch

    def static_shared_bytes(self):
        """Shared memory the kernel declares statically (its fixed layout), 0 in the simulator."""
        static = getattr(self._here(), "static_shared_bytes", None)
        return static() if static else 0

    def _here(self):
        """The launch on the current GPU, compiled (loaded) there on its first: the aggregate device
        (``numbasplat.placement``) launches each kernel on several GPUs of one process."""
        device = 0 if SIM or VIA_NUMBA else _current_device()
        launch = self._launches.get(device)
        if launch is None:
            launch = self._launches[device] = self._compile()
        return launch

    def __getitem__(self, config):
        """``k[grid, block]`` or ``k[grid, block, dynamic_shared_bytes]``."""
        launch = self._here()
        grid, block, shared = config if len(config) == 3 else (*config, 0)
        grid = grid if isinstance(grid, tuple) else (grid,)
        block = block if isinstance(block, tuple) else (block,)
        global launches
        launches += 1
        return lambda *args: launch(grid, block, args, shared)


def _current_device():
    import cupy
    return cupy.cuda.runtime.getDevice()


def with_max_registers(ptx, n):
    """The PTX with a per-thread register cap on its kernel (``.maxnreg``, a performance directive
    between the parameter list and the body); unchanged for ``n`` None."""
    if not n:
        return ptx
    entry = re.search(r"\.entry\s+\w+\s*\(", ptx)
    params_end = ptx.index(")", entry.end())
    return f"{ptx[:params_end + 1]}\n.maxnreg {int(n)}{ptx[params_end + 1:]}"


def _source_digest(fn, _package=[]):
    """Hash of every source file of the package and of the kernel's own module (a kernel may
    live outside the package): any edit invalidates the PTX cache."""
    if not _package:
        _package.append(package_digest())
    module = Path(sys.modules[fn.__module__].__file__)
    return hashlib.sha256((_package[0] + module.name).encode() + module.read_bytes()).hexdigest()


def _cached_ptx(fn, sig, cc, fastmath=False):
    """Numba's PTX for (fn, sig, cc), from the disk cache when it is there."""
    import numba
    import numba.cuda as nc
    key = "|".join((_source_digest(fn), fn.__module__, fn.__qualname__, sig, str(cc), str(fastmath), numba.__version__,
                    getattr(nc, "__version__", "")))
    cache = Path(os.environ.get("NUMBASPLAT_CACHE", Path.home() / ".cache" / "numbasplat"))
    path = cache / f"{fn.__name__}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.ptx"
    try:
        return path.read_text()
    except OSError:
        pass
    ptx, _ = cuda.compile_ptx(fn, sig, cc=cc, fastmath=fastmath)
    try:  # best effort, atomic: a read-only or full disk only costs the next run a compile
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(ptx)
        os.replace(tmp, path)
    except OSError:
        pass
    return ptx


# CUfunction_attribute values, through the driver: CuPy 14's Function has no properties for them
_SHARED_SIZE_BYTES, _MAX_DYNAMIC_SHARED_SIZE_BYTES = 1, 8


def _static_shared_bytes(func):
    from cupy.cuda import driver
    return driver.funcGetAttribute(_SHARED_SIZE_BYTES, func.ptr)


def _set_max_dynamic_shared(func, nbytes):
    from cupy.cuda import driver
    driver.funcSetAttribute(func.ptr, _MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)


def kernel(*argtypes, fastmath=False, max_registers=None):
    """Decorator: ``@kernel("float32[::1]", "int64", ...)`` for a void CUDA kernel
    (``fastmath``: approximate exp, division and square root, flushed denormals;
    ``max_registers``: a cap per thread, for more resident warps where latency dominates)."""
    return lambda fn: Kernel(fn, "void(" + ", ".join(argtypes) + ")", fastmath, max_registers)
