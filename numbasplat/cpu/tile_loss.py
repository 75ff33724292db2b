"""The tile-local loss's CPU kernel: an ``njit`` loop parallel over tiles, in the images' dtype
(float32 or float64).  The S3IM window math is ``numbasplat.math.ssim``'s.
"""
import numpy as np
from numba import njit, prange

from ..math.ssim import C1, C2, NWIN, WSIZE, l1_grad, window_ssim
from ..math.tiles import TILE, tile_grid


@njit(parallel=True, cache=True)
def _tile_loss(img, gt, perms, l1_scale, ssim_scale, c1, c2, dimg, partials):
    """dimg and per-tile (sum |img - gt|, sum n_w ssim_w); tiles are independent."""
    H, W, _ = img.shape
    tiles_x = (W + TILE - 1) // TILE
    for t in prange(partials.shape[0]):
        y0 = (t // tiles_x) * TILE
        x0 = (t % tiles_x) * TILE
        l1 = 0.0
        ss = 0.0
        for py in range(y0, min(y0 + TILE, H)):
            for px in range(x0, min(x0 + TILE, W)):
                for ch in range(3):
                    d = img[py, px, ch] - gt[py, px, ch]
                    l1 += abs(d)
                    dimg[py, px, ch] = l1_grad(d, l1_scale)
        for r in range(perms.shape[0]):
            for w in range(NWIN):
                for ch in range(3):
                    n = sx = sy = sxx = syy = sxy = 0.0
                    for j in range(WSIZE):
                        slot = perms[r, WSIZE * w + j]
                        py = y0 + slot // TILE
                        px = x0 + slot % TILE
                        if py < H and px < W:
                            x = img[py, px, ch]
                            y = gt[py, px, ch]
                            n += 1.0
                            sx += x
                            sy += y
                            sxx += x * x
                            syy += y * y
                            sxy += x * y
                    if n == 0.0:
                        continue
                    s, a, b, c = window_ssim(n, sx, sy, sxx, syy, sxy, c1, c2)
                    ss += n * s
                    for j in range(WSIZE):
                        slot = perms[r, WSIZE * w + j]
                        py = y0 + slot // TILE
                        px = x0 + slot % TILE
                        if py < H and px < W:
                            dimg[py, px, ch] += ssim_scale * (a + b * img[py, px, ch] + c * gt[py, px, ch])
        partials[t, 0] = l1
        partials[t, 1] = ss


def tile_loss(img, gt, perms, lam, inv_l1, inv_ssim):
    """(per-tile (sum |d|, sum n_w ssim_w) partials, dimg) of the tile loss.  ``inv_l1`` =
    1/(3HW), ``inv_ssim`` = 1/(R*3HW)."""
    perms = np.ascontiguousarray(perms, dtype=np.int32)
    tiles_x, tiles_y = tile_grid(img.shape[1], img.shape[0])
    dimg = np.empty_like(img)
    partials = np.empty((tiles_x * tiles_y, 2), np.float64)
    ft = img.dtype.type
    _tile_loss(img, gt, perms, ft((1.0 - lam) * inv_l1), ft(-lam * inv_ssim), ft(C1), ft(C2), dimg, partials)
    return partials, dimg
