"""The rasterizer's CPU kernels: Numba ``njit`` loops with the semantics of the CUDA ones.

Per-Gaussian kernels run the bodies of ``numbasplat.math.gaussian_ops`` under ``prange``.
Tiles are independent, so ``prange`` runs over tiles; the backward pass writes one gradient
row per tile-Gaussian intersection (no races) and then sums them per Gaussian, and so does the
contributions pass with its per-Gaussian totals.  The
per-pixel math is ``numbasplat.math.blend``'s, shared with the CUDA kernels.
"""
import numpy as np
from numba import njit, prange

from ..math import gaussian_ops as go
from ..math import geometry as geo
from ..math.blend import (blend_step, blend_vjp, dominant_step, gaussian_alpha, load_behind, load_front,
                          store_behind, store_front, store_pixel)
from ..math.jit import shared

_ops = go.build(njit(cache=True))  # not inlined: parfors cannot analyse the inlined tuple math
project_one, visit_tiles, project_backward_one = _ops.project, _ops.visit_tiles, _ops.project_backward
project_backward_adam_one = _ops.project_backward_adam
depth_key_one, emit_one, range_from_count_one = _ops.depth_key, _ops.emit, _ops.range_from_count
screen_stats_one = _ops.screen_stats
cull_one = _ops.cull
route_one, route_fill_one = _ops.route, _ops.route_fill
_store_pixel = njit(cache=True)(store_pixel)
_load_front, _store_front = njit(cache=True)(load_front), njit(cache=True)(store_front)
_load_behind, _store_behind = njit(cache=True)(load_behind), njit(cache=True)(store_behind)
_NO_STATE = np.zeros((0, 0, 0))  # ``state`` of a pass that is not chunked


@njit(parallel=True, cache=True)
def project(means, quats, scales, logits, sh, degree, cam, W, H, antialias, tile, tiles_x, tiles_y,
            proj, radii, counts):
    for n in prange(means.shape[0]):
        project_one(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias,
                    tile, tiles_x, tiles_y, proj, radii, counts)


@njit(parallel=True, cache=True)
def cull(means, scales, cam, skip, byte, shift, min_px, sigmas, spare, radii, counts):
    for n in prange(means.shape[0]):
        cull_one(n, means, scales, cam, skip, byte, shift, min_px, sigmas, spare, radii, counts)


@njit(parallel=True, cache=True)
def depth_keys(proj, counts, keys):
    for n in prange(proj.shape[0]):
        depth_key_one(n, proj, counts, keys)


@njit(parallel=True, cache=True)
def emit_intersections(proj, order, counts, ends, tile, tiles_x, tiles_y, W, H, view_of, keep_from, keep_to, pad,
                       room, tile_ids, ids, tally, overflow):
    """The CUDA kernel's emission and its count of each kept tile's intersections into the end column of
    ``tally``: without atomics here, the count is a serial pass over the emitted keys after the parallel
    emission (pad keys, ``tally``'s row count and beyond, count nowhere)."""
    for k in prange(order.shape[0]):
        emit_one(k, proj, order, counts, ends, tile, tiles_x, tiles_y, W, H, view_of, keep_from, keep_to, pad, room,
                 tile_ids, ids, tally, overflow, 0, 1)
    for i in range(tile_ids.shape[0]):
        if tile_ids[i] < tally.shape[0]:
            tally[tile_ids[i], 1] += 1


@njit(cache=True)
def ranges_from_counts(ranges):
    """Each tile's [start, end) in the sorted intersections from its count (``range_from_count_body``):
    a running sum over the tiles in order."""
    start = 0
    for t in range(ranges.shape[0]):
        start += range_from_count_one(t, start, ranges)


@njit(parallel=True, cache=True)
def screen_stats(grad, counts, radii, col_u, col_v, sx, sy, skip, sums, seen, max_radius):
    for n in prange(grad.shape[0]):
        screen_stats_one(n, grad, counts, radii, col_u, col_v, sx, sy, skip, sums, seen, max_radius)


@njit(parallel=True, cache=True)
def route(proj, counts, tile, tiles_x, tiles_y, first_tile, bounds, b, plan):
    for n in prange(proj.shape[0]):
        route_one(n, proj, counts, tile, tiles_x, tiles_y, first_tile, bounds, b, plan)


@njit(parallel=True, cache=True)
def route_fill(proj, counts, b, plan, slot, send, route):
    for n in prange(proj.shape[0]):
        route_fill_one(n, proj, counts, b, plan, slot, send, route)


@njit(parallel=True, cache=True)
def project_backward(means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad,
                     d_means, d_quats, d_scales, d_logits, d_sh, accumulate):
    for n in prange(means.shape[0]):
        project_backward_one(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad,
                             d_means, d_quats, d_scales, d_logits, d_sh, accumulate)


@njit(parallel=True, cache=True)
def project_backward_over_params(means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad):
    """``project_backward`` with each Gaussian's gradients written over its parameters
    (``rendering.project_backward`` into the parameters themselves): each parameter array passed once and
    used as its gradients' output too, since the arrays of a parallel loop are compiled as not aliasing one
    another; ``project_backward_body`` reads every parameter of a Gaussian before it writes its gradient."""
    for n in prange(means.shape[0]):
        project_backward_one(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad,
                             means, quats, scales, logits, sh, False)


@njit(parallel=True, cache=True)
def project_backward_adam(means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad,
                          m_means, m_quats, m_scales, m_logits, m_sh, v_means, v_quats, v_scales, v_logits, v_sh,
                          lr_means, lr_quats, lr_scales, lr_logits, lr_sh, visible, skip, b1, b2, eps, corrections):
    """``project_backward`` with Adam's update of each Gaussian's parameters and moments (``m_*``,
    ``v_*``; ``lr_*`` each group's per-column rates; ``corrections`` the bias corrections) in place of
    writing its gradients; ``visible``: Gaussians not drawn keep their state; none where skip[0] is set."""
    if skip[0] != 0:
        return
    hyper = (b1, b2, eps, corrections[0], corrections[1])
    for n in prange(means.shape[0]):
        project_backward_adam_one(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts,
                                  grad, m_means, m_quats, m_scales, m_logits, m_sh, v_means, v_quats, v_scales,
                                  v_logits, v_sh, lr_means, lr_quats, lr_scales, lr_logits, lr_sh, hyper, visible)


@shared
def record_alpha(proj, g, px, py):
    return gaussian_alpha(proj[g, go.U], proj[g, go.V], proj[g, go.CA], proj[g, go.CB], proj[g, go.CC],
                          proj[g, go.OPAC], px, py)


@njit(parallel=True, cache=True)
def _raster_forward(proj, ids, ranges, W, H, tile, tiles_x, bg, image, trans, depth, last, state, first, stop_tile):
    carry = state.shape[0] != 0
    for t in prange(first, stop_tile):
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
                done = False
                if carry:
                    T, r, gr, b, d, done = _load_front(state, py, px)
                for i in range(start, start if done else end):  # (a pixel ended in front: none)
                    g = ids[i]
                    alpha, vis, dx, dy = record_alpha(proj, g, px + 0.5, py + 0.5)
                    w, T, done = blend_step(alpha, T)
                    if done:
                        break
                    if w > 0:
                        r += w * proj[g, go.RED]
                        gr += w * proj[g, go.GREEN]
                        b += w * proj[g, go.BLUE]
                        d += w * proj[g, go.DEPTH]
                        stop = i + 1
                _store_pixel(image, trans, depth, last, py, px, r, gr, b, T, d, stop, bg)
                if carry:
                    _store_front(state, py, px, T, r, gr, b, d, done)


def raster_forward(proj, ids, ranges, W, H, tile, tiles_x, bg, image, trans, depth, last, state=None,
                   tile_rows=None):
    """Composite each pixel's Gaussians front to back into ``image``, ``trans``, ``depth``, ``last``;
    ``state`` ((FRONT_FIELDS, H, W) float64, ``blend.load_front``): start from it instead of an
    empty pixel (a chunk of the view's Gaussians after those in front) and leave the pixel's
    state there.  ``tile_rows`` (first, last): those rows of tiles only (None: every tile)."""
    first, stop = _tile_span(tile_rows, tiles_x, ranges.shape[0])
    _raster_forward(proj, ids, ranges, W, H, tile, tiles_x, bg, image, trans, depth, last,
                    _NO_STATE if state is None else state, first, stop)


def _tile_span(tile_rows, tiles_x, n_tiles):
    """The row-major tiles [first, stop) of the tile rows ``tile_rows`` (None: every tile)."""
    if tile_rows is None:
        return 0, n_tiles
    return tile_rows[0] * tiles_x, min(tile_rows[1] * tiles_x, n_tiles)


@njit(parallel=True, cache=True)
def _raster_backward_isect(proj, ids, ranges, W, H, tile, tiles_x, bg, trans, last, d_image, d_alpha, d_depth,
                           grad_isect, state, first, stop_tile):
    """Per-intersection screen-space gradients, back to front per pixel (from and into ``state``
    where it is not empty: ``raster_backward``), of tiles [first, stop_tile)."""
    carry = state.shape[0] != 0
    for t in prange(first, stop_tile):
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
                if carry:
                    T, s0, s1, s2, sd, da_end = _load_behind(state, py, px)
                for i in range(last[py, px] - 1, start - 1, -1):
                    g = ids[i]
                    alpha, vis, dx, dy = record_alpha(proj, g, px + 0.5, py + 0.5)
                    if alpha < geo.ALPHA_MIN:
                        continue
                    out = blend_vjp(alpha, vis, dx, dy, proj[g, go.OPAC], proj[g, go.CA], proj[g, go.CB],
                                    proj[g, go.CC], proj[g, go.RED], proj[g, go.GREEN], proj[g, go.BLUE],
                                    proj[g, go.DEPTH], T, s0, s1, s2, sd, dc0, dc1, dc2, dd, da_end, True)
                    T, s0, s1, s2, sd = out[0], out[1], out[2], out[3], out[4]
                    for f in range(go.GRAD_FIELDS):
                        grad_isect[i, f] += out[5 + f]
                if carry:
                    _store_behind(state, py, px, T, s0, s1, s2, sd)


@njit(parallel=True, cache=True)
def _contributions_isect(proj, ids, ranges, W, H, tile, tiles_x, dominant, contrib):
    """Each pixel's dominant Gaussian (-1: none contributes), and each intersection's contribution
    summed over its tile's pixels, front to back per pixel as in the forward pass."""
    for t in prange(ranges.shape[0]):
        for q in range(tile * tile):
            px = (t % tiles_x) * tile + q % tile
            py = (t // tiles_x) * tile + q // tile
            if px >= W or py >= H:
                continue
            T = 1.0
            best = 0.0
            best_g = -1
            for i in range(ranges[t, 0], ranges[t, 1]):
                g = ids[i]
                w, T, done = blend_step(record_alpha(proj, g, px + 0.5, py + 0.5)[0], T)
                if done:
                    break
                k, best, best_g = dominant_step(w, proj[g, go.RED], proj[g, go.GREEN], proj[g, go.BLUE], g, best,
                                                best_g)
                contrib[i, 0] += k
            dominant[py, px] = best_g


@njit(cache=True)
def scatter_add_rows(ids, rows, out):
    for i in range(ids.shape[0]):
        g = ids[i]
        for f in range(rows.shape[1]):
            out[g, f] += rows[i, f]


def raster_backward(proj, ids, ranges, W, H, tile, tiles_x, bg, trans, last, d_image, d_alpha, d_depth, grad,
                    fixed=None, state=None, tile_rows=None):
    """Add each Gaussian's screen-space gradient record into ``grad`` (N, GRAD_FIELDS).

    ``state`` ((BEHIND_FIELDS, H, W) float64, ``blend.load_behind``): each pixel's backward starts
    from it (the chunks behind done) instead of from ``trans``, ``bg`` and ``d_alpha``, which are
    not read, and leaves its state in front of these Gaussians there.  ``tile_rows`` (first, last):
    those rows of tiles only (None: every tile).

    Deterministic as it is, so ``fixed`` (the CUDA backend's order of summation for
    ``--deterministic``) is not needed: each intersection's row is written by the one thread
    that takes its tile, in pixel order, and the rows are added per Gaussian in sorted order by
    one thread; no ``prange`` reduction, so neither the thread count nor the schedule changes a
    bit."""
    rows = np.zeros((ids.shape[0], grad.shape[1]), grad.dtype)
    first, stop = _tile_span(tile_rows, tiles_x, ranges.shape[0])
    _raster_backward_isect(proj, ids, ranges, W, H, tile, tiles_x, bg, trans, last, d_image, d_alpha, d_depth, rows,
                           _NO_STATE if state is None else state, first, stop)
    scatter_add_rows(ids, rows, grad)


def contributions(proj, ids, ranges, W, H, tile, tiles_x, dominant, total):
    """Each pixel's dominant Gaussian into ``dominant`` (H, W); each Gaussian's contribution over
    the view added into ``total`` (N,)."""
    rows = np.zeros((ids.shape[0], 1), proj.dtype)
    _contributions_isect(proj, ids, ranges, W, H, tile, tiles_x, dominant, rows)
    scatter_add_rows(ids, rows, total.reshape(-1, 1))
