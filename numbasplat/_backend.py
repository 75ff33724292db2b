"""Backend selection: which kernels run and which array module holds device data.

``NUMBASPLAT_BACKEND=cpu|cuda`` overrides the automatic choice (CUDA when a GPU
or the CUDA simulator is available, else CPU).  Under ``NUMBA_ENABLE_CUDASIM=1``
the CUDA kernels run in Python on numpy arrays, so ``xp`` is numpy there and
CuPy on a real GPU.
"""
import os

import numpy as np
from numba import config as _nb_config

SIM = bool(_nb_config.ENABLE_CUDASIM) or os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def _cuda_available():
    if SIM:
        return True
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:  # numba-cuda missing or no driver
        return False


def _choose():
    want = os.environ.get("NUMBASPLAT_BACKEND", "").strip().lower()
    if want not in ("", "cpu", "cuda"):
        raise ValueError(f"NUMBASPLAT_BACKEND must be 'cpu' or 'cuda', got {want!r}")
    if want == "cuda" and not _cuda_available():
        raise RuntimeError("NUMBASPLAT_BACKEND=cuda but no CUDA GPU (or simulator) is available")
    if want:
        return want
    return "cuda" if _cuda_available() else "cpu"


BACKEND = _choose()


def array_module(backend=None):
    """numpy for the CPU backend and the simulator, CuPy for a real GPU."""
    if (backend or BACKEND) == "cuda" and not SIM:
        import cupy
        return cupy
    return np


def is_device(a):
    """A GPU array (CuPy), not numpy (which also holds the CUDA simulator's arrays)."""
    return not isinstance(a, np.ndarray) and hasattr(a, "__cuda_array_interface__")


def array_module_of(a):
    """numpy or CuPy: whichever holds ``a``."""
    if not is_device(a):
        return np
    import cupy
    return cupy


def to_host(a):
    """Copy a device array (CuPy) to numpy; numpy arrays pass through."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


class HostCopy:
    """A device array on its way to the host: the copy is queued now (into pinned memory) and
    waited for in ``get()``, so the host can queue more GPU work before it waits (a plain
    ``to_host`` leaves the GPU idle until the host has caught up).  Numpy arrays pass through."""

    def __init__(self, a):
        self._event = None
        if not is_device(a):
            self._host = np.asarray(a)
            return
        import cupy
        a = cupy.ascontiguousarray(a)
        self._host = np.frombuffer(cupy.cuda.alloc_pinned_memory(max(a.nbytes, 1)), a.dtype, a.size).reshape(a.shape)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(self._host.ctypes.data, a.data.ptr, a.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self._event = stream.record()
        self._source = a  # kept until the copy is done

    def get(self):
        """The host array (waits for the copy the first time)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = self._source = None
        return self._host


_views = {}


def as_numba(a):
    """A Numba device-array view of a CuPy array, for kernel launches.

    Numba's own conversion synchronises the stream for every array argument
    and costs ~20 us; this view has no owner and no sync (CuPy and Numba both
    use the legacy default stream) and is cached by (pointer, shape, strides,
    dtype), which CuPy's memory pool makes repeat from step to step.  Numpy
    arrays (CPU backend, simulator) pass through.
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
