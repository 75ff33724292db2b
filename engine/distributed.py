"""What pipelines over several MPI ranks share: one GPU per rank, the checks that ranks agree, and
cuts of rows or tiles into contiguous ranges, one per rank."""
import json

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


def disagreement(comm, fields):
    """Where the ranks' ``fields`` ({name: JSON value}, the same names on every rank) differ: one
    message, the same on every rank, naming each differing field, the ranks that differ from rank 0
    and two of the values; None where all agree.  Collective (one gather of the fields)."""
    mine = {k: json.dumps(v, sort_keys=True, default=str) for k, v in fields.items()}
    every = comm.allgather(mine)
    problems = []
    for name in fields:
        values = [r[name] for r in every]
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            ranks = ("rank " if len(differ) == 1 else "ranks ") + ", ".join(map(str, differ))
            problems.append(f"{name} differs on {ranks} (rank 0: {values[0]}, rank {differ[0]}: {values[differ[0]]})")
    return "; ".join(problems) or None


def max_over_ranks(comm, value):
    """The largest of the ranks' integers ``value``: one small host allreduce.  Collective."""
    from mpi4py import MPI
    buf = np.array([value], np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return int(buf[0])


def even_bounds(n, parts):
    """Cut ``n`` rows into ``parts`` contiguous ranges of near-equal size: their ``parts + 1`` bounds."""
    return np.array([n * r // parts for r in range(parts + 1)], np.int64)


def balanced_bounds(cost, parts):
    """Cut a cost array into ``parts`` contiguous ranges of near-equal total cost."""
    c = np.cumsum(np.asarray(cost, np.float64) + 1e-3)  # +eps: empty tiles still split evenly
    targets = c[-1] * np.arange(1, parts) / parts
    inner = np.searchsorted(c, targets) + 1
    return np.concatenate([[0], np.minimum(inner, len(c)), [len(c)]]).astype(np.int64)
