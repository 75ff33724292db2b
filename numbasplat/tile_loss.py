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

Backends: a CPU ``njit`` loop parallel over tiles (float32 or float64), and one
CUDA kernel (one 16x16 block per tile) built on the device function
``tile_loss_grad``; both use the same scalar helpers.
"""
import numpy as np
from numba import cuda, njit, prange, uint32
from numpy import float32 as f32

from . import _backend
from .device import shared
from .launch import kernel
from .loss import LazyLoss, _prepare, column_sums, tile_pixels

C1 = 0.01 ** 2
C2 = 0.03 ** 2
TILE = 16
NT = TILE * TILE             # pixel slots (= threads) per tile
NWIN = 16                    # windows per tile and repeat
WSIZE = 16                   # slots per window

# Shared scratch of tile_loss_grad: rows 0-2 rendered colour, 3-5 target,
# 6 valid flag (1/0) per slot; row 7: window of each slot in the current
# repeat; row 8: gradient coefficients (a, b, c) of the 48 (channel, window)
# pairs of the current repeat at 3 * (16 * ch + w).
TILE_LOSS_SMEM = (9, NT)
_VALID, _WIN, _COEF = 6, 7, 8


def s3im_permutations(rng, repeats=10):
    """(repeats, 256) int32: row 0 the 4x4-block identity arrangement, the
    other rows random permutations of the tile's slots (fresh ones each step)."""
    ly, lx = np.divmod(np.arange(NT), TILE)
    identity = np.argsort((ly // 4) * 4 + lx // 4, kind="stable")  # block by block, row-major inside
    rows = [identity] + [rng.permutation(NT) for _ in range(repeats - 1)]
    return np.stack(rows).astype(np.int32)


# ---------------------------------------------------------------------------
# Scalar math shared by the CPU loop and the CUDA device function.
# ---------------------------------------------------------------------------

@shared
def window_ssim(n, sx, sy, sxx, syy, sxy, c1, c2):
    """SSIM of one window from the sums of x, y, x^2, y^2, xy over its n > 0
    valid pixels, and (a, b, c) with d ssim / d x_i = (a + b x_i + c y_i) / n.

    Chain rule through mu_x, var_x, cov: d mu_x/dx_i = 1/n,
    d var_x/dx_i = 2 (x_i - mu_x)/n, d cov/dx_i = (y_i - mu_y)/n."""
    two = f32(2.0)
    mx = sx / n
    my = sy / n
    vx = sxx / n - mx * mx
    vy = syy / n - my * my
    cov = sxy / n - mx * my
    a1 = two * mx * my + c1
    a2 = two * cov + c2
    b1 = mx * mx + my * my + c1
    b2 = vx + vy + c2
    s = (a1 * a2) / (b1 * b2)
    s_mu = s * (two * my / a1 - two * mx / b1)   # d s / d mu_x at fixed var_x, cov
    s_var = -s / b2
    s_cov = two * s / a2
    return s, s_mu - two * s_var * mx - s_cov * my, two * s_var, s_cov


@shared
def l1_grad(d, scale):
    """scale * sign(d), sign(0) = 0."""
    if d > f32(0.0):
        return scale
    if d < f32(0.0):
        return -scale
    return scale * f32(0.0)


# ---------------------------------------------------------------------------
# CPU backend
# ---------------------------------------------------------------------------

@njit(parallel=True, cache=True)
def _tile_loss_cpu(img, gt, perms, l1_scale, ssim_scale, c1, c2, dimg, partials):
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


# ---------------------------------------------------------------------------
# CUDA: the per-tile device function and the unfused kernel built on it.
# ---------------------------------------------------------------------------

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


@kernel("float32[:, :, ::1]", "float32[:, :, ::1]", "int32[:, ::1]", "float32", "float32", "float32",
        "float32[:, :, ::1]", "float32[:, ::1]")
def _tile_loss_kernel(img, gt, perms, lam, inv_l1, inv_ssim, dimg, partials):
    """One block per tile: dimg, and the tile's (sum |d|, sum n_w ssim_w) in
    partials[tile] (summed on the host: deterministic, no atomics)."""
    sm = cuda.shared.array(TILE_LOSS_SMEM, f32)
    red = cuda.shared.array((2, NT), f32)
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
    step = NT // 2
    while step > 0:
        if tid < step:
            red[0, tid] += red[0, tid + step]
            red[1, tid] += red[1, tid + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        partials[tile, 0] = red[0, 0]
        partials[tile, 1] = red[1, 0]


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------

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
    img, gt, backend = _prepare(img, gt, backend)
    xp = np if backend == "cpu" else _backend.array_module("cuda")
    if backend == "cpu":
        perms = _backend.to_host(perms)
    perms = xp.ascontiguousarray(xp.asarray(perms, dtype=np.int32))  # a device copy stays there: no sync
    if perms.ndim != 2 or perms.shape[1] != NT or perms.shape[0] < 1:
        raise ValueError(f"perms must be (R, {NT}), got {perms.shape}")
    H, W = img.shape[:2]
    R = perms.shape[0]
    tiles_x, tiles_y = (W + TILE - 1) // TILE, (H + TILE - 1) // TILE
    inv_l1 = 1.0 / (3 * H * W)
    inv_ssim = inv_l1 / R
    lam = float(lam)
    if backend == "cpu":
        dimg = np.empty_like(img)
        partials = np.empty((tiles_x * tiles_y, 2), np.float64)
        ft = img.dtype.type
        _tile_loss_cpu(img, gt, perms, ft((1.0 - lam) * inv_l1), ft(-lam * inv_ssim), ft(C1), ft(C2),
                       dimg, partials)
    else:
        dimg = xp.empty_like(img)
        partials = xp.empty((tiles_x * tiles_y, 2), np.float32)
        _tile_loss_kernel[(tiles_x, tiles_y), (TILE, TILE)](img, gt, perms, f32(lam), f32(inv_l1), f32(inv_ssim),
                                                            dimg, partials)
    return partials, dimg
