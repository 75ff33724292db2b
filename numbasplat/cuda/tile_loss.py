"""The tile-local loss's CUDA code (float32): the per-tile device function ``tile_loss_grad``
that the fused kernel calls after compositing, and the unfused kernel built on it (one 16x16
block per tile).  The S3IM window math is ``numbasplat.math.ssim``'s.
"""
import numpy as np
from numba import cuda, uint32
from numpy import float32 as f32

from ..math.ssim import C1, C2, NWIN, WSIZE, l1_grad, window_ssim
from ..math.tiles import TILE, TILE_LOSS_ROWS, TILE_PIXELS, tile_grid
from .launch import F2, F3, I2, array_module, kernel

# Shared scratch of tile_loss_grad: rows 0-2 rendered colour, 3-5 target,
# 6 valid flag (1/0) per slot; row 7: window of each slot in the current
# repeat; row 8: gradient coefficients (a, b, c) of the 48 (channel, window)
# pairs of the current repeat at 3 * (16 * ch + w).
TILE_LOSS_SMEM = (TILE_LOSS_ROWS, TILE_PIXELS)
_VALID, _WIN, _COEF = 6, 7, 8


@cuda.jit(device=True)
def tile_loss_grad(tid, slot, valid, c0, c1, c2, t0, t1, t2, perms, repeats, lam, inv_l1, inv_ssim, sm):
    """dL/dcolour of this thread's pixel, for a 256-thread block that owns one tile.

    Every thread of the block must call it (it synchronises 2 * repeats + 1
    times).  tid: the thread (0..255); slot = ly*16 + lx: its pixel in the
    tile (the raster kernels give a warp a block of pixels, not a row, so the
    two differ there); valid: the pixel lies inside the image; c, t:
    rendered and target colour; perms: (repeats, 256) int32; lam, inv_l1 =
    1/(3HW), inv_ssim = 1/(R*3HW): float32; sm: float32 shared array of shape
    TILE_LOSS_SMEM.  Returns (dc0, dc1, dc2, l1, ss): the gradient (zero for
    invalid pixels) and this thread's share of the block's sum |c - t| and of
    its sum n_w * ssim_w (unscaled; their block sums are the tile's partials).
    Per repeat, threads 0..47 each compute one (channel, window) and publish its
    gradient coefficients; then every pixel picks up those of its window."""
    zero = f32(0.0)
    if not valid:                       # invalid slots hold zeros and flag 0
        c0 = c1 = c2 = t0 = t1 = t2 = zero
    sm[0, slot] = c0
    sm[1, slot] = c1
    sm[2, slot] = c2
    sm[3, slot] = t0
    sm[4, slot] = t1
    sm[5, slot] = t2
    sm[_VALID, slot] = f32(1.0) if valid else zero
    cuda.syncthreads()

    k1, k2 = f32(C1), f32(C2)
    scale = -lam * inv_ssim
    g0 = g1 = g2 = zero
    ss = zero
    for r in range(repeats):
        row = uint32(r)  # unsigned indices: Numba wraps signed ones for negative values, ~10 instructions a read
        sm[_WIN, uint32(perms[row, uint32(tid)])] = f32(tid // WSIZE)  # inverse arrangement: slot -> window
        if tid < 3 * NWIN:
            ch = uint32(tid // NWIN)
            base = uint32(WSIZE * (tid % NWIN))
            n = sx = sy = sxx = syy = sxy = zero
            for j in range(WSIZE):
                other = uint32(perms[row, base + uint32(j)])
                x = sm[ch, other]
                y = sm[ch + uint32(3), other]
                n += sm[_VALID, other]
                sx += x
                sy += y
                sxx += x * x
                syy += y * y
                sxy += x * y
            a = b = c = zero
            if n > zero:
                s, a, b, c = window_ssim(n, sx, sy, sxx, syy, sxy, k1, k2)
                ss += n * s
            sm[_COEF, 3 * tid] = scale * a
            sm[_COEF, 3 * tid + 1] = scale * b
            sm[_COEF, 3 * tid + 2] = scale * c
        cuda.syncthreads()
        k = 3 * int(sm[_WIN, slot])                        # (channel 0, my window)
        g0 += sm[_COEF, k] + sm[_COEF, k + 1] * c0 + sm[_COEF, k + 2] * t0
        k += 3 * NWIN
        g1 += sm[_COEF, k] + sm[_COEF, k + 1] * c1 + sm[_COEF, k + 2] * t1
        k += 3 * NWIN
        g2 += sm[_COEF, k] + sm[_COEF, k + 1] * c2 + sm[_COEF, k + 2] * t2
        cuda.syncthreads()                                 # rows 7, 8 are rewritten next repeat

    if not valid:
        return zero, zero, zero, zero, ss
    l1_scale = (f32(1.0) - lam) * inv_l1
    d0 = c0 - t0
    d1 = c1 - t1
    d2 = c2 - t2
    return (g0 + l1_grad(d0, l1_scale), g1 + l1_grad(d1, l1_scale), g2 + l1_grad(d2, l1_scale),
            abs(d0) + abs(d1) + abs(d2), ss)


@kernel(F3, F3, I2, "float32", "float32", "float32", F3, F2)
def _tile_loss_kernel(img, gt, perms, lam, inv_l1, inv_ssim, dimg, partials):
    """One block per tile: dimg, and the tile's (sum |d|, sum n_w ssim_w) in
    partials[tile] (summed on the host: deterministic, no atomics)."""
    sm = cuda.shared.array(TILE_LOSS_SMEM, f32)
    red = cuda.shared.array((2, TILE_PIXELS), f32)
    H, W = img.shape[0], img.shape[1]
    tid = cuda.threadIdx.y * TILE + cuda.threadIdx.x
    py = cuda.blockIdx.y * TILE + cuda.threadIdx.y
    px = cuda.blockIdx.x * TILE + cuda.threadIdx.x
    valid = py < H and px < W
    c0 = c1 = c2 = t0 = t1 = t2 = f32(0.0)
    if valid:
        c0, c1, c2 = img[py, px, 0], img[py, px, 1], img[py, px, 2]
        t0, t1, t2 = gt[py, px, 0], gt[py, px, 1], gt[py, px, 2]
    d0, d1, d2, l1, ss = tile_loss_grad(tid, tid, valid, c0, c1, c2, t0, t1, t2, perms, perms.shape[0],
                                        lam, inv_l1, inv_ssim, sm)
    if valid:
        dimg[py, px, 0] = d0
        dimg[py, px, 1] = d1
        dimg[py, px, 2] = d2
    store_tile_sums(tid, cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x, l1, ss, red, partials)


@cuda.jit(device=True)
def store_tile_sums(tid, tile, l1, ss, red, partials):
    """Block sums of the threads' (L1, SSIM) contributions into partials[tile]
    (a shared-memory tree: no warp shuffles, so the simulator runs it too)."""
    red[0, tid] = l1
    red[1, tid] = ss
    cuda.syncthreads()
    step = TILE_PIXELS // 2
    while step > 0:
        if tid < step:
            red[0, tid] += red[0, tid + step]
            red[1, tid] += red[1, tid + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        partials[tile, 0] = red[0, 0]
        partials[tile, 1] = red[1, 0]


def tile_loss(img, gt, perms, lam, inv_l1, inv_ssim):
    """(per-tile (sum |d|, sum n_w ssim_w) partials, dimg) of the tile loss, on the device; one
    launch.  ``inv_l1`` = 1/(3HW), ``inv_ssim`` = 1/(R*3HW)."""
    xp = array_module()
    perms = xp.ascontiguousarray(xp.asarray(perms, dtype=np.int32))  # a device copy stays there: no sync
    tiles_x, tiles_y = tile_grid(img.shape[1], img.shape[0])
    dimg = xp.empty_like(img)
    partials = xp.empty((tiles_x * tiles_y, 2), np.float32)
    _tile_loss_kernel[(tiles_x, tiles_y), (TILE, TILE)](img, gt, perms, f32(lam), f32(inv_l1), f32(inv_ssim),
                                                        dimg, partials)
    return partials, dimg
