"""The out-of-core model's tiers off the device: every block's table in host memory (``HostBlocks``), or
in files with host memory a cache of them (``DiskBlocks``)."""
import errno
import os
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .layout import format_bytes

def own_memory(table):
    """``table``, or a copy where it is a view: a view keeps the whole array it views alive (a step's
    write-back of many blocks is one array), which host memory would then hold beside the blocks."""
    return np.array(table) if table.base is not None else table


class HostBlocks:
    """Every block's table in host memory (``--offload host``); ``read_bytes``/``written_bytes``
    count the disk's traffic (none here)."""

    def __init__(self):
        self.tables = {}
        self.whole = None  # the array of every block's rows, block after block, where the blocks are views of one
        self.read_bytes = self.written_bytes = 0

    def reset(self, tables, whole=None):
        """Hold ``tables`` ({block: its rows' table}) instead of what was held; ``whole``: the array
        they are views of, block after block (block b's from row ``index.starts[b]``), if they are:
        the whole model is then gathered from it without a second copy of the table."""
        self.tables, self.whole = dict(tables), whole

    def get(self, b):
        return self.tables[b]

    def put(self, b, table):
        """Block ``b``'s rows now, copied into its table in place: the blocks stay the one array that
        ``reset`` was given views of, so host memory holds the model once however often parts of it
        come back from the device."""
        held = self.tables.get(b)
        if held is not None and held.shape == table.shape:
            held[...] = table
        else:
            self.tables[b], self.whole = own_memory(table), None

    def close(self):
        self.tables, self.whole = {}, None


class DiskBlocks(HostBlocks):
    """Every block's table in a file of its own in a fresh folder in ``folder`` (``--offload-dir``,
    removed at the end), host memory a cache of at most ``capacity`` bytes (``--host-memory``): the
    least recently used blocks leave it first, written back if they changed.  The files are a
    working copy, rewritten from the model at each resume: the snapshot (HDF5, written atomically
    by the trainer) is what a crash leaves.  With ``prefetch``, a thread reads ``prefetch``'s blocks
    ahead into a staging area of a quarter of ``capacity``."""

    def __init__(self, folder, capacity, prefetch=True):
        super().__init__()
        self.folder_arg = folder
        try:
            os.makedirs(folder, exist_ok=True)
            self.folder = tempfile.mkdtemp(prefix="numbasplat-blocks-", dir=folder)
        except OSError as e:
            raise OSError(e.errno, f"--offload-dir {folder} is not a writable folder: "
                                   f"{e.strerror or e}") from None
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True)
        self.capacity = int(capacity)
        self.staging_capacity = self.capacity // 4 if prefetch else 0
        self.cache = OrderedDict()  # block: table, the most recently used last
        self.dirty = set()
        self.cached_bytes = 0
        self.shapes = {}
        self.generation = 0
        self.version = {}  # block: puts so far (a read ahead of an older version is dropped)
        self.staged = {}
        self.staged_bytes = 0
        self.lock = threading.Lock()
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="offload-prefetch") if prefetch else None
        self.pending = None
        self.prefetched_bytes = 0

    def _path(self, b, generation=None):
        return os.path.join(self.folder, f"g{self.generation if generation is None else generation}-b{b}.f32")

    def reset(self, tables, whole=None):  # (``whole`` unused: the blocks are files, a few of them cached)
        self._wait()
        largest = max((t.nbytes for t in tables.values()), default=0)
        if largest > self.capacity - self.staging_capacity:
            raise ValueError(f"--host-memory {format_bytes(self.capacity)} is too small: a block of the model "
                             f"takes {format_bytes(largest)} (and the read-ahead a quarter of the cap); give "
                             f"--host-memory {format_bytes(int(np.ceil(largest * 4 / 3)))} or more")
        old = self.generation
        with self.lock:
            self.generation += 1
            self.cache.clear()
            self.staged.clear()
            self.dirty.clear()
            self.cached_bytes = self.staged_bytes = 0
            self.shapes = {b: t.shape for b, t in tables.items()}
            self.version = dict.fromkeys(tables, 0)
        for b, t in tables.items():
            self.put(b, t)
        for name in os.listdir(self.folder):  # the blocks before
            if name.startswith(f"g{old}-"):
                os.unlink(os.path.join(self.folder, name))

    def get(self, b):
        with self.lock:
            if b in self.cache:
                self.cache.move_to_end(b)
                return self.cache[b]
            table = self.staged.pop(b, None)
            if table is not None:
                self.staged_bytes -= table.nbytes
        if table is None:
            table = self._read(b)
        self._insert(b, table, dirty=False)
        return table

    def put(self, b, table):
        """Block ``b``'s rows now, in the cache (an array of their own: the cap counts each block alone)."""
        with self.lock:
            self.version[b] = self.version.get(b, 0) + 1
            old = self.staged.pop(b, None)
            if old is not None:
                self.staged_bytes -= old.nbytes
        self._insert(b, own_memory(table), dirty=True)

    def _insert(self, b, table, dirty):
        with self.lock:
            old = self.cache.pop(b, None)
            self.cached_bytes += table.nbytes - (0 if old is None else old.nbytes)
            self.cache[b] = table
            if dirty:
                self.dirty.add(b)
            evicted = []
            while self.cached_bytes > self.capacity - self.staging_capacity and len(self.cache) > 1:
                e, t = self.cache.popitem(last=False)
                self.cached_bytes -= t.nbytes
                if e in self.dirty:
                    self.dirty.discard(e)
                    evicted.append((e, t))
        for e, t in evicted:  # (the main thread writes; the reader thread only reads files of blocks not cached)
            self._write(e, t)

    def _read(self, b, generation=None):
        """Block ``b``'s table from its file (of ``generation``, default the current one's), counted."""
        table = np.fromfile(self._path(b, generation), np.float32).reshape(self.shapes[b])
        with self.lock:
            self.read_bytes += table.nbytes
        return table

    def _write(self, b, table):
        """Write block ``b``'s file; a failure (a full disk) stops training with one message."""
        path = self._path(b)
        data = memoryview(np.ascontiguousarray(table)).cast("B")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                done = 0
                while done < len(data):
                    done += os.write(fd, data[done:])
            finally:
                os.close(fd)
        except OSError as e:
            why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise OSError(e.errno, f"--offload-dir {self.folder_arg}: cannot write a block of the model "
                                   f"({why}); training stopped, the last snapshot is kept") from None
        self.written_bytes += len(data)

    # ------------------------------------------------------------------ reading ahead
    def prefetch(self, blocks):
        """Read ahead, on the reader thread, those of ``blocks`` that are neither cached nor staged
        (as many as the staging area holds)."""
        if self.reader is None or (self.pending is not None and not self.pending.done()):
            return
        self._wait()
        with self.lock:
            wanted = [(int(b), self.version.get(int(b), 0)) for b in blocks
                      if b not in self.cache and b not in self.staged]
            generation = self.generation
        if wanted:
            self.pending = self.reader.submit(self._read_ahead, wanted, generation)

    def _read_ahead(self, wanted, generation):
        for b, version in wanted:
            with self.lock:
                room = self.staging_capacity - self.staged_bytes
                if generation != self.generation or 4 * int(np.prod(self.shapes[b])) > room:
                    return
            table = self._read(b, generation)
            with self.lock:  # kept only if nothing changed the block meanwhile
                if (generation == self.generation and self.version.get(b) == version and b not in self.cache
                        and b not in self.staged):
                    self.staged[b] = table
                    self.staged_bytes += table.nbytes
                    self.prefetched_bytes += table.nbytes

    def _wait(self):
        """Wait for the read ahead in flight (its errors are not the step's: a read repeats it)."""
        if self.pending is not None:
            try:
                self.pending.result()
            except OSError:
                pass
            self.pending = None

    def close(self):
        self._wait()
        if self.reader is not None:
            self.reader.shutdown()
        self.cache.clear()
        self.staged.clear()
        self._finalizer()
