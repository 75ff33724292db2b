"""Per-image colour correction: an appearance model for captures whose exposure varies.

Each training image i has an affine colour transform, ``out = A_i rgb + b_i`` per pixel
(A_i 3x3, b_i 3: 12 numbers), that the loss sees instead of the render: exposure, white balance
and vignetting-free tone shifts of a camera are then absorbed there rather than baked into the
Gaussians' colours as floaters.  It starts as the identity, trains with Adam (only the row of the
image rendered, with its own step count for the bias correction), and is not used for held-out
views, which render the scene as the Gaussians have it (as gsplat's ``app_opt`` evaluates).

The gradients, with d the loss's gradient with respect to ``out`` (pixels x 3):
dL/drgb = d A_i, dL/dA_i = d^T rgb, dL/db_i = the sum of d over the pixels.
"""
import numpy as np

from numbasplat import backend as _backend

EXPOSURE_SPREAD_HINT = 0.14  # ``exposure_spread`` above which ``run.py train`` suggests --appearance (BENCHMARKS.md)
VISIBILITY_CELL = 0.05       # ``exposure_spread``'s squares for the points' visibility, as a fraction of the width


def exposure_spread(data, max_views=64, max_points=20_000, seed=0):
    """How much the training images' exposure and white balance vary, from the capture's SfM points:
    each image's gain per channel is the median over the points it sees of log(pixel / point colour)
    (a point's colour is its observations' mean, so a steady capture's gains are all near 0); the
    spread is the standard deviation of the gains over the images, averaged over the channels.
    A point counts as seen where it is in front of the others that fall in its cell of the image
    (``in_front``): a point behind a nearer surface samples that surface's colour, and in a street
    view of a city most points in the frustum are hidden so (a steady city read 0.16 without it).
    Up to ``max_views`` images and ``max_points`` points, drawn with ``seed``.  None where the capture
    has no points (random initial points) or fewer than 2 images with 20 usable samples."""
    points, colours = np.asarray(data.points, np.float64), np.asarray(data.colors, np.float64)
    if len(points) == 0:
        return None
    rng = np.random.default_rng(seed)
    if len(points) > max_points:
        keep = rng.choice(len(points), max_points, replace=False)
        points, colours = points[keep], colours[keep]
    views = data.train
    if len(views) > max_views:
        views = [views[i] for i in sorted(rng.choice(len(views), max_views, replace=False))]
    gains = []
    for v in views:
        cam = v.camera
        x = points @ cam.viewmat[:3, :3].T + cam.viewmat[:3, 3]
        z = np.maximum(x[:, 2], 1e-9)
        u = np.floor(cam.fx * x[:, 0] / z + cam.cx).astype(np.int64)
        w = np.floor(cam.fy * x[:, 1] / z + cam.cy).astype(np.int64)
        seen = np.flatnonzero((x[:, 2] > 1e-6) & (u >= 0) & (u < cam.width) & (w >= 0) & (w < cam.height))
        seen = seen[in_front(u[seen], w[seen], z[seen], cell=max(cam.width * VISIBILITY_CELL, 1.0))]
        pixel = np.asarray(v.image)[w[seen], u[seen]].astype(np.float64)  # (the samples alone, not the image)
        colour = colours[seen]
        usable = (colour > 0.05).all(axis=1) & (pixel > 0.02).all(axis=1)  # (dark values: no ratio to trust)
        if usable.sum() >= 20:
            gains.append(np.median(np.log(pixel[usable] / colour[usable]), axis=0))
    if len(gains) < 2:
        return None
    return float(np.std(gains, axis=0).mean())


def in_front(u, w, z, cell, slack=0.1):
    """Which of the points at pixels (u, w) and depths z are in front in their square of ``cell``
    pixels: within ``slack`` (relative) of the nearest depth there.  A z-buffer of the points, which
    keeps a surface's points and drops those behind it where the surface has points of its own."""
    if len(z) == 0:
        return np.zeros(0, bool)
    cols = int(u.max() // cell) + 1
    square = (w // cell).astype(np.int64) * cols + (u // cell).astype(np.int64)
    nearest = np.full(int(square.max()) + 1, np.inf)
    np.minimum.at(nearest, square, z)
    return z <= nearest[square] * (1 + slack)


IDENTITY = np.concatenate([np.eye(3).ravel(), np.zeros(3)]).astype(np.float32)  # a row: A row-major, then b
WIDTH = len(IDENTITY)


class ColourCorrection:
    """The affine colour transforms of ``n_views`` training images, and their Adam state."""

    def __init__(self, n_views, lr, backend=None, b1=0.9, b2=0.999, eps=1e-15):
        self.backend = backend
        xp = _backend.array_module(backend)
        self.params = xp.asarray(np.tile(IDENTITY, (n_views, 1)))
        self.m = xp.zeros_like(self.params)
        self.v = xp.zeros_like(self.params)
        self.steps = np.zeros(n_views, np.int64)  # Adam's step count per image (host: its bias correction)
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

    def transform(self, i):
        """(A, b) of image i."""
        row = self.params[i]
        return row[:9].reshape(3, 3), row[9:]

    def apply(self, image, i):
        """Image i's render (H, W, 3) as the loss sees it: A rgb + b per pixel."""
        A, b = self.transform(i)
        return image @ A.T + b

    def gradients(self, d_out, image, i):
        """(dL/d render, dL/d image i's row) from ``d_out``, the loss's gradient with respect to
        ``apply(image, i)``."""
        A, _ = self.transform(i)
        d = d_out.reshape(-1, 3)
        row = self.xp.concatenate([(d.T @ image.reshape(-1, 3)).ravel(), d.sum(axis=0)])
        return d_out @ A, row

    def backward(self, d_out, image, i):
        """The loss's gradient with respect to the render (``gradients``); updates image i's
        transform with Adam."""
        d_image, row = self.gradients(d_out, image, i)
        self._adam(i, row)
        return d_image

    def _adam(self, i, grad):
        self.steps[i] += 1
        t = int(self.steps[i])
        self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * grad
        self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * grad * grad
        m_hat = self.m[i] / (1 - self.b1 ** t)
        v_hat = self.v[i] / (1 - self.b2 ** t)
        self.params[i] -= self.lr * m_hat / (self.xp.sqrt(v_hat) + self.eps)

    @property
    def xp(self):
        return _backend.array_module(self.backend)

    def state(self):
        """Host arrays for a snapshot."""
        return {"params": _backend.to_host(self.params), "m": _backend.to_host(self.m),
                "v": _backend.to_host(self.v), "steps": self.steps.copy()}

    def load_state(self, state):
        """Continue from ``state()``; ValueError when it is for another number of images."""
        if state["params"].shape != tuple(self.params.shape):
            raise ValueError(f"the snapshot's colour correction holds {state['params'].shape[0]} images, "
                             f"this capture {self.params.shape[0]} training images")
        xp = self.xp
        self.params, self.m, self.v = (xp.asarray(state[k], np.float32) for k in ("params", "m", "v"))
        self.steps = np.asarray(state["steps"], np.int64).copy()
