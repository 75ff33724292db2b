"""Run under mpiexec by tests/test_alltoallv.py: checks comm.Exchange and the gradient exchanges across ranks.

    mpiexec -n 4 python tests/check_mpi_comm.py           # every check, prints "rank R ok"
    mpiexec -n 2 python tests/check_mpi_comm.py --fail    # the last rank raises inside abort_on_error
    mpiexec -n 2 python tests/check_mpi_comm.py --device --transport=nccl   # GPUs: device arrays, NCCL

Arrays are numpy here (CPU backend); with CuPy on a GPU pass --device to run the
same checks on device arrays.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from comm import alltoallv as a2a  # noqa: E402
from comm.alltoallv import Exchange, abort_on_error  # noqa: E402
from comm.sparse import exchange_dense, exchange_sparse  # noqa: E402

comm = MPI.COMM_WORLD
rank, P = comm.Get_rank(), comm.Get_size()
DEVICE = "--device" in sys.argv
TRANSPORT = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--transport=")), "host")
if DEVICE:
    import cupy as xp
    from engine.pipelines.distributed import select_device
    select_device(comm)  # one GPU per rank where there are enough (NCCL needs that)
else:
    xp = np


def host(a):
    return a.get() if DEVICE else a


def rows_for(src, dst, n, width, dtype, trial):
    """Deterministic rows that name their source, destination and index."""
    j = np.arange(n)[:, None]
    f = np.arange(width)[None, :]
    v = (trial * 7 + src * 1000 + dst * 100 + j * 3 + f) % 251
    return v.astype(dtype)


def check_alltoallv(ex, trial, dtype, width, flat=False, known=False):
    rng = np.random.default_rng(1000 * trial + rank)
    counts = rng.integers(0, 6, P)
    counts[rng.random(P) < 0.3] = 0
    if trial == 0:
        counts[:] = 0  # nothing at all moves
    send = np.concatenate([rows_for(rank, d, counts[d], width, dtype, trial) for d in range(P)]
                          or [np.zeros((0, width), dtype)])
    if flat:
        send = send[:, 0].copy()
    everyone = comm.allgather(counts)  # the reference: what every source sends me
    expect_counts = np.array([everyone[s][rank] for s in range(P)])
    expect = np.concatenate([rows_for(s, rank, expect_counts[s], width, dtype, trial) for s in range(P)])
    if flat:
        expect = expect[:, 0]
    recv, rc = ex.alltoallv(xp.asarray(send), counts, expect_counts if known else None)
    assert rc.dtype == np.int64 and rc.tolist() == expect_counts.tolist(), (rc, expect_counts)
    assert type(recv) is type(xp.asarray(send)) and recv.dtype == dtype and recv.shape == expect.shape
    np.testing.assert_array_equal(host(recv), expect)


class FakeDeviceArray:
    """A numpy array the comm layer takes for a GPU one (it has ``__cuda_array_interface__``,
    ``get`` and ``set``), so the device paths' index arithmetic runs without a GPU."""

    def __init__(self, a):
        self.a = a

    __cuda_array_interface__ = property(lambda self: self.a.__array_interface__)
    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    nbytes = property(lambda self: self.a.nbytes)

    def __len__(self):
        return len(self.a)

    def __getitem__(self, k):
        return FakeDeviceArray(self.a[k])  # a view, as on the device

    def __setitem__(self, k, v):
        self.a[k] = v.a if isinstance(v, FakeDeviceArray) else v

    def reshape(self, *shape):
        return FakeDeviceArray(self.a.reshape(*shape))

    def view(self, dtype):
        return FakeDeviceArray(self.a.view(dtype))

    def get(self, out):
        out[...] = self.a

    def set(self, host):
        self.a[...] = host


def check_host_staging_of_device_rows(trial):
    """HostStaged's device path (own rows by a device copy, the others through host buffers)."""
    t = a2a.HostStaged()
    t._buffer = lambda key, nbytes: np.empty(nbytes, np.uint8)  # instead of pinned memory
    rng = np.random.default_rng(500 + trial * 10 + rank)
    counts = rng.integers(0, 5, P)
    counts[rng.random(P) < 0.3] = 0
    send = np.concatenate([rows_for(rank, d, counts[d], 3, np.float32, trial) for d in range(P)])
    rcounts = np.array(comm.alltoall(counts.tolist()), np.int64)
    recv = np.full((rcounts.sum(), 3), -1, np.float32)
    t.alltoallv(comm, FakeDeviceArray(send), counts.astype(np.int64), FakeDeviceArray(recv), rcounts)
    expect = np.concatenate([rows_for(s, rank, rcounts[s], 3, np.float32, trial) for s in range(P)])
    np.testing.assert_array_equal(recv, expect)


class HostSharedMemory:
    """``CudaIpc``'s buffers as POSIX shared memory, so that its protocol runs on CPU ranks."""

    def allocate(self, nbytes):
        from multiprocessing import shared_memory
        shm = shared_memory.SharedMemory(create=True, size=nbytes)
        return FakeDeviceArray(np.ndarray(nbytes, np.uint8, shm.buf)), shm.name, shm

    def free(self, shm):
        shm.close()
        shm.unlink()

    def open(self, name, nbytes):
        from multiprocessing import resource_tracker, shared_memory
        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")  # (its maker unlinks it)
        return FakeDeviceArray(np.ndarray(nbytes, np.uint8, shm.buf)), shm

    def close(self, shm):
        shm.close()

    def synchronize(self):
        pass


def check_ipc_of_device_rows():
    """CudaIpc's protocol (each rank's rows in a buffer the others map, read out by each rank): rows of
    random counts, a buffer outgrown mid-way (its handle sent anew, the old one let go), empty exchanges."""
    t = a2a.CudaIpc(HostSharedMemory())
    for trial, scale in enumerate((1, 100000, 1, 0, 250000, 3)):  # (100,000 rows of 12 bytes: past the first buffer)
        rng = np.random.default_rng(700 + trial * 10 + rank)
        counts = rng.integers(0, 5, P) * scale
        if scale < 1000:
            counts[rng.random(P) < 0.3] = 0
        else:  # (rows to every rank: each one's buffer outgrown)
            counts = rng.integers(1, 5, P) * scale
        send = np.concatenate([rows_for(rank, d, counts[d], 3, np.float32, trial) for d in range(P)])
        rcounts = np.array(comm.alltoall(counts.tolist()), np.int64)
        recv = np.full((rcounts.sum(), 3), -1, np.float32)
        t.alltoallv(comm, FakeDeviceArray(send), counts.astype(np.int64), FakeDeviceArray(recv), rcounts)
        expect = np.concatenate([rows_for(s, rank, rcounts[s], 3, np.float32, trial) for s in range(P)])
        np.testing.assert_array_equal(recv, expect, err_msg=f"trial {trial}")
    assert t._mine[3] >= 1 or P == 1, "no buffer outgrown: the test missed the growth"
    t.close(comm)


def check_mismatch(ex):
    """Ranks disagreeing on dtype are caught with the counts: every rank raises, none hangs."""
    dtype = np.float64 if rank == 0 else np.float32
    try:
        ex.alltoallv(xp.zeros((P, 3), dtype), np.ones(P, np.int64))
    except ValueError as e:
        assert "dtype or width" in str(e)
    else:
        raise AssertionError("mismatched dtypes were not detected")


def check_helpers(ex):
    s = ex.allreduce_sum(xp.asarray(np.arange(5, dtype=np.float32) * (rank + 1)))
    np.testing.assert_allclose(host(s), np.arange(5) * P * (P + 1) / 2)
    mine = np.full((rank + 1, 2), rank, np.int32)
    allrows, counts = ex.allgatherv(xp.asarray(mine))
    assert counts.tolist() == list(range(1, P + 1))
    np.testing.assert_array_equal(host(allrows), np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(P)]))


def check_gradients(ex, trial):
    """exchange_sparse adds the same gradients into ``out`` as exchange_dense."""
    rng = np.random.default_rng(50 + trial * 10 + rank)
    counts = rng.integers(0, 90, P)
    counts[rng.random(P) < 0.2] = 0
    G = rng.normal(size=(counts.sum(), 12)).astype(np.float32)
    G[rng.random(len(G)) < 0.7] = 0
    G[rng.random(len(G)) < 0.1, 3] = 0.5  # rows with one non-zero field
    recv_counts = np.array(comm.alltoall(counts.tolist()))
    n_out = 40
    route = rng.integers(0, n_out, recv_counts.sum()).astype(np.int32)
    out_s = xp.zeros((n_out, 12), np.float32)
    out_d = xp.zeros((n_out, 12), np.float32)
    st_s = exchange_sparse(ex, xp.asarray(G), counts, xp.asarray(route), out_s)
    st_d = exchange_dense(ex, xp.asarray(G), counts, xp.asarray(route), out_d)
    np.testing.assert_allclose(host(out_s), host(out_d), rtol=1e-6, atol=1e-6)
    assert st_s["sparse_bytes"] <= st_s["dense_bytes"] + 8 * P and st_d["dense_bytes"] == G.nbytes
    assert 0.0 <= st_s["zero_fraction"] <= 1.0


def main():
    with abort_on_error(comm):
        if "--fail" in sys.argv:
            if rank == P - 1:
                raise RuntimeError(f"deliberate failure on rank {rank}")
            comm.Barrier()  # the others would wait here forever without the abort
            raise AssertionError("unreachable: the failing rank should have aborted everyone")
        if not DEVICE:  # no GPU of its own on any rank: "auto" never picks NCCL (which would refuse)
            assert a2a.make_transport("auto", comm).name in ("host", "cuda")
        ex = Exchange(comm, transport=TRANSPORT)
        if rank == 0:
            print(f"transport {ex.transport.name}", flush=True)
        trial = 0
        for dtype, width in ((np.float32, 12), (np.int64, 1), (np.uint8, 5), (np.float32, 10)):
            for flat, known in ((False, False), (False, True)):
                check_alltoallv(ex, trial, dtype, width, flat, known)
                trial += 1
        check_alltoallv(ex, trial, np.int32, 1, flat=True)
        limit = a2a.BYTE_LIMIT
        a2a.BYTE_LIMIT = 16  # force the row-datatype path (what >2 GiB messages use)
        try:
            for t in range(3):
                check_alltoallv(ex, 100 + t, np.float32, 3)
            check_helpers(ex)
        finally:
            a2a.BYTE_LIMIT = limit
        check_mismatch(ex)
        check_helpers(ex)
        for t in range(3):
            check_gradients(ex, t)
        if not DEVICE:
            for t in range(4):
                check_host_staging_of_device_rows(t)
            check_ipc_of_device_rows()
        comm.Barrier()
        print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
