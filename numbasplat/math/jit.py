"""How the shared math compiles: the ``shared`` decorator, and whether Numba's CUDA target is
the simulator.

A ``@shared`` function (``numba.njit(inline="always")``) can be called from CPU ``njit``
kernels and from ``@cuda.jit`` kernels alike, so the projection, SH, blending and loss math
is written once.  Such functions take and return scalars and tuples only: under the CUDA
simulator kernel arguments are fake arrays that ``njit`` cannot type.

``SIM``: ``NUMBA_ENABLE_CUDASIM=1``, the CUDA kernels run in Python on numpy arrays.  It
lives here, at the bottom of the package, because both the backend choice
(``numbasplat.backend``) and the CUDA kernels (which pick simulator variants of a few
device functions) need it.
"""
import os

import numba
from numba import config as _nb_config

shared = numba.njit(inline="always", cache=False, fastmath=False)

SIM = bool(_nb_config.ENABLE_CUDASIM) or os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
