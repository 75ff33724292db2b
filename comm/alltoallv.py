"""Variable-size all-to-all of row arrays over MPI, for host (numpy) or device (CuPy) arrays.

Rows are the unit: projected/gradient records are rows of float32, so every
message is "these rows go to rank d".  Counts travel first (one Alltoall of
int64), so ranks never need to agree on sizes beforehand.

How device arrays cross ranks is a ``Transport``:

* ``HostStaged`` copies them through reused pinned host buffers and runs a
  host MPI_Alltoallv.  It works with any MPI and is the default.
* ``CudaAware`` hands device pointers to MPI directly.  A MPI that is not
  CUDA-aware crashes on those, so "auto" only picks it when the library itself
  says at run time that it supports CUDA (``cuda_aware_mpi()``).
* ``Nccl`` sends device rows GPU to GPU through NCCL (CuPy's binding):
  grouped send/recv per peer on the current stream, over NVLink or the
  network, with no host copy and no sync.  NCCL needs one GPU per rank, so
  "auto" takes it only when every rank has its own GPU and NCCL loads.
* ``CudaIpc`` ("ipc") copies device rows between the ranks of one host through
  CUDA IPC: each rank's rows in a device buffer that every rank has mapped,
  each rank copying its rows out of the others'.  It works where ranks share a
  GPU (which NCCL refuses: GPU partitions standing in for GPUs, MPS) and
  between GPUs of one host, with a plain MPI; it is asked for by name.

"auto" tries them in that order of preference: ``CudaAware``, ``Nccl``, ``HostStaged``.

Messages: counts and displacements are sent in bytes while the whole buffer
fits MPI's int counts, else in units of a contiguous row datatype (so ~2**31
rows, not bytes, is the limit; past that a clear OverflowError).
"""
import contextlib
import os
import sys
import time
import traceback
import zlib

import numpy as np

from numbasplat.backend import array_module_of, is_device, synchronize, to_host

from .libraries import load_mpi, load_nccl, loaded_libraries

MPI = load_mpi()

BYTE_LIMIT = 2**31 - 1  # MPI int counts/displacements; tests lower it to exercise the row-datatype path
INT_MAX = 2**31 - 1
ABORT_GRACE_S = 0.5  # fail_all: time for mpiexec to forward the message before the abort


# --------------------------------------------------------------------------- helpers

def _bytes(a):
    """Flat uint8 view of a C-contiguous array (numpy or CuPy)."""
    return a.reshape(-1).view(np.uint8)


def _displs(counts):
    d = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=d[1:])
    return d


def _signature(dtype, width):
    """An int64 naming the row kind, so mismatched senders are caught with the counts."""
    return zlib.crc32(f"{np.dtype(dtype).str}x{width}".encode())


_row_types = {}


def _row_type(row_bytes):
    t = _row_types.get(row_bytes)
    if t is None:
        t = _row_types[row_bytes] = MPI.BYTE.Create_contiguous(row_bytes).Commit()
    return t


def _mpi_alltoallv(comm, sbuf, scounts, rbuf, rcounts, row_bytes, keep_self=False):
    """MPI_Alltoallv of flat byte buffers whose counts are given in rows.

    With ``keep_self`` this rank's own chunk is left out (the caller copies it)."""
    sdispl, rdispl = _displs(scounts), _displs(rcounts)
    if keep_self:
        me = comm.Get_rank()
        scounts, rcounts = scounts.copy(), rcounts.copy()
        scounts[me] = rcounts[me] = 0
    if max(sbuf.nbytes, rbuf.nbytes) <= BYTE_LIMIT:
        unit, dtype = row_bytes, MPI.BYTE
    else:
        if max(int(scounts.sum()), int(rcounts.sum())) > INT_MAX:
            raise OverflowError(f"alltoallv: more than 2**31-1 rows ({scounts.sum()} sent, {rcounts.sum()} "
                                "received): split the exchange")
        unit, dtype = 1, _row_type(row_bytes)
    s = [sbuf, ((scounts * unit).tolist(), (sdispl * unit).tolist()), dtype]
    r = [rbuf, ((rcounts * unit).tolist(), (rdispl * unit).tolist()), dtype]
    comm.Alltoallv(s, r)


def _mpi_allgatherv(comm, sbuf, srows, rbuf, rcounts, row_bytes):
    if rbuf.nbytes <= BYTE_LIMIT:
        unit, dtype = row_bytes, MPI.BYTE
    else:
        if int(rcounts.sum()) > INT_MAX:
            raise OverflowError("allgatherv: more than 2**31-1 rows")
        unit, dtype = 1, _row_type(row_bytes)
    comm.Allgatherv([sbuf, srows * unit, dtype],
                    [rbuf, ((rcounts * unit).tolist(), (_displs(rcounts) * unit).tolist()), dtype])


def cuda_aware_mpi(_cache=[]):
    """True only when the MPI library reports CUDA support at run time.

    Asks ``MPIX_Query_cuda_support()`` (Open MPI's mpi-ext, MPICH >= 4.1; mpi4py
    does not wrap it) through ctypes in the loaded libmpi.  Anything uncertain
    (symbol missing, lookup fails) answers False: a MPI that is not CUDA-aware
    crashes when given device pointers, while host staging always works.
    """
    if not _cache:
        _cache.append(_query_cuda_support())
    return _cache[0]


def _query_cuda_support():
    import ctypes
    for lib in [None, *loaded_libraries("libmpi")]:
        try:
            fn = ctypes.CDLL(lib).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, []
        try:
            return fn() == 1
        except Exception:
            return False
    return False


# --------------------------------------------------------------------------- transports

class Transport:
    """Moves rows between ranks: ``alltoallv(comm, send, scounts, recv, rcounts)``.

    ``send``/``recv`` are C-contiguous 2D arrays of one kind and dtype, ``recv``
    already allocated; counts are int64 numpy arrays in rows.  Host rows go
    straight to MPI.  Of device rows, a rank's rows to itself are a device copy
    (about 1/P of the bytes, never worth a trip out); subclasses move the
    others in ``_exchange``, deciding how device memory reaches the network.
    """
    name = "base"

    def alltoallv(self, comm, send, scounts, recv, rcounts):
        row_bytes = send.shape[1] * send.dtype.itemsize
        if not is_device(send):
            _mpi_alltoallv(comm, _bytes(send), scounts, _bytes(recv), rcounts, row_bytes)
            return
        me = comm.Get_rank()
        sd, rd = _displs(scounts), _displs(rcounts)
        recv[rd[me]:rd[me] + rcounts[me]] = send[sd[me]:sd[me] + scounts[me]]
        self._exchange(comm, send, scounts, sd, recv, rcounts, rd, row_bytes)

    def _exchange(self, comm, send, scounts, sd, recv, rcounts, rd, row_bytes):
        """Every chunk but this rank's own (``sd``/``rd``: the chunks' first rows)."""
        raise NotImplementedError


class HostStaged(Transport):
    """Device rows through pinned host buffers (reused, grown by doubling) and a host MPI_Alltoallv."""
    name = "host"

    def __init__(self):
        self._pinned = {}

    def _buffer(self, key, nbytes):
        buf = self._pinned.get(key)
        if buf is None or buf.size < nbytes:
            import cupy
            size = max(nbytes, 1 << 20, 0 if buf is None else 2 * buf.size)
            buf = np.frombuffer(cupy.cuda.alloc_pinned_memory(size), np.uint8, size)
            self._pinned[key] = buf
        return buf[:nbytes]

    def _exchange(self, comm, send, scounts, sd, recv, rcounts, rd, row_bytes):
        me = comm.Get_rank()
        hs = self._buffer("send", send.nbytes).reshape(-1, row_bytes)
        hr = self._buffer("recv", recv.nbytes).reshape(-1, row_bytes)
        for part in (slice(0, sd[me]), slice(sd[me] + scounts[me], len(send))):
            if part.stop > part.start:  # blocking copies: they also wait for the kernels that wrote send
                _bytes(send[part]).get(out=hs[part].reshape(-1))
        _mpi_alltoallv(comm, hs.reshape(-1), scounts, hr.reshape(-1), rcounts, row_bytes, keep_self=True)
        for part in (slice(0, rd[me]), slice(rd[me] + rcounts[me], len(recv))):
            if part.stop > part.start:
                _bytes(recv[part]).set(hr[part].reshape(-1))


class CudaAware(Transport):
    """Device pointers straight to a CUDA-aware MPI (mpi4py reads ``__cuda_array_interface__``)."""
    name = "cuda"

    def _exchange(self, comm, send, scounts, sd, recv, rcounts, rd, row_bytes):
        synchronize()  # MPI reads the buffer outside any stream: the kernels writing it must be done
        _mpi_alltoallv(comm, _bytes(send), scounts, _bytes(recv), rcounts, row_bytes, keep_self=True)


class Nccl(Transport):
    """Device rows GPU to GPU through NCCL: one group of send/recv per peer, on the current stream.

    Nothing waits for the transfer: later work on the stream runs after it.
    Built collectively (every rank of ``comm`` at once): rank 0 makes the NCCL
    id and broadcasts it by MPI."""
    name = "nccl"

    def __init__(self, comm):
        nccl, why = load_nccl()
        if nccl is None:
            raise ValueError(f"transport 'nccl': NCCL does not load ({why}); install the gpu-cu12 or gpu-cu13 "
                               "extra, which brings it")
        self.nccl = nccl
        uid = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None, root=0)
        self.nc = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())

    def _exchange(self, comm, send, scounts, sd, recv, rcounts, rd, row_bytes):
        import cupy
        nccl, me = self.nccl, comm.Get_rank()
        stream = cupy.cuda.get_current_stream().ptr
        nccl.groupStart()
        for d in range(len(scounts)):
            if d != me and scounts[d]:
                self.nc.send(send.data.ptr + int(sd[d]) * row_bytes, int(scounts[d]) * row_bytes,
                             nccl.NCCL_UINT8, d, stream)
            if d != me and rcounts[d]:
                self.nc.recv(recv.data.ptr + int(rd[d]) * row_bytes, int(rcounts[d]) * row_bytes,
                             nccl.NCCL_UINT8, d, stream)
        nccl.groupEnd()


class CudaIpcMemory:
    """Device buffers that other processes of the host map: CUDA IPC (CuPy's runtime calls)."""

    def allocate(self, nbytes):
        """-> (a flat uint8 device array of ``nbytes``, the handle that maps it elsewhere, what ``free`` takes)."""
        import cupy
        ptr = cupy.cuda.runtime.malloc(nbytes)  # (its own allocation: a pooled one would export its neighbours)
        return self._array(ptr, nbytes), cupy.cuda.runtime.ipcGetMemHandle(ptr), ptr

    def free(self, owned):
        import cupy
        cupy.cuda.runtime.free(owned)

    def open(self, handle, nbytes):
        """-> (another rank's buffer of ``nbytes`` from its handle, mapped here; what ``close`` takes)."""
        import cupy
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        return self._array(ptr, nbytes), ptr

    def close(self, mapped):
        import cupy
        cupy.cuda.runtime.ipcCloseMemHandle(mapped)

    @staticmethod
    def _array(ptr, nbytes):
        import cupy
        memory = cupy.cuda.UnownedMemory(ptr, nbytes, None)
        return cupy.ndarray(nbytes, np.uint8, cupy.cuda.MemoryPointer(memory, 0))

    def synchronize(self):
        synchronize()


class CudaIpc(Transport):
    """Device rows between the ranks of one host through CUDA IPC, with any MPI.

    Each rank copies its rows into a device buffer of its own that the other ranks map once
    (``cudaIpcOpenMemHandle``; a new buffer, twice the size, where the rows outgrow it), and waits
    for the copy; the ranks then meet (an MPI allgather of each one's rows' places, and of a new
    buffer's handle), each copies the rows sent to it out of the others' buffers into ``recv``, and
    the ranks meet again (a barrier) before any buffer is written anew.  The device copies run on
    the current stream; on one GPU (ranks sharing it, as GPU partitions standing in for GPUs do)
    they never leave it.  ``memory``: the buffers' kind (``CudaIpcMemory``; the tests give host
    shared memory)."""
    name = "ipc"

    def __init__(self, memory=None):
        self.memory = memory or CudaIpcMemory()
        self._mine = None    # (array, handle, owned, generation): this rank's buffer
        self._retired = []   # buffers outgrown, freed once every rank has let them go (the next barrier)
        self._handles = {}   # rank: (generation, handle, nbytes): the newest buffer each rank has made
        self._peers = {}     # rank: (generation, array, mapped): the buffers mapped here

    def _buffer(self, nbytes):
        """This rank's buffer, of ``nbytes`` at least; -> whether it is new (its handle to send)."""
        if self._mine is not None and self._mine[0].nbytes >= nbytes:
            return False
        generation = 0 if self._mine is None else self._mine[3] + 1
        size = max(nbytes, 1 << 20, 0 if self._mine is None else 2 * self._mine[0].nbytes)
        if self._mine is not None:
            self._retired.append(self._mine[2])
        array, handle, owned = self.memory.allocate(size)
        self._mine = (array, handle, owned, generation)
        return True

    def _peer(self, s):
        """Rank ``s``'s newest buffer, mapped here (the one before let go)."""
        generation, handle, nbytes = self._handles[s]
        if s in self._peers and self._peers[s][0] != generation:
            self.memory.close(self._peers.pop(s)[2])  # (no array of it left here)
        if s not in self._peers:
            self._peers[s] = (generation, *self.memory.open(handle, nbytes))
        return self._peers[s][1]

    def _exchange(self, comm, send, scounts, sd, recv, rcounts, rd, row_bytes):
        me = comm.Get_rank()
        new = self._buffer(send.nbytes)
        mine = self._mine
        if send.nbytes:
            mine[0][:send.nbytes] = _bytes(send)
        self.memory.synchronize()  # (the rows are in the buffer before any rank reads it)
        places = comm.allgather((mine[3], mine[1] if new else None, mine[0].nbytes, (sd * row_bytes).tolist()))
        for s, (generation, handle, nbytes, _) in enumerate(places):
            if handle is not None and s != me:
                self._handles[s] = (generation, handle, nbytes)
                self._peer(s)  # (mapped now: the buffer before is let go before the barrier below)
        out = _bytes(recv)
        for s in range(len(places)):
            if s != me and rcounts[s]:
                first, n = places[s][3][me], int(rcounts[s]) * row_bytes
                out[int(rd[s]) * row_bytes:int(rd[s]) * row_bytes + n] = self._peer(s)[first:first + n]
        self.memory.synchronize()
        comm.Barrier()  # every rank has read the buffers (and let outgrown ones go) before any is written
        for owned in self._retired:
            self.memory.free(owned)
        self._retired = []

    def close(self, comm):
        """Let the other ranks' buffers go, then (once every rank has: a barrier) free this rank's.  Collective."""
        for _, _, mapped in self._peers.values():
            self.memory.close(mapped)
        self._peers.clear()
        comm.Barrier()
        for owned in self._retired + ([self._mine[2]] if self._mine is not None else []):
            self.memory.free(owned)
        self._mine, self._retired = None, []


TRANSPORTS = {"host": HostStaged, "cuda": CudaAware, "nccl": Nccl, "ipc": CudaIpc}


def _own_gpus(comm):
    """Every rank has a GPU of its own (NCCL refuses two ranks on one device); False without CuPy."""
    try:
        import cupy
        mine = (MPI.Get_processor_name(), cupy.cuda.Device().pci_bus_id)
    except Exception:
        mine = None
    every = comm.allgather(mine)
    return None not in every and len(set(every)) == len(every)


def _nccl_or_none(comm):
    """An ``Nccl`` transport if every rank can build one, else None (decided together: no rank hangs)."""
    have = load_nccl()[0] is not None
    ok = _own_gpus(comm)
    return Nccl(comm) if comm.allreduce(have and ok, op=MPI.LAND) else None


def make_transport(transport="auto", comm=None):
    """``transport``: "auto", a name of ``TRANSPORTS`` or a ``Transport``.  Collective (NCCL's set-up)."""
    if isinstance(transport, Transport):
        return transport
    comm = comm if comm is not None else MPI.COMM_WORLD
    if transport == "auto":
        if cuda_aware_mpi():
            return CudaAware()
        return _nccl_or_none(comm) or HostStaged()
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be 'auto' or one of {sorted(TRANSPORTS)}, got {transport!r}")
    if transport == "nccl":
        if not _own_gpus(comm):
            raise ValueError("transport 'nccl' needs a GPU of its own for every rank (one rank per GPU; "
                             "ranks sharing a GPU use 'host')")
        return Nccl(comm)
    return TRANSPORTS[transport]()


# --------------------------------------------------------------------------- Exchange

class Exchange:
    """Collective row exchanges on one communicator.

    Every method is collective: all ranks of ``comm`` must call it, in the
    same order.  Arrays may be numpy or CuPy; results are of the same kind.
    """

    def __init__(self, comm=None, transport="auto"):
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.transport = make_transport(transport, self.comm)
        self._host = HostStaged()
        self.collective_seconds = 0.0  # the host's time inside the collectives so far (see ``_collective``)

    @contextlib.contextmanager
    def _collective(self):
        """Count the host's time inside one collective into ``collective_seconds``: with host MPI its
        transfer and its wait for the slowest rank (the imbalance a rank sees); with NCCL only the
        queueing, its transfer running on the stream (waited for where the stream is)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.collective_seconds += time.perf_counter() - start

    def alltoall_ints(self, table):
        """Alltoall of a (P, k) int64 table: row d goes to rank d; returns row s from rank s."""
        table = np.ascontiguousarray(table, np.int64)
        if table.shape[0] != self.size:
            raise ValueError(f"alltoall_ints: table has {table.shape[0]} rows for {self.size} ranks")
        out = np.empty_like(table)
        with self._collective():
            self.comm.Alltoall(table, out)
        return out

    def alltoallv(self, send, counts, recv_counts=None):
        """Send ``counts[d]`` consecutive rows of ``send`` to rank d; returns ``(recv, recv_counts)``.

        ``send`` is (rows, F) (or 1D: F = 1) with rows grouped by destination in
        rank order; ``recv`` holds the rows from each source in rank order.
        Counts (and a signature of dtype and F, which must agree across ranks)
        are exchanged first, unless the caller already knows ``recv_counts``
        (then nothing is checked).
        """
        xp = array_module_of(send)
        flat = send.ndim == 1
        send2 = xp.ascontiguousarray(send.reshape(-1, 1) if flat else send)
        if send2.ndim != 2:
            raise ValueError(f"alltoallv: send must be 1D or 2D, got shape {send.shape}")
        counts = np.asarray(counts, np.int64).reshape(-1)
        if counts.size != self.size or int(counts.sum()) != send2.shape[0] or (counts < 0).any():
            raise ValueError(f"alltoallv: counts {counts.tolist()} do not split {send2.shape[0]} rows "
                             f"over {self.size} ranks")
        if recv_counts is None:
            sig = _signature(send2.dtype, send2.shape[1])
            got = self.alltoall_ints(np.stack([counts, np.full(self.size, sig, np.int64)], axis=1))
            bad = np.flatnonzero(got[:, 1] != sig)
            if bad.size:
                raise ValueError(f"alltoallv on rank {self.rank}: rank {bad[0]} sends rows of another dtype or "
                                 f"width than this rank's {send2.dtype} x {send2.shape[1]}")
            recv_counts = got[:, 0].copy()
        else:
            recv_counts = np.asarray(recv_counts, np.int64).reshape(-1)
        recv = xp.empty((int(recv_counts.sum()), send2.shape[1]), send2.dtype)
        transport = self.transport if is_device(send2) else self._host
        with self._collective():
            transport.alltoallv(self.comm, send2, counts, recv, recv_counts)
        return (recv.reshape(-1) if flat else recv), recv_counts

    def allreduce_sum(self, a):
        """Element-wise sum over ranks of a small array (staged through the host)."""
        h = np.ascontiguousarray(a.get()) if is_device(a) else np.array(a, order="C")  # a fresh host copy
        with self._collective():
            self.comm.Allreduce(MPI.IN_PLACE, h, op=MPI.SUM)
        return array_module_of(a).asarray(h)

    def allgatherv(self, rows):
        """Every rank's rows, concatenated in rank order: ``(all_rows, counts)`` (staged through the host)."""
        h = np.ascontiguousarray(to_host(rows))
        flat = h.ndim == 1
        h2 = h.reshape(-1, 1) if flat else h
        sig = _signature(h2.dtype, h2.shape[1])
        meta = np.empty((self.size, 2), np.int64)
        with self._collective():
            self.comm.Allgather(np.array([h2.shape[0], sig], np.int64), meta)
        if (meta[:, 1] != sig).any():
            raise ValueError(f"allgatherv on rank {self.rank}: ranks disagree on dtype or width")
        counts = meta[:, 0].copy()
        out = np.empty((int(counts.sum()), h2.shape[1]), h2.dtype)
        with self._collective():
            _mpi_allgatherv(self.comm, _bytes(h2), h2.shape[0], _bytes(out), counts, h2.shape[1] * h2.dtype.itemsize)
        out = out.reshape(-1) if flat else out
        return array_module_of(rows).asarray(out), counts


# --------------------------------------------------------------------------- failing together

def fail_all(comm, exc, code=1):
    """Print the traceback and ``rank R: <message>`` to stderr, then MPI_Abort every rank; never returns.

    An exception on one rank would otherwise leave the others blocked forever
    in their next collective; Abort makes mpiexec end them all, non-zero.  A deliberate exit and
    a failed MPI call (what a rank sees when another one dies) get their line alone.
    MPICH's MPI_Abort may return before the process is killed: this process then ends at once
    with ``code`` (``os._exit``), so that no code after the failure runs (a caller's later lines
    would fail on what the failed block never set, a second traceback after the message).
    """
    comm = comm if comm is not None else MPI.COMM_WORLD
    line = f"rank {comm.Get_rank()}: {type(exc).__name__}: {exc}\n"
    if isinstance(exc, SystemExit):  # a deliberate exit with a message
        line = f"rank {comm.Get_rank()}: {exc}\n"
    elif isinstance(exc, MPI.Exception):
        line = (f"rank {comm.Get_rank()}: an MPI call failed ({exc}); another rank has probably ended "
                f"(killed, out of memory or failed): its own output says why\n")
    try:
        sys.stdout.flush()
        tb = "" if isinstance(exc, (SystemExit, MPI.Exception)) else "".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__))
        # One write, the summary first (and again after a traceback, where it is seen last): mpiexec
        # may stop forwarding output as soon as the abort reaches it, so give it a moment to read
        # the pipe (seen losing the message otherwise).
        sys.stderr.write(line + tb + line if tb else line)
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
    finally:
        comm.Abort(code)
        os._exit(code)  # (MPI_Abort returned: end here, skipping the exit handlers' MPI_Finalize)


@contextlib.contextmanager
def abort_on_error(comm=None):
    """``with abort_on_error(comm): ...`` -- any exception on any rank ends all ranks (see ``fail_all``).

    With a single rank there is nobody to hang, so the exception propagates
    normally; ``sys.exit(0)`` is left alone.
    """
    comm = comm if comm is not None else MPI.COMM_WORLD
    try:
        yield
    except SystemExit as e:
        if e.code in (None, 0) or comm.Get_size() == 1:
            raise
        fail_all(comm, e, e.code if isinstance(e.code, int) else 1)
    except BaseException as e:
        if comm.Get_size() == 1:
            raise
        fail_all(comm, e)
