"""The out-of-core model's shape: its Gaussians in spatially coherent blocks (``BlockIndex``), a
Gaussian's values one row of a table (``RowLayout``), a step's working set of rows (``WorkingRows``),
and the part of a model that a view can see (``frustum_part``)."""
from collections import namedtuple

import numpy as np

from numbasplat import backend as _backend
from numbasplat.optim import GROUPS, FlatParams, RowsAdam, group_widths
from numbasplat.rows import flat_to_rows, rows_to_flat

from engine.pipelines.partition import GROW_PX, REACH, cluster_boxes, morton_order, stable_argsort, visible_regions
from engine.recipe.model import GaussianModel

BLOCK_ROWS = 4096  # Gaussians a block holds, about: spatially close ones, culled together
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
        order = morton_order(means)
        block = np.empty(len(means), np.int64)
        block[order] = np.arange(len(means)) // block_rows
        full = len(order) // block_rows * block_rows  # (block b: rows order[b * block_rows:], each sorted: by_block)
        by_block = np.concatenate([np.sort(order[:full].reshape(-1, block_rows), axis=1).ravel(),
                                   np.sort(order[full:])])
        self._cut(block, *cluster_boxes(means, log_scales, block_rows, order), by_block=by_block)

    @classmethod
    def of_blocks(cls, block, lo, hi):
        """The index of blocks given: ``block`` (N,) each Gaussian's, ``lo``/``hi`` (B, 3) their boxes (a
        refinement made block by block, ``OutOfCoreStore.refine``)."""
        index = cls.__new__(cls)
        index._cut(np.asarray(block, np.int64), lo, hi)
        return index

    def _cut(self, block, lo, hi, by_block=None):
        n = len(block)
        self.block = block
        self.blocks = int(self.block.max()) + 1 if n else 0
        self.by_block = (stable_argsort(self.block, self.blocks.bit_length()) if by_block is None  # rows block by
                         else by_block)  # block, each in model order
        self.sizes = np.bincount(self.block, minlength=self.blocks)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.position = np.empty(n, np.int64)
        self.position[self.by_block] = np.arange(n) - np.repeat(self.starts, self.sizes)
        self.table_rows = self.starts[self.block] + self.position  # each Gaussian's row in the blocks' table
        self.lo, self.hi = lo, hi

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
        """The Gaussians of ``blocks``, in model order (a flag a block looked up: ``np.isin`` sorts)."""
        chosen = np.zeros(self.blocks, bool)
        chosen[blocks] = True
        return np.flatnonzero(chosen[self.block])


WorkingRows = namedtuple("WorkingRows", "index blocks slots count rows starts sizes")
WorkingRows.__doc__ = """A working set's blocks (of ``index``) and their ``slots`` (host arrays), its Gaussians'
``count``, and on the device their pool ``rows`` in model order and the blocks' first pool rows
(``starts``) and ``sizes`` (``OffloadTrainer._working_set``)."""


class RowLayout:
    """A Gaussian's row of the out-of-core tables, float32: its parameters (in ``GROUPS`` order, ``width``
    columns), the strategy's statistics (counts exact up to 2**24), then both Adam moments (as the parameters):
    the columns that the device's pool holds where Adam runs on the host, the parameters and the statistics,
    are the row's first, so that a block moves by one copy of them, not one for each.
    ``plan``: where each column goes in a model's flat buffers held back to back (``numbasplat.math.rows``),
    so that rows move between a table and a model in one kernel each way.

    ``moments`` False: the row of the device's pool where Adam runs on the host (``--offload-adam host``),
    the parameters and the statistics alone (``without_moments``); the moments stay in the host's tier."""

    def __init__(self, sh_bases, statistics, moments=True):
        self.sh_bases = sh_bases
        widths = group_widths(sh_bases)
        self.width = w = sum(widths.values())
        starts = np.cumsum([0] + [widths[g] for g in GROUPS])
        self.columns = {g: (int(starts[i]), int(starts[i + 1])) for i, g in enumerate(GROUPS)}
        self.statistics = {k: np.dtype(a.dtype) for k, a in statistics.items()}  # name: dtype
        self.moments = moments
        self.parts = ("params", "m", "v") if moments else ("params",)  # the flat buffers a row holds, in order
        self.first_statistic = w
        statistics_end = w + len(self.statistics)
        self.part_columns = (0, statistics_end, statistics_end + w)[:len(self.parts)]  # each part's first column
        self.columns_total = len(self.parts) * w + len(self.statistics)
        self.row_bytes = 4 * self.columns_total
        part_plan = (lambda first: [(first + a, b - a, c) for a, b in self.columns.values() for c in range(b - a)])
        plan = part_plan(0) + [(w + j, 1, 0) for j in range(len(self.statistics))]
        plan += [p for first in self.part_columns[1:] for p in part_plan(first)]
        plan = [p + (j,) for j, p in enumerate(plan)]  # (column j is flat element group p[0]'s: the table's order)
        self.plan = np.ascontiguousarray(np.array(plan, np.int32).T)  # (4, columns): a, b, d, the column
        self._plans = {}

    def without_moments(self):
        """This layout's row without Adam's moments (the device's pool under ``--offload-adam host``)."""
        if not self.moments:
            return self
        return RowLayout(self.sh_bases, {k: np.zeros(0, dtype) for k, dtype in self.statistics.items()}, moments=False)

    def spans_in(self, pool):
        """-> ((this row's first column, ``pool``'s row's first column, columns), ...): where the columns of
        ``pool`` (this layout, or ``without_moments``) lie in this layout's row: the parameters and the
        statistics; None where ``pool`` holds the whole row."""
        if pool.columns_total == self.columns_total:
            return None
        return ((0, 0, pool.columns_total),)  # (the parameters and the statistics: the row's first columns)

    def saved_arrays(self):
        """-> [(part, name, the table's columns (a, b), the array's shape past its rows, dtype)]: where each array
        of ``GaussianModel.state()`` (part "params", "m" or "v") and each statistic (part "statistics") lies in a
        row, in the order a snapshot writes them."""
        tails = {g: ((self.sh_bases, 3) if g == "sh" else () if g == "opacities" else (b - a,))
                 for g, (a, b) in self.columns.items()}
        arrays = [(which, g, (first + a, first + b), tails[g], np.dtype(np.float32))
                  for which, first in zip(self.parts, self.part_columns) for g, (a, b) in self.columns.items()]
        s = self.first_statistic
        return arrays + [("statistics", k, (s + j, s + j + 1), (), dtype)
                         for j, (k, dtype) in enumerate(self.statistics.items())]

    def saved_state(self, read, step):
        """-> (model state, statistics) with Adam at ``step``: ``GaussianModel.state()``'s groups and the
        statistics, each array ``read(columns, tail, dtype)`` (``saved_arrays``' of it: a ``SlicedRows``, none
        of them read yet)."""
        state, statistics = {"params": {}, "m": {}, "v": {}}, {}
        for part, name, columns, tail, dtype in self.saved_arrays():
            (statistics if part == "statistics" else state[part])[name] = read(columns, tail, dtype)
        return {**state, "step": int(step)}, statistics

    def table_rows(self, table, rows, step):
        """-> ``saved_state`` of ``table``'s rows ``rows`` (host, model order), each array ``TableRows``."""
        return self.saved_state(lambda columns, tail, dtype: TableRows(table, rows, columns, tail, dtype), step)

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
        buffers = (model.params.data, model.adam.m, model.adam.v)[:len(self.parts)]
        flat, views = getattr(model, "_rows_flat", (None, ()))
        if flat is not None and len(views) == len(buffers) and all(a is b for a, b in zip(views, buffers)):
            s = self.first_statistic
            for j, k in enumerate(self.statistics):
                column = flat[(s + j) * n:(s + j + 1) * n]
                source = statistics.get(k)
                if source is None:
                    column[...] = 0
                elif not (_backend.is_device(source) and source.data.ptr == column.data.ptr):  # (not a view)
                    column[...] = xp.asarray(source)
            flat_to_rows(flat, rows, self._plan(xp), table, model.backend)
            return
        for first, buffer in zip(self.part_columns, buffers):
            flat_to_rows(buffer, rows, self._plan(xp, first, first + w), table, model.backend)
        self.store_statistics(statistics, table, rows, xp, model.backend)

    def read_params(self, table, rows, flat, backend="cpu"):
        """The parameters of rows ``rows`` of ``table`` into ``flat`` (``FlatParams``' order), in one kernel."""
        xp = _backend.array_module(backend)
        rows_to_flat(table, rows, self._plan(xp, 0, self.width), flat, backend)

    def write_params(self, flat, table, rows, backend="cpu"):
        """``read_params``' inverse: the parameters ``flat`` into rows ``rows`` of ``table``, in one kernel."""
        xp = _backend.array_module(backend)
        flat_to_rows(flat, rows, self._plan(xp, 0, self.width), table, backend)

    def store_statistics(self, statistics, table, rows, xp, backend):
        """Write ``statistics`` (missing ones: zeros) into rows ``rows`` (on ``xp``'s device) of ``table``, a
        kernel per statistic: all a working set trained in place (``model(in_place=True)``) has to write back."""
        n, s = int(rows.shape[0]), self.first_statistic
        for j, k in enumerate(self.statistics):
            column = xp.asarray(statistics[k], np.float32) if k in statistics else xp.zeros(n, np.float32)
            flat_to_rows(column, rows, self._plan(xp, s + j, s + j + 1), table, backend)

    def table(self, model, statistics, xp=None):
        """The (N, columns) table of ``model`` and ``statistics`` (``store``'s), on ``xp``'s device."""
        if xp is not None and xp is not model.xp:
            return xp.asarray(self.table(model, statistics))
        out = model.xp.empty((len(model), self.columns_total), np.float32)
        self.store(model, statistics, out, model.xp.arange(len(model)))
        return out

    def model_columns(self, in_place):
        """The table's column ranges that ``model`` copies into its array: every one, or ``in_place`` the
        parameters and the statistics."""
        return [(0, self.width + len(self.statistics))] if in_place else [(0, self.columns_total)]

    def model_bytes(self, in_place):
        """Bytes per Gaussian that ``model`` allocates: its array (``model_columns``, float32), and the
        statistics not of float32, which are copies of their columns there, not views."""
        copies = sum(dtype.itemsize for dtype in self.statistics.values() if dtype != np.float32)
        return 4 * sum(b - a for a, b in self.model_columns(in_place)) + copies

    def model(self, table, step, backend, rows=None, betas=(0.9, 0.999), in_place=False, adam=None):
        """-> (``GaussianModel`` on ``backend`` with Adam at ``step`` and ``betas``, statistics) of the rows
        ``rows`` (default: all) of ``table``; the model trains on views of one array that ``store`` writes back.
        ``in_place``: that array holds the parameters and statistics alone, and Adam (``RowsAdam``) reads
        and writes the moments in ``table``'s rows and writes the new parameters there too: a working set
        trained on its pool rows without a second copy of its moments (``store_statistics`` writes back
        the rest); its gradients are made at their first use (``GaussianModel.release_grads``).  Rows
        without moments (``without_moments``) train in place with the Adam that ``adam(params, rows)``
        makes, which holds their moments elsewhere (the store's ``HostAdam``)."""
        if not self.moments and adam is None:
            raise ValueError("RowLayout.model: rows without Adam's moments need the Adam that holds them")
        xp = _backend.array_module(backend)
        table = xp.asarray(table)
        rows = xp.arange(len(table)) if rows is None else xp.asarray(rows, np.int64)
        n, w = int(rows.shape[0]), self.width
        in_place = in_place or not self.moments
        moved = self.model_columns(in_place)
        flat = xp.empty(n * sum(b - a for a, b in moved), np.float32)
        at = 0
        for a, b in moved:
            rows_to_flat(table, rows, self._plan(xp, a, b), flat[at:at + n * (b - a)], backend)
            at += n * (b - a)
        params = FlatParams(n, self.sh_bases, xp, data=flat[:n * w])
        if in_place:
            model = GaussianModel.from_flat(params, flat[:0], flat[:0], step, backend, *betas, grads=False)
            model.adam = (adam(params, rows) if not self.moments else
                          RowsAdam(params, *betas, backend=model.backend, table=table, rows=rows,
                                   columns=self.part_columns))  # (a row: parameters, statistics, m, v)
            model.adam.step_count = int(step)
        else:
            m, v = (flat[n * first:n * (first + w)] for first in self.part_columns[1:])
            model = GaussianModel.from_flat(params, m, v, step, backend, *betas)
            model._rows_flat = (flat, (model.params.data, model.adam.m, model.adam.v))
        first = n * w  # (the statistics, after the parameters in ``flat`` as in the row)
        statistics = {k: flat[first + j * n:first + (j + 1) * n].astype(dtype, copy=False)  # (float32: views)
                      for j, (k, dtype) in enumerate(self.statistics.items())}
        return model, statistics


class SlicedRows:
    """A host array of the whole model, out of core, that is read a slice of rows at a time: columns ``columns``
    (a, b) of its ``n`` rows (model order), shaped ``(n,) + tail`` as ``dtype``.  What snapshots and the PLY write
    out of core (``OutOfCoreStore.saved_state``): each slice they take is a copy of those rows alone, so the host
    never holds the model a second time.  A subclass reads the rows (``_read``)."""

    read_in_slices = True  # (``engine.tools.snapshot.write_snapshot`` writes such arrays a slice of rows at a time)

    def __init__(self, n, columns, tail=(), dtype=np.float32):
        self.columns, self.tail = columns, tuple(tail)
        self.dtype = np.dtype(dtype)
        self.shape = (int(n),) + self.tail
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, key):
        """``key``: a slice of rows, or a tuple of one and indices into the rest (as ``sh[rows, 1:, :]``)."""
        key = key if isinstance(key, tuple) else (key,)
        if not isinstance(key[0], slice):
            raise TypeError(f"{type(self).__name__} reads slices of rows")
        chunk = self._read(key[0]).reshape((-1,) + self.tail).astype(self.dtype, copy=False)
        return chunk[(slice(None),) + key[1:]]

    def _read(self, rows):
        """-> float32 (rows, b - a): the columns of the rows of the slice ``rows``."""
        raise NotImplementedError


class TableRows(SlicedRows):
    """``SlicedRows`` of a host table: the columns of its rows ``rows`` (model order), in host mode the host's
    one table of every block."""

    def __init__(self, table, rows, columns, tail=(), dtype=np.float32):
        super().__init__(len(rows), columns, tail, dtype)
        self.table, self.rows = table, rows

    def _read(self, rows):
        a, b = self.columns
        return self.table[self.rows[rows], a:b]


class FileRows(SlicedRows):
    """``SlicedRows`` of a file that holds the columns in model order from ``offset`` (a float32 (n, b - a)
    array; disk mode's ``DiskBlocks.in_model_order``): a slice of rows is one read."""

    def __init__(self, path, offset, n, columns, tail=(), dtype=np.float32):
        super().__init__(n, columns, tail, dtype)
        self.path, self.offset = path, offset

    def _read(self, rows):
        picked, width = range(len(self))[rows], self.columns[1] - self.columns[0]
        if not len(picked):
            return np.empty((0, width), np.float32)
        first, last = min(picked[0], picked[-1]), max(picked[0], picked[-1])  # (the rows read: first .. last)
        values = np.fromfile(self.path, np.float32, count=(last - first + 1) * width,
                             offset=self.offset + 4 * first * width).reshape(-1, width)
        return values[picked.start - first::picked.step][:len(picked)]


def frustum_part(gaussians, camera):
    """The Gaussians (host arrays) whose reach ``camera`` can see: all that can show in its image, in
    their order, so that they render as the whole model does (evaluation of a model that need not fit
    on the device)."""
    reach = REACH * np.exp(gaussians.scales.max(axis=1, keepdims=True))
    seen = visible_regions(gaussians.means - reach, gaussians.means + reach, camera, grow=GROW_PX)[1]
    return gaussians.take(np.flatnonzero(seen))
