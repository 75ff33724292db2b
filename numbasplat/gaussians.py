"""The Gaussians' parameters: the dataclass that the rendering API and the optimizer's flat
buffer (``optim.FlatParams``) both hold, and its checks.  Its own module, so that the
optimizer need not import the renderer.

``NUMBASPLAT_CHECKS=0`` turns the finiteness checks off (each is a device sync).
"""
import os
from dataclasses import dataclass

import numpy as np

from . import backend as _backend

CHECKS = os.environ.get("NUMBASPLAT_CHECKS", "1") != "0"


def check_finite(xp, **arrays):
    """Raise ValueError naming each non-finite input (one device sync for all)."""
    if not CHECKS or not arrays:
        return
    names = list(arrays)
    flags = xp.stack([xp.isfinite(a).all() for a in arrays.values()])
    bad = [n for n, ok in zip(names, _backend.to_host(flags)) if not ok]
    if bad:
        raise ValueError("non-finite values in " + ", ".join(bad))


@dataclass
class Gaussians:
    """Parameters in the 3DGS conventions (pre-activation).

    means (N,3); scales (N,3) log; quats (N,4) wxyz, unnormalized;
    opacities (N,) logits; sh (N,K,3) with sh[:,0] = (rgb - 0.5) / C0.
    """
    means: object
    scales: object
    quats: object
    opacities: object
    sh: object

    FIELDS = ("means", "scales", "quats", "opacities", "sh")

    def __len__(self):
        return self.means.shape[0]

    def arrays(self):
        return {f: getattr(self, f) for f in self.FIELDS}

    def rows(self, first, last):
        """Gaussians first..last-1, as views of these arrays (writes land here)."""
        return Gaussians(**{f: a[first:last] for f, a in self.arrays().items()})

    def take(self, rows):
        """The Gaussians of ``rows`` (indices or a boolean mask, on the arrays' device), as copies."""
        return Gaussians(**{f: a[rows] for f, a in self.arrays().items()})

    def validate(self, xp, check=True):
        n = len(self)
        shapes = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "opacities": (n,)}
        for name, shape in shapes.items():
            a = getattr(self, name)
            if tuple(a.shape) != shape:
                raise ValueError(f"Gaussian parameter {name} must have shape {shape}, got {tuple(a.shape)}")
        if self.sh.ndim != 3 or self.sh.shape[0] != n or self.sh.shape[2] != 3 or self.sh.shape[1] < 1:
            raise ValueError(f"Gaussian parameter sh must have shape (N, K, 3), got {tuple(self.sh.shape)}")
        if check:
            check_finite(xp, **self.arrays())

    def sh_degree(self):
        k = self.sh.shape[1]
        d = int(round(np.sqrt(k))) - 1
        if (d + 1) ** 2 != k or d > 3:
            raise ValueError(f"sh must hold (d+1)^2 <= 16 coefficients, got {k}")
        return d
