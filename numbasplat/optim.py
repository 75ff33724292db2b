"""Parameters in one flat buffer, and one fused Adam kernel over all of them.

Each group (means, scales, ...) is a contiguous block of N*width values, so
the ``Gaussians`` views are plain reshapes and one launch updates everything.
Learning rates are per column of a group (the sh group's first 3 columns are
the DC band, the rest the higher bands, which 3DGS trains 20x slower).  The
update itself is ``numbasplat.math.adam``'s, run by the backend's ``adam`` kernel, or by the
projection backward's kernels as they compute the gradients (``rendering.project_backward_adam``).
"""
import math
from dataclasses import dataclass

import numpy as np

from . import backend as _backend
from .device import DeviceValues
from .gaussians import Gaussians

GROUPS = ("means", "scales", "quats", "opacities", "sh")


def group_widths(sh_bases):
    return {"means": 3, "scales": 3, "quats": 4, "opacities": 1, "sh": 3 * sh_bases}


class FlatParams:
    """A flat float buffer holding every parameter group of N Gaussians."""

    def __init__(self, n, sh_bases, xp=np, dtype=np.float32, data=None):
        self.n = n
        self.sh_bases = sh_bases
        self.widths = group_widths(sh_bases)
        starts = np.cumsum([0] + [n * self.widths[g] for g in GROUPS])
        self.starts = dict(zip(GROUPS, starts[:-1]))
        self.size = int(starts[-1])
        self.data = xp.zeros(self.size, dtype) if data is None else data
        if self.data.shape != (self.size,):
            raise ValueError(f"flat buffer must hold {self.size} values, got {self.data.shape}")

    def like(self, data=None):
        return FlatParams(self.n, self.sh_bases, _backend.array_module_of(self.data), self.data.dtype, data)

    def view(self, group):
        s, w = self.starts[group], self.widths[group]
        block = self.data[s:s + self.n * w]
        if group == "opacities":
            return block
        if group == "sh":
            return block.reshape(self.n, self.sh_bases, 3)
        return block.reshape(self.n, w)

    def gaussians(self):
        return Gaussians(**{g: self.view(g) for g in GROUPS})

    @classmethod
    def from_gaussians(cls, g: Gaussians, xp=np, dtype=np.float32):
        flat = cls(len(g), g.sh.shape[1], xp, dtype)
        for name in GROUPS:
            flat.view(name)[...] = xp.asarray(getattr(g, name), dtype)
        return flat

    def layout(self, lr_columns):
        """(group bounds, widths, column offsets) arrays for the Adam kernel."""
        if self.size >= 2**31:
            raise ValueError(f"{self.n} Gaussians exceed the int32 indexing of the optimizer")
        bounds = np.array([self.starts[g] for g in GROUPS] + [self.size], np.int32)
        widths = np.array([self.widths[g] for g in GROUPS], np.int32)
        col0 = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int32)
        if len(lr_columns) != widths.sum():
            raise ValueError(f"need {widths.sum()} per-column learning rates, got {len(lr_columns)}")
        return bounds, widths, col0


def adam_step_bound(b1=0.9, b2=0.999):
    """The most one Adam step can move a parameter, in units of its learning rate, whatever the
    gradients: |m_hat / sqrt(v_hat)| <= (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)), by Cauchy-Schwarz
    over the moments' sums (a gradient k steps old weighs b1^k in m, b2^k in v), times the bias
    corrections' ratio sqrt(1 - b2^t) / (1 - b1^t), which is at most 1 for 3DGS's betas (tested).
    It holds for visible-only steps too: a row's moments sum its own steps.  7.27 for (0.9, 0.999);
    the eps only makes a step shorter."""
    if not b1 * b1 < b2:
        raise ValueError(f"adam_step_bound needs b1^2 < b2, got b1={b1}, b2={b2}")
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))


def column_lrs(lr, sh_bases):
    """Per-column learning rates from a dict of group rates; 'sh_rest' is the higher SH bands."""
    cols = []
    for g in GROUPS[:-1]:
        cols += [lr[g]] * group_widths(sh_bases)[g]
    cols += [lr["sh"]] * 3 + [lr.get("sh_rest", lr["sh"] / 20.0)] * 3 * (sh_bases - 1)
    return np.array(cols, np.float32)


def exp_decay(lr0, lr1, step, steps):
    """Log-linear interpolation from lr0 to lr1 over ``steps`` (3DGS's means schedule)."""
    t = min(max(step / max(steps, 1), 0.0), 1.0)
    return math.exp(math.log(lr0) * (1 - t) + math.log(lr1) * t)


@dataclass
class Adam:
    """Fused Adam over a ``FlatParams`` (3DGS defaults: eps 1e-15)."""
    params: FlatParams
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-15
    backend: str = None
    m: object = None  # the moments, flat like ``params.data`` (None: zeros; given: used as they are)
    v: object = None

    def __post_init__(self):
        self.backend = self.backend or _backend.BACKEND
        xp = _backend.array_module(self.backend)
        if self.m is None:  # (numpy's zeros are the system's zero pages until written: a model made only to be
            # rendered or written takes no memory for its moments)
            self.m = xp.zeros(self.params.data.shape, self.params.data.dtype)
        if self.v is None:
            self.v = xp.zeros(self.params.data.shape, self.params.data.dtype)
        self.step_count = 0
        self._layout = None
        self._host_layout = None  # ``_layout`` on the host, and the one-group layouts of row spans (``_row_layouts``)
        self._span_layouts = {}
        self._scalars = None  # the step's per-column rates and bias corrections, at a fixed device address
        self._no_skip = xp.zeros(1, np.int32)
        self._no_mask = xp.ones(1, np.bool_)  # the visible mask's argument where there is none

    def set_step(self, lr_columns):
        """Count a step and write its learning rates (per column) and bias corrections to the device,
        where ``update`` reads them: a step graph (``engine.pipelines.step_graphs``) captures ``update``, and
        replays it with each step's values."""
        self.step_count += 1
        t = self.step_count
        values = np.concatenate([np.asarray(lr_columns, np.float32), [1 - self.b1 ** t, 1 - self.b2 ** t]])
        if self._scalars is None or self._scalars.array.shape != values.shape:
            self._scalars = DeviceValues(len(values), np.float32, self.backend)
        self._scalars.write(values)
        if self._layout is None:  # (here, not in ``update``: a captured update cannot upload it)
            xp = _backend.array_module(self.backend)
            self._host_layout = self.params.layout(lr_columns)
            self._layout = tuple(xp.asarray(a) for a in self._host_layout)

    def step(self, grads, lr_columns, visible=None, skip=None):
        """One update (``set_step`` then ``update``)."""
        self.set_step(lr_columns)
        self.update(grads, visible, skip)

    def update(self, grads, visible=None, skip=None, rows=None):
        """The update of the step ``set_step`` wrote; ``grads`` is a flat buffer like ``params.data``;
        ``visible`` an (N,) bool mask.  ``skip``: a (1,) int32 device flag; where it is set the device
        leaves parameters and moments as they are (a step whose render was cut short, known only on
        the device: no sync).  ``rows`` (first, last): the update of those Gaussians only, a launch per
        group on its block of their rows (``group_rows``; every element's update is its own, so parts
        updated one by one give the bits of the whole); None: every Gaussian, one launch."""
        p = self.params
        kernels = _backend.kernels(self.backend)
        if rows is None:
            if p.size:
                kernels.adam(p.data, grads, self.m, self.v, *self._update_args(visible, skip))
            return
        first, last = rows
        tail = self._update_args(visible, skip)[len(self._layout):]  # (rates, mask, its use, skip, ...)
        for (lo, hi), layout in self._row_layouts(first, last):
            if hi > lo:
                kernels.adam(p.data[lo:hi], grads[lo:hi], self.m[lo:hi], self.v[lo:hi], *layout,
                             tail[0], visible[first:last] if visible is not None else tail[1], *tail[2:])

    def buffers(self):
        """The device arrays that an update reads and writes besides the parameters and their gradients (after
        ``set_step``): a step graph that captured the update holds while they stay where they are
        (``engine.pipelines.step_graphs.array_key``)."""
        return (self.m, self.v, self._scalars.array, *self._layout, self._no_mask, self._no_skip)

    def fusable(self):
        """Whether a kernel may apply this optimizer's update itself (``step_values``): its moments are
        flat buffers like the parameters (not a row table's columns: ``RowsAdam``)."""
        return self.m.shape == self.params.data.shape == self.v.shape

    def step_values(self):
        """What a kernel that applies the step's update per Gaussian reads besides the buffers (after
        ``set_step``; ``rendering.project_backward_adam``): the moments as ``Gaussians`` of views like the
        parameters' groups (m, v), each group's per-column rates ({group: a view of the device values
        ``set_step`` wrote}), the betas, eps, and the two bias corrections (a view of those values)."""
        p = self.params
        m, v = p.like(self.m).gaussians(), p.like(self.v).gaussians()
        scalars = self._scalars.array
        _, widths, col0 = self._host_layout
        rates = {g: scalars[int(col0[k]):int(col0[k] + widths[k])] for k, g in enumerate(GROUPS)}
        return m, v, rates, np.float32(self.b1), np.float32(self.b2), np.float32(self.eps), scalars[-2:]

    def group_spans(self, first, last):
        """The flat spans [lo, hi) that Gaussians first..last-1 hold, one per group (after ``set_step``)."""
        return [span for span, _ in self._row_layouts(first, last)]

    def _row_layouts(self, first, last):
        """For Gaussians first..last-1, each group's (flat span, its one-group layout for the kernel:
        bounds, width, first column), the layouts kept on the device per span (their uploads would
        wait for the device)."""
        xp = _backend.array_module(self.backend)
        bounds, widths, col0 = self._host_layout
        cache = self._span_layouts
        out = []
        for g in range(len(widths)):
            w = int(widths[g])
            lo, hi = int(bounds[g]) + first * w, int(bounds[g]) + last * w
            key = (g, hi - lo, w)
            if key not in cache:
                cache[key] = (xp.asarray(np.array([0, hi - lo], np.int32)), xp.asarray(widths[g:g + 1]),
                              xp.asarray(col0[g:g + 1]))
            out.append(((lo, hi), cache[key]))
        return out

    def _update_args(self, visible, skip):
        """The kernels' arguments after the buffers: the layout, the step's rates, the mask, the skip flag,
        the betas, eps and the bias corrections."""
        scalars = self._scalars.array
        use_visible = visible is not None
        return (*self._layout, scalars[:-2], visible if use_visible else self._no_mask, use_visible,
                self._no_skip if skip is None else skip,
                np.float32(self.b1), np.float32(self.b2), np.float32(self.eps), scalars[-2:])


@dataclass
class MomentsElsewhereAdam(Adam):
    """``Adam`` whose moments are kept by its owner, not in flat buffers of its own (``m``, ``v``
    empty): ``RowsAdam`` (a row table's columns) and the out-of-core store's ``HostAdam`` (the host's
    rows)."""

    def __post_init__(self):
        xp = _backend.array_module(self.backend or _backend.BACKEND)
        self.m = xp.empty(0, np.float32) if self.m is None else self.m
        self.v = xp.empty(0, np.float32) if self.v is None else self.v
        super().__post_init__()


@dataclass
class RowsAdam(MomentsElsewhereAdam):
    """``Adam`` whose moments are not flat buffers of their own but columns of a row table (the
    out-of-core trainer's pool of blocks, ``numbasplat.rows``): Gaussian k of ``params`` is row
    ``rows[k]`` of ``table``, its parameters from column ``columns[0]``, its moments from ``columns[1]``
    and ``columns[2]`` (each in ``FlatParams``' column order).  An update writes the new parameters to
    ``params`` and to the table: a working set trains on a copy of its parameters alone, and the
    device holds its moments once, in the table (``m``, ``v`` are empty)."""
    table: object = None
    rows: object = None
    columns: object = None

    def __post_init__(self):
        super().__post_init__()
        xp = _backend.array_module(self.backend or _backend.BACKEND)
        self.columns = xp.asarray(np.asarray(self.columns, np.int32))

    def buffers(self):
        """``Adam.buffers``, and the table, its rows and its columns."""
        return (*super().buffers(), self.table, self.rows, self.columns)

    def update(self, grads, visible=None, skip=None, rows=None):
        """``Adam.update`` of ``params`` and the table's rows (every Gaussian: ``rows`` must be None, as
        the aggregate device, which splits by rows, does not run out of core)."""
        if rows is not None:
            raise ValueError("RowsAdam.update: no split by rows (the aggregate device does not run out of core)")
        if self.params.size:
            _backend.kernels(self.backend).adam_rows(self.table, self.rows, self.columns, self.params.data, grads,
                                                     *self._update_args(visible, skip))
