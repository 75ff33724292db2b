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
