"""Per-Gaussian work, written once for both backends.

``build(jit)`` defines each ``*_body`` (the work of one Gaussian index) with
the given decorator: ``numbasplat.cpu.raster`` passes ``njit`` and loops with
``prange``, ``numbasplat.cuda.raster`` passes a CUDA device-function decorator
and launches one thread per Gaussian (under the CUDA simulator the bodies run
as Python on fake arrays, which is why the math they call is scalar-only).

Record layouts (rows of float arrays, so exchanges can move whole records):
  projected  (N, PROJ_FIELDS): u, v, conic a, b, c, opacity, r, g, b, depth
  gradients  (N, GRAD_FIELDS): the same ten fields, then |du|, |dv| summed per pixel
"""
import math

from numpy import float32 as f32
from types import SimpleNamespace

from . import geometry as geo
from .adam import adam_update
from .jit import shared
from .sh import sh_basis, sh_basis_jacobian

PROJ_FIELDS = 10
GRAD_FIELDS = 12
U, V, CA, CB, CC, OPAC, RED, GREEN, BLUE, DEPTH = range(10)
ABS_U, ABS_V = 10, 11
CAM_FIELDS = 19  # view (12: R row-major, t), fx, fy, cx, cy, camera centre (3)


@shared
def sigmoid(x):
    return f32(1.0) / (f32(1.0) + math.exp(-x))


@shared
def footprint(u, v, ca, cb, cc, opacity):
    """(ext, cov_a, cov_c) of a projected record: the squared Mahalanobis radius
    where alpha reaches 1/255 and the 2D covariance diagonal.  Binning computes
    this from the stored record so that counting and emitting always agree."""
    ext = geo.opacity_extent(opacity)
    det = ca * cc - cb * cb
    if not (ext > f32(0.0) and det > f32(0.0)):
        return f32(0.0), f32(0.0), f32(0.0)
    return ext, cc / det, ca / det


def build(jit, count_tile=None):
    """The per-Gaussian bodies compiled with ``jit``; returns them in a namespace.

    ``count_tile(tally, key)``: how the backend adds an emitted intersection to its tile's count,
    the end column of row ``key`` of the tally (``emit_body``), where threads emitting other
    Gaussians add to the same rows: the CUDA kernels' atomic add.  None: emission counts nothing
    (the CPU kernels, which have no atomics, count the emitted keys in one pass after their
    parallel loop)."""
    if count_tile is None:
        @jit
        def count_tile(tally, key):
            pass

    @jit
    def store1(a, n, v, accumulate):
        """a[n] += v, or a[n] = v: write mode never reads (the buffer may be uninitialised)."""
        if accumulate:
            v += a[n]
        a[n] = v

    @jit
    def store2(a, n, j, v, accumulate):
        if accumulate:
            v += a[n, j]
        a[n, j] = v

    @jit
    def view_direction(n, means, cam):
        """Unit direction from the camera centre to Gaussian n, and 1 / the distance."""
        dx = means[n, 0] - cam[16]
        dy = means[n, 1] - cam[17]
        dz = means[n, 2] - cam[18]
        inv = f32(1.0) / math.sqrt(dx * dx + dy * dy + dz * dz)
        return dx * inv, dy * inv, dz * inv, inv

    @jit
    def colour_grad(n, proj, grad):
        """Gaussian n's colour gradient; clamped channels (the forward's colour is 0) pass none."""
        g0 = grad[n, RED] if proj[n, RED] > f32(0.0) else f32(0.0)
        g1 = grad[n, GREEN] if proj[n, GREEN] > f32(0.0) else f32(0.0)
        g2 = grad[n, BLUE] if proj[n, BLUE] > f32(0.0) else f32(0.0)
        return g0, g1, g2

    @jit
    def visit_tiles_body(n, proj, tile, tiles_x, tiles_y, W, H, key_map, o, limit, tile_ids, ids, tally, write,
                         first, stride):
        """Count (write=False) or emit (write=True) the tiles hit by Gaussian n.

        Emitting writes (sort key, Gaussian id) pairs into slots [o, o + limit), ``limit`` being
        the count from projection, and counts each key into the ``tally`` (``count_tile``).
        ``key_map`` = (key_base, keep_from, keep_to, pad): tile t of the view (row-major) is written
        as key ``key_base + t`` where ``keep_from <= t < keep_to``, else as ``pad``, which sorts
        after every kept tile and lands in no range (a part's tile rows, ``bin_tiles(tile_rows=)``).
        The two passes are compiled into different kernels, where the compiler may fuse float
        operations differently, so a boundary tile can flip: never write past ``limit``, and pad a
        shortfall with ``pad`` too.  ``stride`` threads may share the writing: this one writes the
        slots ``first``, ``first + stride``, ... of each row's run (one thread: 0, 1)."""
        key_base, keep_from, keep_to, pad = key_map
        u = proj[n, U]
        v = proj[n, V]
        ca, cb, cc = proj[n, CA], proj[n, CB], proj[n, CC]
        ext, cov_a, cov_c = footprint(u, v, ca, cb, cc, proj[n, OPAC])
        k = 0
        if ext > f32(0.0):
            tx0, tx1, ty0, ty1 = geo.tile_rect(u, v, cov_a, cov_c, ext, tile, tiles_x, tiles_y)
            rows = geo.ellipse_rows(ca, cb, cc, ext, cov_a, cov_c)
            for ty in range(ty0, ty1 + 1):
                a, b = geo.row_span(u, v, ca, cb, rows, ty, tile, tiles_x, W, H)
                a = max(a, tx0)  # within the bounding box, as the routing's plan (route_body) assumes
                b = min(b, tx1)
                if write:
                    for tx in range(a + first, b + 1, stride):
                        j = k + tx - a
                        if j < limit:
                            t = ty * tiles_x + tx
                            if keep_from <= t < keep_to:
                                key = key_base + t
                                tile_ids[o + j] = key
                                count_tile(tally, key)
                            else:
                                tile_ids[o + j] = pad
                            ids[o + j] = n
                k += max(b - a + 1, 0)
        if write:
            for j in range(k + first, limit, stride):
                tile_ids[o + j] = pad
                ids[o + j] = n
        return k

    @jit
    def depth_key_body(n, proj, counts, keys):
        """Gaussian n's binning sort key: its depth, or infinity if it touches no tile (it sorts last
        and emits nothing)."""
        keys[n] = proj[n, DEPTH] if counts[n] > 0 else f32(math.inf)

    @jit
    def emit_body(k, proj, order, counts, ends, tile, tiles_x, tiles_y, W, H, view_of, keep_from, keep_to, pad,
                  room, tile_ids, ids, tally, overflow, first, stride):
        """Emit the intersections of the k-th Gaussian in depth order (``order``) into slots
        [ends[k] - counts, ends[k]) (``ends``: the running count in that order) when they all fit in
        the ``room`` slots, counting each kept tile's into the end column of its ``tally`` row; the
        last Gaussian writes overflow[0] = 1 if the total does not fit.  ``view_of``: each
        Gaussian's view, whose tiles' keys follow the views before it (empty: one view);
        ``keep_from``, ``keep_to``, ``pad``: the tiles kept and the key of the others
        (``visit_tiles_body``).  ``first``, ``stride``: this thread's share of the writes."""
        n = order[k]
        c = counts[n]
        end = ends[k]
        if c > 0 and end <= room:
            key_base = view_of[n] * (tiles_x * tiles_y) if view_of.shape[0] > 0 else 0
            visit_tiles_body(n, proj, tile, tiles_x, tiles_y, W, H, (key_base, keep_from, keep_to, pad), end - c, c,
                             tile_ids, ids, tally, True, first, stride)
        if k == order.shape[0] - 1 and first == 0:
            overflow[0] = 1 if end > room else 0

    @jit
    def range_from_count_body(t, start, ranges):
        """Turn tile t's row of ``ranges``, its count of intersections in the end column (``emit_body``),
        into its [start, start + count) in the sorted intersections, ``start`` being the count of every
        tile before it: the tiles' sort is stable and by tile, so each tile's run follows the earlier
        tiles' runs.  The row of an empty tile stays [0, 0).  -> the count."""
        c = ranges[t, 1]
        if c > 0:
            ranges[t, 0] = start
            ranges[t, 1] = start + c
        return c

    @jit
    def screen_stats_body(n, grad, counts, radii, col_u, col_v, sx, sy, skip, sums, seen, max_radius):
        """Add Gaussian n's screen-space gradient norm (columns ``col_u``, ``col_v`` of its record,
        scaled by ``sx``, ``sy``) into ``sums`` if it is drawn, and a view into ``seen`` if it is in
        view (a radius: drawn, or hidden by its view mask, ``cull_body``), where the step is not
        skipped (skip[0] == 0); raise ``max_radius`` to its larger radius."""
        r = f32(max(radii[n, 0], radii[n, 1]))  # (compared as float32: int32 against float32 is float64)
        if r > f32(0.0) and skip[0] == 0:
            if counts[n] > 0:
                gx = grad[n, col_u] * sx
                gy = grad[n, col_v] * sy
                sums[n] += math.sqrt(gx * gx + gy * gy)
            seen[n] += 1
        if r > max_radius[n]:
            max_radius[n] = r

    @jit
    def owner_of(bounds, t):
        """The rank whose tile range holds tile t: the last d with bounds[d] <= t (bounds ascending,
        bounds[0] = 0 <= t < bounds[-1]; empty ranges are skipped)."""
        lo, hi = 0, bounds.shape[0] - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if bounds[mid] <= t:
                lo = mid
            else:
                hi = mid
        return lo

    @jit
    def route_body(n, proj, counts, tile, tiles_x, tiles_y, first_tile, bounds, b, plan):
        """Which ranks render Gaussian n of view b: each rank d whose tiles (``bounds[d]`` up to
        ``bounds[d + 1]``, ids over the batch's views; view b's start at ``first_tile``) meet the
        row-major span of n's tile rectangle.  Writes plan[0, d, b, n] = 1 and plan[1, d, b, n] =
        counts[n] (the intersections rank d will bin) for those, 0 for the others."""
        lo = hi = -1
        if counts[n] > 0:
            ext, cov_a, cov_c = footprint(proj[n, U], proj[n, V], proj[n, CA], proj[n, CB], proj[n, CC],
                                          proj[n, OPAC])
            tx0, tx1, ty0, ty1 = geo.tile_rect(proj[n, U], proj[n, V], cov_a, cov_c, ext, tile, tiles_x, tiles_y)
            lo = owner_of(bounds, first_tile + ty0 * tiles_x + tx0)
            hi = owner_of(bounds, first_tile + ty1 * tiles_x + tx1)
        for d in range(plan.shape[1]):
            goes = lo <= d <= hi and bounds[d] < bounds[d + 1]
            plan[0, d, b, n] = 1 if goes else 0
            plan[1, d, b, n] = counts[n] if goes else 0

    @jit
    def route_fill_body(n, proj, counts, b, plan, slot, send, route):
        """Copy Gaussian n of view b into the send rows of each rank it goes to (row ``slot - 1``,
        ``slot`` the running count of ``plan[0]`` flattened): its record, its tile count, and its
        route b * N + n (where its gradient returns)."""
        N = proj.shape[0]
        for d in range(plan.shape[1]):
            if plan[0, d, b, n]:
                k = slot[(d * plan.shape[2] + b) * N + n] - 1
                for f in range(proj.shape[1]):
                    send[k, f] = proj[n, f]
                send[k, proj.shape[1]] = counts[n]
                route[k] = b * N + n

    @jit
    def project_body(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias,
                     tile, tiles_x, tiles_y, proj, radii, counts):
        """Project Gaussian n, evaluate its SH colour, and count the tiles it hits."""
        view = (cam[0], cam[1], cam[2], cam[3], cam[4], cam[5], cam[6], cam[7], cam[8], cam[9], cam[10], cam[11])
        mx = means[n, 0]
        my = means[n, 1]
        mz = means[n, 2]
        ok, u, v, depth, ca, cb, cc, comp, pa, pb, pc = geo.project(
            mx, my, mz, quats[n, 0], quats[n, 1], quats[n, 2], quats[n, 3],
            scales[n, 0], scales[n, 1], scales[n, 2], view, cam[12], cam[13], cam[14], cam[15], W, H, antialias)
        opacity = sigmoid(logits[n]) * comp
        radii[n, 0] = 0
        radii[n, 1] = 0
        counts[n] = 0
        proj[n, OPAC] = f32(0.0)
        if not (ok and opacity > geo.ALPHA_MIN):
            return
        nx, ny, nz, inv = view_direction(n, means, cam)
        b = sh_basis(degree, nx, ny, nz)
        for c in range(3):
            acc = f32(0.5)
            for k in range((degree + 1) * (degree + 1)):
                acc += b[k] * sh[n, k, c]
            proj[n, RED + c] = max(acc, f32(0.0))
        proj[n, U] = u
        proj[n, V] = v
        proj[n, CA] = ca
        proj[n, CB] = cb
        proj[n, CC] = cc
        proj[n, OPAC] = opacity
        proj[n, DEPTH] = depth
        # tile counting reads the stored (rounded) record back, exactly as emission will
        cnt = visit_tiles_body(n, proj, tile, tiles_x, tiles_y, W, H, (0, 0, 0, 0), 0, 0, counts, counts,
                               radii, False, 0, 1)
        if cnt > 0:
            ext, cov_a, cov_c = footprint(proj[n, U], proj[n, V], proj[n, CA], proj[n, CB], proj[n, CC], opacity)
            radii[n, 0] = int(math.ceil(math.sqrt(ext * cov_a)))
            radii[n, 1] = int(math.ceil(math.sqrt(ext * cov_c)))
        counts[n] = cnt


    @jit
    def cull_body(n, means, scales, cam, skip, byte, shift, min_px, sigmas, spare, radii, counts):
        """Hide Gaussian n from a projection (no tiles) where bit (``byte``, ``shift``) of its row of
        ``skip`` is set (an empty ``skip``: no bits) or its ``footprint_px`` is under ``min_px`` and
        ``spare[n]`` is 0 (an empty ``spare``: none spared): binning, rasterization and the
        projection's backward then skip it.  The LOD gate also takes its radius; a view mask leaves
        it, so that the densification statistics count the view (``screen_stats_body``) as a run
        without masks does, where the Gaussian's gradient in it is negligible (the mask's rows add
        under ``view_mask_below`` to it): otherwise a Gaussian's mean gradient would be taken over
        the views where it shows most, and the masks would densify the model more."""
        masked = skip.shape[0] > n and (skip[n, byte] >> shift) & 1 == 1
        gated = False
        if not masked and min_px > f32(0.0) and not (spare.shape[0] > n and spare[n] != 0):
            focal = max(cam[12], cam[13])
            gated = geo.footprint_px(means[n, 0] - cam[16], means[n, 1] - cam[17], means[n, 2] - cam[18],
                                     scales[n, 0], scales[n, 1], scales[n, 2], focal, sigmas) < min_px
        if masked or gated:
            counts[n] = 0
        if gated:
            radii[n, 0] = 0
            radii[n, 1] = 0

    @jit
    def sh_terms(n, means, degree, cam, proj, grad):
        """What Gaussian n's SH backward reads of its view: the basis and its Jacobian in the view
        direction, the coefficients used at ``degree``, and the colour gradient."""
        nx, ny, nz, inv = view_direction(n, means, cam)
        jx, jy, jz = sh_basis_jacobian(degree, nx, ny, nz)
        g0, g1, g2 = colour_grad(n, proj, grad)
        return sh_basis(degree, nx, ny, nz), jx, jy, jz, (degree + 1) * (degree + 1), g0, g1, g2

    @jit
    def direction_gradient(gx, gy, gz, sh, n, e, g0, g1, g2, jx, jy, jz):
        """The view-direction gradient (gx, gy, gz) plus the share of Gaussian n's SH coefficient at
        column e: its colour weighted by the colour gradient, along the basis function's Jacobian."""
        w = g0 * sh[n, e] + g1 * sh[n, e + 1] + g2 * sh[n, e + 2]
        return gx + w * jx, gy + w * jy, gz + w * jz

    @jit
    def sh_backward_body(n, means, sh, degree, cam, proj, counts, grad, d_sh, accumulate):
        """The SH gradients of Gaussian n (``sh`` and ``d_sh`` as (N, K*3) rows, coefficient-major);
        returns the gradient w.r.t. its view direction.  Clamped colour channels (the forward's
        colour is 0) pass no gradient.  (The CUDA kernel splits this work across a block's threads.)"""
        gx = f32(0.0)
        gy = f32(0.0)
        gz = f32(0.0)
        if counts[n] == 0:  # culled: its gradient is zero
            if not accumulate:
                for e in range(d_sh.shape[1]):
                    d_sh[n, e] = 0
            return gx, gy, gz
        b, jx, jy, jz, used, g0, g1, g2 = sh_terms(n, means, degree, cam, proj, grad)
        for k in range(16):  # a constant trip count: unrolled, so b[k] etc. are registers, not lookups
            e = 3 * k
            if k < used:
                gx, gy, gz = direction_gradient(gx, gy, gz, sh, n, e, g0, g1, g2, jx[k], jy[k], jz[k])
                store2(d_sh, n, e, b[k] * g0, accumulate)
                store2(d_sh, n, e + 1, b[k] * g1, accumulate)
                store2(d_sh, n, e + 2, b[k] * g2, accumulate)
            elif e < d_sh.shape[1] and not accumulate:
                d_sh[n, e] = 0
                d_sh[n, e + 1] = 0
                d_sh[n, e + 2] = 0
        return gx, gy, gz

    def geometry_grads(put_logit):
        """``geometry_grads_body`` compiled with ``put_logit(out, n, gradient)``, which takes Gaussian n's
        opacity logit gradient as soon as it is known (stored, or applied), so that it is not held
        through the rest."""
        @jit
        def geometry_grads_body(n, means, quats, scales, logits, cam, W, H, antialias, grad, gx, gy, gz, out):
            """Gaussian n's gradients from its screen-space gradient record and (gx, gy, gz), the gradient
            w.r.t. its view direction (``sh_backward_body``), for a Gaussian that is drawn (tiles): its
            opacity logit's to ``put_logit(out, n, .)``; -> (mean x, y, z; rotation w, x, y, z; log-scale
            x, y, z)."""
            view = (cam[0], cam[1], cam[2], cam[3], cam[4], cam[5], cam[6], cam[7], cam[8], cam[9], cam[10],
                    cam[11])
            mx = means[n, 0]
            my = means[n, 1]
            mz = means[n, 2]
            qw = quats[n, 0]
            qx = quats[n, 1]
            qy = quats[n, 2]
            qz = quats[n, 3]
            ok, u, v, depth, ca, cb, cc, comp, pa, pb, pc = geo.project(
                mx, my, mz, qw, qx, qy, qz, scales[n, 0], scales[n, 1], scales[n, 2],
                view, cam[12], cam[13], cam[14], cam[15], W, H, antialias)
            s = sigmoid(logits[n])
            d_opac = grad[n, OPAC]
            put_logit(out, n, d_opac * comp * s * (f32(1.0) - s))
            dmx, dmy, dmz, dqw, dqx, dqy, dqz, dl0, dl1, dl2 = geo.project_vjp(
                mx, my, mz, qw, qx, qy, qz, scales[n, 0], scales[n, 1], scales[n, 2],
                view, cam[12], cam[13], cam[14], cam[15], W, H, antialias,
                grad[n, U], grad[n, V], grad[n, DEPTH], grad[n, CA], grad[n, CB], grad[n, CC], d_opac * s)
            # the colour's view-direction term: through the normalisation of (mean - camera centre)
            nx, ny, nz, inv = view_direction(n, means, cam)
            dot = nx * gx + ny * gy + nz * gz
            return (dmx + (gx - nx * dot) * inv, dmy + (gy - ny * dot) * inv, dmz + (gz - nz * dot) * inv,
                    dqw, dqx, dqy, dqz, dl0, dl1, dl2)
        return geometry_grads_body

    @jit
    def store_logit(out, n, g):
        """``geometry_grads``' logit gradient into out = (d_logits, accumulate)."""
        store1(out[0], n, g, out[1])

    geometry_grads_stored = geometry_grads(store_logit)

    @jit
    def geometry_backward_body(n, means, quats, scales, logits, cam, W, H, antialias, counts, grad, gx, gy, gz,
                               d_means, d_quats, d_scales, d_logits, accumulate):
        """Gaussian n's mean, rotation, scale and opacity gradients (``geometry_grads``), written over
        the outputs, or added to them (``accumulate``)."""
        if counts[n] == 0:  # culled: its gradient is zero
            if not accumulate:
                for j in range(3):
                    d_means[n, j] = 0
                    d_scales[n, j] = 0
                for j in range(4):
                    d_quats[n, j] = 0
                d_logits[n] = 0
            return
        d = geometry_grads_stored(n, means, quats, scales, logits, cam, W, H, antialias, grad, gx, gy, gz,
                                  (d_logits, accumulate))
        store2(d_means, n, 0, d[0], accumulate)
        store2(d_means, n, 1, d[1], accumulate)
        store2(d_means, n, 2, d[2], accumulate)
        store2(d_quats, n, 0, d[3], accumulate)
        store2(d_quats, n, 1, d[4], accumulate)
        store2(d_quats, n, 2, d[5], accumulate)
        store2(d_quats, n, 3, d[6], accumulate)
        store2(d_scales, n, 0, d[7], accumulate)
        store2(d_scales, n, 1, d[8], accumulate)
        store2(d_scales, n, 2, d[9], accumulate)

    # ---- the projection backward with Adam's update fused (``rendering.project_backward_adam``): each
    # gradient goes into its parameter's update (``numbasplat.math.adam``) instead of a gradient buffer.
    # ``hyper``: (b1, b2, eps, bias correction 1, bias correction 2) of the step.

    @jit
    def adam_put(a, m, v, n, j, p, mo, vo, g, lr, hyper):
        """Adam's update of a[n, j] (moments m[n, j], v[n, j]; their values p, mo, vo loaded before) by the
        gradient g at rate lr."""
        a[n, j], m[n, j], v[n, j] = adam_update(p, g, mo, vo, lr, hyper[0], hyper[1], hyper[2], hyper[3], hyper[4])

    @jit
    def adam_row3(a, m, v, n, g0, g1, g2, lr, hyper):
        """Adam's update of row n of a group 3 wide: every load before the first store (the compiler
        cannot move a load past a store that may alias it, so interleaved they would wait on each other)."""
        p0, p1, p2 = a[n, 0], a[n, 1], a[n, 2]
        m0, m1, m2 = m[n, 0], m[n, 1], m[n, 2]
        v0, v1, v2 = v[n, 0], v[n, 1], v[n, 2]
        adam_put(a, m, v, n, 0, p0, m0, v0, g0, lr[0], hyper)
        adam_put(a, m, v, n, 1, p1, m1, v1, g1, lr[1], hyper)
        adam_put(a, m, v, n, 2, p2, m2, v2, g2, lr[2], hyper)

    @jit
    def adam_row4(a, m, v, n, g0, g1, g2, g3, lr, hyper):
        """``adam_row3`` of a group 4 wide."""
        p0, p1, p2, p3 = a[n, 0], a[n, 1], a[n, 2], a[n, 3]
        m0, m1, m2, m3 = m[n, 0], m[n, 1], m[n, 2], m[n, 3]
        v0, v1, v2, v3 = v[n, 0], v[n, 1], v[n, 2], v[n, 3]
        adam_put(a, m, v, n, 0, p0, m0, v0, g0, lr[0], hyper)
        adam_put(a, m, v, n, 1, p1, m1, v1, g1, lr[1], hyper)
        adam_put(a, m, v, n, 2, p2, m2, v2, g2, lr[2], hyper)
        adam_put(a, m, v, n, 3, p3, m3, v3, g3, lr[3], hyper)

    @jit
    def adam_one(a, m, v, n, g, lr, hyper):
        """Adam's update of a[n] (a group 1 wide)."""
        a[n], m[n], v[n] = adam_update(a[n], g, m[n], v[n], lr[0], hyper[0], hyper[1], hyper[2], hyper[3], hyper[4])

    @jit
    def adam_logit(out, n, g):
        """``geometry_grads``' logit gradient applied by Adam: out = (logits, m, v, rates, hyper)."""
        adam_one(out[0], out[1], out[2], n, g, out[3], out[4])

    geometry_grads_applied = geometry_grads(adam_logit)

    @jit
    def geometry_adam_body(n, means, quats, scales, logits, cam, W, H, antialias, counts, grad, gx, gy, gz,
                           m_means, m_quats, m_scales, m_logits, v_means, v_quats, v_scales, v_logits,
                           lr_means, lr_quats, lr_scales, lr_logits, hyper, visible):
        """``geometry_backward_body``'s gradients applied by Adam to Gaussian n's mean, rotation, scale
        and opacity (and their moments ``m_*``, ``v_*``; ``lr_*`` each group's per-column rates); a
        Gaussian that is not drawn has gradient 0, and with ``visible`` keeps its state."""
        if counts[n] == 0:
            if not visible:
                z = f32(0.0)
                adam_one(logits, m_logits, v_logits, n, z, lr_logits, hyper)
                adam_row3(means, m_means, v_means, n, z, z, z, lr_means, hyper)
                adam_row4(quats, m_quats, v_quats, n, z, z, z, z, lr_quats, hyper)
                adam_row3(scales, m_scales, v_scales, n, z, z, z, lr_scales, hyper)
            return
        d = geometry_grads_applied(n, means, quats, scales, logits, cam, W, H, antialias, grad, gx, gy, gz,
                                   (logits, m_logits, v_logits, lr_logits, hyper))
        adam_row3(means, m_means, v_means, n, d[0], d[1], d[2], lr_means, hyper)
        adam_row4(quats, m_quats, v_quats, n, d[3], d[4], d[5], d[6], lr_quats, hyper)
        adam_row3(scales, m_scales, v_scales, n, d[7], d[8], d[9], lr_scales, hyper)

    @jit
    def sh_adam_body(n, means, sh, degree, cam, proj, counts, grad, m_sh, v_sh, lr_sh, hyper, visible):
        """``sh_backward_body``'s gradients applied by Adam to Gaussian n's SH coefficients (``sh``,
        ``m_sh``, ``v_sh`` as (N, K*3) rows; ``lr_sh`` their per-column rates), each coefficient read
        for the view-direction gradient before it is updated; -> that gradient.  A Gaussian that is
        not drawn has gradient 0, and with ``visible`` keeps its state."""
        gx = f32(0.0)
        gy = f32(0.0)
        gz = f32(0.0)
        z = f32(0.0)
        if counts[n] == 0:
            if not visible:
                for e in range(sh.shape[1]):
                    adam_put(sh, m_sh, v_sh, n, e, sh[n, e], m_sh[n, e], v_sh[n, e], z, lr_sh[e], hyper)
            return gx, gy, gz
        b, jx, jy, jz, used, g0, g1, g2 = sh_terms(n, means, degree, cam, proj, grad)
        for k in range(16):  # (as in sh_backward_body)
            e = 3 * k
            if k < used:
                gx, gy, gz = direction_gradient(gx, gy, gz, sh, n, e, g0, g1, g2, jx[k], jy[k], jz[k])
                for c in range(3):
                    adam_put(sh, m_sh, v_sh, n, e + c, sh[n, e + c], m_sh[n, e + c], v_sh[n, e + c],
                             b[k] * (g0 if c == 0 else g1 if c == 1 else g2), lr_sh[e + c], hyper)
            elif e < sh.shape[1]:
                for c in range(3):
                    adam_put(sh, m_sh, v_sh, n, e + c, sh[n, e + c], m_sh[n, e + c], v_sh[n, e + c], z,
                             lr_sh[e + c], hyper)
        return gx, gy, gz

    @jit
    def project_backward_adam_body(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts,
                                   grad, m_means, m_quats, m_scales, m_logits, m_sh, v_means, v_quats, v_scales,
                                   v_logits, v_sh, lr_means, lr_quats, lr_scales, lr_logits, lr_sh, hyper, visible):
        """``project_backward_body``'s gradients of Gaussian n applied by Adam to its parameters and
        moments (``sh_adam_body``, ``geometry_adam_body``)."""
        gx, gy, gz = sh_adam_body(n, means, sh, degree, cam, proj, counts, grad, m_sh, v_sh, lr_sh, hyper, visible)
        geometry_adam_body(n, means, quats, scales, logits, cam, W, H, antialias, counts, grad, gx, gy, gz,
                           m_means, m_quats, m_scales, m_logits, v_means, v_quats, v_scales, v_logits,
                           lr_means, lr_quats, lr_scales, lr_logits, hyper, visible)

    @jit
    def project_backward_body(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad,
                              d_means, d_quats, d_scales, d_logits, d_sh, accumulate):
        """Gaussian n's parameter gradients, from its screen-space gradient record (and its
        projected record, for the colour clamp): added to the outputs, or written over them
        (``accumulate`` False: no separate zeroing pass over the gradient buffers)."""
        gx, gy, gz = sh_backward_body(n, means, sh, degree, cam, proj, counts, grad, d_sh, accumulate)
        geometry_backward_body(n, means, quats, scales, logits, cam, W, H, antialias, counts, grad, gx, gy, gz,
                               d_means, d_quats, d_scales, d_logits, accumulate)

    return SimpleNamespace(visit_tiles=visit_tiles_body, depth_key=depth_key_body, emit=emit_body,
                           range_from_count=range_from_count_body, screen_stats=screen_stats_body,
                           project=project_body, cull=cull_body, route=route_body,
                           route_fill=route_fill_body,
                           project_backward=project_backward_body,
                           view_direction=view_direction, colour_grad=colour_grad,
                           geometry_backward=geometry_backward_body,
                           project_backward_adam=project_backward_adam_body, geometry_adam=geometry_adam_body,
                           adam_put=adam_put)
