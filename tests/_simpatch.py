"""Make the CUDA simulator's block scheduler yield the GIL while it polls.

numba-cuda's simulator runs every CUDA thread of a block as a Python thread and
``BlockManager.run`` watches them in a tight ``while livethreads: for t in
livethreads: ...`` loop.  That loop never blocks, so it keeps the GIL for whole
switch intervals while the simulated threads (which contend on the atomics'
locks) wait for it: kernels with atomics can stall for minutes.

``apply()`` replaces ``BlockManager.run`` with a copy of the installed
numba-cuda (0.30.x) loop that sleeps ``POLL_SLEEP`` seconds after each sweep.
Nothing else changes.  It only acts when the simulator is enabled in this
process (``NUMBA_ENABLE_CUDASIM=1``), and it leaves the simulator alone, with a
warning, if the installed loop no longer looks like the one copied here.

Used by tests/conftest.py in the pytest process and, through ``run_sim``, at
the top of every simulator subprocess; scripts can also do::

    import sys; sys.path.insert(0, "tests"); import _simpatch; _simpatch.apply()
"""
import inspect
import os
import time
import warnings

import numpy as np

POLL_SLEEP = 1e-5  # seconds; anything that releases the GIL works

# Lines of the upstream BlockManager.run that the copy below reproduces.
_UPSTREAM_MARKERS = (
    "while livethreads:",
    "for t in livethreads:",
    "if t.syncthreads_blocked:",
    "elif t.exception:",
    "if livethreads == blockedthreads:",
    "t.syncthreads_event.set()",
    "livethreads = set([t for t in livethreads if t.is_alive()])",
    "BlockThread(target, self, grid_point, block_point, self._debug)",
)


def sim_enabled():
    """True when the CUDA simulator is on for this process."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
        return True
    try:
        from numba import config
        return bool(config.ENABLE_CUDASIM)
    except Exception:
        return False


def _make_run(kernel_mod):
    BlockThread = kernel_mod.BlockThread

    def run(self, grid_point, *args):
        # Copy of numba.cuda.simulator.kernel.BlockManager.run (numba-cuda
        # 0.30.x), plus the time.sleep() at the end of each polling sweep.
        threads = set()
        livethreads = set()
        blockedthreads = set()
        for block_point in np.ndindex(*self._block_dim):

            def target():
                self._f(*args)

            t = BlockThread(target, self, grid_point, block_point, self._debug)
            t.start()
            threads.add(t)
            livethreads.add(t)

        while livethreads:
            for t in livethreads:
                if t.syncthreads_blocked:
                    blockedthreads.add(t)
                elif t.exception:
                    # Abort all other simulator threads on exception,
                    # do *not* join immediately to facilitate debugging.
                    for t_other in threads:
                        t_other.abort = True
                        t_other.syncthreads_blocked = False
                        t_other.syncthreads_event.set()

                    raise t.exception[0].with_traceback(t.exception[1])
            if livethreads == blockedthreads:
                for t in blockedthreads:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                blockedthreads = set()
            livethreads = set([t for t in livethreads if t.is_alive()])
            if livethreads:
                time.sleep(POLL_SLEEP)  # the fix: let the block's threads run
        # Final check for exceptions in case any were set prior to thread
        # finishing, before we could check it
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    run._numbasplat_simpatch = True
    return run


def apply(force=False):
    """Patch the simulator's BlockManager.run; return True if the patch is in place.

    Does nothing (returns False) unless the simulator is enabled, or ``force``.
    Safe to call more than once.
    """
    if not (force or sim_enabled()):
        return False
    try:
        import numba.cuda.simulator.kernel as kernel_mod
    except Exception as exc:  # numba-cuda missing: nothing to patch
        warnings.warn(f"CUDA simulator patch not applied: {exc!r}", RuntimeWarning)
        return False
    BM = kernel_mod.BlockManager
    if getattr(BM.run, "_numbasplat_simpatch", False):
        return True
    try:
        src = inspect.getsource(BM.run)
    except (OSError, TypeError) as exc:
        warnings.warn(f"CUDA simulator patch not applied (no source: {exc!r})", RuntimeWarning)
        return False
    missing = [m for m in _UPSTREAM_MARKERS if m not in src]
    if missing:
        warnings.warn(
            "CUDA simulator patch not applied: numba.cuda.simulator.kernel."
            f"BlockManager.run changed upstream (missing {missing}); update tests/_simpatch.py",
            RuntimeWarning,
        )
        return False
    BM._numbasplat_original_run = BM.run
    BM.run = _make_run(kernel_mod)
    return True


def is_applied():
    try:
        import numba.cuda.simulator.kernel as kernel_mod
    except Exception:
        return False
    return bool(getattr(kernel_mod.BlockManager.run, "_numbasplat_simpatch", False))
