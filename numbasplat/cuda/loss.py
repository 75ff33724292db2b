"""The windowed SSIM loss's CUDA kernels (float32): one 16x16-thread block per 16x16 tile.

Two launches per loss: ``_ssim_fwd_kernel`` (moments -> SSIM map and the scaled partials a, b,
c, plus the tile's sums) and ``_ssim_bwd_kernel`` (filter a, b, c -> dloss/dimg).  A block
stages its tile's inputs plus a RAD-wide zero halo in shared memory as HWC rows (contiguous
global loads), then filters separably per channel: a horizontal pass over all halo rows into
``hb``, then a vertical pass for each thread's own pixel.  Shared arrays are flat with offsets
hoisted out of the tap loops: Numba's n-d indexing costs a dozen 64-bit integer ops per
access.  The per-pixel math is ``numbasplat.math.ssim``'s, compiled here as device functions.
"""
import numpy as np
from numba import cuda, float32, uint32

from ..math.ssim import C1, C2, RAD, WIN, WINDOW32, ssim_loss_grad, ssim_terms
from ..math.tiles import TILE, TILE_PIXELS, tile_grid
from .launch import F2, F3, F4, array_module, kernel

_ssim_terms = cuda.jit(device=True)(ssim_terms)
_ssim_loss_grad = cuda.jit(device=True)(ssim_loss_grad)

HR = TILE + 2 * RAD          # halo tile rows
HCP = TILE + 2 * RAD         # halo tile columns (pixels)
HC = HCP * 3                 # halo tile row length (floats)
HB = HR * TILE               # one plane of horizontally filtered values
# Shared-array sizes must be global constants (Numba does not fold expressions).
HALO_LEN = HR * HC
HB5_LEN = 5 * HB
HB3_LEN = 3 * HB
RED_LEN = 2 * TILE_PIXELS


@cuda.jit(device=True, inline=True)
def _at(a, i):
    """a[i] for i >= 0.  An unsigned index spares the negative-index fixup
    Numba emits for every signed one (~5 integer ops per load in a tap loop)."""
    return a[uint32(i)]


@cuda.jit(device=True)
def _load_halo(src, dst, y0, x0):
    """dst[(r*HCP + p)*3 + ch] = src[y0-RAD+r, x0-RAD+p, ch], 0 outside the
    image (that is the conv zero padding).  All threads of the block help."""
    H, W = src.shape[0], src.shape[1]
    for r in range(cuda.threadIdx.y, HR, TILE):
        gy = y0 - RAD + r
        for p in range(cuda.threadIdx.x, HCP, TILE):
            gx = x0 - RAD + p
            inside = gy >= 0 and gy < H and gx >= 0 and gx < W
            o = uint32((r * HCP + p) * 3)
            for ch in range(3):
                v = float32(0)
                if inside:
                    v = src[uint32(gy), uint32(gx), uint32(ch)]
                dst[o + uint32(ch)] = v


@cuda.jit(device=True, inline=True)
def _filter_column(w, hb, o):
    """The vertical pass of one plane of ``hb`` at a thread's pixel: the window ``w`` over
    hb[o], hb[o + TILE], ... (o: the plane's value in the pixel's column at the first halo row)."""
    s = float32(0)
    for t in range(WIN):
        s += w[t] * _at(hb, o + t * TILE)
    return s


@kernel(F3, F3, F4, F2, "float32", "int32")
def _ssim_fwd_kernel(img, gt, dmaps, partials, ssim_scale, row0):
    """Moments -> SSIM map; writes ssim_scale * (a, b, c) to dmaps and the
    block's (sum|d|, sum SSIM) to partials[block] (summed on the host: no
    atomics, deterministic).  Block (x, y) is tile (x, y + row0)."""
    w = cuda.const.array_like(WINDOW32)
    sx = cuda.shared.array(HALO_LEN, float32)
    sy = cuda.shared.array(HALO_LEN, float32)
    hb = cuda.shared.array(HB5_LEN, float32)          # horizontally filtered moments
    red = cuda.shared.array(RED_LEN, float32)
    H, W = img.shape[0], img.shape[1]
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    tid = ty * TILE + tx
    y0 = (cuda.blockIdx.y + row0) * TILE
    x0 = cuda.blockIdx.x * TILE
    py, px = y0 + ty, x0 + tx
    c1, c2 = float32(C1), float32(C2)

    _load_halo(img, sx, y0, x0)
    _load_halo(gt, sy, y0, x0)
    cuda.syncthreads()
    l1 = float32(0)
    ss = float32(0)
    for ch in range(3):
        for r in range(ty, HR, TILE):                  # horizontal pass, all halo rows
            i = r * HC + tx * 3 + ch
            m0 = float32(0)
            m1 = float32(0)
            m2 = float32(0)
            m3 = float32(0)
            m4 = float32(0)
            for t in range(WIN):
                x = _at(sx, i + 3 * t)
                y = _at(sy, i + 3 * t)
                m0 += w[t] * x
                m1 += w[t] * y
                m2 += w[t] * (x * x)
                m3 += w[t] * (y * y)
                m4 += w[t] * (x * y)
            o = r * TILE + tx
            hb[o] = m0
            hb[o + HB] = m1
            hb[o + 2 * HB] = m2
            hb[o + 3 * HB] = m3
            hb[o + 4 * HB] = m4
        cuda.syncthreads()
        o = ty * TILE + tx                           # vertical pass, own pixel
        m0 = _filter_column(w, hb, o)
        m1 = _filter_column(w, hb, o + HB)
        m2 = _filter_column(w, hb, o + 2 * HB)
        m3 = _filter_column(w, hb, o + 3 * HB)
        m4 = _filter_column(w, hb, o + 4 * HB)
        if py < H and px < W:
            s, da, db, dc = _ssim_terms(m0, m1, m2, m3, m4, c1, c2)
            ss += s
            i = ((ty + RAD) * HCP + tx + RAD) * 3 + ch
            l1 += abs(sx[i] - sy[i])
            dmaps[0, py, px, ch] = ssim_scale * da
            dmaps[1, py, px, ch] = ssim_scale * db
            dmaps[2, py, px, ch] = ssim_scale * dc
        cuda.syncthreads()                           # hb is reused by the next channel

    red[tid] = l1
    red[tid + TILE_PIXELS] = ss
    cuda.syncthreads()
    step = TILE_PIXELS // 2
    while step > 0:                                  # shared-memory tree reduction
        if tid < step:
            red[tid] += red[tid + step]
            red[tid + TILE_PIXELS] += red[tid + TILE_PIXELS + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        b = (cuda.blockIdx.y + row0) * cuda.gridDim.x + cuda.blockIdx.x
        partials[b, 0] = red[0]
        partials[b, 1] = red[TILE_PIXELS]


@kernel(F3, F3, F4, F3, "float32", "int32")
def _ssim_bwd_kernel(img, gt, dmaps, dimg, l1_scale, row0):
    """dimg = G*a + 2x G*b + y G*c + l1_scale sign(x - y), from the scaled
    partial maps of the forward kernel (halo-tiled like the forward; block (x, y) is tile (x, y + row0))."""
    w = cuda.const.array_like(WINDOW32)
    sa = cuda.shared.array(HALO_LEN, float32)
    sb = cuda.shared.array(HALO_LEN, float32)
    sc = cuda.shared.array(HALO_LEN, float32)
    hb = cuda.shared.array(HB3_LEN, float32)
    H, W = img.shape[0], img.shape[1]
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    y0 = (cuda.blockIdx.y + row0) * TILE
    x0 = cuda.blockIdx.x * TILE
    py, px = y0 + ty, x0 + tx

    _load_halo(dmaps[0], sa, y0, x0)
    _load_halo(dmaps[1], sb, y0, x0)
    _load_halo(dmaps[2], sc, y0, x0)
    cuda.syncthreads()
    for ch in range(3):
        for r in range(ty, HR, TILE):
            i = r * HC + tx * 3 + ch
            g0 = float32(0)
            g1 = float32(0)
            g2 = float32(0)
            for t in range(WIN):
                g0 += w[t] * _at(sa, i + 3 * t)
                g1 += w[t] * _at(sb, i + 3 * t)
                g2 += w[t] * _at(sc, i + 3 * t)
            o = r * TILE + tx
            hb[o] = g0
            hb[o + HB] = g1
            hb[o + 2 * HB] = g2
        cuda.syncthreads()
        o = ty * TILE + tx
        g0 = _filter_column(w, hb, o)
        g1 = _filter_column(w, hb, o + HB)
        g2 = _filter_column(w, hb, o + 2 * HB)
        if py < H and px < W:
            dimg[py, px, ch] = _ssim_loss_grad(img[py, px, ch], gt[py, px, ch], g0, g1, g2, l1_scale)
        cuda.syncthreads()


def as_images(img, gt):
    """img and gt as the kernels take them: contiguous float32 arrays of ``array_module``."""
    xp = array_module()
    return (xp.ascontiguousarray(xp.asarray(img, dtype=xp.float32)),
            xp.ascontiguousarray(xp.asarray(gt, dtype=xp.float32)))


_SCRATCH = {}


def _scratch(H, W):
    """dmaps (3, H, W, 3) float32, reused by later calls of the same shape (launches are
    stream-ordered).  Not for concurrent host threads.  (Not the partial sums: a ``LazyLoss``
    holds them until it is read, past later calls.)"""
    ws = _SCRATCH.get((H, W))
    if ws is None:
        if len(_SCRATCH) >= 4:
            _SCRATCH.clear()
        ws = _SCRATCH[(H, W)] = array_module().empty((3, H, W, 3), np.float32)
    return ws


def ssim_forward(img, gt, ssim_scale, rows=None):
    """-> (per-tile (sum|d|, sum SSIM) (tiles, 2) on the device, scaled partial maps); one launch.
    ``rows``: only tile rows [r0, r1) (the other tiles' partials and maps are left as they were)."""
    H, W = img.shape[:2]
    dmaps = _scratch(H, W)
    gx, gy = tile_grid(W, H)
    partials = array_module().empty((gx * gy, 2), np.float32)
    r0, r1 = rows or (0, gy)
    if r1 > r0:
        _ssim_fwd_kernel[(gx, r1 - r0), (TILE, TILE)](img, gt, dmaps, partials, np.float32(ssim_scale),
                                                      np.int32(r0))
    return partials, dmaps


def l1_ssim(img, gt, lam, tiles=None):
    """(per-tile sums, dimg) of (1-lam) * L1 + lam * (1 - SSIM), on the device; two launches.
    ``tiles=(lo, hi)``: the loss and gradient right on those tiles only, computed on their tile
    rows (the maps one tile row further: the backward's window reaches into them)."""
    n = img.size
    gx, gy = tile_grid(img.shape[1], img.shape[0])
    fwd = bwd = (0, gy)
    xp = array_module()
    if tiles is None:
        dimg = xp.empty_like(img)
    else:
        lo, hi = tiles
        bwd = (lo // gx, -(-hi // gx)) if hi > lo else (0, 0)
        fwd = (max(bwd[0] - 1, 0), min(bwd[1] + 1, gy)) if hi > lo else (0, 0)
        dimg = xp.zeros_like(img)  # zero off the rows: nothing reads garbage
    partials, dmaps = ssim_forward(img, gt, -lam / n, fwd)
    if bwd[1] > bwd[0]:
        _ssim_bwd_kernel[(gx, bwd[1] - bwd[0]), (TILE, TILE)](img, gt, dmaps, dimg, np.float32((1.0 - lam) / n),
                                                              np.int32(bwd[0]))
    return partials, dimg  # on the device: ``LazyLoss`` reads them back when asked
