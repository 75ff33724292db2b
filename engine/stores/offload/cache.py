"""The out-of-core model's blocks on the device: a pool of block slots (``DeviceCache``), and the blocks'
boxes as the device recomputes them, read back a step late (``BoxesInFlight``)."""
import math

import numpy as np

from numbasplat import backend as _backend
from numbasplat import device
from numbasplat.optim import adam_step_bound
from numbasplat.rows import copy_host_rows, pool_rows, reach_boxes

from engine.pipelines.partition import REACH


def copy_columns(dst, dst_row, src, src_row, rows, spans, stream=None):
    """``device.copy_rows`` of the columns ``spans`` alone ((``src``'s first column, ``dst``'s first column,
    columns), ...), between row tables of different widths, host or device either side, a 2-D copy a span
    queued as ``copy_rows``' (the same rules); ``spans`` None: whole rows of one width (``copy_rows``).  Rows
    move so between the host's tier and a pool without Adam's moments (``--offload-adam host``)."""
    if spans is None:
        device.copy_rows(dst, dst_row, src, src_row, rows, stream)
        return
    dst_row, src_row, rows = int(dst_row), int(src_row), int(rows)
    if not _backend.is_device(dst) and not _backend.is_device(src):  # (on every core)
        copy_host_rows(src[src_row:src_row + rows], None, dst[dst_row:dst_row + rows], None, spans)
        return
    if rows == 0:
        return
    import cupy
    handle = stream.stream.ptr if stream is not None else cupy.cuda.get_current_stream().ptr
    pointer = (lambda x: x.data.ptr if _backend.is_device(x) else x.ctypes.data)
    size = src.itemsize
    for a, c, k in spans:
        cupy.cuda.runtime.memcpy2DAsync(pointer(dst) + dst_row * dst.strides[0] + c * size, dst.strides[0],
                                        pointer(src) + src_row * src.strides[0] + a * size, src.strides[0],
                                        k * size, rows, cupy.cuda.runtime.memcpyDefault, handle)


class DeviceCache:
    """The blocks resident on the device: one pool of ``slots`` slots of ``block_rows`` rows
    (a block's table in a slot), the least recently used block out first (back to ``host`` if a
    step changed it: ``changed``), and each Gaussian's block and place in it (``index``'s, int32), from
    which ``rows`` finds a working set's pool rows on the device.  ``moved_bytes``, ``hits``, ``misses``:
    the traffic so far.  The bookkeeping is arrays over the blocks (each block's slot, when it was last
    used, whether it changed), so that a step's costs follow its missing blocks, not a Python loop over
    its working set's (thousands of blocks at 100M Gaussians).

    ``direct``: the host's one table of every block (``HostBlocks.whole``) in page-locked memory, or
    None.  With it a block moves by one copy between its host rows and its slot, queued without the
    host waiting; ``prefetch`` queues the next step's moves on a stream of their own (``CopyStream``)
    while this step's kernels run.  Without it (disk mode, or no page-locked table) the blocks come
    from ``host.get`` and go back by ``host.put``: on a GPU through page-locked staging buffers
    (``staging``: ``device.StagingRing`` of ``STAGING_BLOCKS`` blocks each), a copy a block queued
    without the host waiting for it; elsewhere, or with ``staged`` False, in one gathered copy each way,
    which the host waits for on a GPU.  (On a GPU ``prefetch`` does nothing there: disk mode reads the
    next blocks ahead on a thread, ``DiskBlocks.prefetch``.)

    ``pool_layout``: the pool's rows, ``layout`` (the host's rows) or where Adam runs on the host
    (``--offload-adam host``) ``layout.without_moments()``: then only the parameters' and the statistics'
    columns move (``spans``), and a block goes back into its host rows' columns, its moments there kept."""

    INDEX_BYTES = 16  # a Gaussian's block and place in it on the device (int32 each), and ``pool_rows``' scan
    STAGING_BLOCKS = 32  # blocks a staging buffer holds (two buffers: 2 x 32 x 4096 rows of 720 B at SH 3, 189 MB)
    staged = None  # moves without ``direct`` through ``staging``: None on GPUs only; True, False: always, never

    def __init__(self, xp, layout, block_rows, slots, index, direct=None, pool_layout=None):
        self.xp, self.block_rows, self.direct = xp, block_rows, direct
        pool_layout = layout if pool_layout is None else pool_layout
        self.spans = layout.spans_in(pool_layout)  # (host column, pool column, columns), None: whole rows
        self.back = None if self.spans is None else tuple((c, a, k) for a, c, k in self.spans)  # (pool to host)
        blocks = index.blocks
        self.block, self.position = xp.asarray(index.block, np.int32), xp.asarray(index.position, np.int32)
        self.slots = int(min(slots, blocks))
        self.pool = xp.empty((self.slots * block_rows, pool_layout.columns_total), np.float32)
        self.slot = np.full(blocks, -1, np.int64)  # each block's slot (-1: not resident)
        self.free = list(range(self.slots))[::-1]  # the free slots, the next one taken last
        self.used = np.zeros(blocks, np.int64)  # when each resident block was last used (``clock``'s count)
        self.clock = 0
        self.dirty = np.zeros(blocks, bool)  # the resident blocks that a step changed (``changed``)
        self.incoming = np.zeros(blocks, bool)  # blocks ``prefetch`` moved in that no step has used yet (misses)
        self.copies = device.CopyStream()
        self.moved_bytes = self.hits = self.misses = 0
        staged = _backend.is_device(self.pool) if self.staged is None else self.staged
        self.staging = (device.StagingRing(self.STAGING_BLOCKS * block_rows, pool_layout.columns_total)
                        if direct is None and staged else None)

    def fetch(self, blocks, index, host):
        """Make ``blocks`` resident, the least recently used others out: the kernels queued next wait
        for the copies ``prefetch`` queued, and those blocks still missing move now, queued on the
        kernels' stream."""
        self.copies.kernels_after()
        blocks = np.asarray(blocks, np.int64)
        resident = self.slot[blocks] >= 0
        held, missing = blocks[resident], blocks[~resident]
        self.hits += int(np.count_nonzero(~self.incoming[held]))
        self._touch(held)
        self.incoming[:] = False
        self.misses += len(missing)
        self._move_in(missing, self._mask(blocks), index, host, None)

    def changed(self, blocks):
        """Resident ``blocks`` changed (a step trained them): they go back to the host when they leave."""
        self.dirty[blocks] = True

    def _touch(self, blocks):
        """``blocks`` used now, in their order (the last the most recently)."""
        self.used[blocks] = self.clock + np.arange(len(blocks))
        self.clock += len(blocks)

    def _mask(self, *block_lists):
        """A flag a block: whether it is in one of ``block_lists``."""
        mask = np.zeros(len(self.slot), bool)
        for blocks in block_lists:
            mask[np.asarray(blocks, np.int64)] = True
        return mask

    def prefetch(self, blocks, busy, index, host):
        """Move in those of ``blocks`` (the next step's) that are missing and fit beside ``busy`` (this
        step's, which its kernels use) and ``blocks``, on the copy stream, after the kernels queued so
        far: the moves overlap this step's kernels.  A guess: ``fetch`` moves what it missed."""
        if self.direct is None and self.xp is not np:  # (disk mode reads its next blocks ahead on a thread instead:
            return  # blocks moved in here would be read from the disk by the host, before the step's kernels)
        blocks = np.asarray(blocks, np.int64)
        keep = self._mask(blocks, busy)
        room = len(self.free) + int(np.count_nonzero((self.slot >= 0) & ~keep))
        missing = blocks[self.slot[blocks] < 0][:room]
        if not len(missing):
            return
        self.misses += len(missing)
        self.incoming[missing] = True
        self.copies.after_kernels()
        self._move_in(missing, keep, index, host, self.copies)
        self.copies.queued()

    def _move_in(self, missing, keep, index, host, stream):
        """Slots for ``missing`` (an array of blocks), the least recently used blocks not in ``keep`` (a flag
        a block) out (back to ``host`` if changed), and their rows in, on ``stream`` (None: the kernels')."""
        if not len(missing):
            return
        out = max(0, len(missing) - len(self.free))  # (enough slots: the trainer checks)
        leaving = self._least_recently_used(np.flatnonzero((self.slot >= 0) & ~keep), out)
        self._write_back(leaving[self.dirty[leaving]], index, host, stream)
        self.dirty[leaving] = False
        self.free.extend(self.slot[leaving].tolist())
        self.slot[leaving] = -1
        taken = self.free[len(self.free) - len(missing):][::-1]  # (the free slots taken last first)
        del self.free[len(self.free) - len(missing):]
        self.slot[missing] = taken
        self._touch(missing)
        if self.direct is not None:  # a copy a block, host rows to slot, queued
            for b in missing.tolist():
                copy_columns(self.pool, self.slot[b] * self.block_rows, self.direct, index.starts[b],
                             index.sizes[b], self.spans, stream)
            self.moved_bytes += int(index.sizes[missing].sum()) * self.pool.strides[0]
            return
        tables = [self.pool_part(host.get(b)) for b in missing.tolist()]
        self.moved_bytes += sum(t.nbytes for t in tables)
        if self.staging is not None:  # a copy a block, from a page-locked buffer to its slot, queued
            self.staging.upload(tables, self.pool, [int(self.slot[b]) * self.block_rows for b in missing], stream)
            return
        self.pool[self.xp.asarray(self._rows_of(missing, index))] = self.xp.asarray(np.concatenate(tables))

    def hold_all(self, table):
        """Every block resident at once: ``table`` (host or device) holds the rows block by block,
        block b from row b * ``block_rows`` (``BlockIndex``'s blocks are full but the last), so
        it is the pool with block b in slot b."""
        if self.spans is not None:  # (the pool's columns alone, straight into it)
            copy_columns(self.pool, 0, table, 0, len(table), self.spans)
        elif self.xp is np or _backend.is_device(table):
            self.pool[:len(table)] = table
        else:  # (straight into the pool: no device copy of the table beside it)
            self.pool[:len(table)].set(np.ascontiguousarray(table))
        if not _backend.is_device(table):  # (from the host, as ``fetch`` counts)
            self.moved_bytes += len(table) * self.pool.strides[0]
        self.slot[:] = np.arange(len(self.slot))
        self.free = []
        self._touch(np.arange(len(self.slot)))

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
        self._write_back(np.flatnonzero(self.dirty), index, host, None)
        self.dirty[:] = False
        self.settle()

    def release_all(self):
        """Every block out of the pool, none written back (``flush`` first): its rows are free for other use
        (a chunked view's rows)."""
        self.settle()
        self.slot[:] = -1
        self.free = list(range(self.slots))[::-1]
        self.dirty[:] = False
        self.incoming[:] = False

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

    def pool_part(self, table):
        """The columns that the pool holds of host rows ``table``: ``table`` itself where it holds whole rows."""
        if self.spans is None:
            return table
        out = np.empty((len(table), self.pool.shape[1]), np.float32)
        copy_columns(out, 0, table, 0, len(table), self.spans)
        return out

    def put_back(self, host, b, rows):
        """Block ``b``'s ``rows`` as the pool holds them back to ``host``: whole rows as they are, else into
        its host rows' columns (``host.get``'s, put again: the moments there kept)."""
        if self.spans is None:
            host.put(b, rows)
            return
        held = host.get(b)
        copy_columns(held, 0, rows, 0, len(rows), self.back)
        host.put(b, held)

    def _least_recently_used(self, blocks, count):
        """The ``count`` of ``blocks`` used least recently, the least first."""
        if count >= len(blocks):
            return blocks[np.argsort(self.used[blocks], kind="stable")]
        first = blocks[np.argpartition(self.used[blocks], count)[:count]]
        return first[np.argsort(self.used[first], kind="stable")]

    def _rows_of(self, blocks, index):
        """The pool rows of resident ``blocks``' Gaussians, block after block."""
        sizes = index.sizes[blocks]
        first = np.cumsum(sizes) - sizes  # each block's first place in the result
        return np.repeat(self.slot[blocks] * self.block_rows - first, sizes) + np.arange(int(sizes.sum()))

    def _write_back(self, blocks, index, host, stream):
        """Resident ``blocks``' rows to ``host``: a copy a block into the page-locked table, queued on
        ``stream``; or through the staging buffers, or one copy from the device, and ``host.put``."""
        if not len(blocks):
            return
        blocks = np.asarray(blocks, np.int64)
        if self.direct is not None:
            for b in blocks.tolist():
                copy_columns(self.direct, index.starts[b], self.pool, self.slot[b] * self.block_rows,
                             index.sizes[b], self.back, stream)
            self.moved_bytes += int(index.sizes[blocks].sum()) * self.pool.strides[0]
            return
        if self.staging is not None:  # a copy a block, from its slot into a page-locked buffer, then ``host.put``
            sizes = [int(index.sizes[b]) for b in blocks]
            slots = [int(self.slot[b]) * self.block_rows for b in blocks]
            for b, table in zip(blocks.tolist(), self.staging.download(self.pool, slots, sizes, stream)):
                self.put_back(host, b, table)  # (a copy: the buffer is used again)
            self.moved_bytes += sum(sizes) * self.pool.strides[0]
            return
        tables = _backend.to_host(self.pool[self.xp.asarray(self._rows_of(blocks, index))])  # (a new array)
        ends = np.cumsum(index.sizes[blocks])
        for b, start, end in zip(blocks.tolist(), ends - index.sizes[blocks], ends):
            self.put_back(host, b, tables[start:end])
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
        self._owed = None  # (blocks, reach, the rates): a step's boxes not yet computed (``owe``)

    def add(self, blocks, lo, hi, lr_means, lr_scales):
        """A step's boxes of ``blocks`` (device arrays), queued to the host."""
        self.pending.append((blocks, device.HostCopy(lo), device.HostCopy(hi), lr_means, lr_scales))
        self._culling = None

    def owe(self, blocks, reach, lr_means, lr_scales):
        """A step's boxes of ``blocks``, computed only where they are read (``reach()`` -> device (lo, hi), from the
        pool as it is then: ``for_culling``, ``settle()``, which wait for them): where every block is the working set
        nothing culls, and each step would compute and copy boxes that the next replaces.  The pool must hold
        ``blocks`` in the same slots until then (the store reads the boxes before it moves any block)."""
        if self._owed is not None and not np.array_equal(self._owed[0], blocks):
            self._compute_owed()
        self._owed = (blocks, reach, lr_means, lr_scales)

    def _compute_owed(self):
        """The boxes ``owe`` left, computed now (queued to the host as ``add``'s)."""
        if self._owed is not None:
            blocks, reach, lr_means, lr_scales = self._owed
            self._owed = None
            self.add(blocks, *reach(), lr_means, lr_scales)

    def settle(self, keep=0):
        """Write the boxes that came back into the index, all but the last ``keep`` steps' (waiting
        for them: the older ones are long done); ``keep`` 0: every step's, those owed too."""
        if keep == 0:
            self._compute_owed()
        while len(self.pending) > keep:
            blocks, lo, hi, _, _ = self.pending.pop(0)
            self.index.lo[blocks], self.index.hi[blocks] = lo.get(), hi.get()
            self._culling = None

    def for_culling(self):
        """(lo, hi) that hold every block's Gaussians now: the last step's blocks grown for its update; after steps
        that owed their boxes (``owe``), the index's are older than one step, so the boxes owed land first (a wait)."""
        self.settle(keep=0 if self._owed is not None else 1)
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
