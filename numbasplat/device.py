"""The CuPy kit: streams, asynchronous copies, page-locked host memory and device timing.

A real GPU runs what the host queues while the host goes on; these helpers keep it so.
``HostCopy`` brings an array to the host without the host waiting at once; ``DeviceValues``
rewrites a small device array every step at a fixed address (a captured step graph reads it
there); ``pinned_empty`` allocates page-locked host memory, from which and into which copies
need no wait (``is_pinned``, ``release_pinned``); ``copy_rows`` and ``CopyStream`` move rows
between host and device beside the kernels' stream, ``StagingRing`` through page-locked buffers where the
host's rows are not page-locked; ``DeviceInterval`` times a span of queued work; ``cap_device_memory``
bounds CuPy's pool.  The aggregate device's kit (``numbasplat.placement``) is at the end: a stream
per part of its split operators (``PartStreams``), and for real GPUs managed memory, its advice and
prefetches, a reserve that caps a GPU, and the GPUs' peer access.  On the CPU backend and in the CUDA simulator
(numpy arrays: ``numbasplat.backend.on_gpu`` is False) every call does its work at once.
"""
import time
from contextlib import contextmanager, nullcontext

import numpy as np

from .backend import array_module, is_device, on_gpu


class HostCopy:
    """A device array on its way to the host: the copy is queued now (into pinned memory) and
    waited for in ``get()``, so the host can queue more GPU work before it waits (a plain
    ``to_host`` leaves the GPU idle until the host has caught up).  Numpy arrays pass through.
    ``into``: a ``pinned_empty`` array of ``a``'s shape and dtype to copy into, for a caller that
    copies every step and reads each copy before it queues the next (no page-locked allocation)."""

    def __init__(self, a, into=None):
        self._event = None
        if not is_device(a):
            self._host = np.asarray(a)
            return
        import cupy
        a = cupy.ascontiguousarray(a)
        if into is not None and (into.shape != a.shape or into.dtype != a.dtype):
            raise ValueError(f"HostCopy: into is {into.dtype}{into.shape}, the array {a.dtype}{a.shape}")
        self._host = pinned_empty(a.shape, a.dtype) if into is None else into
        queue_to_host(a, self._host)
        self._event = cupy.cuda.get_current_stream().record()
        self._source = a  # kept until the copy is done

    def get(self):
        """The host array (waits for the copy the first time)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = self._source = None
        return self._host


class DeviceValues:
    """A small device array that the host rewrites every step without a sync, at a fixed address
    (a captured step graph reads it there: ``engine.pipelines.step_graphs``).  ``write(values)`` queues a
    copy from one of ``SLOTS`` page-locked buffers, each reused only once its last copy is done
    (an upload from pageable memory may wait for the GPU to idle; a new array each step would
    move).  The buffers are shared by every instance of a size and kept for the process, so that
    an instance dropped while its copy is queued (a working model's Adam) leaves the buffer alone.
    A numpy array on the CPU backend and in the simulator, written in place."""
    SLOTS = 8
    _rings = {}  # (size, dtype) -> [slots, the event after each slot's last copy, the next slot]

    def __init__(self, n, dtype=np.float32, backend=None):
        self.array = array_module(backend).zeros(n, dtype)
        self._device = is_device(self.array)

    def write(self, values):
        """Queue ``values`` (n of them) into ``array`` on the current stream; -> ``array``."""
        if not self._device:
            self.array[...] = values
            return self.array
        import cupy
        a = self.array
        ring = self._rings.setdefault((a.size, a.dtype.str), [[None] * self.SLOTS, [None] * self.SLOTS, 0])
        slots, done, k = ring
        ring[2] = (k + 1) % self.SLOTS
        if done[k] is not None:
            done[k].synchronize()
        if slots[k] is None:
            slots[k] = pinned_empty(a.shape, a.dtype)
        slots[k][...] = values
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(a.data.ptr, slots[k].ctypes.data, a.nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream.ptr)
        done[k] = stream.record()
        return a


def queue_to_host(a, into):
    """Queue the copy of the contiguous array ``a`` into the host array ``into`` (page-locked, of its
    shape and dtype) on the current stream; a plain copy for numpy."""
    if not is_device(a):
        into[...] = a
        return
    import cupy
    cupy.cuda.runtime.memcpyAsync(into.ctypes.data, a.data.ptr, a.nbytes, cupy.cuda.runtime.memcpyDeviceToHost,
                                  cupy.cuda.get_current_stream().ptr)


def stream_event():
    """An event recorded now on the current stream (None on the CPU and in the simulator):
    ``.synchronize()`` waits for what was queued before it."""
    if not on_gpu():
        return None
    import cupy
    return cupy.cuda.get_current_stream().record()


class GraphScratch:
    """A memory pool and a stream of CUDA graphs' own: the scratch arrays of the steps that
    ``capture_graph`` captures come from the pool, which nothing else allocates from (a graph keeps
    the addresses it was captured with), and the graphs are captured and launched on the stream
    (blocking: ordered with the default stream's work)."""

    def __init__(self):
        import cupy
        self.pool, self.stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream()

    def free(self):
        """Let the scratch go (every graph captured with it dropped first)."""
        self.pool.free_all_blocks()


def capture_graph(call, scratch):
    """``call()``'s device work captured into a CUDA graph on ``scratch`` (a ``GraphScratch``), its
    arrays allocated from the scratch's pool.  -> (the graph: ``graph.launch(scratch.stream)`` queues
    it again; what ``call`` returned, kept allocated with the graph).  ``call`` must neither upload from
    the host nor wait for the device (either stops the capture)."""
    import cupy
    with scratch.stream, cupy.cuda.using_allocator(scratch.pool.malloc):
        scratch.stream.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
        try:
            outputs = call()
        finally:
            graph = scratch.stream.end_capture()
    return graph, outputs


def address(a):
    """Where the data of ``a`` (a device or a numpy array) starts."""
    return a.data.ptr if is_device(a) else a.__array_interface__["data"][0]


def pinned_empty(shape, dtype=np.float32):
    """An uninitialised host array in page-locked memory, from which and into which the GPU copies
    without the host waiting (``copy_rows``); a plain one where no GPU runs or none can be locked."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    if not on_gpu():
        return np.empty(shape, dtype)
    import cupy
    try:
        memory = cupy.cuda.alloc_pinned_memory(max(size, 1))
    except (cupy.cuda.memory.OutOfMemoryError, cupy.cuda.runtime.CUDARuntimeError, MemoryError):
        return np.empty(shape, dtype)
    return np.frombuffer(memory, dtype, int(np.prod(shape))).reshape(shape)


def is_pinned(a):
    """Whether host array ``a`` lies in page-locked memory (``pinned_empty``'s)."""
    if not on_gpu() or not isinstance(a, np.ndarray):
        return False
    import cupy
    return cupy.cuda.runtime.pointerGetAttributes(a.ctypes.data).type == cupy.cuda.runtime.memoryTypeHost


def release_pinned():
    """Give the page-locked memory no array holds back to the system (CuPy keeps it for reuse)."""
    if on_gpu():
        import cupy
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def copy_rows(dst, dst_row, src, src_row, rows, stream=None):
    """``dst[dst_row:dst_row + rows] = src[src_row:src_row + rows]`` for C-contiguous arrays of one row
    width (1-D: a row is an element), host or device either side.  With a device array it is queued on ``stream``
    (a ``CopyStream``; None: the current stream) and the host does not wait where the host side is
    page-locked: the host must not touch those rows, nor free either array, before the stream is done."""
    if not is_device(dst) and not is_device(src):
        dst[dst_row:dst_row + rows] = src[src_row:src_row + rows]
        return
    import cupy
    row, dst_row, src_row, rows = src.strides[0], int(dst_row), int(src_row), int(rows)
    handle = stream.stream.ptr if stream is not None else cupy.cuda.get_current_stream().ptr
    pointer = (lambda a: a.data.ptr if is_device(a) else a.ctypes.data)
    cupy.cuda.runtime.memcpyAsync(pointer(dst) + dst_row * row, pointer(src) + src_row * row, rows * row,
                                  cupy.cuda.runtime.memcpyDefault, handle)


class CopyStream:
    """A CUDA stream for host<->device copies beside the kernels' stream (CuPy's current one; Numba
    launches on the legacy default stream, with which a non-blocking stream does not serialise), so
    that a step's moves overlap the kernels of the step before.  ``after_kernels``: copies queued next
    wait for the kernels queued so far; ``kernels_after``: kernels queued next wait for the copies
    queued so far.  On the CPU and in the simulator copies finish as they are made: every call is a no-op."""

    def __init__(self):
        self.stream = None
        if on_gpu():
            import cupy
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._last = None  # the event after the copies queued so far

    def after_kernels(self):
        if self.stream is not None:
            import cupy
            self.stream.wait_event(cupy.cuda.get_current_stream().record())

    def queued(self):
        """Copies were queued since the last ``kernels_after``."""
        if self.stream is not None:
            self._last = self.stream.record()

    def kernels_after(self):
        if self._last is not None:
            import cupy
            cupy.cuda.get_current_stream().wait_event(self._last)
            self._last = None

    def synchronize(self):
        if self.stream is not None:
            self.stream.synchronize()
            self._last = None


def event_on(stream=None):
    """An event recorded now on ``stream`` (a ``CopyStream``; None: the current stream), None on the CPU
    and in the simulator: ``.synchronize()`` waits for what was queued there before it."""
    if stream is not None and stream.stream is not None:
        return stream.stream.record()
    return stream_event() if stream is None else None


class StagingRing:
    """Page-locked staging buffers of ``rows`` rows of ``columns`` float32 each, used in turn, between
    host arrays in pageable memory (disk mode's blocks) and a device table: a move goes through the next
    buffer (waiting first for the copies the buffer's last use queued), so that the device copies from
    and into page-locked memory without the host waiting on each.  On the CPU and in the simulator
    ``pinned_empty`` gives plain arrays and the copies finish as they are made."""

    def __init__(self, rows, columns, buffers=2):
        self.rows = int(rows)
        self.buffers = [pinned_empty((self.rows, columns), np.float32) for _ in range(buffers)]
        self.done = [None] * buffers  # the event after each buffer's last copies
        self.next = 0

    def _take(self):
        """The next buffer, once its last copies are done."""
        k, self.next = self.next, (self.next + 1) % len(self.buffers)
        if self.done[k] is not None:
            self.done[k].synchronize()
            self.done[k] = None
        return k

    def _batches(self, sizes):
        """``sizes`` (rows of each move, each at most ``rows``) cut into runs that fit one buffer: -> lists of
        (the move's place in ``sizes``, its first row in the buffer)."""
        batch, used = [], 0
        for j, size in enumerate(sizes):
            if size > self.rows:
                raise ValueError(f"StagingRing: a move of {size} rows exceeds the buffers' {self.rows}")
            if used + size > self.rows:
                yield batch
                batch, used = [], 0
            batch.append((j, used))
            used += size
        if batch:
            yield batch

    def upload(self, tables, table, starts, stream=None):
        """``table[starts[j]:starts[j] + len(tables[j])] = tables[j]`` for each host array ``tables[j]``, queued
        on ``stream`` (``copy_rows``'s) from the staging buffers: the host returns once the last buffer it
        filled is free, not when the copies are done."""
        def fill(j, into):
            into[...] = tables[j]
        self.upload_filled(table, starts, [len(t) for t in tables], fill, stream)

    def upload_filled(self, table, starts, sizes, fill, stream=None):
        """``upload``'s copies of ``sizes[j]`` rows to ``table[starts[j]:]`` for each j, each written into its staging
        rows by ``fill(j, into)`` (``into``: a view of a staging buffer) instead of copied from a host array: a
        gather made straight into page-locked memory."""
        for batch in self._batches(sizes):
            k = self._take()
            for j, at in batch:
                fill(j, self.buffers[k][at:at + sizes[j]])
                copy_rows(table, starts[j], self.buffers[k], at, sizes[j], stream)
            self.done[k] = event_on(stream)

    def download(self, table, starts, sizes, stream=None):
        """For each j, the rows ``table[starts[j]:starts[j] + sizes[j]]`` on the host: yields them in turn, views
        of a staging buffer valid until the next is yielded from another batch (copy what is kept)."""
        for batch in self._batches(sizes):
            k = self._take()
            for j, at in batch:
                copy_rows(self.buffers[k], at, table, starts[j], sizes[j], stream)
            event = event_on(stream)
            if event is not None:
                event.synchronize()
            for j, at in batch:
                yield self.buffers[k][at:at + sizes[j]]


class DeviceInterval:
    """The time the current stream takes from ``__init__`` to ``stop()`` (a span of work queued
    between them, and any wait on another stream in it), read later without waiting: ``seconds()``
    is None until the GPU has run it.  Host time on the CPU and in the simulator."""

    def __init__(self):
        self._start, self._end, self._host = None, None, time.perf_counter()
        if on_gpu():
            import cupy
            self._start = cupy.cuda.get_current_stream().record()

    def stop(self):
        if self._start is None:
            self._host = time.perf_counter() - self._host
        else:
            import cupy
            self._end = cupy.cuda.get_current_stream().record()
        return self

    def seconds(self):
        if self._start is None:
            return self._host
        if not self._end.done:
            return None
        import cupy
        return cupy.cuda.get_elapsed_time(self._start, self._end) / 1e3


def cap_device_memory(nbytes):
    """Keep what CuPy's pool holds on the device within ``nbytes`` (0: no cap): an allocation that would
    pass it first hands back the blocks the pool keeps cached, and fails (``MemoryError``) only where
    the arrays alive need more.  The pool left alone would keep blocks of every size it has served
    (buffers sized by a varying working set) and grow past the cap although far less is in use."""
    if not on_gpu():
        return
    import cupy
    pool = cupy.get_default_memory_pool()
    pool.set_limit(size=int(nbytes))
    if not nbytes:
        cupy.cuda.set_allocator(pool.malloc)
        return

    def malloc(size):
        try:
            return pool.malloc(size)
        except cupy.cuda.memory.OutOfMemoryError:
            pool.free_all_blocks()
            return pool.malloc(size)
    cupy.cuda.set_allocator(malloc)


# --------------------------------------------------------------------------- the aggregate device
# (``numbasplat.placement`` on a GPU: its parts' streams, and with real GPUs, ``--devices``, the rest.
# Nothing here runs on the CPU backend or in the simulator: each helper returns at once there, or is
# called only on a GPU, ``PartStreams`` there with a test's fake of CuPy's streams.)

class PartStreams:
    """A CUDA stream for each part of the aggregate device's split operators (``numbasplat.placement``),
    forked from the caller's stream before an operator and joined back after it, so that the parts'
    kernels run side by side: on one GPU (virtual parts) each part's launches hold a share of the
    work too small to fill the GPU alone, and one after another their tails leave it idle; on
    separate GPUs (``devices``, each stream on its part's GPU) they run at once.

    ``fork()`` records an event on the caller's stream; ``on_part(k, fork)`` makes part ``k``'s stream
    wait for it (for everything the caller had queued) and current for what runs inside; ``join()`` makes
    the caller's stream wait for an event recorded on every part's stream.  Inside a captured CUDA graph
    (``capture_graph``) that wait on the capturing stream's event draws each part's stream into the
    capture, and the fork and join become the graph's parallel branches.  ``api``: CuPy's ``cupy.cuda``
    (streams, events, devices), or a test's recording fake of it."""

    def __init__(self, parts, devices=None, api=None):
        if api is None:
            import cupy
            api = cupy.cuda
        self.api = api
        self.devices = devices  # (None: every stream on the current device)
        self.streams = []
        for k in range(parts):
            with self._on_device(k):
                self.streams.append(api.Stream(non_blocking=True))
        self._events = []  # the last operator's, kept alive until the next fork (a graph's capture reads them)

    def _on_device(self, k):
        return self.api.Device(self.devices[k]) if self.devices is not None else nullcontext()

    def fork(self):
        """An event on the caller's stream after everything queued there: each part starts after it."""
        event = self.api.get_current_stream().record(self.api.Event(disable_timing=True))
        self._events = [event]
        return event

    @contextmanager
    def on_part(self, k, fork):
        """Queue what runs inside on part ``k``'s stream (and its GPU), after the event ``fork``."""
        with self._on_device(k):
            self.streams[k].wait_event(fork)
            with self.streams[k]:
                yield

    def join(self):
        """Make the caller's stream wait for everything queued on every part's stream."""
        caller = self.api.get_current_stream()
        for k, stream in enumerate(self.streams):
            with self._on_device(k):
                done = stream.record(self.api.Event(disable_timing=True))
            caller.wait_event(done)
            self._events.append(done)


def managed_memory():
    """Allocate CuPy's arrays from here on in CUDA managed memory (one address space over the
    host and every GPU, paged on demand: a model larger than a GPU's memory pages in from the
    host), through a pool of managed blocks.  -> the pool."""
    import cupy
    pool = cupy.cuda.MemoryPool(cupy.cuda.malloc_managed)
    cupy.cuda.set_allocator(pool.malloc)
    return pool


def _managed_span(a, first, last):
    """(address, bytes) of rows first..last-1 of the C-contiguous device array ``a``."""
    row = a.nbytes // max(a.shape[0], 1) if a.ndim else a.nbytes
    return a.data.ptr + first * row, (last - first) * row


def advise_rows(arrays, first, last, device_id, others=()):
    """Prefer GPU ``device_id`` for rows first..last-1 of each managed array in ``arrays`` (where the
    pages live), and map them for ``others`` (GPU ids) to read and write in place over peer
    access instead of migrating (``cudaMemAdvise``)."""
    import cupy
    rt = cupy.cuda.runtime
    for a in arrays:
        ptr, size = _managed_span(a, first, last)
        if size:
            rt.memAdvise(ptr, size, rt.cudaMemAdviseSetPreferredLocation, device_id)
            for d in others:
                rt.memAdvise(ptr, size, rt.cudaMemAdviseSetAccessedBy, d)


def prefetch_rows(arrays, first, last, device_id):
    """Queue the migration of rows first..last-1 of each managed array in ``arrays`` to GPU
    ``device_id`` on the current stream (``cudaMemPrefetchAsync``), before a part reads them;
    ``device_id`` None (virtual devices, the CPU backend, the simulator): nothing."""
    if device_id is None or not on_gpu():
        return
    import cupy
    stream = cupy.cuda.get_current_stream().ptr
    for a in arrays:
        if is_device(a):
            ptr, size = _managed_span(a, first, last)
            if size:
                cupy.cuda.runtime.memPrefetchAsync(ptr, size, device_id, stream)


def free_bytes():
    """The GPU's free memory plus what CuPy's pool holds unused: what new arrays can take."""
    import cupy
    free, _ = cupy.cuda.runtime.memGetInfo()
    return free + cupy.get_default_memory_pool().free_bytes()


def reserve_device_memory(keep_free, device_id=None):
    """Hold all but ``keep_free`` bytes of the GPU's free memory in one allocation outside CuPy's
    pool, so that only ``keep_free`` remain for the run (``--gpu-memory`` with ``--devices 1``:
    managed memory then pages the rest of the model in from the host).  -> the held block
    (keep it alive), None where nothing needs holding."""
    import cupy
    with cupy.cuda.Device(device_id if device_id is not None else cupy.cuda.Device().id):
        free, _ = cupy.cuda.runtime.memGetInfo()
        hold = free - int(keep_free)
        if hold <= 0:
            return None
        return cupy.cuda.memory.Memory(hold)  # (cudaMalloc, not managed: never paged out)


def peer_access():
    """{(i, j): whether GPU i can reach GPU j's memory directly (NVLink or PCIe peer access)} over
    the visible GPUs, i != j."""
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    return {(i, j): bool(cupy.cuda.runtime.deviceCanAccessPeer(i, j)) for i in range(n) for j in range(n) if i != j}


def enable_peer_access(devices):
    """Let each of ``devices`` read and write the others' memory directly (where it can)."""
    import cupy
    for i in devices:
        with cupy.cuda.Device(i):
            for j in devices:
                if i != j and cupy.cuda.runtime.deviceCanAccessPeer(i, j):
                    try:
                        cupy.cuda.runtime.deviceEnablePeerAccess(j)
                    except cupy.cuda.runtime.CUDARuntimeError:  # (already enabled)
                        pass
