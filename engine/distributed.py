"""What pipelines over several MPI ranks share: one GPU per rank, and cuts of rows or tiles into
contiguous ranges, one per rank."""
import numpy as np

from numbasplat import backend as _backend


def select_device(comm):
    """One GPU per rank: the rank's index among the ranks of its node picks the device."""
    if not _backend.on_gpu():
        return
    from mpi4py import MPI
    import cupy
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()


def even_bounds(n, parts):
    """Cut ``n`` rows into ``parts`` contiguous ranges of near-equal size: their ``parts + 1`` bounds."""
    return np.array([n * r // parts for r in range(parts + 1)], np.int64)


def balanced_bounds(cost, parts):
    """Cut a cost array into ``parts`` contiguous ranges of near-equal total cost."""
    c = np.cumsum(np.asarray(cost, np.float64) + 1e-3)  # +eps: empty tiles still split evenly
    targets = c[-1] * np.arange(1, parts) / parts
    inner = np.searchsorted(c, targets) + 1
    return np.concatenate([[0], np.minimum(inner, len(c)), [len(c)]]).astype(np.int64)
