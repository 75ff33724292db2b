"""Model state: Gaussian parameters, their gradients and Adam moments, resizable.

Densification changes N, so every per-Gaussian buffer (parameters, gradient,
both Adam moments) is rebuilt together by ``gather``: keep some rows, append
new ones (whose Adam state starts at zero, as in the reference 3DGS code).
"""
import math

import numpy as np

from numbasplat import _backend
from numbasplat.optim import GROUPS, Adam, FlatParams
from numbasplat.sh import C0


def inverse_sigmoid(p):
    return math.log(p / (1.0 - p))


def knn_mean_distance(points, k=3):
    """Mean distance to the k nearest neighbours (3DGS's scale initialisation), in chunks."""
    pts = np.asarray(points, np.float64)
    n = len(pts)
    if n <= 1:
        return np.ones(n)
    k = min(k, n - 1)
    out = np.empty(n)
    sq = (pts ** 2).sum(1)
    for s in range(0, n, 2048):
        d2 = sq[s:s + 2048, None] + sq[None, :] - 2.0 * pts[s:s + 2048] @ pts.T
        d2[np.arange(min(2048, n - s)), np.arange(s, min(s + 2048, n))] = np.inf
        part = np.partition(d2, k - 1, axis=1)[:, :k]
        out[s:s + 2048] = np.sqrt(np.maximum(part, 1e-14)).mean(1)
    return out


def init_from_points(points, colors, sh_degree=3, opacity=0.1, rng=None, n_random=100_000, box=None):
    """Host arrays of a new model: SfM points if any, else ``n_random`` points in ``box``."""
    points = np.asarray(points, np.float64).reshape(-1, 3)
    colors = np.asarray(colors, np.float64).reshape(-1, 3)
    if len(points) == 0:
        rng = rng or np.random.default_rng(0)
        lo, hi = box if box is not None else (-np.ones(3), np.ones(3))
        points = rng.uniform(lo, hi, (n_random, 3))
        colors = rng.uniform(0, 1, (n_random, 3))
    n = len(points)
    dist = knn_mean_distance(points) if n <= 200_000 else np.full(n, np.median(knn_mean_distance(points[:50_000])))
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

    def __init__(self, arrays, backend=None, b1=0.9, b2=0.999):
        self.backend = backend or _backend.BACKEND
        self.xp = _backend.array_module(self.backend)
        self.b1, self.b2 = b1, b2
        n, k = arrays["means"].shape[0], arrays["sh"].shape[1]
        params = FlatParams(n, k, self.xp)
        for g in GROUPS:
            params.view(g)[...] = self.xp.asarray(arrays[g], np.float32)
        self._install(params)

    def _install(self, params, m=None, v=None):
        self.params = params
        self.grads = params.like(self.xp.zeros(params.size, np.float32))
        step = self.adam.step_count if hasattr(self, "adam") else 0
        self.adam = Adam(params, self.b1, self.b2, backend=self.backend)
        self.adam.step_count = step
        if m is not None:
            self.adam.m, self.adam.v = m, v

    def __len__(self):
        return self.params.n

    @property
    def gaussians(self):
        return self.params.gaussians()

    @property
    def grad_gaussians(self):
        return self.grads.gaussians()

    def group(self, name, which="params"):
        buf = {"params": self.params.data, "m": self.adam.m, "v": self.adam.v}[which]
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

    def reset_moments(self, group):
        for which in ("m", "v"):
            self.group(group, which)[...] = 0

    def host_arrays(self, which="params"):
        return {g: _backend.to_host(self.group(g, which)) for g in GROUPS}
