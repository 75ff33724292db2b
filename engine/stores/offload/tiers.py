"""The out-of-core model's tiers off the device: every block's table in host memory (``HostBlocks``), or
in files with host memory a cache of them (``DiskBlocks``)."""
import errno
import os
import shutil
import socket
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

    def reset_unwritten(self, starts, sizes, columns):
        """Hold blocks of ``sizes`` rows of ``columns`` (block b's from row ``starts[b]`` of one table) whose rows are
        not here yet: each is ``put`` before it is read (the device's pool holds them all, changed)."""
        whole = np.empty((int(np.sum(sizes)), columns), np.float32)  # (its pages untouched until written)
        self.reset({b: whole[starts[b]:starts[b] + sizes[b]] for b in range(len(sizes))}, whole=whole)

    def get(self, b):
        return self.tables[b]

    def scan(self, b):
        """Block ``b``'s table for a pass over every block (a refinement's, a save's): ``get``'s here."""
        return self.tables[b]

    def remove_model_order(self):
        """(Host mode saves from its one table: no file of the model in model order.)"""

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


def remove_abandoned(folder, keep=None):
    """Remove the block folders (``DiskBlocks``') in ``folder`` but ``keep`` that a process of this host made and
    that has ended without removing its folder (a crash, a kill): their files are a working copy that no run reads
    again (a resume rewrites its own from the snapshot).  A folder of another host (a shared file system), of a
    process still running, or whose name names none (an older version's) stays.  -> the folders removed."""
    removed = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        pid, at, host = name[len(DiskBlocks.PREFIX):].rpartition("-")[0].partition("@")
        if not name.startswith(DiskBlocks.PREFIX) or path == keep or not at or not pid.isdigit():
            continue
        if host == socket.gethostname() and not process_runs(int(pid)) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def process_runs(pid):
    """Whether process ``pid`` of this host runs (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        pass
    return True


class DiskBlocks(HostBlocks):
    """Every block's table in a file of its own in a fresh folder in ``folder`` (``--offload-dir``,
    removed at the end), host memory a cache of at most ``capacity`` bytes (``--host-memory``): the
    least recently used blocks leave it first, written back if they changed.  The files are a
    working copy, rewritten from the model at each resume: the snapshot (HDF5, written atomically
    by the trainer) is what a crash leaves.  A crash leaves the folder too (nothing removes it): the
    folder's name names its process and host (``PREFIX``), and a later start in ``folder`` removes those of
    this host whose process has ended (``remove_abandoned``), which may hold as much as the model.

    Blocks in transit take a quarter of ``capacity`` (where either thread runs), the cache the rest:
    with ``prefetch``, a reader thread reads ``prefetch``'s blocks ahead into a staging area; with
    ``write_behind``, a writer thread writes the blocks that leave the cache changed, so that neither
    the reads nor the writes hold up the training thread while the disk keeps up.  A block on its way
    to its file stays reachable (``writing``) until it is there: a read of it is served from memory,
    never from a file half written, and its bytes count toward the cap, the training thread waiting
    for the oldest writes where they fall behind.  A write's failure (a full disk) stops training at
    the next call with one message, the last snapshot kept.

    A pass over every block (``scan``) reads them without the cache: a refinement block by block writes its new
    blocks as the files of the next generation (``put_next``) while it reads the blocks before, which stay whole
    until ``advance`` makes the new ones the tier's; a save reads the model in model order from a file of its
    columns (``in_model_order``)."""

    PREFIX = "numbasplat-blocks-"  # each run's folder in ``--offload-dir``: PREFIX, then PID@HOST-, then random

    def __init__(self, folder, capacity, prefetch=True, write_behind=True):
        super().__init__()
        self.folder_arg = folder
        try:
            os.makedirs(folder, exist_ok=True)
            self.folder = tempfile.mkdtemp(prefix=f"{self.PREFIX}{os.getpid()}@{socket.gethostname()}-", dir=folder)
        except OSError as e:
            raise OSError(e.errno, f"--offload-dir {folder} is not a writable folder: "
                                   f"{e.strerror or e}") from None
        self.removed_abandoned = remove_abandoned(folder, keep=self.folder)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True)
        self.capacity = int(capacity)
        self.staging_capacity = self.capacity // 4 if prefetch or write_behind else 0  # the blocks in transit
        self.cache = OrderedDict()  # block: table, the most recently used last
        self.dirty = set()
        self.cached_bytes = 0
        self.shapes = {}
        self.generation = 0
        self.version = {}  # block: puts so far (a read ahead of an older version is dropped)
        self.next_shapes = {}  # block: its shape, of the blocks ``put_next`` wrote for the next generation
        self.ordered = None  # (what it holds, its path, {columns: offset}): the last ``in_model_order`` file
        self.staged = {}
        self.staged_bytes = 0
        self.reading, self.reading_bytes = None, 0  # (generation, block) that the reader thread reads now, its room
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # (notified as blocks leave transit)
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="offload-prefetch") if prefetch else None
        self.pending = None
        self.prefetched_bytes = 0
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="offload-write") if write_behind else None
        self.writing = {}  # block: (version, table) of its latest write in flight
        self.writes_in_flight = 0
        self.writing_bytes = 0  # the bytes of the writes in flight (a block written twice counts twice)
        self.failure = None  # a write's error, raised on the training thread
        self.failure_raised = False

    def _path(self, b, generation=None):
        return os.path.join(self.folder, f"g{self.generation if generation is None else generation}-b{b}.f32")

    def reset(self, tables, whole=None):  # (``whole`` unused: the blocks are files, a few of them cached)
        old = self._new_generation({b: t.shape for b, t in tables.items()})
        for b, t in tables.items():
            self.put(b, t)
        self._remove_generation(old)

    def reset_unwritten(self, starts, sizes, columns):
        """``HostBlocks.reset_unwritten``: a generation of blocks with no files yet (each is ``put`` first)."""
        self._remove_generation(self._new_generation({b: (int(k), columns) for b, k in enumerate(sizes)}))

    def reset_appended(self, shapes, runs):
        """Hold a new generation of blocks of ``shapes`` ({block: shape}) made of ``runs`` ((block, its next rows),
        each block's in its row order), appended to the blocks' files as they come: host memory holds what ``runs``
        makes at a time (a slice of a model cut into blocks, ``OutOfCoreStore.hold_new``), never the model."""
        old = self._new_generation(shapes)
        appended = dict.fromkeys(shapes, 0)
        for b, rows in runs:
            self._write(b, rows, self.generation, append=True)
            appended[b] += len(rows)
        short = {b: (appended[b], shape[0]) for b, shape in shapes.items() if appended[b] != shape[0]}
        if short:
            raise RuntimeError("blocks were not given their rows (block: (given, rows)): "
                               f"{dict(list(short.items())[:5])}")
        self._remove_generation(old)

    def _new_generation(self, shapes):
        """``_renew`` for blocks of ``shapes``, after the writes in flight landed (the files before go after them; a
        failure raised) and the cap checked against the largest block.  -> the generation before."""
        self._wait()
        self.flush()
        largest = 4 * max((int(np.prod(shape)) for shape in shapes.values()), default=0)
        if largest > self.capacity - self.staging_capacity:
            raise ValueError(f"--host-memory {format_bytes(self.capacity)} is too small: a block of the model "
                             f"takes {format_bytes(largest)} (and the reads ahead and writes behind a quarter of the "
                             f"cap); give --host-memory {format_bytes(int(np.ceil(largest * 4 / 3)))} or more")
        return self._renew(shapes)

    def put_next(self, b, table):
        """Block ``b`` of the next generation (a refinement's new blocks, ``advance``), written to its file while
        the blocks now are still read: their cache and files stay as they are.  Behind, on the writer thread, where
        ``write_behind`` (its bytes counted in transit: the training thread waits for the oldest writes where they
        fill the room), else at once."""
        self._raise_failure()
        table = np.ascontiguousarray(table)
        generation = self.generation + 1
        with self.changed:
            self.next_shapes[b] = table.shape
            if self.writer is not None:
                self.changed.wait_for(lambda: self.writes_in_flight == 0
                                      or self._in_transit() + table.nbytes <= self.staging_capacity)
                self.writes_in_flight += 1
                self.writing_bytes += table.nbytes
                self.writer.submit(self._write_next, b, table, generation)
                return
        self._write(b, table, generation)

    def advance(self, blocks):
        """The blocks 0 .. ``blocks`` - 1 that ``put_next`` wrote are the tier's now: their writes landed (a failure
        raised, the blocks before then kept), the blocks before and their cache let go, their files removed."""
        written, self.next_shapes = self.next_shapes, {}
        missing = [b for b in range(blocks) if b not in written]
        if missing:
            raise RuntimeError(f"blocks {missing[:5]} of the next generation were never written")
        self._wait()
        self.flush()
        self._remove_generation(self._renew({b: written[b] for b in range(blocks)}))

    def _renew(self, shapes):
        """A new generation of blocks of ``shapes`` ({block: shape}), none cached, none in transit (the reads
        ahead and the writes in flight landed first); -> the generation before."""
        old = self.generation
        with self.lock:
            self.generation += 1
            self.cache.clear()
            self.staged.clear()
            self.dirty.clear()
            self.writing.clear()
            self.cached_bytes = self.staged_bytes = 0
            self.shapes = dict(shapes)
            self.version = dict.fromkeys(shapes, 0)
        self.remove_model_order()
        return old

    def _remove_generation(self, generation):
        """The files of ``generation``'s blocks removed."""
        for name in os.listdir(self.folder):
            if name.startswith(f"g{generation}-"):
                os.unlink(os.path.join(self.folder, name))

    def get(self, b):
        """Block ``b``'s table: from the cache, the read ahead, the writes in flight, else its file."""
        self._raise_failure()
        with self.lock:
            if b in self.cache:
                self.cache.move_to_end(b)
                return self.cache[b]
            table = self.staged.pop(b, None)
            if table is not None:
                self.staged_bytes -= table.nbytes
                self.changed.notify_all()
            elif b in self.writing:
                table = self.writing[b][1]  # (its file is being written: the same rows, counted while in flight)
        if table is None:
            table = self._read(b)
        self._insert(b, table, dirty=False)
        return table

    def scan(self, b):
        """Block ``b``'s table for a pass over every block (a refinement's, a save's), as ``get`` finds it but
        not put in the cache: a pass over more blocks than it holds would only push out the blocks the next
        steps use, and write the changed ones."""
        self._raise_failure()
        with self.lock:
            table = self.cache.get(b)
            if table is None:
                table = self.staged.get(b)
            if table is None and b in self.writing:
                table = self.writing[b][1]
        return self._read(b) if table is None else table

    def put(self, b, table):
        """Block ``b``'s rows now, in the cache (an array of their own: the cap counts each block alone)."""
        self._raise_failure()
        if self.ordered is not None:
            self.remove_model_order()  # (no longer the model's rows: its room on the disk back)
        with self.lock:
            self.version[b] = self.version.get(b, 0) + 1
            old = self.staged.pop(b, None)
            if old is not None:
                self.staged_bytes -= old.nbytes
                self.changed.notify_all()
        self._insert(b, own_memory(table), dirty=True)

    def _insert(self, b, table, dirty):
        """Block ``b``'s ``table`` into the cache, the least recently used blocks out first to make room (the
        changed ones written, behind where ``write_behind``) and, where the writes in flight fill the room in
        transit, the oldest of them landed first: the cache, the reads ahead and the writes never hold more
        than the cap."""
        with self.lock:
            held = self.cache.get(b)
            if held is not None:
                self.cache.move_to_end(b)  # (the last out)
            need = table.nbytes - (0 if held is None else held.nbytes)
            evicted = []
            room = self.capacity - self.staging_capacity
            while self.cached_bytes + need > room and len(self.cache) > (held is not None):
                e, t = self.cache.popitem(last=False)
                self.cached_bytes -= t.nbytes
                if e in self.dirty:
                    self.dirty.discard(e)
                    if self.writer is not None:
                        self._write_behind(e, t)
                    else:
                        evicted.append((e, t))
            self.changed.wait_for(lambda: self.writes_in_flight == 0 or self._in_transit() <= self.staging_capacity)
            self.cache.pop(b, None)
            self.cache[b] = table
            self.cached_bytes += need
            if dirty:
                self.dirty.add(b)
            generation = self.generation
        for e, t in evicted:  # (the reader thread reads only files of blocks neither cached nor being written)
            self._write(e, t, generation)
        self._raise_failure()

    def _in_transit(self):
        """The bytes between the cache and the files: read ahead, being read, being written (under the lock)."""
        return self.staged_bytes + self.reading_bytes + self.writing_bytes

    def _read(self, b, generation=None):
        """Block ``b``'s table from its file (of ``generation``, default the current one's), counted."""
        table = np.fromfile(self._path(b, generation), np.float32).reshape(self.shapes[b])
        with self.lock:
            self.read_bytes += table.nbytes
        return table

    def _write(self, b, table, generation, append=False):
        """Write block ``b``'s file of ``generation`` (``append``: ``table``'s rows after those written); a failure (a
        full disk) stops training with one message."""
        path = self._path(b, generation)
        data = memoryview(np.ascontiguousarray(table)).cast("B")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
            try:
                done = 0
                while done < len(data):
                    done += os.write(fd, data[done:])
            finally:
                os.close(fd)
        except OSError as e:
            raise self._cannot_write(e, "a block of the model") from None
        with self.lock:
            self.written_bytes += len(data)

    def _cannot_write(self, e, what):
        """The one-line error of a write of ``what`` in the folder that failed with ``e`` (a full disk)."""
        why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        return OSError(e.errno, f"--offload-dir {self.folder_arg}: cannot write {what} ({why}); training "
                                f"stopped, the last snapshot is kept")

    # ------------------------------------------------------------------ writing behind
    def _write_behind(self, b, table):
        """Hand block ``b``'s ``table`` to the writer thread; it stays in ``writing`` until its file is
        written (under the lock)."""
        entry = (self.version.get(b, 0), table)
        self.writing[b] = entry
        self.writes_in_flight += 1
        self.writing_bytes += table.nbytes
        self.writer.submit(self._write_in_flight, b, entry, self.generation)

    def _write_in_flight(self, b, entry, generation):
        """The writer thread's write of ``entry`` (version, table) to block ``b``'s file: the block leaves
        ``writing`` unless a later write of it is queued; an error kept for the training thread (the
        block then stays in ``writing``: its rows are in memory alone)."""
        with self.changed:  # (a file is never written while it is read)
            self.changed.wait_for(lambda: self.reading != (generation, b))
        failure = self._try_write(b, entry[1], generation)
        with self.changed:
            if failure is None and self.failure is None and self.writing.get(b, (None,))[0] == entry[0]:
                del self.writing[b]
            self._landed(entry[1].nbytes, failure)

    def _write_next(self, b, table, generation):
        """The writer thread's write of block ``b`` of the next generation (``put_next``: nothing reads it yet)."""
        failure = self._try_write(b, table, generation)
        with self.changed:
            self._landed(table.nbytes, failure)

    def _try_write(self, b, table, generation):
        """``_write`` on the writer thread: -> its error, kept for the training thread (after a failure nothing
        more is written: training stops)."""
        if self.failure is None:
            try:
                self._write(b, table, generation)
            except Exception as e:  # noqa: BLE001 (raised on the training thread at its next call)
                return e
        return None

    def _landed(self, nbytes, failure):
        """A write in flight of ``nbytes`` done, with ``failure`` (None: none) (under the lock)."""
        if failure is not None and self.failure is None:
            self.failure = failure
        self.writes_in_flight -= 1
        self.writing_bytes -= nbytes
        self.changed.notify_all()

    def flush(self):
        """Wait for the writes in flight (every block that left the cache changed then in its file); a
        write's failure raised."""
        with self.changed:
            self.changed.wait_for(lambda: self.writes_in_flight == 0)
        self._raise_failure()

    def _raise_failure(self, again=True):
        """Raise a write's failure on this (the training) thread: the one-line error ``_write`` made (once
        only where ``again`` is off)."""
        failure = self.failure
        if failure is None or (self.failure_raised and not again):
            return
        self.failure_raised = True
        if isinstance(failure, OSError):
            raise OSError(failure.errno, failure.strerror) from None
        raise failure

    # ------------------------------------------------------------------ the model in model order
    def in_model_order(self, index, ranges):
        """-> (path, {columns: offset}): a file of the model's columns ``ranges`` ((a, b) of the blocks' tables,
        whose ``BlockIndex`` is ``index``) in model order, each range a float32 (N, b - a) array from its offset,
        one after the other: what a snapshot and the PLY read a slice of rows at a time, the model not gathered
        in host memory.  A block holds rows from all over the model order, so it is made in two passes, each
        writing runs of rows: every block's rows appended to the part of a scratch file that holds the slice of
        model rows they fall in, then each slice (the last first) put in model order, its ranges written to
        their places, and the scratch file cut short before it.  Host memory: a block, then a slice and one
        range of it (a slice fills at most half the room in transit, which holds nothing while the store saves,
        and holds a block at least); the disk: the model once more and a slice, besides the blocks.  Kept, and
        given again, until a block changes (the PLY after the snapshot reads it too)."""
        key = (self.generation, len(index), tuple(ranges))
        if self.ordered is not None and self.ordered[0] == key:
            return self.ordered[1:]
        self._wait()
        self.flush()
        self.remove_model_order()
        n, shapes = len(index), [self.shapes[b] for b in range(index.blocks)]
        columns = shapes[0][1] if shapes else 1
        row_bytes = 4 * columns
        slice_rows = max(max((s[0] for s in shapes), default=1), self.staging_capacity // (2 * row_bytes))
        offsets, at = {}, 0
        for a, b in ranges:
            offsets[(a, b)] = at
            at += 4 * n * (b - a)
        path = os.path.join(self.folder, "model-order.f32")
        try:
            self._write_in_model_order(index, offsets, path, slice_rows, columns)
        except BaseException:
            if os.path.exists(path):
                os.unlink(path)
            raise
        self.ordered = (key, path, offsets)
        return path, offsets

    def _write_in_model_order(self, index, offsets, path, slice_rows, columns):
        """``in_model_order``'s two passes, into the file ``path`` (``offsets``: each range's), the slices of
        ``slice_rows`` rows of ``columns`` columns in a scratch file beside it, removed after."""
        n, row_bytes, what = len(index), 4 * columns, "the model in model order to save it"
        scratch = path[:-len(".f32")] + "-slices.f32"
        by_slice = self._open(scratch, os.O_RDWR, what)
        try:
            out = self._open(path, os.O_WRONLY, what)
            try:
                filled = np.zeros(-(-n // slice_rows), np.int64)  # each slice's rows appended so far
                for b in range(index.blocks):
                    table, members = self.scan(b), index.members(b)  # (its rows in model order)
                    part = members // slice_rows
                    for run in np.split(np.arange(len(members)), np.flatnonzero(np.diff(part)) + 1):
                        k = int(part[run[0]])
                        self._write_at(by_slice, table[run[0]:run[-1] + 1],
                                       (k * slice_rows + int(filled[k])) * row_bytes, what)
                        filled[k] += len(run)
                for start in reversed(range(0, n, slice_rows)):
                    stop = min(n, start + slice_rows)
                    rows = self._read_at(scratch, start * row_bytes, (stop - start) * columns).reshape(-1, columns)
                    appended = np.argsort(index.block[start:stop], kind="stable")  # (block after block, as pass 1)
                    for (a, b), offset in offsets.items():
                        ordered = np.empty((stop - start, b - a), np.float32)
                        ordered[appended] = rows[:, a:b]
                        self._write_at(out, ordered, offset + 4 * start * (b - a), what)
                    rows = ordered = None  # (let go before the next slice is read)
                    os.ftruncate(by_slice, start * row_bytes)
            finally:
                os.close(out)
        finally:
            os.close(by_slice)
            os.unlink(scratch)

    def _open(self, path, flags, what):
        """The file ``path`` opened anew (created, emptied) with ``flags``; a failure named (``what``)."""
        try:
            return os.open(path, flags | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise self._cannot_write(e, what) from None

    def _write_at(self, fd, array, offset, what):
        """``array``'s bytes written to the open file ``fd`` from ``offset``, counted; a failure named (``what``)."""
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        done = 0
        try:
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
        except OSError as e:
            raise self._cannot_write(e, what) from None
        with self.lock:
            self.written_bytes += len(data)

    def _read_at(self, path, offset, count):
        """``count`` float32 of the file ``path`` from ``offset``, counted."""
        values = np.fromfile(path, np.float32, count=count, offset=offset)
        with self.lock:
            self.read_bytes += values.nbytes
        return values

    def remove_model_order(self):
        """The last ``in_model_order`` file removed, its room on the disk back: once what was saved from it is
        written (the store's next step), or a block changed, or the blocks are new."""
        if self.ordered is not None:
            path, self.ordered = self.ordered[1], None
            if os.path.exists(path):
                os.unlink(path)

    # ------------------------------------------------------------------ reading ahead
    def prefetch(self, blocks):
        """Read ahead, on the reader thread, those of ``blocks`` that are neither cached, staged nor being
        written (as many as the room in transit holds)."""
        self._raise_failure()
        if self.reader is None or (self.pending is not None and not self.pending.done()):
            return
        self._wait()
        with self.lock:
            wanted = [(int(b), self.version.get(int(b), 0)) for b in blocks
                      if b not in self.cache and b not in self.staged and b not in self.writing]
            generation = self.generation
        if wanted:
            self.pending = self.reader.submit(self._read_ahead, wanted, generation)

    def _read_ahead(self, wanted, generation):
        """The reader thread's reads of ``wanted`` ((block, version)) into the staging area, while they fit the
        room in transit (the writes in flight landing first); a read is kept only if the block did not change."""
        for b, version in wanted:
            need = 4 * int(np.prod(self.shapes[b]))
            with self.changed:  # room for it, the writes in flight first landed where they take it
                self.changed.wait_for(lambda: self.writes_in_flight == 0 or self.failure is not None
                                      or self._in_transit() + need <= self.staging_capacity)
                if (generation != self.generation or self.failure is not None
                        or self._in_transit() + need > self.staging_capacity):
                    return
                if b in self.cache or b in self.staged or b in self.writing:
                    continue  # (in memory already: a file being written is never read)
                self.reading, self.reading_bytes = (generation, b), need
            try:
                table = self._read(b, generation)
            except (OSError, ValueError):  # (a file written meanwhile, at once: the read repeats on demand)
                continue
            finally:
                with self.changed:
                    self.reading, self.reading_bytes = None, 0
                    self.changed.notify_all()
            with self.lock:  # kept only if nothing changed the block meanwhile
                if (generation == self.generation and self.version.get(b) == version and b not in self.cache
                        and b not in self.staged and b not in self.writing):
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
        """Wait for the threads' reads and writes, remove the folder; a write's failure not yet raised then
        raised."""
        try:
            self._wait()
            with self.changed:
                self.changed.wait_for(lambda: self.writes_in_flight == 0)
        finally:
            for pool in (self.reader, self.writer):
                if pool is not None:
                    pool.shutdown()
            self.cache.clear()
            self.staged.clear()
            self.writing.clear()
            self.ordered = None
            self._finalizer()
        self._raise_failure(again=False)
