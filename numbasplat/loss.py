"""Image losses for training: L1 + D-SSIM with exact hand-written gradients.

    loss = (1 - lam) * mean|img - gt| + lam * (1 - SSIM(img, gt))

SSIM follows the reference 3DGS code: per channel, an 11x11 Gaussian window
(sigma 1.5) with zero padding, averaged over all pixels and channels; its
math and gradient are in ``numbasplat.math.ssim``.  The backend's kernels
(``numbasplat.cpu.loss``: ``njit`` passes over numpy arrays, float32 or
float64; ``numbasplat.cuda.loss``: two tiled shared-memory kernels, float32)
return per-tile partial sums and the gradient; the loss is made of the sums
here, so a renderer's tiles give its share of the loss.  Also here: the
``LazyLoss`` both losses return, and PSNR.
"""
import math

import numpy as np

from . import backend as _backend
from .math.tiles import tile_pixels


def prepare_images(img, gt, backend=None):
    """(kernels, img, gt): the backend's kernels and the two (H, W, 3) images as they take them
    (a host copy for the CPU, float32 on the GPU; the CPU keeps float64)."""
    kernels = _backend.kernels(backend)
    if img.shape != gt.shape or img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"expected two (H, W, 3) images, got {img.shape} and {gt.shape}")
    img, gt = kernels.as_images(_backend.asarray(img, backend), _backend.asarray(gt, backend))
    return kernels, img, gt


def l1_ssim_loss(img, gt, lam=0.2, backend=None, tiles=None, lazy=False):
    """(1-lam) * L1 + lam * (1 - SSIM) and its gradient w.r.t. img.

    Returns (loss: float, dimg) with dimg shaped like img, on the backend's
    device (CuPy array on a GPU; float32 on the CUDA path, img's float dtype
    on the CPU).  Two kernel launches on the CUDA path.  ``lazy=True`` returns
    the loss as a ``LazyLoss``: no device sync until its value is read.

    ``tiles=(lo, hi)``, a range of row-major 16x16 tiles, returns those tiles'
    share of the loss instead (the shares of a partition of the tiles add up to
    the loss), for a renderer that owns them: its image must then be right on
    its tiles and 10 pixels around them (two 11x11 windows), and dimg is exact
    on its tiles only.
    """
    kernels, img, gt = prepare_images(img, gt, backend)
    partials, dimg = kernels.l1_ssim(img, gt, float(lam), tiles)
    n = img.size
    lo, hi = (0, len(partials)) if tiles is None else tiles
    values = n if tiles is None else 3 * int(tile_pixels(img.shape[1], img.shape[0])[lo:hi].sum())

    def finish(p):
        l1, ss = column_sums(p[lo:hi])
        return ((1.0 - lam) * l1 + lam * (values - ss)) / n
    loss = LazyLoss(partials, finish)
    return (loss if lazy else float(loss)), dimg


class LazyLoss:
    """A loss whose partial sums stay on the device until its value is read (``float``).

    Reading it waits for the device.  A training step needs the value only on
    the steps it logs; not reading it on the others lets the host queue the
    rest of the step's kernels while the device works."""

    def __init__(self, partials, finish):
        self._partials, self._finish, self._value = partials, finish, None

    def again(self):
        """A loss over the same partial sums, not yet read: a step graph writes them again at each
        replay (``engine.pipelines.step_graphs``), and each replay's loss is read from them afresh."""
        if self._partials is None:
            raise RuntimeError("LazyLoss.again: this loss was read, and its partial sums let go")
        return LazyLoss(self._partials, self._finish)

    def __float__(self):
        if self._value is None:
            self._value = float(self._finish(_backend.to_host(self._partials).astype(np.float64)))
            self._partials = self._finish = None
        return self._value


def column_sums(partials):
    """The two float64 column sums of per-tile (n, 2) partial sums.  A matrix-vector product:
    numpy's axis-0 sum of an (n, 2) array is many times slower."""
    return np.ones(len(partials)) @ np.asarray(partials, np.float64)


def ssim(img, gt, backend=None):
    """Mean SSIM over all pixels and channels (3DGS definition)."""
    kernels, img, gt = prepare_images(img, gt, backend)
    partials, _ = kernels.ssim_forward(img, gt, 0.0)
    return float(_backend.to_host(partials).astype(np.float64)[:, 1].sum()) / img.size


def psnr(img, gt):
    """-10 log10(MSE) for images in [0, 1]; numpy or CuPy input."""
    d = img.astype("float64") - gt.astype("float64")
    return psnr_of_mse(float((d * d).mean()))


def psnr_of_mse(mse):
    """The PSNR of a mean squared error over values in [0, 1] (inf where it is 0)."""
    return math.inf if mse == 0.0 else -10.0 * math.log10(mse)
