"""Tile-local training loss (ByteSplat): L1 + D-S3IM, one 16x16 tile at a time.

    loss = (1 - lam) * L1 + lam * (1 - S3IM)

Unlike the windowed SSIM of ``loss.py``, nothing here reads a neighbouring
tile, so the loss and its gradient can be computed inside the rasterizer's own
tile block right after compositing (``tile_loss_grad``), with no image round
trip through global memory.

S3IM (stochastic structural similarity): each tile's 256 pixel slots
(slot = ly*16 + lx) are arranged R times into 16 "virtual patches" (windows) of
16 slots: window k of repeat r is ``perms[r, 16k:16k+16]``.  Row 0 of ``perms``
is the identity arrangement (window k = the 4x4 spatial block (k//4, k%4)),
rows 1..R-1 are random permutations; the same rows serve every tile.  Per
window and channel, SSIM is computed from uniform-weight moments over the
window's valid (inside-image) pixels, n of them; windows with n = 0 are
skipped, and

    S3IM = sum_windows n_w * ssim_w / (R * 3 * H * W)

so every block can normalise on its own (for sides that are multiples of 16
this is the plain mean of ssim_w).

Gradient.  With sums over the window, ssim_w is a function of mu_x, var_x and
cov, and d ssim_w / d x_i = (a + b x_i + c y_i) / n (``window_ssim``).  The
factor n cancels against the weight n_w, so every pixel just adds
-lam/(R*3*H*W) * (a + b x_i + c y_i) for each window it lies in (one per repeat
and channel).

Backends: a CPU ``njit`` loop parallel over tiles (float32 or float64,
``numbasplat.cpu.tile_loss``), and one CUDA kernel (one 16x16 block per tile,
``numbasplat.cuda.tile_loss``) built on the device function ``tile_loss_grad``
that the fused kernel calls too; both use the window math of
``numbasplat.math.ssim``.
"""
import numpy as np

from . import backend as _backend
from .loss import LazyLoss, column_sums, prepare_images
from .math.tiles import TILE, TILE_PIXELS, tile_pixels


def s3im_permutations(rng, repeats=10):
    """(repeats, 256) int32: row 0 the 4x4-block identity arrangement, the
    other rows random permutations of the tile's slots (fresh ones each step)."""
    ly, lx = np.divmod(np.arange(TILE_PIXELS), TILE)
    identity = np.argsort((ly // 4) * 4 + lx // 4, kind="stable")  # block by block, row-major inside
    rows = [identity] + [rng.permutation(TILE_PIXELS) for _ in range(repeats - 1)]
    return np.stack(rows).astype(np.int32)


def fused_layout(smem_budget=None, backend=None):
    """(M_budget, M_fixed, M_g, where M_budget comes from), in bytes, of the fused raster + loss +
    backward kernel: a tile fits it when its Gaussians number at most (M_budget - M_fixed) // M_g.
    ``smem_budget`` replaces M_budget (the GPU's shared memory per block; without a GPU, an
    H200's)."""
    per_block, fixed, per_gaussian, source = _backend.kernels(backend).fused_layout()
    if smem_budget is not None:
        if smem_budget <= 0:
            raise ValueError(f"--smem-budget must be a positive number of bytes, got {smem_budget}")
        per_block, source = int(smem_budget), "--smem-budget"
    return per_block, fixed, per_gaussian, source


def loss_from_tile_sums(partials, lam, W, H, repeats, tiles=None):
    """The loss from per-tile (sum |d|, sum n_w SSIM_w) partial sums, as a ``LazyLoss``.

    With ``tiles`` (a bool mask) it is those tiles' share of the image's loss:
    the shares of disjoint tile sets add up to the loss (each renderer under
    MPI computes its own share)."""
    share = 1.0 if tiles is None else tile_pixels(W, H)[tiles].sum() / (W * H)
    npix = 3.0 * W * H

    def finish(p):
        l1, ss = column_sums(p if tiles is None else p[tiles])
        return (1.0 - lam) * l1 / npix + lam * (share - ss / (repeats * npix))
    return LazyLoss(partials, finish)


def tile_loss(img, gt, perms, lam=0.2, backend=None, tiles=None, lazy=False):
    """(1-lam) * L1 + lam * (1 - S3IM) and its gradient w.r.t. img.

    img, gt: (H, W, 3); perms: (R, 256) int32 from ``s3im_permutations``.
    Returns (loss: float, dimg) with dimg on the backend's device (float32 on
    the CUDA path, img's float dtype on the CPU).  One kernel launch on CUDA.
    ``tiles`` (bool mask): count only those tiles' share of the loss.
    ``lazy=True``: the loss as a ``LazyLoss`` (read when needed: a device sync).
    """
    partials, dimg = tile_loss_sums(img, gt, perms, lam, backend)
    H, W = np.shape(img)[:2]
    loss = loss_from_tile_sums(partials, lam, W, H, np.shape(perms)[0], tiles)
    return (loss if lazy else float(loss)), dimg


def tile_loss_sums(img, gt, perms, lam=0.2, backend=None):
    """``tile_loss``'s per-tile partial sums (``loss_from_tile_sums`` makes the loss of them) and dimg."""
    kernels, img, gt = prepare_images(img, gt, backend)
    shape = np.shape(perms)
    if len(shape) != 2 or shape[1] != TILE_PIXELS or shape[0] < 1:
        raise ValueError(f"perms must be (R, {TILE_PIXELS}), got {shape}")
    H, W = img.shape[:2]
    inv_l1 = 1.0 / (3 * H * W)
    return kernels.tile_loss(img, gt, _backend.asarray(perms, backend), float(lam), inv_l1, inv_l1 / shape[0])
