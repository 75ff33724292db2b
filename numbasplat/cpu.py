"""CPU backend: Numba ``njit`` kernels with the semantics of the CUDA ones.

It is the reference the CUDA kernels are checked against, and it runs in the
dtype it is given, so float64 inputs give float64 gradients for finite-difference
checks.  Tiles are independent, so ``prange`` runs over tiles; the backward pass
writes one gradient row per tile-Gaussian intersection (no races) and then sums
them per Gaussian.
"""
import math

import numpy as np
from numba import njit, prange

from . import gaussian_ops as go
from . import geometry as geo
from .optim import adam_body
from .device import shared

_ops = go.build(njit(cache=True))  # not inlined: parfors cannot analyse the inlined tuple math
project_one, visit_tiles, project_backward_one = _ops.project, _ops.visit_tiles, _ops.project_backward


@njit(parallel=True, cache=True)
def project(means, quats, scales, logits, sh, degree, cam, W, H, antialias, tile, tiles_x, tiles_y,
            proj, radii, counts):
    for n in prange(means.shape[0]):
        project_one(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias,
                    tile, tiles_x, tiles_y, proj, radii, counts)


@njit(parallel=True, cache=True)
def emit_intersections(proj, order, counts, offsets, tile, tiles_x, tiles_y, W, H, key_base, tile_ids, ids):
    for k in prange(order.shape[0]):
        n = order[k]
        if counts[n] > 0:
            visit_tiles(n, proj, tile, tiles_x, tiles_y, W, H, key_base, offsets[k], counts[n], tile_ids, ids, True)


@njit(parallel=True, cache=True)
def project_backward(means, quats, scales, logits, sh, degree, cam, W, H, antialias, counts, grad,
                     d_means, d_quats, d_scales, d_logits, d_sh, accumulate):
    for n in prange(means.shape[0]):
        project_backward_one(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias, counts, grad,
                             d_means, d_quats, d_scales, d_logits, d_sh, accumulate)


@shared
def pixel_alpha(proj, g, px, py):
    """(alpha, exp(-sigma)) of record g at pixel centre (px, py); alpha 0 where sigma < 0."""
    dx = proj[g, go.U] - px
    dy = proj[g, go.V] - py
    sigma = 0.5 * (proj[g, go.CA] * dx * dx + proj[g, go.CC] * dy * dy) + proj[g, go.CB] * dx * dy
    if sigma < 0.0:
        return 0.0, 0.0, dx, dy
    vis = math.exp(-sigma)
    return min(geo.ALPHA_MAX, proj[g, go.OPAC] * vis), vis, dx, dy


@njit(parallel=True, cache=True)
def raster_forward(proj, ids, ranges, W, H, tile, tiles_x, bg, image, trans, depth, last):
    n_tiles = ranges.shape[0]
    for t in prange(n_tiles):
        ty = t // tiles_x
        tx = t - ty * tiles_x
        start = ranges[t, 0]
        end = ranges[t, 1]
        for py in range(ty * tile, min(ty * tile + tile, H)):
            for px in range(tx * tile, min(tx * tile + tile, W)):
                T = 1.0
                r = 0.0
                gr = 0.0
                b = 0.0
                d = 0.0
                stop = start
                for i in range(start, end):
                    g = ids[i]
                    alpha, vis, dx, dy = pixel_alpha(proj, g, px + 0.5, py + 0.5)
                    if alpha < geo.ALPHA_MIN:
                        continue
                    nT = T * (1.0 - alpha)
                    if nT <= geo.T_MIN:
                        break
                    w = alpha * T
                    r += w * proj[g, go.RED]
                    gr += w * proj[g, go.GREEN]
                    b += w * proj[g, go.BLUE]
                    d += w * proj[g, go.DEPTH]
                    T = nT
                    stop = i + 1
                image[py, px, 0] = r + T * bg[0]
                image[py, px, 1] = gr + T * bg[1]
                image[py, px, 2] = b + T * bg[2]
                trans[py, px] = T
                depth[py, px] = d
                last[py, px] = stop


@njit(parallel=True, cache=True)
def _raster_backward_isect(proj, ids, ranges, W, H, tile, tiles_x, bg, trans, last, d_image, d_alpha, d_depth,
                    grad_isect):
    """Per-intersection screen-space gradients, back to front per pixel."""
    n_tiles = ranges.shape[0]
    for t in prange(n_tiles):
        ty = t // tiles_x
        tx = t - ty * tiles_x
        start = ranges[t, 0]
        for py in range(ty * tile, min(ty * tile + tile, H)):
            for px in range(tx * tile, min(tx * tile + tile, W)):
                T_end = trans[py, px]
                T = T_end
                dc0 = d_image[py, px, 0]
                dc1 = d_image[py, px, 1]
                dc2 = d_image[py, px, 2]
                dd = d_depth[py, px]
                # what lies behind the current Gaussian, background included
                s0 = T_end * bg[0]
                s1 = T_end * bg[1]
                s2 = T_end * bg[2]
                sd = 0.0
                da_end = d_alpha[py, px] * T_end
                for i in range(last[py, px] - 1, start - 1, -1):
                    g = ids[i]
                    alpha, vis, dx, dy = pixel_alpha(proj, g, px + 0.5, py + 0.5)
                    if alpha < geo.ALPHA_MIN:
                        continue
                    ra = 1.0 / (1.0 - alpha)
                    T *= ra
                    w = alpha * T
                    c0 = proj[g, go.RED]
                    c1 = proj[g, go.GREEN]
                    c2 = proj[g, go.BLUE]
                    z = proj[g, go.DEPTH]
                    grad_isect[i, go.RED] += w * dc0
                    grad_isect[i, go.GREEN] += w * dc1
                    grad_isect[i, go.BLUE] += w * dc2
                    grad_isect[i, go.DEPTH] += w * dd
                    d_a = (dc0 * (c0 * T - s0 * ra) + dc1 * (c1 * T - s1 * ra) + dc2 * (c2 * T - s2 * ra)
                           + dd * (z * T - sd * ra) + da_end * ra)
                    s0 += w * c0
                    s1 += w * c1
                    s2 += w * c2
                    sd += w * z
                    o = proj[g, go.OPAC]
                    if o * vis <= geo.ALPHA_MAX:
                        grad_isect[i, go.OPAC] += vis * d_a
                        ds = -o * vis * d_a
                        gu = ds * (proj[g, go.CA] * dx + proj[g, go.CB] * dy)
                        gv = ds * (proj[g, go.CB] * dx + proj[g, go.CC] * dy)
                        grad_isect[i, go.U] += gu
                        grad_isect[i, go.V] += gv
                        grad_isect[i, go.ABS_U] += abs(gu)
                        grad_isect[i, go.ABS_V] += abs(gv)
                        grad_isect[i, go.CA] += 0.5 * ds * dx * dx
                        grad_isect[i, go.CB] += ds * dx * dy
                        grad_isect[i, go.CC] += 0.5 * ds * dy * dy


@njit(cache=True)
def scatter_add_rows(ids, rows, out):
    for i in range(ids.shape[0]):
        g = ids[i]
        for f in range(rows.shape[1]):
            out[g, f] += rows[i, f]


def raster_backward(proj, ids, ranges, W, H, tile, tiles_x, bg, trans, last, d_image, d_alpha, d_depth, grad):
    """Add each Gaussian's screen-space gradient record into ``grad`` (N, GRAD_FIELDS)."""
    rows = np.zeros((ids.shape[0], grad.shape[1]), grad.dtype)
    _raster_backward_isect(proj, ids, ranges, W, H, tile, tiles_x, bg, trans, last, d_image, d_alpha, d_depth, rows)
    scatter_add_rows(ids, rows, grad)


_adam_one = njit(inline="always")(adam_body)


@njit(parallel=True, cache=True)
def adam(params, grads, m, v, bounds, widths, col0, lrs, visible, use_visible, b1, b2, eps, bc1, bc2):
    for i in prange(params.shape[0]):
        _adam_one(i, params, grads, m, v, bounds, widths, col0, lrs, visible, use_visible, b1, b2, eps, bc1, bc2)
