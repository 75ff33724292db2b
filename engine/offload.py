"""Out-of-core training (``--offload host|disk``): the model out of the device, which holds a view's working set.

All parameters, Adam moments and densification statistics live out of the device, a Gaussian's
values one row of a table (``RowLayout``).  The Gaussians are grouped into spatially coherent
blocks (``BlockIndex``: the Morton order of their centres, cut into blocks of about
``BLOCK_ROWS``), each with a box that holds its centres grown by its Gaussians' reach.  Three
levels hold the blocks' tables:

* the disk (``--offload disk``): a file per block in ``--offload-dir`` (``DiskBlocks``), with host
  memory a cache of them capped by ``--host-memory`` (least recently used out first, written back
  if changed; a thread reads the next view's blocks ahead);
* host memory (``--offload host``: every block, ``HostBlocks``);
* the device: a pool of block slots (``DeviceCache``), capped by ``--gpu-memory``, holding the
  blocks the recent views saw (least recently used out first, written back to the host).

One step, one view:

1. the view's blocks: those whose grown box the view can see, culled on the host from the boxes
   alone (``partition.visible_regions``); those the device lacks come in (the only transfers);
2. the working set, those blocks' rows in model order, is gathered from the pool into a model of its
   own, which renders, computes the loss and back-propagates as the single-GPU pipeline does, and
   steps Adam on the Gaussians the view saw (visible-only Adam: ``cfg.visible_adam`` must be on)
   with the whole model's step count; its rows go back to the pool, and its blocks' boxes are
   recomputed there (one kernel) for the host's culling, which reads them a step late
   (``BoxesInFlight``: the host queues the next step without waiting for this one);
3. where the strategy densifies or resets (``DefaultStrategy.acts_at``), the whole model is
   gathered in host memory, changed, and cut into blocks anew; snapshots gather it likewise.

Under MPI each rank holds its shard so (``OutOfCoreShard``): of the Gaussian exchange
(``engine.gaussian_exchange.OffloadedGaussianExchangeTrainer``: a step's working set is what any view
of its batch sees) or of the pixel exchange (``engine.pixel_exchange.OffloadedPixelExchangeTrainer``:
the Gaussians of the rank's box that its view of the step sees).  ``OutOfCore`` is what the one-process
pipeline (``OffloadTrainer``) and both share.

Rows keep the in-memory model's order, so the working set binned and sorted on the device ties as
the whole model would, and the strategy's random draws fall on the same Gaussians: offloaded
training equals in-memory training with visible-only Adam and the same view order (tested).  While the
device holds under half the blocks, the views follow a tour along the cameras by default (``--view-order
auto``: trajectory), so that consecutive working sets overlap and few blocks move; else they come in
random order, as in memory: a tour's neighbouring views in a row cost quality.

The moves overlap the kernels: where blocks move in host mode the host's table is page-locked, a
block moves by one copy between its rows there and its slot, and the next step's blocks (a guess from
the next view) move in on a stream of their own while this step trains (``DeviceCache.prefetch``);
what the guess missed moves at the step, queued before its kernels.
"""
import errno
import itertools
import math
import os
import resource
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict, namedtuple
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

import numbasplat as ns
from numbasplat import backend as _backend
from numbasplat.device import (CopyStream, DeviceInterval, HostCopy, cap_device_memory, copy_rows, is_pinned, pinned_empty,
                               release_pinned)
from numbasplat.loss import l1_ssim_loss, psnr
from numbasplat.optim import GROUPS, FlatParams, adam_step_bound, group_widths
from numbasplat.rows import flat_to_rows, pool_rows, reach_boxes, rows_to_flat

from .model import GaussianModel
from .partition import GROW_PX, REACH, cluster_boxes, morton_codes, visible_regions
from .strategy import BYTES_PER_GAUSSIAN, Context
from .trainer import PhaseClock, Trainer

BLOCK_ROWS = 4096  # Gaussians a block holds, about: spatially close ones, culled together
OFFLOAD_MODES = ("none", "host", "disk")
GPU_SHARE = 0.8  # --gpu-memory 0: this share of the device memory free at the start
TOUR_BELOW = 0.5  # --view-order auto: a tour while the device's pool holds under this share of the blocks


def format_bytes(n):
    """``n`` bytes for a message: in the largest binary unit that keeps it at 1 or more."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        size = 1 << {"TiB": 40, "GiB": 30, "MiB": 20, "KiB": 10}[unit]
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


class BlockIndex:
    """The model's Gaussians in spatially coherent blocks with growing boxes: ``block`` (N,) each
    Gaussian's block, ``position`` (N,) its place among its block's rows (in model order),
    ``lo``/``hi`` (B, 3) each block's box (centres grown by ``REACH`` of its members' largest scale)."""

    def __init__(self, means, log_scales, block_rows=BLOCK_ROWS):
        n = len(means)
        order = np.argsort(morton_codes(means), kind="stable")
        self.block = np.empty(n, np.int64)
        self.block[order] = np.arange(n) // block_rows
        self.blocks = int(self.block.max()) + 1 if n else 0
        self.by_block = np.argsort(self.block, kind="stable")  # rows block by block, each block's in model order
        self.sizes = np.bincount(self.block, minlength=self.blocks)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.position = np.empty(n, np.int64)
        self.position[self.by_block] = np.arange(n) - np.repeat(self.starts, self.sizes)
        self.table_rows = self.starts[self.block] + self.position  # each Gaussian's row in the blocks' table
        self.lo, self.hi = cluster_boxes(means, log_scales, block_rows, order)  # (block b: rows order[b * block_rows:])

    def __len__(self):
        return len(self.block)

    def members(self, b):
        """The rows of block ``b``, in model order."""
        return self.by_block[self.starts[b]:self.starts[b] + self.sizes[b]]

    def visible(self, camera, boxes=None):
        """The blocks whose box (``boxes``: (lo, hi) instead of the index's) ``camera`` can see."""
        lo, hi = (self.lo, self.hi) if boxes is None else boxes
        return np.flatnonzero(visible_regions(lo, hi, camera, grow=GROW_PX)[1])

    def rows(self, blocks):
        """The Gaussians of ``blocks``, in model order."""
        return np.flatnonzero(np.isin(self.block, blocks))


WorkingRows = namedtuple("WorkingRows", "index blocks slots count rows starts sizes")
WorkingRows.__doc__ = """A working set's blocks (of ``index``) and their ``slots`` (host arrays), its Gaussians'
``count``, and on the device their pool ``rows`` in model order and the blocks' first pool rows
(``starts``) and ``sizes`` (``OffloadTrainer._working_set``)."""


class RowLayout:
    """A Gaussian's row of the out-of-core tables, float32: its parameters, both Adam moments (each in
    ``GROUPS`` order, ``width`` columns) and the strategy's statistics (counts exact up to 2**24).
    ``plan``: where each column goes in a model's flat buffers held back to back (``numbasplat.math.rows``),
    so that rows move between a table and a model in one kernel each way."""

    def __init__(self, sh_bases, statistics):
        self.sh_bases = sh_bases
        widths = group_widths(sh_bases)
        self.width = w = sum(widths.values())
        starts = np.cumsum([0] + [widths[g] for g in GROUPS])
        self.columns = {g: (int(starts[i]), int(starts[i + 1])) for i, g in enumerate(GROUPS)}
        self.statistics = {k: np.dtype(a.dtype) for k, a in statistics.items()}  # name: dtype
        self.columns_total = 3 * w + len(self.statistics)
        self.row_bytes = 4 * self.columns_total
        plan = [(i * w + a, b - a, c) for i in range(3) for a, b in self.columns.values() for c in range(b - a)]
        plan += [(3 * w + j, 1, 0) for j in range(len(self.statistics))]
        plan = [p + (j,) for j, p in enumerate(plan)]
        self.plan = np.ascontiguousarray(np.array(plan, np.int32).T)  # (4, columns): a, b, d, the column
        self._plans = {}

    def _plan(self, xp, start=0, stop=None):
        """The plan on ``xp``'s device of the table's columns ``start`` .. ``stop`` (default: all), as if
        their buffer (the parameters, m, v or a statistic alone) were the flat one."""
        key = (xp, start, stop)
        if key not in self._plans:
            plan = np.array(self.plan[:, start:stop], order="C")  # (a copy)
            plan[0] -= plan[0, 0]
            self._plans[key] = xp.asarray(plan)
        return self._plans[key]

    def store(self, model, statistics, table, rows):
        """Write ``model`` (a ``GaussianModel``) and ``statistics`` (its rows'; missing: zeros) into
        rows ``rows`` of ``table``, on the model's device: in one kernel when the model trains on the
        flat array that ``model()`` made, else a kernel per buffer (the whole model is not copied:
        the out-of-core trainer cuts models of 100M Gaussians into blocks)."""
        xp, n, w = model.xp, len(model), self.width
        rows = xp.asarray(rows, np.int64)
        buffers = (model.params.data, model.adam.m, model.adam.v)
        flat, views = getattr(model, "_rows_flat", (None, ()))
        if flat is not None and all(a is b for a, b in zip(views, buffers)):
            for j, k in enumerate(self.statistics):
                column = flat[(3 * w + j) * n:(3 * w + j + 1) * n]
                source = statistics.get(k)
                if source is None:
                    column[...] = 0
                elif not (_backend.is_device(source) and source.data.ptr == column.data.ptr):  # (not a view)
                    column[...] = xp.asarray(source)
            flat_to_rows(flat, rows, self._plan(xp), table, model.backend)
            return
        for part, buffer in enumerate(buffers):
            flat_to_rows(buffer, rows, self._plan(xp, part * w, (part + 1) * w), table, model.backend)
        for j, k in enumerate(self.statistics):
            column = xp.asarray(statistics[k], np.float32) if k in statistics else xp.zeros(n, np.float32)
            flat_to_rows(column, rows, self._plan(xp, 3 * w + j, 3 * w + j + 1), table, model.backend)

    def table(self, model, statistics, xp=None):
        """The (N, columns) table of ``model`` and ``statistics`` (``store``'s), on ``xp``'s device."""
        if xp is not None and xp is not model.xp:
            return xp.asarray(self.table(model, statistics))
        out = model.xp.empty((len(model), self.columns_total), np.float32)
        self.store(model, statistics, out, model.xp.arange(len(model)))
        return out

    def model(self, table, step, backend, rows=None, betas=(0.9, 0.999)):
        """-> (``GaussianModel`` on ``backend`` with Adam at ``step`` and ``betas``, statistics) of the rows
        ``rows`` (default: all) of ``table``; the model trains on views of one array that ``store`` writes back."""
        xp = _backend.array_module(backend)
        table = xp.asarray(table)
        rows = xp.arange(len(table)) if rows is None else xp.asarray(rows, np.int64)
        n, w = int(rows.shape[0]), self.width
        flat = xp.empty(n * self.columns_total, np.float32)
        rows_to_flat(table, rows, self._plan(xp), flat, backend)
        params = FlatParams(n, self.sh_bases, xp, data=flat[:n * w])
        model = GaussianModel.from_flat(params, flat[n * w:2 * n * w], flat[2 * n * w:3 * n * w], step, backend,
                                        *betas)
        model._rows_flat = (flat, (model.params.data, model.adam.m, model.adam.v))
        statistics = {k: flat[(3 * w + j) * n:(3 * w + j + 1) * n].astype(dtype, copy=False)  # (float32: views)
                      for j, (k, dtype) in enumerate(self.statistics.items())}
        return model, statistics


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


class DeviceCache:
    """The blocks resident on the device: one pool of ``slots`` slots of ``block_rows`` rows
    (a block's table in a slot), the least recently used block out first (back to ``host`` if a
    step changed it), and each Gaussian's block and place in it (``index``'s, int32), from which
    ``rows`` finds a working set's pool rows on the device.  ``moved_bytes``, ``hits``, ``misses``:
    the traffic so far.

    ``direct``: the host's one table of every block (``HostBlocks.whole``) in page-locked memory, or
    None.  With it a block moves by one copy between its host rows and its slot, queued without the
    host waiting; ``prefetch`` queues the next step's moves on a stream of their own (``CopyStream``)
    while this step's kernels run.  Without it (disk mode, or no page-locked table) the blocks come
    from ``host.get`` and go back by ``host.put`` (on the GPU the host waits for those copies, so
    ``prefetch`` does nothing there)."""

    INDEX_BYTES = 16  # a Gaussian's block and place in it on the device (int32 each), and ``pool_rows``' scan

    def __init__(self, xp, layout, block_rows, slots, index, direct=None):
        self.xp, self.block_rows, self.direct = xp, block_rows, direct
        blocks = index.blocks
        self.block, self.position = xp.asarray(index.block, np.int32), xp.asarray(index.position, np.int32)
        self.slots = int(min(slots, blocks))
        self.pool = xp.empty((self.slots * block_rows, layout.columns_total), np.float32)
        self.slot = np.full(blocks, -1, np.int64)  # each block's slot (-1: not resident)
        self.free = list(range(self.slots))[::-1]
        self.lru = OrderedDict()  # resident blocks, the most recently used last
        self.dirty = set()
        self.incoming = set()  # blocks ``prefetch`` moved in that no step has used yet (counted as misses)
        self.copies = CopyStream()
        self.moved_bytes = self.hits = self.misses = 0

    def fetch(self, blocks, index, host):
        """Make ``blocks`` resident, the least recently used others out: the kernels queued next wait
        for the copies ``prefetch`` queued, and those blocks still missing move now, queued on the
        kernels' stream."""
        self.copies.kernels_after()
        missing = []
        for b in blocks:
            b = int(b)
            if self.slot[b] < 0:
                missing.append(b)
            else:
                self.hits += b not in self.incoming
                self.lru.move_to_end(b)
        self.incoming.clear()
        self.misses += len(missing)
        self._move_in(missing, set(int(b) for b in blocks), index, host, None)

    def prefetch(self, blocks, busy, index, host):
        """Move in those of ``blocks`` (the next step's) that are missing and fit beside ``busy`` (this
        step's, which its kernels use) and ``blocks``, on the copy stream, after the kernels queued so
        far: the moves overlap this step's kernels.  A guess: ``fetch`` moves what it missed."""
        if self.direct is None and self.xp is not np:
            return
        missing = [int(b) for b in blocks if self.slot[b] < 0]
        keep = set(int(b) for b in blocks) | set(int(b) for b in busy)
        room = len(self.free) + sum(1 for o in self.lru if o not in keep)
        missing = missing[:room]
        if not missing:
            return
        self.misses += len(missing)
        self.incoming.update(missing)
        self.copies.after_kernels()
        self._move_in(missing, keep, index, host, self.copies)
        self.copies.queued()

    def _move_in(self, missing, keep, index, host, stream):
        """Slots for ``missing``, the least recently used blocks not in ``keep`` out (back to ``host``
        if changed), and their rows in, on ``stream`` (None: the kernels')."""
        if not missing:
            return
        out = max(0, len(missing) - len(self.free))  # (enough slots: the trainer checks)
        leaving = list(itertools.islice((o for o in self.lru if o not in keep), out))
        self._write_back([o for o in leaving if o in self.dirty], index, host, stream)
        for o in leaving:
            self.dirty.discard(o)
            self.free.append(int(self.slot[o]))
            self.slot[o] = -1
            del self.lru[o]
        for b in missing:
            self.slot[b] = self.free.pop()
            self.lru[b] = None
        if self.direct is not None:  # a copy a block, host rows to slot, queued
            for b in missing:
                copy_rows(self.pool, self.slot[b] * self.block_rows, self.direct, index.starts[b],
                          index.sizes[b], stream)
            self.moved_bytes += int(index.sizes[missing].sum()) * self.pool.strides[0]
            return
        moving = np.concatenate([host.get(b) for b in missing])
        self.pool[self.xp.asarray(self._rows_of(missing, index))] = self.xp.asarray(moving)
        self.moved_bytes += moving.nbytes

    def hold_all(self, table):
        """Every block resident at once: ``table`` (host or device) holds the rows block by block,
        block b from row b * ``block_rows`` (``BlockIndex``'s blocks are full but the last), so
        it is the pool with block b in slot b."""
        self.pool[:len(table)] = self.xp.asarray(table)
        if not _backend.is_device(table):  # (from the host, as ``fetch`` counts)
            self.moved_bytes += table.nbytes
        self.slot[:] = np.arange(len(self.slot))
        self.free = []
        self.lru = OrderedDict.fromkeys(range(len(self.slot)))

    def rows(self, blocks, total):
        """The pool rows of the Gaussians of resident ``blocks`` (``total`` of them), in model order, on
        the device."""
        slot = np.full(len(self.slot), -1, np.int64)
        slot[blocks] = self.slot[blocks]
        return pool_rows(self.block, self.position, self.xp.asarray(slot), self.block_rows, total)

    def flush(self, index, host):
        """Every changed resident block back to ``host`` (they stay resident), and every copy done:
        the host's tables may be read."""
        self.copies.kernels_after()
        self._write_back(sorted(self.dirty), index, host, None)
        self.dirty.clear()
        self.settle()

    def settle(self):
        """Wait for every copy and kernel queued: the pool and the host's tables are then as the
        moves left them (before either is read on the host or freed)."""
        self.copies.synchronize()
        _backend.synchronize()

    def boxes(self, starts, sizes, layout):
        """The boxes that the pool's rows ``starts`` .. ``starts + sizes`` (device arrays: resident
        blocks' rows) reach now, computed on the device (``numbasplat.rows.reach_boxes``) -> device
        (lo, hi), (len(starts), 3)."""
        return reach_boxes(self.pool, starts, sizes, layout.columns["means"][0], layout.columns["scales"][0], REACH)

    def _rows_of(self, blocks, index):
        """The pool rows of resident ``blocks``' Gaussians, block after block."""
        sizes = index.sizes[blocks]
        first = np.cumsum(sizes) - sizes  # each block's first place in the result
        return np.repeat(self.slot[blocks] * self.block_rows - first, sizes) + np.arange(int(sizes.sum()))

    def _write_back(self, blocks, index, host, stream):
        """Resident ``blocks``' rows to ``host``: a copy a block into the page-locked table, queued on
        ``stream``, or one copy from the device and ``host.put``."""
        if not len(blocks):
            return
        if self.direct is not None:
            for b in blocks:
                copy_rows(self.direct, index.starts[b], self.pool, self.slot[b] * self.block_rows,
                          index.sizes[b], stream)
            self.moved_bytes += int(index.sizes[blocks].sum()) * self.pool.strides[0]
            return
        tables = _backend.to_host(self.pool[self.xp.asarray(self._rows_of(blocks, index))])  # (a new array)
        ends = np.cumsum(index.sizes[blocks])
        for b, start, end in zip(blocks, ends - index.sizes[blocks], ends):
            host.put(b, tables[start:end])
        self.moved_bytes += tables.nbytes


class BoxesInFlight:
    """The blocks' boxes, as the device recomputes them after each step (``DeviceCache.boxes``), read
    back a step late: the host culls the next view's blocks without waiting for the device to finish
    the step (reading them at once was a sync a step, which kept the host from queuing ahead).  Until
    a step's boxes arrive its blocks' boxes are grown by the most one Adam step can move a centre
    (``adam_step_bound`` times the means' rate) and a reach (the scales' rate, on at most half the
    box): the culling stays conservative and never misses a Gaussian the view sees."""

    def __init__(self, index):
        self.index = index
        self.pending = []  # (blocks, HostCopy lo, HostCopy hi, the means' and the scales' rates), oldest first
        self._culling = None  # for_culling's boxes until the next step's arrive (a step culls twice in disk mode)

    def add(self, blocks, lo, hi, lr_means, lr_scales):
        """A step's boxes of ``blocks`` (device arrays), queued to the host."""
        self.pending.append((blocks, HostCopy(lo), HostCopy(hi), lr_means, lr_scales))
        self._culling = None

    def settle(self, keep=0):
        """Write the boxes that came back into the index, all but the last ``keep`` steps' (waiting
        for them: the older ones are long done)."""
        while len(self.pending) > keep:
            blocks, lo, hi, _, _ = self.pending.pop(0)
            self.index.lo[blocks], self.index.hi[blocks] = lo.get(), hi.get()
            self._culling = None

    def for_culling(self):
        """(lo, hi) that hold every block's Gaussians now: the last step's blocks grown for its update."""
        self.settle(keep=1)
        if not self.pending:
            return self.index.lo, self.index.hi
        if self._culling is None:
            blocks, _, _, lr_means, lr_scales = self.pending[0]
            lo, hi = self.index.lo.copy(), self.index.hi.copy()
            bound = adam_step_bound()
            grow = bound * lr_means + math.expm1(bound * lr_scales) * 0.5 * (hi[blocks] - lo[blocks])
            lo[blocks] -= grow
            hi[blocks] += grow
            self._culling = (lo, hi)
        return self._culling


class OutOfCoreModel:
    """What the trainer asks of its ``model`` when the model is out of core: its size, SH bases, and
    its parameters (gathered in host memory)."""

    def __init__(self, trainer):
        self._trainer = trainer

    def __len__(self):
        return len(self._trainer.index)

    @property
    def sh_bases(self):
        return self._trainer.layout.sh_bases

    @property
    def gaussians(self):
        return self._trainer.whole_model().gaussians


class OutOfCore:
    """The model out of core, for a ``Trainer``: the blocks' tiers, the device's pool, and the working
    set of the views that a step trains.  Shared by the one-process pipeline (``OffloadTrainer``) and
    each rank's shard under MPI (``OutOfCoreShard``).
    Between steps the trainer's ``model`` is an ``OutOfCoreModel``."""

    def _add_offload_options(self, mode, offload_dir, host_memory, gpu_memory):
        """Add the out-of-core options to the pipeline's (``Trainer.options``), before ``Trainer.__init__``
        checks them."""
        self.options = replace(self.options, offload=mode, offload_dir=offload_dir, host_memory=host_memory,
                               gpu_memory=gpu_memory)

    def _init_out_of_core(self, mode, offload_dir, host_memory, gpu_memory, prefetch, block_rows):
        self.mode, self.block_rows, self.gpu_memory = mode, block_rows, int(gpu_memory)
        if _backend.on_gpu(self.backend):
            cap_device_memory(self.gpu_memory)
        self._locked = None  # the page-locked table the host's blocks are rows of, kept across re-cuts
        self._cuts = 0  # the model cut into blocks so far
        self.host = DiskBlocks(offload_dir, host_memory, prefetch) if mode == "disk" else HostBlocks()
        self.index = self.layout = self.cache = self.boxes = None
        self._whole = None  # the whole model gathered in host memory, until a step changes it
        self._rows = None  # the last working set's ``WorkingRows``, reused while its blocks and slots are unchanged
        self._working = None  # (its ``_rows``, the model it trained, its statistics): the next step's if still current
        self.wait_s = 0.0  # the kernels' stream's time on the steps' moves (``DeviceInterval``s read so far)
        self._waits = []  # those not yet read
        self._since_log = self._counters()

    def _statistics_of(self, model, state):
        """The strategy's statistics of ``model``'s rows from ``state`` (host arrays; zeros where absent)."""
        statistics = self.strategy.fresh_statistics(np, len(model))
        statistics.update({k: _backend.to_host(a) for k, a in (state or {}).items() if len(a) == len(model)})
        return statistics

    def _start_out_of_core(self, model, statistics):
        """Hold ``model`` (a shard or the whole; host or device) and its ``statistics`` out of core."""
        self.layout = RowLayout(model.sh_bases, self.strategy.fresh_statistics(np, 0))
        self._adam_steps = model.adam.step_count
        self._install(model, statistics)
        self.model = OutOfCoreModel(self)

    def _install(self, model, statistics):
        """Cut ``model`` (on the host or the device) and its ``statistics`` into blocks anew: the index,
        the host's tables, the device's pool: every block in it at once where it holds them all (one
        copy), else empty (the views' blocks come in as they are seen)."""
        g = model.gaussians
        if self.boxes is not None:
            self.boxes.settle()  # the old index's boxes in flight landed (their pinned memory free to reuse)
        if self.cache is not None:
            self.cache.settle()  # the old pool's moves done before it and the host's tables are replaced
        self.index = index = BlockIndex(_backend.to_host(g.means), _backend.to_host(g.scales), self.block_rows)
        self._rows = None  # (the last working set stays for _check_finite: its rows are no longer current)
        self.boxes = BoxesInFlight(index)
        counts = (self.cache.moved_bytes, self.cache.hits, self.cache.misses) if self.cache else (0, 0, 0)
        self.cache = None  # (the old pool freed before the new one is made)
        slots = self._slots(len(index))
        # the rows block by block, block b from row b * block_rows: the host's tables (page-locked where
        # blocks will move between them and the device: the moves then queue without the host waiting)
        shape = (len(index), self.layout.columns_total)
        moving = self.mode == "host" and _backend.on_gpu(self.backend) and slots < index.blocks
        if self._locked is not None and (not moving or self._locked.shape[0] < shape[0]):
            self.host.reset({})  # (the old tables freed first: ``model`` is a copy of them)
            self._locked = None
            release_pinned()
        if moving and self._locked is None:  # (locking takes seconds at 100M: a quarter more rows after a re-cut)
            self._locked = pinned_empty((shape[0] * (5 if self._cuts else 4) // 4, shape[1]))
        self._cuts += 1
        locked = self._locked[:shape[0]] if moving else None
        table = locked if locked is not None and model.xp is np else model.xp.empty(shape, np.float32)
        self.layout.store(model, statistics, table, model.xp.asarray(index.table_rows))
        host_table = table
        if _backend.is_device(table):
            host_table = locked if locked is not None else np.empty(shape, np.float32)
            table.get(out=host_table)
        self.host.reset({b: host_table[index.starts[b]:index.starts[b] + index.sizes[b]] for b in range(index.blocks)},
                        whole=host_table)
        direct = host_table if locked is not None and is_pinned(host_table) else None
        self.cache = DeviceCache(self.xp, self.layout, self.block_rows, slots, index, direct)
        self.cache.moved_bytes, self.cache.hits, self.cache.misses = counts  # (the traffic counts on)
        if self.cache.slots == index.blocks:
            self.cache.hold_all(table)
        self._whole = (model, statistics) if model.xp is np else None

    def _gather_resident(self):
        """-> (the whole model, its statistics) on the device, from its pool, where it holds every
        block (a working set of them all), else None."""
        if not (self.cache.slot >= 0).all():
            return None
        self.cache.copies.kernels_after()  # (the last blocks may still be on their way)
        every = np.arange(self.index.blocks)
        return self.layout.model(self.cache.pool, self._adam_steps, self.backend,
                                 rows=self.cache.rows(every, len(self.index)), betas=self.adam_betas())

    def _slot_bytes(self):
        """Device bytes a block slot takes: its rows' table, and room for them in a step's working set
        (the strategy's estimate of a Gaussian's parameters, gradients, moments and per-step buffers)."""
        return self.block_rows * (self.layout.row_bytes + BYTES_PER_GAUSSIAN)

    def _slots(self, n):
        """How many block slots the device may hold, besides the index of ``n`` Gaussians there and the
        training images (which the cap counts too)."""
        budget = self.gpu_memory - self._images_bytes()
        if not self.gpu_memory:
            if not _backend.on_gpu(self.backend):
                return 1 << 62  # no cap: every block may stay
            import cupy
            free, _ = cupy.cuda.runtime.memGetInfo()
            budget = int(GPU_SHARE * (free + cupy.get_default_memory_pool().free_bytes()))
        return max(0, budget - DeviceCache.INDEX_BYTES * n) // self._slot_bytes()

    def _whole_group(self, group):
        """Parameter ``group`` (e.g. "means") of the whole model, host, in model order: read from the
        host's one table without gathering the model where there is one (a few columns, not whole rows)."""
        if self._whole is None and self.host.whole is not None:
            self.cache.flush(self.index, self.host)
            a, b = self.layout.columns[group]
            return self.host.whole[self.index.table_rows, a:b]
        return getattr(self._gather_whole()[0].gaussians, group)

    def _images_bytes(self):
        """The device memory the training images take (on a GPU; host arrays count nothing)."""
        return self.targets.device_bytes

    def _gather_whole(self):
        """-> (the whole model on the host, its statistics): the device's changed blocks written back
        first."""
        if self._whole is None:
            self.cache.flush(self.index, self.host)
            index, table = self.index, self.host.whole
            rows = None
            if table is not None:  # the blocks' rows in model order, straight from the one table
                rows = index.table_rows
            else:
                table = np.empty((len(index), self.layout.columns_total), np.float32)
                for b in range(index.blocks):
                    table[index.members(b)] = self.host.get(b)
            self._whole = self.layout.model(table, self._adam_steps, "cpu", rows=rows, betas=self.adam_betas())
        return self._whole

    def context(self, **step):
        """The strategy's context without the device's free memory: the model is not on the device."""
        return Context(self.data.scene_scale, self.rng, self.cfg.max_gaussians, 0, **step)

    # ------------------------------------------------------------------ a step's working set
    def _working_set(self, views):
        """The blocks that the training ``views`` see resident (the missing ones moved in); -> their
        ``WorkingRows``.  Consecutive steps often have the same blocks in the same slots (every one,
        where the model fits): their rows are then reused, not found again."""
        waited = DeviceInterval()
        boxes = self.boxes.for_culling()
        blocks = self._blocks_seen(views, boxes)
        if len(blocks) > self.cache.slots:
            need = len(blocks) * self._slot_bytes() + DeviceCache.INDEX_BYTES * len(self.index) + self._images_bytes()
            have = self.gpu_memory or self.cache.slots * self._slot_bytes()
            names = ("view " if len(views) == 1 else "views ") + ", ".join(self.data.train[i].name for i in views)
            raise ValueError(f"--gpu-memory {format_bytes(have)} is too small for {names}: its working set "
                             f"({int(self.index.sizes[blocks].sum()):,} Gaussians in {len(blocks)} blocks) needs "
                             f"{format_bytes(need)}; give --gpu-memory {format_bytes(need)} or more")
        self.cache.fetch(blocks, self.index, self.host)
        slots = self.cache.slot[blocks]
        last = self._rows
        if last is None or last.index is not self.index or not np.array_equal(last.blocks, blocks) \
                or not np.array_equal(last.slots, slots):
            xp, sizes = self.xp, self.index.sizes[blocks]
            count = int(sizes.sum())
            self._rows = WorkingRows(self.index, blocks, slots, count, self.cache.rows(blocks, count),
                                     xp.asarray(slots * self.block_rows), xp.asarray(sizes))
            self.cache.moved_bytes += 8 * self.index.blocks + 16 * len(blocks)  # the slot map, the slots' rows, sizes
        self._waits.append(waited.stop())
        upcoming = self._upcoming_views(len(views))
        if upcoming and self.cache.slots < self.index.blocks:  # the next step's blocks, moved in while this step
            # trains (a guess: its boxes will grow); where the device holds every block nothing moves
            ahead = self._blocks_seen(upcoming, boxes)
            self.cache.prefetch(ahead, blocks, self.index, self.host)
            if self.mode == "disk":
                self.host.prefetch(ahead)
        return self._rows

    def _upcoming_views(self, n):
        """The next step's ``n`` training views, where known (the epoch's order holds them)."""
        return self.order[::-1][:n] if len(self.order) >= n else []

    def _blocks_seen(self, views, boxes):
        """The blocks whose ``boxes`` the training ``views`` see."""
        seen = [self.index.visible(self.data.train[i].camera, boxes) for i in views]
        return seen[0] if len(seen) == 1 else np.unique(np.concatenate(seen))

    def _load_working(self, in_pool):
        """-> (the model of the working set ``in_pool``, its statistics) on the device: the last step's
        as it is where its rows are the same, else gathered from the pool."""
        if self._working is None or self._working[0] is not in_pool:
            self._working = (in_pool, *self.layout.model(self.cache.pool, self._adam_steps, self.backend,
                                                         rows=in_pool.rows, betas=self.adam_betas()))
        return self._working[1:]

    def _store_working(self, working, statistics, in_pool, lr_means, lr_scales):
        """The trained working set back to the pool (parameters, moments, statistics); its blocks' boxes
        recomputed there and read a step late (their growth bounded by the step's learning rates)."""
        self._adam_steps = working.adam.step_count
        self.layout.store(working, statistics, self.cache.pool, in_pool.rows)
        self.cache.dirty.update(int(b) for b in in_pool.blocks)
        self._whole = None
        reach = self.cache.boxes(in_pool.starts, in_pool.sizes, self.layout)
        self.boxes.add(in_pool.blocks, *reach, lr_means, lr_scales)
        self.cache.moved_bytes += 24 * len(in_pool.blocks)  # the boxes out

    def _counters(self):
        """The traffic so far (the device's pool, the disk) and the time waited for it."""
        cache = self.cache
        while self._waits and self._waits[0].seconds() is not None:
            self.wait_s += self._waits.pop(0).seconds()
        return {"moved_bytes": cache.moved_bytes if cache else 0, "hits": cache.hits if cache else 0,
                "misses": cache.misses if cache else 0, "disk_read_bytes": self.host.read_bytes,
                "disk_written_bytes": self.host.written_bytes, "wait_s": self.wait_s}

    def _check_finite(self, loss=None, model=None):
        if model is None and self._working is not None:
            model = self._working[1]  # the last working set (on the device)
        super()._check_finite(loss, model)

    def log_extra(self):
        """The working set, the device's pool and the traffic per step since the last log line."""
        now = self._counters()
        steps = max(1, self.step - self._since_log.get("step", 0))
        d = {k: now[k] - self._since_log[k] for k in now}
        self._since_log = {**now, "step": self.step}
        lookups = d["hits"] + d["misses"]
        return {**super().log_extra(), "resident_gaussians": self.stats.get("resident_gaussians", 0),
                "cached_gaussians": int(self.index.sizes[self.cache.slot >= 0].sum()),
                "moved_bytes": d["moved_bytes"] / steps, "cache_hit_rate": d["hits"] / lookups if lookups else 1.0,
                "wait_s": d["wait_s"] / steps, "disk_read_bytes": d["disk_read_bytes"] / steps,
                "disk_written_bytes": d["disk_written_bytes"] / steps, "peak_device_bytes": self._device_memory_peak(),
                "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def progress_extra(self, record):
        return (f"resident {record['resident_gaussians']:,} moved {record['moved_bytes'] / 2**20:.1f} MiB/step "
                f"hit {record['cache_hit_rate']:.0%} wait {1e3 * record['wait_s']:.1f} ms")

    def close(self):
        """Remove disk mode's files (they hold nothing the snapshot lacks); let the boxes in flight land."""
        if self.boxes is not None:
            self.boxes.settle()
        if self.cache is not None:
            self.cache.settle()
        self.host.close()
        self._locked = None
        release_pinned()
        if _backend.on_gpu(self.backend):
            cap_device_memory(0)


def frustum_part(gaussians, camera):
    """The Gaussians (host arrays) whose reach ``camera`` can see: all that can show in its image, in
    their order, so that they render as the whole model does (evaluation of a model that need not fit
    on the device)."""
    reach = REACH * np.exp(gaussians.scales.max(axis=1, keepdims=True))
    seen = visible_regions(gaussians.means - reach, gaussians.means + reach, camera, grow=GROW_PX)[1]
    return gaussians.take(np.flatnonzero(seen))


class OutOfCoreShard(OutOfCore):
    """A rank's shard out of core under MPI, for either exchange (``engine.gaussian_exchange``,
    ``engine.pixel_exchange``): the shard made on the host and cut into blocks at the start; the whole
    shard gathered in host memory for what gathers the model (snapshots, the PLY, the viewer); a
    step's traffic in its stats.  ``_in_pool``: the step's working set (None: the rank trained nothing)."""

    _in_pool = None

    def start_from(self, model_state, strategy_state=None):
        super().start_from(model_state, strategy_state)  # this rank's shard, on the host
        self._start_out_of_core(self.model, self._statistics_of(self.model, self.strategy_state))
        self.strategy_state = {}

    def train_step(self):
        before = self._counters()
        loss, events = super().train_step()
        after = self._counters()
        self.stats.update({"resident_gaussians": self._in_pool.count if self._in_pool is not None else 0,
                           **{k: after[k] - before[k] for k in after}})
        return loss, events

    def _change_whole_shard(self, change):
        """``change()`` run with the whole shard in host memory as ``model`` and ``strategy_state``
        (refinements, migrations), which is then cut into blocks anew.  -> what it returns."""
        self.model, self.strategy_state = self._gather_whole()
        result = change()
        self._install(self.model, self._statistics_of(self.model, self.strategy_state))
        self.model, self.strategy_state = OutOfCoreModel(self), {}
        return result

    @contextmanager
    def _whole_shard(self):
        """The whole shard as ``model`` and ``strategy_state`` (in host memory) for what gathers them."""
        held = self.model, self.strategy_state
        self.model, self.strategy_state = self._gather_whole()
        try:
            yield
        finally:
            self.model, self.strategy_state = held

    def gathered(self, which="params", root_only=False):
        with self._whole_shard():
            return super().gathered(which, root_only)

    def gather_state(self):
        with self._whole_shard():
            return super().gather_state()

    def view_model(self, most):
        with self._whole_shard():
            return super().view_model(most)

    def whole_model(self):
        """Rank 0 gathers the parameters in host memory (the whole model need not fit on the device)."""
        params = self.gathered("params", root_only=True)
        return GaussianModel(params, "cpu") if self.rank == 0 else None

    def view_image(self, gaussians, camera):
        """A view rendered on the device from the part of ``gaussians`` (the whole model, in host
        memory) that its frustum holds."""
        seen = frustum_part(gaussians, camera)
        return super().view_image(ns.Gaussians(**{k: self.xp.asarray(a) for k, a in seen.arrays().items()}), camera)


class OffloadTrainer(OutOfCore, Trainer):
    """``Trainer`` with the model out of the device and a view's working set on it (see above).

    ``mode``: host or disk; ``offload_dir``, ``host_memory`` (bytes): disk mode's folder and host cache;
    ``gpu_memory`` (bytes, 0: ``GPU_SHARE`` of the device's free memory, no cap on the CPU backend): the
    device's pool of blocks and the working sets built from them; ``prefetch``: disk mode reads the next
    view's blocks ahead on a thread."""

    def __init__(self, dataset, out_dir, cfg, backend=None, log=print, block_rows=BLOCK_ROWS, mode="host",
                 offload_dir=None, host_memory=0, gpu_memory=0, prefetch=True):
        self._add_offload_options(mode, offload_dir, host_memory, gpu_memory)
        super().__init__(dataset, out_dir, cfg, backend, log)
        self._init_out_of_core(mode, offload_dir, host_memory, gpu_memory, prefetch, block_rows)
        self.model = None

    def start_from(self, model_state, strategy_state=None):
        model = GaussianModel.from_state(model_state, "cpu")
        self._start_out_of_core(model, self._statistics_of(model, strategy_state))

    def gather_state(self):
        model, statistics = self._gather_whole()
        return model.state(), {k: np.array(a) for k, a in statistics.items()}

    def whole_model(self):
        return self._gather_whole()[0]

    def view_image(self, gaussians, camera):
        """A view rendered from its working set on the device (the whole model need not fit there)."""
        self.boxes.settle()
        seen = gaussians.take(self.index.rows(self.index.visible(camera)))
        return super().view_image(ns.Gaussians(**{k: self.xp.asarray(a) for k, a in seen.arrays().items()}), camera)

    def epoch_view_order(self):
        """auto: a tour along the cameras while the device's pool holds under ``TOUR_BELOW`` of the
        blocks (consecutive views then share most of their blocks, and random views would move most
        of theirs), else random: a tour's neighbouring views in a row cost quality (2.3 dB on a city
        whose pool held 85% of the blocks, for no fewer moves: BENCHMARKS.md, "Out-of-core")."""
        if self.cfg.view_order != "auto":
            return self.cfg.view_order
        return "trajectory" if self.cache.slots < TOUR_BELOW * self.index.blocks else "random"

    # ------------------------------------------------------------------ one step
    def train_step(self):
        c = self.cfg
        clock = PhaseClock(self.backend, self._timing())
        before = self._counters()
        i = self.next_view()
        view = self.data.train[i]
        in_pool = self._working_set([i])
        working, stats = self._load_working(in_pool)
        clock.end("owner")
        g = working.gaussians
        p = ns.project(g, view.camera, sh_degree=self.sh_degree_now(), antialias=c.antialias, backend=self.backend,
                       check=False)
        clock.end("project")
        b = ns.bin_tiles(p, backend=self.backend)
        r = ns.rasterize(p, b, self.step_background(), self.backend)
        clock.end("render")
        target = self.targets[i]
        loss, d_img = l1_ssim_loss(r.image, target, c.lambda_dssim, backend=self.backend, lazy=True)
        clock.end("loss")
        grad = ns.rasterize_backward(p, b, r, d_img, backend=self.backend)
        clock.end("backward")
        ns.project_backward(g, p, grad, working.grad_gaussians, accumulate=False, backend=self.backend)
        self._progress_view = (r.image, target)
        self.add_strategy_gradients(working, stats)  # the strategy's gradients and statistics: of the working set
        self.strategy.after_backward(working, stats, self.step, p, grad)
        lr, cols = self.learning_rates()
        working.adam.step(working.grads.data, cols, p.counts > 0)
        self.step += 1
        self._store_working(working, stats, in_pool, lr["means"], lr["scales"])
        clock.end("optimizer")
        ctx = self.context(lr_means=lr["means"])
        events = {}
        if self.strategy.acts_at(self.step, ctx):  # densify or reset: on the device if it holds every block
            model, statistics = self._gather_resident() or self._gather_whole()
            events = self.strategy.after_optimizer(model, statistics, self.step, ctx)
            self._install(model, statistics)
        after = self._counters()
        self.stats = {"resident_gaussians": in_pool.count, **{k: after[k] - before[k] for k in after}, **clock.stats()}
        return loss, events

    def progress_psnr(self):
        image, target = self._progress_view
        return psnr(image, target)
