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

``package_digest``: a hash of the package's source, which keys both backends' compiled code on
disk: the CUDA kernels' PTX cache (``numbasplat.cuda.launch``) and, through
``drop_stale_caches``, the CPU kernels' Numba caches.
"""
import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import numba
from numba import config as _nb_config

shared = numba.njit(inline="always", cache=False, fastmath=False)

SIM = bool(_nb_config.ENABLE_CUDASIM) or os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"

PACKAGE = Path(__file__).resolve().parents[1]  # numbasplat/
STAMP = "numbasplat-source.sha256"  # beside a Numba cache: the package digest its entries were compiled from


def package_digest(root=PACKAGE):
    """Hash of every source file under ``root``: its path relative to ``root`` and its contents
    (a kernel compiles from its own module, its backend's helpers and numbasplat.math)."""
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def drop_stale_caches(modules, digest=None):
    """Flush the disk caches of ``modules``' ``njit(cache=True)`` functions (module globals, and the
    members of a ``SimpleNamespace`` of them) that were written from other sources; -> how many.

    Numba checks a cache against its function's own file only, but the CPU kernels inline
    ``numbasplat.math`` from other files: after an edit there (a pull into an editable install) a
    kernel would load the old machine code.  So each cache directory keeps the package digest it
    was filled under (``STAMP``); under another digest its functions' entries are dropped and they
    compile again on first use.  A directory that cannot be written is left as it is."""
    from numba.core.dispatcher import Dispatcher
    found = []
    for m in modules:
        for v in vars(m).values():
            found += [v] if isinstance(v, Dispatcher) else (
                [d for d in vars(v).values() if isinstance(d, Dispatcher)] if isinstance(v, SimpleNamespace) else [])
    by_dir = {}
    for d in found:
        if d._cache.cache_path:  # (None: a NullCache, caching off)
            by_dir.setdefault(Path(d._cache.cache_path), {})[id(d)] = d
    digest = digest or package_digest()
    flushed = 0
    for where, dispatchers in by_dir.items():
        stamp = where / STAMP
        try:
            if stamp.exists() and stamp.read_text() == digest:
                continue
            for d in dispatchers.values():
                d._cache.flush()
            flushed += len(dispatchers)
            where.mkdir(parents=True, exist_ok=True)
            tmp = where / f"{STAMP}.{os.getpid()}"
            tmp.write_text(digest)
            os.replace(tmp, stamp)
        except OSError:
            pass
    return flushed
