"""Model state: Gaussian parameters, their gradients and Adam moments, resizable.

Densification changes N, so every per-Gaussian buffer (parameters, gradient,
both Adam moments) is rebuilt together by ``gather``: keep some rows, append
new ones (whose Adam state starts at zero, as in the reference 3DGS code).
``state()`` / ``from_state()`` carry a model to and from host arrays: what a
snapshot stores, and what a sharding pipeline cuts into its ranks' rows.
"""
import math

import numpy as np
from numba import njit, prange

from numbasplat import C0
from numbasplat import backend as _backend
from numbasplat.optim import GROUPS, Adam, FlatParams


def inverse_sigmoid(p):
    return math.log(p / (1.0 - p))


def knn_rms_distance(points, k=3):
    """Root mean square distance to the k nearest neighbours (3DGS's scale initialisation).

    Exact, on a uniform grid of about 8 points per cell: each point scans
    growing shells of cells until its k-th distance is within the shell."""
    pts = np.ascontiguousarray(points, np.float64)
    n = len(pts)
    if n <= k:
        return np.ones(n)
    lo = pts.min(0)
    extent = np.maximum(pts.max(0) - lo, 1e-9)
    h = max(float(np.prod(extent) * 8.0 / n) ** (1.0 / 3.0), float(extent.max()) / 1024.0)
    dims = np.minimum(np.floor(extent / h).astype(np.int64) + 1, 2**20)
    cell = np.minimum(((pts - lo) / h).astype(np.int64), dims - 1)
    key = (cell[:, 0] * dims[1] + cell[:, 1]) * dims[2] + cell[:, 2]
    order = np.argsort(key, kind="stable")
    keys, starts = np.unique(key[order], return_index=True)
    ends = np.append(starts[1:], n)
    return _grid_knn(pts, cell, dims, h, order, keys, starts, ends, k)


@njit(parallel=True, cache=True)
def _grid_knn(pts, cell, dims, h, order, keys, starts, ends, k):
    n = pts.shape[0]
    out = np.empty(n)
    for i in prange(n):
        best = np.full(k, np.inf)
        r = 0
        while True:
            for dx in range(-r, r + 1):
                for dy in range(-r, r + 1):
                    for dz in range(-r, r + 1):
                        if max(abs(dx), abs(dy), abs(dz)) != r:
                            continue  # only the new shell
                        cx, cy, cz = cell[i, 0] + dx, cell[i, 1] + dy, cell[i, 2] + dz
                        if cx < 0 or cy < 0 or cz < 0 or cx >= dims[0] or cy >= dims[1] or cz >= dims[2]:
                            continue
                        kk = (cx * dims[1] + cy) * dims[2] + cz
                        j = np.searchsorted(keys, kk)
                        if j >= keys.shape[0] or keys[j] != kk:
                            continue
                        for q in range(starts[j], ends[j]):
                            o = order[q]
                            if o == i:
                                continue
                            d = ((pts[o, 0] - pts[i, 0]) ** 2 + (pts[o, 1] - pts[i, 1]) ** 2
                                 + (pts[o, 2] - pts[i, 2]) ** 2)
                            if d < best[k - 1]:
                                m = k - 1
                                while m > 0 and best[m - 1] > d:
                                    best[m] = best[m - 1]
                                    m -= 1
                                best[m] = d
            # anything beyond this shell is at least r * h away
            if best[k - 1] <= (r * h) ** 2 or r > dims.max():
                break
            r += 1
        out[i] = np.sqrt(np.maximum(best, 1e-14).mean())
    return out


def init_from_points(points, colors, sh_degree=3, opacity=0.1, rng=None, n_random=100_000, box=None):
    """Host arrays of a new model: SfM points if any, else ``n_random`` points in ``box``."""
    points = np.asarray(points, np.float64).reshape(-1, 3)
    colors = np.asarray(colors, np.float64).reshape(-1, 3)
    if len(points) == 0:
        rng = rng or np.random.default_rng(0)
        lo, hi = box if box is not None else (-np.ones(3), np.ones(3))
        points = rng.uniform(lo, hi, (n_random, 3))
        colors = 0.5 + C0 * rng.uniform(0, 1 / 255, (n_random, 3))  # grey, as 3DGS (sh0 = U(0, 1/255))
    n = len(points)
    dist = knn_rms_distance(points)
    sh = np.zeros((n, (sh_degree + 1) ** 2, 3), np.float32)
    sh[:, 0] = (colors - 0.5) / C0
    quats = np.zeros((n, 4), np.float32)
    quats[:, 0] = 1.0
    return dict(means=points.astype(np.float32),
                scales=np.repeat(np.log(dist)[:, None], 3, 1).astype(np.float32),
                quats=quats, opacities=np.full(n, inverse_sigmoid(opacity), np.float32), sh=sh)


class GaussianModel:
    """Parameters in one flat buffer (``FlatParams``), a gradient buffer of the
    same layout, and the fused Adam over them."""

    grads_over_params = False  # the gradients' buffer the parameters' own (``grads``): a backward writes each
    # gradient over its parameter, for an Adam that holds the parameters elsewhere and needs their gradients alone
    # (the out-of-core store's ``HostAdam``, which brings the new parameters back)

    def __init__(self, arrays, backend=None, b1=0.9, b2=0.999):
        self.backend = backend or _backend.BACKEND
        self.xp = _backend.array_module(self.backend)
        self.b1, self.b2 = b1, b2
        n, k = arrays["means"].shape[0], arrays["sh"].shape[1]
        params = FlatParams(n, k, self.xp)
        for g in GROUPS:
            params.view(g)[...] = self.xp.asarray(arrays[g], np.float32)
        self._install(params)

    def _install(self, params, m=None, v=None, grads=True):
        self.params = params
        self._grads = params.like(self.xp.zeros(params.size, np.float32)) if grads else None
        old = getattr(self, "adam", None)
        self.adam = Adam(params, self.b1, self.b2, backend=self.backend, m=m, v=v)  # (m, v None: zeros)
        if old is not None:  # the step count, and the device values a step graph reads (engine.pipelines.step_graphs)
            self.adam.step_count, self.adam._scalars = old.step_count, old._scalars

    def __len__(self):
        return self.params.n

    @property
    def grads(self):
        """The parameters' gradients, a ``FlatParams`` like ``params``: made (zeros) at its first use where the
        model was made without it or let it go (``from_flat(grads=False)``, ``release_grads``); ``params``
        itself where ``grads_over_params``."""
        if self._grads is None:
            self._grads = (self.params if self.grads_over_params else
                           self.params.like(self.xp.zeros(self.params.size, np.float32)))
        return self._grads

    @property
    def kept_grads(self):
        """The gradients' buffer where the model holds it now (None: made at its next use, as ``grads`` says)."""
        return self._grads

    def release_grads(self):
        """Let the gradients' buffer go until its next use: an out-of-core working set's live from its
        backward to its update, not through the binning, whose peak then does without them."""
        self._grads = None

    @property
    def sh_bases(self):
        """SH coefficients per colour channel: (degree + 1) ** 2."""
        return self.params.sh_bases

    def nbytes(self):
        """Bytes of the parameters, their gradients (where they have a buffer of their own) and both Adam moments."""
        grads = () if self._grads is None or self._grads is self.params else (self._grads.data,)
        return sum(int(a.nbytes) for a in (self.params.data, *grads, self.adam.m, self.adam.v))

    @property
    def gaussians(self):
        return self.params.gaussians()

    @property
    def grad_gaussians(self):
        return self.grads.gaussians()

    def group(self, name, which="params"):
        buf = {"params": self.params.data, "m": self.adam.m, "v": self.adam.v, "grads": self.grads.data}[which]
        return self.params.like(buf).view(name)

    def gather(self, keep, new=None):
        """Keep rows ``keep`` (indices or bool mask) and append ``new`` (a dict of
        group arrays); appended rows get zero Adam moments."""
        xp = self.xp
        keep = xp.asarray(keep)
        if keep.dtype == np.bool_:
            keep = xp.flatnonzero(keep)
        n_new = 0 if new is None else int(new["means"].shape[0])
        n = int(keep.shape[0]) + n_new
        out = [FlatParams(n, self.params.sh_bases, xp) for _ in range(3)]
        for g in GROUPS:
            for dst, which in zip(out, ("params", "m", "v")):
                rows = self.group(g, which)[keep]
                view = dst.view(g)
                view[:len(keep)] = rows
                if n_new:
                    view[len(keep):] = xp.asarray(new[g], np.float32) if which == "params" else 0
        self._install(out[0], out[1].data, out[2].data)

    def reset_moments(self, group, rows=Ellipsis):
        """Zero both Adam moments of ``group``, of all its rows or of ``rows`` (indices or a mask)."""
        for which in ("m", "v"):
            self.group(group, which)[rows] = 0

    def host_arrays(self, which="params"):
        return {g: _backend.to_host(self.group(g, which)) for g in GROUPS}

    def state(self):
        """Host copies of all that training continues from: the parameters and both Adam
        moments (``{"params" | "m" | "v": {group: array}}``) and Adam's step count ("step")."""
        return {**{which: self.host_arrays(which) for which in ("params", "m", "v")}, "step": self.adam.step_count}

    @classmethod
    def from_flat(cls, params, m, v, step, backend=None, b1=0.9, b2=0.999, grads=True):
        """The model over flat buffers as they are (no copies): ``params`` a ``FlatParams``, ``m`` and
        ``v`` its Adam moments (flat arrays of its size), Adam at ``step``; ``grads`` False: its gradients
        made at their first use."""
        model = cls.__new__(cls)
        model.backend = backend or _backend.BACKEND
        model.xp = _backend.array_module(model.backend)
        model.b1, model.b2 = b1, b2
        model._install(params, m, v, grads)
        model.adam.step_count = int(step)
        return model

    @classmethod
    def from_state(cls, state, backend=None, b1=0.9, b2=0.999):
        """The model holding a ``state()``'s arrays (host or device; all its rows or a shard's).
        A state of parameters only (``{"params": ...}``: a new model) starts Adam at zero."""
        model = cls(state["params"], backend, b1, b2)
        for which in ("m", "v"):
            if which in state:
                for g in GROUPS:
                    model.group(g, which)[...] = model.xp.asarray(state[which][g])
        model.adam.step_count = int(state.get("step", 0))
        return model
