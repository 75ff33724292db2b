"""The backend: which kernels run and where their arrays live.  The one module that names one.

``NUMBASPLAT_BACKEND=cpu|cuda`` overrides the automatic choice (CUDA when a GPU or the CUDA
simulator is available, else CPU).  ``kernels(backend)`` is the backend's kernel package,
``numbasplat.cpu`` or ``numbasplat.cuda``: both export the same entry points, so the API calls
``kernels(backend).raster_forward(...)`` whatever the backend.  Under
``NUMBA_ENABLE_CUDASIM=1`` (``SIM``) the CUDA kernels run in Python on numpy arrays, so the
array module is numpy there and CuPy on a real GPU; ``on_gpu`` tells the two apart, and
``synchronize`` waits for a real GPU.  The rest are helpers for arrays of either kind; the
streams, copies and page-locked memory of a real GPU are ``numbasplat.device``'s.
"""
import os

import numpy as np

from .math.jit import SIM


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


def kernels(backend=None):
    """The kernel package of ``backend`` (None: the process default), imported on first use."""
    backend = backend or BACKEND
    if backend == "cpu":
        from . import cpu
        return cpu
    if backend == "cuda":
        from . import cuda
        return cuda
    raise ValueError(f"backend must be 'cpu' or 'cuda', got {backend!r}")


def backend_of(a):
    """The backend whose kernels take ``a``: CUDA for a device array, and for a numpy array under
    the simulator when CUDA is the process default; else CPU."""
    if not isinstance(a, np.ndarray):
        return "cuda"
    return "cuda" if SIM and BACKEND == "cuda" else "cpu"


def on_gpu(backend=None):
    """Whether ``backend`` (None: the process default) runs on a real GPU, not the simulator."""
    return (backend or BACKEND) == "cuda" and not SIM


def synchronize(backend=None):
    """Wait for the work queued on the current CuPy stream (kernels, copies, NCCL transfers), on a
    real GPU; a no-op on the CPU and in the simulator, where every call finishes its work."""
    if on_gpu(backend):
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def array_module(backend=None):
    """numpy for the CPU backend and the simulator, CuPy for a real GPU."""
    return kernels(backend).array_module()


def is_device(a):
    """A GPU array (CuPy), not numpy (which also holds the CUDA simulator's arrays)."""
    return not isinstance(a, np.ndarray) and hasattr(a, "__cuda_array_interface__")


def array_module_of(a):
    """numpy or CuPy: whichever holds ``a``."""
    if not is_device(a):
        return np
    import cupy
    return cupy


def asarray(a, backend=None):
    """``a`` as an array of the backend's array module: a device array comes to the host for
    numpy, a host array goes to the device for CuPy."""
    xp = array_module(backend)
    return to_host(a) if xp is np else xp.asarray(a)


def to_host(a):
    """Copy a device array (CuPy) to numpy; numpy arrays pass through."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)
