"""The model out of core as a pipeline's store (``engine.stores.memory``): its blocks' tiers, the device's
pool, and the working set of the views that a step trains (``OutOfCoreStore``)."""
import resource
from collections import deque, namedtuple
from dataclasses import replace
from types import SimpleNamespace

import numpy as np

import numbasplat as ns

from numbasplat import backend as _backend
from numbasplat import device
from numbasplat.rendering import (BINNING_GAUSSIAN_BYTES, binning_intersection_bytes, gradient_record_bytes,
                                  projection_bytes, sort_scratch_bytes)
from numbasplat.rows import copy_host_rows, reach_boxes

from engine.pipelines.partition import REACH, morton_order
from engine.recipe.model import GaussianModel
from .cache import BoxesInFlight, DeviceCache
from .chunked import ChunkedView
from .host_adam import ADAM_PLACES, HostAdam
from .layout import BLOCK_ROWS, BlockIndex, FileRows, RowLayout, WorkingRows, format_bytes, frustum_part
from .tiers import DiskBlocks, HostBlocks

HOLD_SLICE_ROWS = 1 << 20  # rows read from the host's tier at a time (``hold_new``, a chunked view's)
GPU_SHARE = 0.8  # --gpu-memory 0: this share of the device memory free at the start
GPU_HEADROOM = (0.05, 32 << 20)  # under a --gpu-memory cap on a GPU, this share of it plus these bytes stay out of
# the budget, for what it does not count: the allocator's split chunks, a step's transient arrays
INTERSECTIONS_PER_GAUSSIAN = 8.0  # the tile intersections per working-set Gaussian that the device's budget
# assumes (``working_set_bytes``) at least: a view's binning takes 22 B each at its peak, and a GPU's sort 12 B more
INTERSECTIONS_WINDOW = 100  # the budget follows the largest intersections per Gaussian of this many recent binnings
INTERSECTIONS_SPARE = 1.25  # ... times this (``OutOfCoreStore.intersections_per_gaussian``)
DEVICE_REFINE_ROWS = 8  # a refinement of the whole model on the device takes up to this many table rows' bytes a
# Gaussian beside the pool: the model gathered from it (parameters, moments, gradients, statistics), the strategy's
# refined model (up to twice the rows) and its transients, the table it is cut into anew (``_install``)
VIEW_BYTES_PER_PIXEL = 24 + 36 + 12 + 12 + 8 + 2 * 24  # the device's budget keeps room for the largest view's
# per-pixel buffers: the render (image, transmittance, depth, last), the loss (the SSIM maps, the image's
# gradient, the target in float32), the raster backward's alpha and depth gradients, a chunked view's two
# pixel states (float32 on a GPU; numbasplat.rendering.STATE_FIELDS)


def working_set_bytes(layout, intersections=INTERSECTIONS_PER_GAUSSIAN, tiles=0, adam="device",
                      grads_over_params=True):
    """-> ({what: device bytes per working-set Gaussian}, the step's peak of them): where an out-of-core step's
    device memory goes, per Gaussian of its working set with ``intersections`` tile intersections on average
    (over ``tiles`` tiles: the sort keys' width), from the sizes that the code allocates (``layout``: the
    rows' ``RowLayout``, whose pool rows lack Adam's moments where ``adam`` is host, ``--offload-adam``; the
    functions of ``numbasplat.rendering`` that size ``project``'s, ``bin_tiles``' and ``rasterize_backward``'s
    buffers; a GPU's sort scratch is an estimate).  The pool's rows and the working
    set's buffers live through the step; the binning's peak (its sorts) and the backward's (the gradient
    records, the sorted ids the binning kept, the parameters' gradients, made there and let go at the
    check-in) come one after the other, so the peak counts the larger.  With Adam on the host and
    ``grads_over_params`` (``OutOfCoreStore.grads_over_params``: the single-process pipeline's) the backward
    writes the parameters' gradients over the working copy's parameters, which the host's Adam does not read:
    they take no bytes of their own.  Per view, not per Gaussian (not here: ``VIEW_BYTES_PER_PIXEL``): the
    render and the loss's buffers; per model Gaussian: the index (``DeviceCache.INDEX_BYTES``)."""
    pool = layout.without_moments() if adam == "host" else layout
    over_params = adam == "host" and grads_over_params
    lasting = {
        ("pool rows: parameters, Adam's moments, statistics" if pool.moments else
         "pool rows: parameters, statistics (Adam's moments in the host's tier)"): pool.row_bytes,
        "working copy: parameters, statistics" + (" (its moments stay in the pool)" if pool.moments else ""):
            layout.model_bytes(in_place=True),
        "projection: records, radii, tile counts": projection_bytes(),
        "the working set's pool rows, visible mask": 8 + 1,
    }
    binning = BINNING_GAUSSIAN_BYTES + intersections * binning_intersection_bytes(tiles)
    scratch = intersections * sort_scratch_bytes(tiles)
    backward = gradient_record_bytes() + intersections * 4 + (0 if over_params else 4 * layout.width)
    items = {**lasting, "binning at its peak: depth order, intersections and their sort": binning,
             "binning's sort scratch on a GPU (an estimate)": scratch,
             ("backward: gradient records, the sorted intersections' ids (the parameters' gradients written over "
              "the working copy's parameters)" if over_params else
              "backward: gradient records, the sorted intersections' ids, the parameters' gradients"): backward}
    return items, sum(lasting.values()) + max(binning + scratch, backward)


TierBytes = namedtuple("TierBytes", "working_set index host host_growing host_index disk")
HOST_INDEX_BYTES = 32  # a Gaussian's block, place in it, row of the host's table, and the rows block by block (int64)


def tier_bytes(layout, intersections=INTERSECTIONS_PER_GAUSSIAN, adam="device"):
    """-> ``TierBytes``: the bytes per Gaussian of each tier of a model out of core in ``layout``'s rows
    (``--offload``): on the device per working-set Gaussian (``working_set``: ``working_set_bytes``' peak, with
    Adam run on the ``adam`` side) and per model Gaussian (``index``: ``DeviceCache.INDEX_BYTES``); in host
    memory per model Gaussian in host mode: its table of the blocks' rows (``host``: a model that does not grow;
    evaluations read a view's blocks, refinements and snapshots a block or a slice at a time), and where the model
    grows (``host_growing``) the table a quarter larger than the model after its first re-cut beside the larger
    one that a refinement outgrowing it refines into (``refine``); both modes also hold the blocks' index there
    (``host_index``; disk mode's host memory otherwise its cache, capped by --host-memory); on the disk per
    model Gaussian (disk mode: the blocks' files; a snapshot writes the model once more there for a while,
    ``DiskBlocks.in_model_order``).  What still gathers the whole model in host memory: the BlitzGS passes
    (``--importance-every``) and the pruning passes."""
    row = layout.row_bytes
    return TierBytes(working_set_bytes(layout, intersections, adam=adam)[1], DeviceCache.INDEX_BYTES,
                     row, row * 9 // 4, HOST_INDEX_BYTES, row)


def runs_by_block(blocks):
    """The places in ``blocks`` (each row's block) of each block's rows, in order, block after block (none empty)."""
    order = np.argsort(blocks, kind="stable")
    return [part for part in np.split(order, np.flatnonzero(np.diff(blocks[order])) + 1) if len(part)]


class OutOfCoreModel:
    """The store's stand-in for the whole model between steps, what the recipe reads of ``model``: its
    size, SH bases, and its parameters (gathered in host memory); evaluation renders a view of it from the
    view's blocks alone (``OutOfCoreStore.part_in_view``)."""

    def __init__(self, store):
        self._store = store

    def __len__(self):
        return len(self._store.index)

    @property
    def sh_bases(self):
        return self._store.layout.sh_bases

    @property
    def gaussians(self):
        return self._store.whole()[0].gaussians

    def host_arrays(self, which="params"):
        """``GaussianModel.host_arrays`` of the whole model (gathered in host memory)."""
        return self._store.whole()[0].host_arrays(which)


class RefinedInTable:
    """A refinement block by block in host mode (``OutOfCoreStore.refine``): each block read from the host's one
    ``table`` and its new rows written to their new place there (``plan``'s) once no row still to be read lies
    there: back to front where the model grows, front to back where it shrinks.  With ``into`` (a larger table,
    where the model outgrows ``table``): written there at once."""

    def __init__(self, table, plan, into=None):
        self.table, self.plan, self.pending = table, plan, []
        self.into = table if into is None else into

    def order(self):
        """The blocks in the order they are refined."""
        blocks = len(self.plan.pieces)
        return range(blocks - 1, -1, -1) if self.plan.growing else range(blocks)

    def rows(self, b):
        """Block ``b``'s rows before the refinement."""
        return self.table[self.plan.old_starts[b]:self.plan.old_ends[b]]

    def put(self, b, out):
        """Block ``b``'s new rows ``out``: written where no row still to be read lies, the others written later;
        -> the bytes of the blocks held until now (this one's among them)."""
        plan = self.plan
        if self.into is not self.table:
            self._write(b, out)
            return out.nbytes
        self.pending.append((b, out))
        held = sum(o.nbytes for _, o in self.pending)
        frontier = plan.old_starts[b] if plan.growing else plan.old_ends[b]
        ready = [p for p in self.pending if (plan.new_starts[p[0]] >= frontier if plan.growing
                                             else plan.new_starts[p[0]] + len(p[1]) <= frontier)]
        for c, rows_out in ready:
            self._write(c, rows_out)
        self.pending = [p for p in self.pending if all(p[0] != c for c, _ in ready)]
        return held

    def done(self):
        """The blocks still waiting written."""
        for c, rows_out in self.pending:
            self._write(c, rows_out)
        self.pending = []

    def _write(self, b, rows_out):
        start = self.plan.new_starts[b]
        self.into[start:start + len(rows_out)] = rows_out


class RefinedToFiles:
    """A refinement block by block in disk mode (``OutOfCoreStore.refine``): each block read from the tier
    (``DiskBlocks.scan``: its cache, else its file; nothing enters the cache) and its new rows written as its new
    blocks' files of the tier's next generation (``DiskBlocks.put_next``; ``plan.first_piece``: their numbers),
    while the blocks before stay as they are: they are let go only when every new block is written (``done``:
    ``DiskBlocks.advance``), so a failure midway leaves the tier whole."""

    def __init__(self, host, plan):
        self.host, self.plan = host, plan

    def order(self):
        """The blocks in the order they are refined (any order would do: the new blocks' numbers are planned)."""
        return range(len(self.plan.pieces))

    def rows(self, b):
        """Block ``b``'s rows before the refinement."""
        return self.host.scan(b)

    def put(self, b, out):
        """Block ``b``'s new rows ``out``, its new blocks' after one another, each to its file (behind, in the room
        in transit); -> the bytes of the blocks held until now: this one's alone."""
        ends = np.cumsum([len(p) for p in self.plan.pieces[b]], dtype=np.int64)
        for j, (start, end) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
            self.host.put_next(int(self.plan.first_piece[b]) + j, out[start:end])
        return out.nbytes

    def done(self):
        """The new blocks the tier's, the blocks before let go."""
        self.host.advance(len(self.plan.lo))


class OutOfCoreStore:
    """The Gaussians out of the device (``--offload host|disk``), the device a step's working set:
    a store (``engine.stores.memory``) for any pipeline, the whole model of one process or a rank's shard.

    ``mode``: host or disk; ``offload_dir``, ``host_memory`` (bytes): disk mode's folder and host
    cache; ``gpu_memory`` (bytes, 0: ``GPU_SHARE`` of the device's free memory, no cap on the CPU
    backend): the device's pool of blocks and the working sets built from them; ``prefetch``: disk
    mode reads the next view's blocks ahead on a thread; ``block_rows``: Gaussians a block holds;
    ``shard``: it holds one rank's shard (evaluation then renders the part of the whole model in a
    view's frustum, not the store's own rows); ``adam``: where a working set's Adam runs (``--offload-adam``):
    on the device, its moments in the pool's rows (``RowsAdam``), or on the host, its moments in the host's
    tier alone and the pool's rows its parameters and statistics (``HostAdam``)."""

    out_of_core = True
    chunked_views = False  # a view larger than the pool is checked out in chunks (``ChunkedView``): set by a
    # pipeline whose step trains them (``OffloadTrainer``); else such a view is refused
    grads_over_params = False  # with Adam on the host, the backward writes a checked-out model's gradients over
    # its parameters (``GaussianModel.grads_over_params``; the host's Adam reads the host's rows): set by a pipeline
    # that runs one projection backward per checked-out model (``OffloadTrainer``; a batch's views add theirs
    # into a buffer of their own), and the device's budget then counts no gradients' buffer (``working_set_bytes``)
    home = "cpu"  # a model to hold is made in host memory, then cut into blocks
    refine_in_blocks = True  # refine block by block on the host's tier (``refine``: host mode's one table, disk
    # mode's files), not gathering the whole model a second time (off: the whole model gathered and re-cut into
    # full blocks, as before; BENCHMARKS.md)

    def __init__(self, mode="host", offload_dir=None, host_memory=0, gpu_memory=0, prefetch=True,
                 block_rows=BLOCK_ROWS, shard=False, adam="device"):
        if adam not in ADAM_PLACES:
            raise ValueError(f"--offload-adam {adam}: unknown (device or host)")
        self.adam = adam
        self.pool_layout = None  # the pool's rows: ``layout``, or without Adam's moments (``adam`` host)
        self.mode, self.offload_dir, self.host_memory = mode, offload_dir, host_memory
        self.gpu_memory, self.prefetch, self.block_rows, self.shard = int(gpu_memory), prefetch, block_rows, shard
        self.host = self.index = self.layout = self.cache = self.boxes = None
        self.device_budget = None  # device bytes for the pool and the index (``_slots``; None: no cap)

    def open(self, backend, views, images_bytes, betas, fresh_statistics):
        """Ready the store for a trainer on ``backend`` whose training ``views`` (``.camera``, ``.name``)
        are culled by the blocks' boxes, whose images take ``images_bytes`` of the device (the cap
        counts them), whose Adam has ``betas``, and whose strategy's statistics ``fresh_statistics(xp,
        n)`` makes: the device capped, the host's tier made (disk mode's folder checked)."""
        self.backend, self.xp = backend, _backend.array_module(backend)
        self.views, self.images_bytes, self.betas = views, images_bytes, betas
        self.fresh_statistics = fresh_statistics
        if _backend.on_gpu(backend):
            device.cap_device_memory(self.gpu_memory)
        self._locked = None  # the page-locked table the host's blocks are rows of, kept across re-cuts
        self._cuts = 0  # the model cut into blocks so far
        self.host = (DiskBlocks(self.offload_dir, self.host_memory, self.prefetch) if self.mode == "disk"
                     else HostBlocks())
        self._whole = None  # the whole model gathered in host memory, until a step changes it
        self._rows = None  # the last working set's ``WorkingRows``, reused while its blocks and slots are unchanged
        self._working = None  # (its ``_rows``, the model it trained, its statistics, whether in place): the next
        # step's if still current
        self._owed = None  # (the working set's copy of whole rows or None, its statistics, its ``WorkingRows``) not yet
        # back in the pool (``_store_owed``)
        self._in_pool = None  # the working set checked out (None: the step trains none of this store's rows)
        self.chunked_steps = 0  # the steps that trained a view in chunks (``ChunkedView``)
        self._chunk_ring = None  # (``_chunk_staging``)
        self._chunk_nonfinite = []  # (``rows_out``)
        self._binned = deque(maxlen=INTERSECTIONS_WINDOW)  # the recent binnings' intersections per Gaussian
        self.wait_s = 0.0  # the kernels' stream's time on the steps' moves (``DeviceInterval``s read so far)
        self._waits = []  # those not yet read
        self._since_log = self._counters()
        self._before_step = self._since_log

    # ------------------------------------------------------------------ the store's calls
    @property
    def model(self):
        """The stand-in for the whole model (None before anything is held)."""
        return None if self.index is None else OutOfCoreModel(self)

    @property
    def state(self):
        """The strategy's state between steps: its statistics live in the blocks' rows."""
        return {}

    def hold(self, model, state):
        """Hold ``model`` (host or device) and the strategy ``state`` of its rows out of core: cut into
        blocks anew."""
        self._rows_of(model.sh_bases)
        self._adam_steps = model.adam.step_count
        self._install(model, self._statistics_of(model, state))

    def hold_new(self, params):
        """Hold a new model of ``params`` (``GaussianModel``'s groups of host arrays, or of a PLY: ``PlyGaussians``),
        Adam at zero and the statistics fresh, cut into blocks a slice of ``HOLD_SLICE_ROWS`` rows at a time: host
        memory holds the table and a slice, never the model beside it."""
        n = len(params["opacities"]) if not hasattr(params, "rows") else len(params)
        rows = params.rows if hasattr(params, "rows") else (lambda a, b: {k: v[a:b] for k, v in params.items()})
        means, scales = np.asarray(params["means"], np.float32), np.asarray(params["scales"], np.float32)
        first = rows(0, min(n, 1))
        self._rows_of(first["sh"].shape[1])
        self._adam_steps = 0

        slices = [(a, min(n, a + HOLD_SLICE_ROWS)) for a in range(0, n, HOLD_SLICE_ROWS)]

        def store_slice(a, b, table, at):  # (rows a..b of the model into rows ``at`` of ``table``)
            self.layout.store(GaussianModel(rows(a, b), "cpu"), self.fresh_statistics(np, b - a), table, at)

        def write(table, at):
            for a, b in slices:
                store_slice(a, b, table, at[a:b])

        def runs(index):  # (disk mode: each slice's rows appended to their blocks' files, in model order)
            for a, b in slices:
                table = np.empty((b - a, self.layout.columns_total), np.float32)
                store_slice(a, b, table, np.arange(b - a))
                for part in runs_by_block(index.block[a:b]):
                    yield int(index.block[a + part[0]]), table[part]
        self._cut(means, scales, np, write, runs)

    def _rows_of(self, sh_bases):
        """The rows' layout for a model of ``sh_bases`` SH bases (and the pool's)."""
        if self.layout is None or self.layout.sh_bases != sh_bases:
            self.layout = RowLayout(sh_bases, self.fresh_statistics(np, 0))
            self.pool_layout = self.layout.without_moments() if self.adam == "host" else self.layout

    def checkout(self, views, upcoming=()):
        """-> (the working set of the training ``views`` as a model on the device, its statistics); (None,
        None) where ``views`` is empty (this rank trains none of its rows in the step).  ``upcoming``: the
        next step's views, whose blocks move in while this step trains."""
        self._before_step = self._counters()
        self.host.remove_model_order()  # (what a save read from it is written by now)
        self._in_pool = self._working_set(views, upcoming) if len(views) else None
        if isinstance(self._in_pool, ChunkedView):
            return self._in_pool, {}
        return self._load_working(self._in_pool) if self._in_pool is not None else (None, None)

    def checkin(self, model, state, lr):
        """The working set that ``checkout`` gave, trained with the learning rates ``lr`` (by group), back
        to the pool; ``model`` None: none was checked out, and Adam's step count (every rank's) advances."""
        if model is None:
            self._adam_steps += 1
            return
        if isinstance(model, ChunkedView):
            self._chunked_done(model)
            return
        self._store_working(model, state, self._in_pool, lr["means"], lr["scales"])

    @property
    def steady(self):
        """Whether the working set that ``checkout`` gave stays the same model from step to step, its buffers where
        they are, until the next refinement (a step graph may replay its steps): every block (``_working_set``),
        Adam on the device (the host's runs outside the device's step) and no ``gpu_memory`` cap (a step graph's
        scratch, the gradients' buffer of a captured step included, is a memory pool of its own, outside the cap's)."""
        return self.adam == "device" and not self.gpu_memory and self._every_block_working(self._in_pool)

    def binned(self, gaussians, intersections):
        """A step's (or a chunk's) binning of ``gaussians`` working-set rows into ``intersections`` tile
        intersections (its exact total, or the room it binned into): the device's budget follows them
        (``intersections_per_gaussian``)."""
        if gaussians:
            self._binned.append(int(intersections) / gaussians)

    def intersections_per_gaussian(self):
        """The tile intersections per working-set Gaussian that the device's budget assumes: at least
        ``INTERSECTIONS_PER_GAUSSIAN``, more where the recent binnings had more (the largest of them, with
        ``INTERSECTIONS_SPARE``): a model grown from a capture's few large SfM Gaussians may have many more at
        first, and a working set whose binning outgrew its room would leave the cap."""
        return max([INTERSECTIONS_PER_GAUSSIAN] + [INTERSECTIONS_SPARE * k for k in self._binned])

    def whole(self, device=False):
        """-> (the whole model, its statistics): in host memory, the device's changed blocks written back
        first; with ``device``, on the device where its pool holds every block (a refinement there)."""
        return (device and self._gather_resident()) or self._gather_whole()

    def saved_state(self):
        """-> (model state, strategy state) for a snapshot, host arrays in model order, read from the host's tier a
        slice of rows at a time as they are written (``SlicedRows``: the host never holds the model twice): in
        host mode from its one table (``TableRows``), in disk mode from a file of the model's columns in model
        order that its blocks are written to first (``FileRows``, ``DiskBlocks.in_model_order``); the model
        itself where it is gathered already."""
        if self._whole is None and self._tier_reads_rows():
            self._flush()
            if self.host.whole is not None:
                return self.layout.table_rows(self.host.whole, self.index.table_rows, self._adam_steps)
            arrays = self.layout.saved_arrays()
            path, offsets = self.host.in_model_order(self.index, [columns for _, _, columns, _, _ in arrays])
            n = len(self.index)
            return self.layout.saved_state(
                lambda columns, tail, dtype: FileRows(path, offsets[columns], n, columns, tail, dtype),
                self._adam_steps)
        model, statistics = self._gather_whole()
        return model.state(), {k: _backend.to_host(a) for k, a in statistics.items()}

    def saved_gaussians(self):
        """-> the whole model's ``Gaussians`` for the PLY, host, read as ``saved_state``'s."""
        return ns.Gaussians(**self.saved_state()[0]["params"])

    def group(self, name):
        """Parameter group ``name`` (e.g. "means") of the whole model, host, in model order: read from the host's
        tier without gathering the model where it can (a few columns, not whole rows): from its one table, or in
        disk mode block by block."""
        if self._whole is None and self._tier_reads_rows():
            self._flush()
            a, b = self.layout.columns[name]
            if self.host.whole is not None:
                return self.host.whole[self.index.table_rows, a:b]
            out = np.empty((len(self.index), b - a), np.float32)
            for block in range(self.index.blocks):
                out[self.index.members(block)] = self.host.scan(block)[:, a:b]
            return out
        return getattr(self._gather_whole()[0].gaussians, name)

    def _tier_reads_rows(self):
        """Whether the host's tier gives rows without the model gathered: host mode's one table of every block,
        or disk mode's files."""
        return self.host.whole is not None or isinstance(self.host, DiskBlocks)

    def rendered(self):
        """The whole model to render evaluation views from (read only): on the device the last working set where
        it is every block of the index now (in model order, its parameters Adam's latest: as the step graphs train
        it), else gathered from a pool of every block (after a refinement), else the stand-in ``model``, whose
        views ``part_in_view`` reads from the host's tier a view's blocks at a time (the host never holds the
        model twice for an evaluation), else gathered on the host."""
        if self._working is not None and self._working[0].index is self.index \
                and self._every_block_working(self._working[0]):
            return self._working[1]
        if self._whole is None and not self.shard and self._tier_reads_rows():
            resident = self._gather_resident()
            return self.model if resident is None else resident[0]
        return self.whole(device=True)[0]

    def recent(self):
        """The last working set (on the device); None after a view trained in chunks (whose rows ``_chunked_done``
        checks as they come back), else the whole model."""
        if self._working is not None:
            return self._working[1]
        return None if isinstance(self._in_pool, ChunkedView) else self.whole()[0]

    def part_in_view(self, model, camera):
        """The Gaussians of ``model`` (``rendered``'s) that ``camera``'s evaluation view renders, on the device (the
        whole need not fit there): all of them where they are there already, the blocks that the view sees
        where ``model`` is the stand-in (read from the host's tier: ``_host_gaussians``) or on the host, or for a
        shard the Gaussians in the view's frustum."""
        if isinstance(model, OutOfCoreModel):
            self.boxes.settle()
            self._flush()  # (the device's changed blocks written back first)
            return self._host_gaussians(self.index.rows(self.index.visible(camera)), self.layout.sh_bases,
                                        self.host.scan)
        gaussians = model.gaussians
        if _backend.is_device(gaussians.means):
            return gaussians
        if self.shard:
            seen = frustum_part(gaussians, camera)
        else:
            self.boxes.settle()
            seen = gaussians.take(self.index.rows(self.index.visible(camera)))
        return type(seen)(**{k: self.xp.asarray(a) for k, a in seen.arrays().items()})

    def last_working_set(self):
        """The last step's working set as a model on the device (None: none, or a chunked view's)."""
        return self._working[1] if self._working is not None else None

    def working_set_bytes(self, intersections, tiles=0):
        """``working_set_bytes`` of this store's working sets (its rows, where its Adam runs, whether their
        gradients go over their parameters) at ``intersections`` per Gaussian over ``tiles``."""
        return working_set_bytes(self.layout, intersections, tiles, self.adam, self.grads_over_params)

    def step_device_bytes(self, intersections, tiles=0):
        """Device bytes that ``working_set_bytes`` (at ``intersections`` per Gaussian over ``tiles``) makes of
        the last step: the pool, its working set's buffers beside their pool rows, the index, the training
        images and the largest view's per-pixel buffers."""
        count = self._in_pool.count if self._in_pool is not None else 0
        peak = self.working_set_bytes(intersections, tiles)[1]
        return (int(self.cache.pool.nbytes) + count * (peak - self.pool_layout.row_bytes)
                + DeviceCache.INDEX_BYTES * len(self.index) + self.images_bytes + self._view_bytes())

    def prefers_tour(self, below):
        """Whether the device's pool holds under the share ``below`` of the blocks (views in a tour along
        the cameras then share most of their blocks, random ones would move most of theirs)."""
        return self.cache.slots < below * self.index.blocks

    def step_stats(self):
        """The last step's working set and its traffic, for the trainer's ``stats``."""
        after = self._counters()
        resident = self._in_pool.count if self._in_pool is not None else 0
        return {"resident_gaussians": resident, **{k: after[k] - self._before_step[k] for k in after}}

    def log_fields(self, step, peak_device_bytes):
        """The working set, the device's pool and the traffic per step since the last log line (at ``step``),
        and the peaks of memory (``peak_device_bytes()``: the device's)."""
        now = self._counters()
        steps = max(1, step - self._since_log.get("step", 0))
        d = {k: now[k] - self._since_log[k] for k in now}
        self._since_log = {**now, "step": step}
        lookups = d["hits"] + d["misses"]
        return {"resident_gaussians": self._in_pool.count if self._in_pool is not None else 0,
                "cached_gaussians": int(self.index.sizes[self.cache.slot >= 0].sum()),
                "moved_bytes": d["moved_bytes"] / steps, "cache_hit_rate": d["hits"] / lookups if lookups else 1.0,
                "wait_s": d["wait_s"] / steps, "disk_read_bytes": d["disk_read_bytes"] / steps,
                "disk_written_bytes": d["disk_written_bytes"] / steps, "peak_device_bytes": peak_device_bytes(),
                "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def progress_text(self, record):
        return (f"resident {record['resident_gaussians']:,} moved {record['moved_bytes'] / 2**20:.1f} MiB/step "
                f"hit {record['cache_hit_rate']:.0%} wait {1e3 * record['wait_s']:.1f} ms")

    def close(self):
        """Remove disk mode's files (they hold nothing the snapshot lacks); let the boxes in flight land."""
        if self.boxes is not None:
            self.boxes.settle()
        if self.cache is not None:
            self.cache.settle()
        self.host.close()
        self._locked = self._chunk_ring = None
        device.release_pinned()
        if _backend.on_gpu(self.backend):
            device.cap_device_memory(0)

    # ------------------------------------------------------------------ the blocks
    def _statistics_of(self, model, state):
        """The strategy's statistics of ``model``'s rows from ``state``, on the model's device (zeros where
        absent)."""
        xp = model.xp
        statistics = self.fresh_statistics(xp, len(model))
        statistics.update({k: _backend.to_host(a) if xp is np else xp.asarray(a) for k, a in (state or {}).items()
                           if len(a) == len(model)})
        return statistics

    def _install(self, model, statistics):
        """Cut ``model`` (on the host or the device) and its ``statistics`` into blocks anew (``_cut``)."""
        g = model.gaussians
        self._cut(_backend.to_host(g.means), _backend.to_host(g.scales), model.xp,
                  lambda table, at: self.layout.store(model, statistics, table, at))
        self._whole = (model, statistics) if model.xp is np else None

    def _cut(self, means, scales, xp, write, runs=None):
        """Cut a model of ``means`` and ``scales`` (host) into blocks anew: the index, the host's tables, the device's
        pool: every block in it at once where it holds them all (one copy), else empty (the views' blocks come in as
        they are seen).  ``write(table, at)`` writes the model's rows and statistics into rows ``at`` of ``table``
        (on ``xp``'s device: the model's); in disk mode, where the pool lacks blocks, ``runs(index)`` (if given)
        gives them as ``DiskBlocks.reset_appended``'s runs instead, so that host memory never holds the table."""
        self._whole = None
        self._owed = None  # (the old pool's: ``model`` and ``statistics`` replace it)
        if self.boxes is not None:
            self.boxes.settle()  # the old index's boxes in flight landed (their pinned memory free to reuse)
        if self.cache is not None:
            self.cache.settle()  # the old pool's moves done before it and the host's tables are replaced
        self.index = index = BlockIndex(means, scales, self.block_rows)
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
            device.release_pinned()
        if moving and self._locked is None:  # (locking takes seconds at 100M: a quarter more rows after a re-cut)
            self._locked = device.pinned_empty((shape[0] * (5 if self._cuts else 4) // 4, shape[1]))
        self._cuts += 1
        if runs is not None and self.mode == "disk" and slots < index.blocks:
            self.host.reset_appended({b: (int(k), shape[1]) for b, k in enumerate(index.sizes)}, runs(index))
            self._place(None, None, slots, counts)
            return
        locked = self._locked[:shape[0]] if moving else None
        table = locked if locked is not None and xp is np else xp.empty(shape, np.float32)
        write(table, xp.asarray(index.table_rows))
        host_table = table
        later = self._written_back_later(slots, xp)
        if later:
            self.host.reset_unwritten(index.starts, index.sizes, shape[1])
            host_table = None
        elif _backend.is_device(table):
            host_table = locked if locked is not None else np.empty(shape, np.float32)
            table.get(out=host_table)
        self._place(host_table, table, slots, counts)
        if later:
            self.cache.changed(self._every_block())

    def _written_back_later(self, slots, xp):
        """Whether a model on ``xp``'s device, cut into blocks, goes to the host's tier only when it is read there
        (every block changed in the pool, written back at the next ``_flush``; ``reset_unwritten``): where the pool
        of ``slots`` slots holds every block with Adam's moments (nothing leaves it until the next cut) and the model
        is on the device (or on the CPU backend, whose pool is a copy too).  A refinement on the device then copies
        nothing to the host, nor writes the disk's files."""
        return (slots >= self.index.blocks and self.pool_layout.moments
                and (xp is not np or not _backend.on_gpu(self.backend)))

    def _place(self, host_table, table, slots, counts):
        """The host's tier the blocks of ``self.index`` as views of ``host_table`` (their rows block after block; None:
        the tier holds them already: disk mode's refined blocks, or blocks written later, ``reset_unwritten``), a new
        device pool of ``slots`` slots (every block in it at once from ``table``, the same rows on the model's device,
        where it holds them all; else they come in as views see them), the traffic ``counts`` carried on."""
        index = self.index
        if host_table is not None:
            self.host.reset({b: host_table[index.starts[b]:index.starts[b] + index.sizes[b]]
                             for b in range(index.blocks)}, whole=host_table)
        direct = host_table if self._locked is not None and device.is_pinned(host_table) else None
        self.cache = DeviceCache(self.xp, self.layout, self.block_rows, slots, index, direct, self.pool_layout)
        self.cache.moved_bytes, self.cache.hits, self.cache.misses = counts  # (the traffic counts on)
        if self.cache.slots == index.blocks and table is not None:
            self.cache.hold_all(table)

    def refine(self, strategy, step, ctx):
        """The strategy's refinement or reset (``after_optimizer``) at ``step``, made block by block on the host's tier
        where the strategy decides per Gaussian (``candidates``) and the device's pool lacks some blocks: in host mode
        on its one table, where it can take the new model in place, else into a page-locked table a quarter larger
        than the new model (``RefinedInTable``'s ``into``; the old one let go after); in disk mode from the blocks' files to new ones
        (``RefinedToFiles``).  -> its events, or None where it cannot (the caller then refines the whole model).
        Equal to the whole model's refinement, rows in the same order: the decisions are each Gaussian's, the memory
        guard's is made over all the candidates, and the random draws are functions of the global row
        (``Context.rows``) under the one key the whole model would draw.  Host memory beyond the table (host mode)
        or the cache and its room in transit (disk mode): a block's rows, the blocks written later
        (``refine_peak_bytes``) and the decisions (17 B a Gaussian).  Blocks that grow past ``block_rows`` split in
        Morton order; the index and the boxes are made anew."""
        table = self.host.whole
        on_disk = isinstance(self.host, DiskBlocks)
        if (not self.refine_in_blocks or not hasattr(strategy, "candidates") or not self._tier_reads_rows()
                or (self.cache.slot >= 0).all() or (not on_disk and self._locked is None and table.base is not None)):
            return None
        self._flush()
        plan = self._refinement_plan(strategy, step, ctx)
        if on_disk:
            blocks = RefinedToFiles(self.host, plan)
        else:
            capacity = len(self._locked) if self._locked is not None else max(plan.n, plan.n_new)
            self.host.reset({})
            if plan.n_new > capacity:  # (a larger page-locked table, refined into: the old one let go after)
                table, self._locked = self._locked[:plan.n], device.pinned_empty((plan.n_new * 5 // 4, table.shape[1]))
                blocks = RefinedInTable(table, plan, into=self._locked)
            else:
                if self._locked is not None:
                    table = self._locked[:max(plan.n, plan.n_new)]
                elif plan.growing:
                    table.resize((plan.n_new, table.shape[1]), refcheck=False)
                blocks = RefinedInTable(table, plan)
        self._whole = None
        events = self._refine_blocks(strategy, step, ctx, plan, blocks)
        outgrown = not on_disk and blocks.into is not blocks.table
        blocks = None
        if on_disk:
            table = None
        elif self._locked is not None:
            table = self._locked[:plan.n_new]
        elif not plan.growing:
            table.resize((plan.n_new, table.shape[1]), refcheck=False)
        if plan.decided is not None:
            events["gaussians"] = plan.n_new
        self._reindex(table, plan)
        if outgrown:
            device.release_pinned()  # (the table outgrown)
        return events

    def _refinement_plan(self, strategy, step, ctx):
        """Where every row goes: the whole model's decisions (``_refinement``; none at a step that only
        resets), each block's new size, first row and new blocks (``_pieces``: their first's number), each kept
        row's new global row; the new blocks' boxes to come."""
        index, n = self.index, len(self.index)
        decided = self._refinement(strategy, step, ctx) if strategy.refines_at(step, ctx) else None
        keep = np.ones(n, bool) if decided is None else decided[0]
        clone, split = (np.zeros(0, np.int64),) * 2 if decided is None else decided[1:]
        new_sizes = np.bincount(index.block[keep], minlength=index.blocks) \
            + np.bincount(index.block[clone], minlength=index.blocks) \
            + 2 * np.bincount(index.block[split], minlength=index.blocks)
        n_new = int(new_sizes.sum())
        pieces = self._pieces(new_sizes)
        first_piece = np.concatenate([[0], np.cumsum(pieces)[:-1]]).astype(np.int64)
        return SimpleNamespace(
            decided=decided, keep=keep, clone=clone, split=split, n=n, n_new=n_new, growing=n_new >= n,
            old_starts=index.starts, old_ends=index.starts + index.sizes,
            new_starts=np.concatenate([[0], np.cumsum(new_sizes)[:-1]]).astype(np.int64),
            new_kept=np.cumsum(keep) - 1, n_kept=int(keep.sum()),
            clone_places=dict(self._by_block(clone)), split_places=dict(self._by_block(split)),
            first_piece=first_piece, pieces=[None] * index.blocks,
            lo=np.empty((int(pieces.sum()), 3), np.float32), hi=np.empty((int(pieces.sum()), 3), np.float32))

    def _pieces(self, size):
        """How many blocks a refined block of ``size`` rows (or each of an array of sizes) becomes: none where it
        is empty, itself, or past ``block_rows`` as many as hold its rows (``_cut_block``)."""
        return -(-size // self.block_rows)

    def _refine_blocks(self, strategy, step, ctx, plan, blocks):
        """Refine each block on its own rows (read from ``blocks``, a ``RefinedInTable`` or ``RefinedToFiles``) and
        hand its new rows back to ``blocks``, which writes them where they go; the new blocks' boxes computed
        from their rows."""
        rng_before = ctx.rng.bit_generator.state
        events = {}
        self.refine_peak_bytes = 0
        means_and_scales = self.layout.columns["means"][0], self.layout.columns["scales"][0]
        for b in blocks.order():
            rng = np.random.Generator(type(ctx.rng.bit_generator)())
            rng.bit_generator.state = rng_before
            out, done = self._refine_block(strategy, step, replace(ctx, rng=rng), plan, blocks.rows(b), b)
            for k, v in done.items():
                events[k] = events.get(k, 0) + v if isinstance(v, int) and not isinstance(v, bool) else v
            sizes = np.array([len(p) for p in plan.pieces[b]], np.int64)
            if len(sizes):
                first = plan.first_piece[b]
                starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
                plan.lo[first:first + len(sizes)], plan.hi[first:first + len(sizes)] = reach_boxes(
                    out, starts, sizes, *means_and_scales, REACH, backend="cpu")
            held = blocks.put(b, out)
            self.refine_peak_bytes = max(self.refine_peak_bytes, held + 3 * out.nbytes)
        blocks.done()
        ctx.rng.bit_generator.state = rng.bit_generator.state
        return events

    def _refine_block(self, strategy, step, ctx, plan, table, b):
        """Block ``b`` (its rows ``table``) refined alone (its global rows in ``ctx.rows``, the whole model's
        decisions for them): -> (its new rows in the table's layout, its new blocks' after one another; the
        strategy's events).  ``plan.pieces[b]`` gets the new blocks' global rows."""
        index = self.index
        rows = index.members(b)
        model, statistics = self.layout.model(table, self._adam_steps, "cpu", betas=self.betas)
        local = None
        if plan.decided is not None:
            none = np.zeros(0, np.int64)
            cp, sp = plan.clone_places.get(b, none), plan.split_places.get(b, none)
            splits = index.position[plan.split[sp]]
            kept = plan.keep[rows]
            pruned = ~kept
            pruned[splits] = False  # (the strategy prunes the split parents itself)
            local = (pruned, index.position[plan.clone[cp]], splits)
            global_rows = np.concatenate([plan.new_kept[rows[kept]], plan.n_kept + cp,
                                          (plan.n_kept + len(plan.clone) + 2 * sp[:, None] + np.arange(2)).ravel()])
        else:
            global_rows = plan.new_kept[rows]
        done = strategy.after_optimizer(model, statistics, step, replace(ctx, rows=rows), decided=local)
        out = self.layout.table(model, statistics)  # (fresh after a refinement; kept by a reset alone)
        pieces = self._cut_block(out, global_rows)
        order = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        plan.pieces[b] = [global_rows[p] for p in pieces]
        return out[order], done

    def _refinement(self, strategy, step, ctx):
        """The whole model's refinement decisions, made block by block (each read from the host's tier, as a pass
        over every block reads it: ``scan``): -> (keep mask, clone rows, split rows)."""
        index, n = self.index, len(self.index)
        prune = np.zeros(n, bool)
        clone, split, clone_grads, split_grads = [], [], [], []
        for b in range(index.blocks):
            rows = index.members(b)
            model, statistics = self.layout.model(self.host.scan(b), self._adam_steps, "cpu", betas=self.betas)
            grads, prune[rows], c, s = strategy.candidates(model, statistics, step, ctx)
            clone.append(rows[c]), split.append(rows[s]), clone_grads.append(grads[c]), split_grads.append(grads[s])
        by_row = [np.argsort(np.concatenate(r)) for r in (clone, split)]
        clone, clone_grads = (np.concatenate(a)[by_row[0]] for a in (clone, clone_grads))
        split, split_grads = (np.concatenate(a)[by_row[1]] for a in (split, split_grads))
        clone, split = strategy.guard(np, n - int(prune.sum()), clone, split, clone_grads, split_grads, ctx)
        keep = ~prune
        keep[split] = False
        return keep, clone, split

    def _cut_block(self, table, global_rows):
        """A refined block's rows (``table``; their new ``global_rows``) -> the places in ``table`` of each block it
        becomes, each in model order: none where it is empty, itself, or past ``block_rows`` pieces in the Morton
        order of their centres (``_pieces`` of them)."""
        by_row = np.argsort(global_rows, kind="stable")
        if len(table) <= self.block_rows:
            return [by_row] if len(table) else []
        a = self.layout.columns["means"][0]
        order = morton_order(table[:, a:a + 3])
        return [part[np.argsort(global_rows[part], kind="stable")]
                for part in np.array_split(order, self._pieces(len(table)))]

    def _reindex(self, table, plan):
        """The index of the refined blocks (``plan.pieces``: each old block's new blocks' model rows, laid out in
        ``table`` from ``plan.new_starts`` in host mode, in the tier's files in disk mode (``table`` None); their
        boxes ``plan.lo``, ``plan.hi``), the host's tier and the pool made anew."""
        block = np.empty(plan.n_new, np.int64)
        for j, rows in enumerate(p for ps in plan.pieces for p in ps):
            block[rows] = j
        self.boxes.settle()
        self.cache.settle()
        self._owed = None  # (stored before the refinement read the blocks: ``refine``'s flush)
        counts = (self.cache.moved_bytes, self.cache.hits, self.cache.misses)
        self.cache = None
        self.index = BlockIndex.of_blocks(block, plan.lo, plan.hi)
        self.boxes = BoxesInFlight(self.index)
        self._rows = self._working = None
        self._place(table, table, self._slots(len(self.index)), counts)

    def _gather_resident(self):
        """-> (the whole model, its statistics) on the device, from its pool, where it holds every
        block (a working set of them all) with Adam's moments (not ``adam`` host) and a ``--gpu-memory`` cap
        leaves room for a refinement there (``_room_to_refine``), else None."""
        if not (self.cache.slot >= 0).all() or not self._room_to_refine() or not self.pool_layout.moments:
            return None
        self.cache.copies.kernels_after()  # (the last blocks may still be on their way)
        self._store_owed()
        every = np.arange(self.index.blocks)
        return self.layout.model(self.cache.pool, self._adam_steps, self.backend,
                                 rows=self.cache.rows(every, len(self.index)), betas=self.betas)

    def _room_to_refine(self):
        """Whether the cap leaves room beside the pool for a refinement of the whole model on the device
        (``DEVICE_REFINE_ROWS`` rows a Gaussian); always without a cap, where the pool took only a share of
        the free memory.  Else the refinement runs on the host."""
        if not self.gpu_memory or not _backend.on_gpu(self.backend):
            return True
        import cupy
        pool = cupy.get_default_memory_pool()
        return pool.get_limit() - pool.used_bytes() >= DEVICE_REFINE_ROWS * len(self.index) * self.layout.row_bytes

    def _slot_bytes(self):
        """Device bytes a block slot takes: its rows' table, and room for them in a step's working set
        (``working_set_bytes``' peak at ``intersections_per_gaussian``)."""
        return int(np.ceil(self.block_rows * self._working_row_bytes()))

    def _working_row_bytes(self):
        """Device bytes a working-set Gaussian takes at the step's peak, its pool row included."""
        return self.working_set_bytes(self.intersections_per_gaussian())[1]

    def _working_rows(self):
        """The working-set rows that the budget holds beside the pool as it was made, at the intersections per
        Gaussian assumed now (which may have grown since: fewer rows than the pool's then); None: no cap."""
        if self.device_budget is None:
            return None
        spare = self.device_budget - DeviceCache.INDEX_BYTES * len(self.index) - int(self.cache.pool.nbytes)
        return max(0, spare) // int(np.ceil(self._working_row_bytes() - self.pool_layout.row_bytes))

    def _slots(self, n):
        """How many block slots the device may hold, besides the index of ``n`` Gaussians there and the
        training images (which the cap counts too); the budget kept in ``device_budget``."""
        self.device_budget = self._device_budget()
        if self.device_budget is None:
            return 1 << 62  # no cap: every block may stay
        index = DeviceCache.INDEX_BYTES * n
        if self.gpu_memory and self.device_budget < index:  # (not even the index fits: say so before allocating it)
            need = self._cap_for(self.images_bytes + self._view_bytes() + index + self._slot_bytes())
            raise ValueError(f"--gpu-memory {format_bytes(self.gpu_memory)} is too small: the training images take "
                             f"{format_bytes(self.images_bytes)} of it (--targets uint8 keeps them in a quarter), the "
                             f"largest view's buffers {format_bytes(self._view_bytes())}, the index of {n:,} Gaussians "
                             f"{format_bytes(index)} and one block {format_bytes(self._slot_bytes())}; give "
                             f"--gpu-memory {format_bytes(need)} or more")
        return max(0, self.device_budget - index) // self._slot_bytes()

    def _view_bytes(self):
        """Device bytes of the largest training view's per-pixel buffers (``VIEW_BYTES_PER_PIXEL``)."""
        return VIEW_BYTES_PER_PIXEL * max((v.camera.width * v.camera.height for v in self.views), default=0)

    def _headroom(self):
        """(share of the cap, bytes) kept out of a ``gpu_memory`` cap's budget: ``GPU_HEADROOM`` on a GPU, none
        on the CPU backend (no allocator's chunks there)."""
        return GPU_HEADROOM if _backend.on_gpu(self.backend) else (0.0, 0)

    def _cap_for(self, need):
        """The ``--gpu-memory`` whose budget holds ``need`` bytes besides the headroom."""
        share, fixed = self._headroom()
        return int(np.ceil((need + fixed) / (1.0 - share)))

    def _device_budget(self):
        """Device bytes for the pool and the index: ``gpu_memory`` less the training images and the headroom
        (``_headroom``), or where it is 0, ``GPU_SHARE`` of the device's free memory now (the images already in
        it); less room for the largest view's per-pixel buffers (``VIEW_BYTES_PER_PIXEL``); None on the CPU
        backend without a cap."""
        view = self._view_bytes()
        if self.gpu_memory:
            share, fixed = self._headroom()
            return self.gpu_memory - int(share * self.gpu_memory) - fixed - self.images_bytes - view
        if not _backend.on_gpu(self.backend):
            return None
        return int(GPU_SHARE * device.free_bytes()) - view

    def _gather_whole(self):
        """-> (the whole model on the host, its statistics): the device's changed blocks written back
        first."""
        if self._whole is None:
            self._flush()
            index, table = self.index, self.host.whole
            rows = None
            if table is not None:  # the blocks' rows in model order, straight from the one table
                rows = index.table_rows
            else:
                table = np.empty((len(index), self.layout.columns_total), np.float32)
                for b in range(index.blocks):
                    table[index.members(b)] = self.host.get(b)
            self._whole = self.layout.model(table, self._adam_steps, "cpu", rows=rows, betas=self.betas)
        return self._whole

    def _working_set(self, views, upcoming):
        """The blocks that the training ``views`` see resident (the missing ones moved in, and those of
        ``upcoming``, the next step's views, queued to move in while this step trains); -> their
        ``WorkingRows``.  Where the pool and the budget hold the whole model, every block, whichever the
        views see: the working set is then the same from step to step (as the model in memory is), its rows
        and its model reused, not found and gathered again for each view (copies from the host that wait for
        the device's queue); the projection leaves out what a view does not see, as in memory.  Else
        consecutive steps that have the same blocks in the same slots reuse them too."""
        waited = device.DeviceInterval()
        rows = self._working_rows()
        if self._holds_every_block(rows):
            self.boxes.settle(keep=1)  # (the boxes in flight land as they would for culling; none is grown)
            blocks = self._every_block()
        else:
            self._store_owed()  # (the blocks may leave the pool, written back)
            blocks = self._blocks_seen(views, self.boxes.for_culling())
        if len(blocks) > self.cache.slots or (rows is not None and self.index.sizes[blocks].sum() > rows):
            chunked = self.chunked_views and len(views) == 1
            slots = 1 if chunked else len(blocks)  # (chunks need one block's room; else the whole working set)
            need = self._cap_for(slots * self._slot_bytes() + DeviceCache.INDEX_BYTES * len(self.index)
                                 + self.images_bytes + self._view_bytes())
            if chunked and self.cache.slots >= 1 and (rows is None or rows >= 1):
                self._waits.append(waited.stop())
                return self._chunked(views[0], blocks, rows)
            have = self.gpu_memory or self.cache.slots * self._slot_bytes()
            names = ("view " if len(views) == 1 else "views ") + ", ".join(self.views[i].name for i in views)
            seen = f"({int(self.index.sizes[blocks].sum()):,} Gaussians in {len(blocks)} blocks)"
            what = (f"its working set {seen}, trained in depth-ordered chunks, needs room for one block of "
                    f"{self.block_rows:,} Gaussians beside the index, {format_bytes(need)}" if chunked
                    else f"its working set {seen} needs {format_bytes(need)}")
            raise ValueError(f"--gpu-memory {format_bytes(have)} is too small for {names}: {what}; give "
                             f"--gpu-memory {format_bytes(need)} or more")
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
        if len(upcoming) and self.cache.slots < self.index.blocks:  # the next step's blocks, moved in while this step
            # trains (a guess: its boxes will grow); where the device holds every block nothing moves
            ahead = self._blocks_seen(upcoming, self.boxes.for_culling())
            self.cache.prefetch(ahead, blocks, self.index, self.host)
            if self.mode == "disk":
                self.host.prefetch(ahead)
        return self._rows

    # ------------------------------------------------------------------ a view in chunks
    def _chunked(self, view, blocks, rows=None):
        """-> a ``ChunkedView`` of training ``view``, whose ``blocks`` outnumber the pool's slots or hold
        more than the budget's working ``rows`` (None: no cap): the pool's changed blocks written back and
        every block let go (the pool stages the chunks' rows, at most ``rows`` a chunk), the boxes in flight
        landed (the step's are computed on the host after it)."""
        self._flush()
        self.cache.release_all()
        self.boxes.settle()
        self._rows = self._working = None
        self.chunked_steps += 1
        self._chunk_nonfinite = []  # (each chunk's rows with a non-finite parameter, counted on the model's device)
        size = self.cache.slots * self.block_rows
        return ChunkedView(self, view, blocks, size if rows is None else min(size, rows))

    def rows_in(self, rows):
        """-> (the model rows ``rows`` (host, model order) as a model on the device with Adam at the store's
        step, their statistics): gathered from the host's tier into the pool's first rows (one copy, no
        array of them on the device besides), and trained in place there as a working set is
        (``_load_working``)."""
        n, ring = len(rows), self._chunk_staging()
        starts = np.arange(0, n, ring.rows)  # (a slice at a time, gathered into page-locked memory: host memory
        # holds a slice, not the chunk; the pool's columns alone)
        ring.upload_filled(self.cache.pool, starts, np.minimum(ring.rows, n - starts),
                           lambda j, into: self._host_rows(rows[starts[j]:starts[j] + len(into)], self.cache.spans,
                                                           out=into))
        self.cache.moved_bytes += n * self.pool_layout.row_bytes
        pool_rows = self.xp.arange(n)
        return self._trained_in_place(self.pool_layout.model(self.cache.pool, self._adam_steps, self.backend,
                                                             rows=pool_rows, betas=self.betas, in_place=True,
                                                             adam=self._host_adam(rows, pool_rows)))

    def rows_out(self, rows, model, statistics):
        """``rows_in``'s ``model`` and ``statistics`` of the model rows ``rows``, trained, back to the host's
        tier (through the pool's first rows, where Adam wrote the parameters and, on the device, the moments)."""
        n, ring, pool, w = len(rows), self._chunk_staging(), self.cache.pool, self.layout.width
        self.pool_layout.store_statistics(statistics, pool, self.xp.arange(n), self.xp, self.backend)
        starts = np.arange(0, n, ring.rows)  # (a slice at a time, as ``rows_in``)
        self._chunk_nonfinite += [(~self.xp.isfinite(pool[a:min(n, a + ring.rows), :w])).any(axis=1).sum()
                                  for a in starts]
        for a, table in zip(starts, ring.download(self.cache.pool, starts, np.minimum(ring.rows, n - starts))):
            self.put_host_rows(rows[a:a + len(table)], table, self.cache.back)
        self.cache.moved_bytes += n * self.pool_layout.row_bytes

    def _chunk_staging(self):
        """The page-locked buffers (``device.StagingRing``) that a chunked view's rows move through, a slice of at
        most ``HOLD_SLICE_ROWS`` of the pool's rows each, made at the first chunked view."""
        rows, columns = min(HOLD_SLICE_ROWS, len(self.cache.pool)), self.pool_layout.columns_total
        ring = self._chunk_ring
        if ring is None or ring.rows != rows or ring.buffers[0].shape[1] != columns:
            self._chunk_ring = ring = None  # (the old buffers let go first)
            self._chunk_ring = ring = device.StagingRing(rows, columns)
        return ring

    def put_host_rows(self, rows, table, spans=None):
        """The rows of the model rows ``rows`` (host, model order) into the host's tier: ``table``'s rows, whole
        or (``spans``: ``copy_columns``') their columns alone."""
        index = self.index
        if self.host.whole is not None:
            copy_host_rows(table, None, self.host.whole, index.table_rows[rows], spans)
            return
        for b, sel in self._by_block(rows):
            held = self.host.get(b)
            copy_host_rows(table, sel, held, index.position[rows[sel]], spans)
            self.host.put(b, held)

    def host_rows_for_update(self, rows):
        """-> (a host table that holds the rows of the model rows ``rows`` (host, model order), their rows in
        it, whether it is a copy, to go back by ``put_host_rows``): host mode's one table where it has it,
        else the rows gathered (``HostAdam``'s update of a working set)."""
        if self.host.whole is not None:
            return self.host.whole, self.index.table_rows[rows], False
        return self._host_rows(rows), np.arange(len(rows)), True

    def _host_adam(self, rows, pool_rows):
        """-> None on the device's Adam; on the host's (``adam`` host) a maker of the ``HostAdam`` of the model
        rows ``rows`` (host) that the pool's rows ``pool_rows`` hold (``RowLayout.model``'s ``adam``)."""
        if self.adam != "host":
            return None
        pool = self.cache.pool
        return lambda params, _: HostAdam(params, *self.betas, backend=self.backend, store=self, rows=rows,
                                          pool=pool, pool_rows=pool_rows)

    def _host_rows(self, rows, spans=None, read=None, out=None):
        """The host tier's table rows of the model rows ``rows`` (a new array, or into ``out``): whole, or ``spans``'
        columns alone, only those read (((the row's first column, the new array's first column, columns), ...), as
        ``DeviceCache.spans``); in disk mode each block's by ``read`` (default ``get``: into the cache)."""
        index, whole = self.index, self.host.whole
        spans = spans or ((0, 0, self.layout.columns_total),)
        if out is None:
            out = np.empty((len(rows), sum(k for _, _, k in spans)), np.float32)
        if whole is not None:
            copy_host_rows(whole, index.table_rows[rows], out, None, spans)
            return out
        for b, sel in self._by_block(rows):
            copy_host_rows((read or self.host.get)(b), index.position[rows[sel]], out, sel, spans)
        return out

    def depth_rows(self, rows):
        """The Gaussians of the model rows ``rows`` (host) on the device with what their depth keys read alone
        (``numbasplat.chunks.depth_keys``: the means, scales, rotations, opacities and SH degree 0): a chunked
        view's depth pass moves these, not the pool's rows."""
        return self._host_gaussians(rows, 1, moved=True)

    def _host_gaussians(self, rows, sh_bases, read=None, moved=False):
        """The parameters of the model rows ``rows`` (host), their SH up to ``sh_bases`` bases, as ``Gaussians`` on
        the device: a row's first columns alone read from the host's tier (``_host_rows``; ``read``: disk mode's
        block reader), counted as moved with ``moved``."""
        first_sh = self.layout.columns["sh"][0]
        table = self._host_rows(rows, ((0, 0, first_sh + 3 * sh_bases),), read)
        if moved:
            self.cache.moved_bytes += table.nbytes
        spans = {g: (a, b - a) for g, (a, b) in self.layout.columns.items() if g != "sh"}
        spans["sh"] = (first_sh, 3 * sh_bases)
        groups = {}
        for g, (a, k) in spans.items():  # (each group's columns made contiguous on every core)
            groups[g] = np.empty((len(rows), k), np.float32)
            copy_host_rows(table, None, groups[g], None, ((a, 0, k),))
        groups["opacities"] = groups["opacities"][:, 0]
        groups["sh"] = groups["sh"].reshape(len(rows), sh_bases, 3)
        return ns.Gaussians(**{g: self.xp.asarray(a) for g, a in groups.items()})

    def _by_block(self, rows):
        """(block, the places in ``rows`` of its rows) for each block that ``rows`` (model rows) touch."""
        blocks = self.index.block[rows]
        return [(int(blocks[part[0]]), part) for part in runs_by_block(blocks)]

    def _chunked_done(self, view):
        """After a chunked step: Adam's step count on, and the view's blocks' boxes computed from the host's
        rows (at once: the pool holds none of them; their centres and scales alone read), a group of blocks of
        about ``HOLD_SLICE_ROWS`` rows at a time (host memory holds a group's rows, not the view's); a parameter
        gone non-finite in a chunk (``rows_out`` counts them on the device) stops training with one message (the
        divergence check of a chunked view)."""
        self._adam_steps = view.adam.step_count
        self._whole = None
        blocks, index, columns = view.blocks, self.index, self.layout.columns
        ends = np.cumsum(index.sizes[blocks])
        reach = ((columns["means"][0], 0, 3), (columns["scales"][0], 3, 3))
        for group in np.split(blocks, np.searchsorted(ends, np.arange(HOLD_SLICE_ROWS, ends[-1], HOLD_SLICE_ROWS))
                              if len(blocks) else []):
            if not len(group):
                continue
            table = self._host_rows(np.concatenate([index.members(b) for b in group]), reach)  # (block after block)
            sizes = index.sizes[group].astype(np.int64)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            index.lo[group], index.hi[group] = reach_boxes(table, starts, sizes, 0, 3, REACH, backend="cpu")
        self.boxes._culling = None
        bad = sum(int(k) for k in self._chunk_nonfinite)
        if bad:
            raise FloatingPointError(f"training diverged: non-finite parameters of {bad} of the {len(view)} Gaussians "
                                     f"of view {self.views[view.view].name}, trained in chunks (the last snapshot is "
                                     "kept; try lower learning rates)")

    def _holds_every_block(self, rows):
        """Whether the pool holds every block and the budget's working ``rows`` (None: no cap) the whole model:
        each step's working set is then every block, as in memory (``_working_set``)."""
        return self.cache.slots >= self.index.blocks and (rows is None or len(self.index) <= rows)

    def _every_block_working(self, in_pool):
        """Whether the working set ``in_pool`` (a ``WorkingRows``, else none) is every block (``_working_set``)."""
        return isinstance(in_pool, WorkingRows) and len(in_pool.blocks) == self.index.blocks

    def _every_block(self):
        """Every block of the index (a working set of them all)."""
        return np.arange(self.index.blocks)

    def _blocks_seen(self, views, boxes):
        """The blocks whose ``boxes`` the training ``views`` see."""
        seen = [self.index.visible(self.views[i].camera, boxes) for i in views]
        return seen[0] if len(seen) == 1 else np.unique(np.concatenate(seen))

    def _load_working(self, in_pool):
        """-> (the model of the working set ``in_pool``, its statistics) on the device: the last step's
        as it is where its rows are the same, else gathered from the pool.  It trains in place: its
        parameters and statistics are a copy, its moments stay in the pool's rows, where Adam writes the
        new parameters too (``RowLayout.model(in_place=True)``).  A steady working set (every block) trains
        on a copy of its whole rows instead where the device has room (``_copies_whole_rows``): the flat Adam
        of a model in memory, with no row indirection, and the rows owed back to the pool (``_store_owed``)."""
        if self._working is None or self._working[0] is not in_pool:
            self._store_owed()  # (the pool's rows current before they are gathered)
            self._working = None  # (the last working set's buffers free before this one's are made)
            adam = self._host_adam(self.index.rows(in_pool.blocks) if self.adam == "host" else None, in_pool.rows)
            in_place = not self._copies_whole_rows()
            self._working = (in_pool, *self._trained_in_place(self.pool_layout.model(
                self.cache.pool, self._adam_steps, self.backend, rows=in_pool.rows, betas=self.betas,
                in_place=in_place, adam=adam)), in_place)
        return self._working[1:3]

    def _copies_whole_rows(self):
        """Whether the working set checked out trains on a copy of its whole rows (``_load_working``): where it is
        steady (every block, Adam on the device, no cap) and the device's free memory holds twice that copy."""
        if not self.steady:
            return False
        need = 2 * len(self.index) * self.layout.model_bytes(False)
        return not _backend.on_gpu(self.backend) or device.free_bytes() >= need

    def _trained_in_place(self, working):
        """``working`` ((a model trained in place on pool rows, its statistics)), its gradients written over its
        parameters where its Adam runs on the host and the pipeline says so (``grads_over_params``)."""
        working[0].grads_over_params = self.adam == "host" and self.grads_over_params
        return working

    def _store_working(self, working, statistics, in_pool, lr_means, lr_scales):
        """The trained working set's statistics back to the pool (Adam wrote its parameters and moments there);
        its blocks' boxes recomputed there and read a step late (their growth bounded by the step's learning
        rates).  Where the working set is every block (the next step's too, unless a refinement or the budget
        changes it) both wait until read: the statistics until the pool's rows are (``_store_owed``), the boxes
        until a view is culled (``BoxesInFlight.owe``)."""
        self._adam_steps = working.adam.step_count
        in_place = self._working[3]
        if in_place:  # (its gradients made again at the next step's backward: the binning's peak does without them;
            working.release_grads()  # a copy of whole rows keeps them, as a model in memory does: no cap counts them)
        self.cache.changed(in_pool.blocks)
        self._whole = None
        reach = lambda: self.cache.boxes(in_pool.starts, in_pool.sizes, self.layout)  # noqa: E731
        if self._every_block_working(in_pool):  # (none is culled while every block is the working set)
            self._owed = (None if in_place else working, statistics, in_pool)
            owed_reach = lambda: (self._store_owed(), reach())[1]  # noqa: E731  (from the pool's rows made current)
            self.boxes.owe(in_pool.blocks, owed_reach, lr_means, lr_scales)
            return
        self.pool_layout.store_statistics(statistics, self.cache.pool, in_pool.rows, self.xp, self.backend)
        self.boxes.add(in_pool.blocks, *reach(), lr_means, lr_scales)
        self.cache.moved_bytes += 24 * len(in_pool.blocks)  # the boxes out

    def _store_owed(self):
        """What steps of every block left in their working set (``_store_working``) back to the pool, before anything
        reads the pool's rows (a gather, a write-back, another working set, the boxes) or replaces it: its statistics,
        or where it trained on a copy of its whole rows, those rows (one kernel)."""
        if self._owed is not None:
            model, statistics, in_pool = self._owed
            self._owed = None
            if model is not None:
                self.layout.store(model, statistics, self.cache.pool, in_pool.rows)
            else:
                self.pool_layout.store_statistics(statistics, self.cache.pool, in_pool.rows, self.xp, self.backend)

    def _flush(self):
        """Every changed block back to the host's tier (``DeviceCache.flush``), with what steps owe it."""
        self._store_owed()
        self.cache.flush(self.index, self.host)

    def _counters(self):
        """The traffic so far (the device's pool, the disk) and the time waited for it."""
        cache = self.cache
        while self._waits and self._waits[0].seconds() is not None:
            self.wait_s += self._waits.pop(0).seconds()
        return {"moved_bytes": cache.moved_bytes if cache else 0, "hits": cache.hits if cache else 0,
                "misses": cache.misses if cache else 0, "disk_read_bytes": self.host.read_bytes,
                "disk_written_bytes": self.host.written_bytes, "wait_s": self.wait_s}
