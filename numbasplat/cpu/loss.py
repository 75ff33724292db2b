"""The windowed SSIM loss's CPU kernels: whole-image ``njit`` passes over (K, H, W, C) stacks,
in the images' dtype (float32 or float64).  The per-pixel math is ``numbasplat.math.ssim``'s,
compiled here by ``njit``.
"""
import numpy as np
from numba import njit, prange

from ..math.ssim import C1, C2, WINDOW64, ssim_loss_grad, ssim_terms
from ..math.tiles import TILE, tile_grid

_ssim_terms = njit(cache=True)(ssim_terms)
_ssim_loss_grad = njit(cache=True)(ssim_loss_grad)


def as_images(img, gt):
    """img and gt as the kernels take them: contiguous numpy arrays, float64 kept, else float32."""
    img = np.ascontiguousarray(img)
    if img.dtype != np.float64:
        img = img.astype(np.float32, copy=False)
    return img, np.ascontiguousarray(gt, dtype=img.dtype)


@njit(parallel=True, cache=True)
def _filter_rows(src, w, out):
    """out[k, a, b, c] = the zero-padded window w along axis 2 of src (K, A, B, C), at b."""
    K, A, B, C = src.shape
    r = w.shape[0] // 2
    for ab in prange(A * B):
        a = ab // B
        b = ab - a * B
        for k in range(K):
            for c in range(C):
                acc = 0.0
                for t in range(max(0, r - b), min(w.shape[0], B + r - b)):
                    acc += w[t] * src[k, a, b + t - r, c]
                out[k, a, b, c] = acc


def _blur(src, w, out):
    """Separable zero-padded window filter of every (k, :, :, c) plane of src (K, H, W, C) into
    out.  The vertical pass is the row filter over the image's rows taken whole (W * C values a
    row), so both passes run the one loop."""
    K, H, W, C = src.shape
    tmp = np.empty_like(src)
    _filter_rows(src, w, tmp)
    if not out.flags.c_contiguous:  # its reshape would be a copy, and the result lost
        raise ValueError("the blur's output must be C-contiguous")
    _filter_rows(tmp.reshape(K, 1, H, W * C), w, out.reshape(K, 1, H, W * C))


@njit(parallel=True, cache=True)
def _products(img, gt, out):
    """The five quantities whose window means are the SSIM moments."""
    H, W, C = img.shape
    for i in prange(H):
        for j in range(W):
            for c in range(C):
                x = img[i, j, c]
                y = gt[i, j, c]
                out[0, i, j, c] = x
                out[1, i, j, c] = y
                out[2, i, j, c] = x * x
                out[3, i, j, c] = y * y
                out[4, i, j, c] = x * y


@njit(parallel=True, cache=True)
def _ssim_map(img, gt, mom, ssim_scale, dmaps, partials):
    """Per 16x16 tile (row-major, as the CUDA blocks): sum of |img-gt| and of
    the SSIM map into partials; writes ssim_scale * (a, b, c)."""
    H, W, C = img.shape
    gx = (W + TILE - 1) // TILE
    for by in prange((H + TILE - 1) // TILE):   # one tile row per thread: no shared sums
        for i in range(by * TILE, min(H, (by + 1) * TILE)):
            for j in range(W):
                t = by * gx + j // TILE
                for c in range(C):
                    s, da, db, dc = _ssim_terms(mom[0, i, j, c], mom[1, i, j, c], mom[2, i, j, c],
                                                mom[3, i, j, c], mom[4, i, j, c], C1, C2)
                    partials[t, 1] += s
                    partials[t, 0] += abs(img[i, j, c] - gt[i, j, c])
                    dmaps[0, i, j, c] = ssim_scale * da
                    dmaps[1, i, j, c] = ssim_scale * db
                    dmaps[2, i, j, c] = ssim_scale * dc


@njit(parallel=True, cache=True)
def _dimg_all(img, gt, g, l1_scale, out):
    H, W, C = img.shape
    for i in prange(H):
        for j in range(W):
            for c in range(C):
                out[i, j, c] = _ssim_loss_grad(img[i, j, c], gt[i, j, c], g[0, i, j, c],
                                               g[1, i, j, c], g[2, i, j, c], l1_scale)


def ssim_forward(img, gt, ssim_scale):
    """-> (per-tile (sum|d|, sum SSIM) (tiles, 2) float64, scaled partial maps (3, H, W, 3))."""
    w = WINDOW64.astype(img.dtype)
    prod = np.empty((5,) + img.shape, img.dtype)
    _products(img, gt, prod)
    mom = np.empty_like(prod)
    _blur(prod, w, mom)
    dmaps = np.empty((3,) + img.shape, img.dtype)
    gx, gy = tile_grid(img.shape[1], img.shape[0])
    partials = np.zeros((gx * gy, 2))
    _ssim_map(img, gt, mom, ssim_scale, dmaps, partials)
    return partials, dmaps


def l1_ssim(img, gt, lam, tiles=None):
    """(per-tile sums, dimg) of (1-lam) * L1 + lam * (1 - SSIM).  Every tile is computed, also
    with ``tiles`` (a renderer's share is taken from the per-tile sums)."""
    n = img.size
    partials, dmaps = ssim_forward(img, gt, -lam / n)
    g = np.empty_like(dmaps)
    _blur(dmaps, WINDOW64.astype(img.dtype), g)
    dimg = np.empty_like(img)
    _dimg_all(img, gt, g, (1.0 - lam) / n, dimg)
    return partials, dimg
