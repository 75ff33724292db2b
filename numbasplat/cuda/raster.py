"""The rasterizer's CUDA kernels (float32): per Gaussian, then per tile.

Per-Gaussian kernels run the bodies of ``numbasplat.math.gaussian_ops`` one thread per
Gaussian (projection, binning, routing, and the projection's backward in two kernels: the SH
gradients with coalesced row access, then the geometry; both also with Adam's update of the
parameters in place of writing their gradients, ``project_backward_adam``).  The raster kernels
run one 16x16 thread block per tile and stream the tile's depth-sorted Gaussians through shared
memory in batches of ``BLOCK``, built on the per-tile device functions of ``tile`` (shared with the
fused kernel); so does the contributions kernel (each pixel's dominant Gaussian, for pruning).
The raster backward is compiled twice from one source: adding gradients with float atomics, and
(``--deterministic``) into a slot per intersection and warp, summed per Gaussian in a fixed order
(``_raster_backward``, ``_slot_sum_kernel``).
The entry points below take the same arguments as ``numbasplat.cpu``'s.
"""
import numpy as np
from numba import cuda, float32, int32

from ..math import gaussian_ops as go
from ..math.blend import blend_step, dominant_step, load_behind, load_front, store_behind, store_front, store_pixel
from ..math.jit import SIM
from ..math.sh import sh_basis, sh_basis_jacobian
from ..math.tiles import TILE, tile_grid
from .launch import F1, F2, F3, I1, I2, L1, THREADS, U1, array_module, kernel, per_item
from .tile import (BLOCK, NF, NG, ONE, RED_ROWS, WARPS, ZERO, add_over_warp, backward_hit, chunk_hits,
                   composite_chunks, field, flat_records, next_hit, pixel_of_tile, record_alpha, record_reaches,
                   warp_all)

BATCH_WORDS = BLOCK * NF    # a batch of records in shared memory (a constant, as Numba needs)


@cuda.jit(device=True, inline=True)
def _count_tile(tally, key):
    """An emitted intersection added to its tile's count (the end column of row ``key``): other threads
    emit into the same tiles, so an atomic add, whose value goes unused (a reduction the threads do not
    wait on)."""
    cuda.atomic.add(tally, (key, 1), 1)


_ops = go.build(cuda.jit(device=True), count_tile=_count_tile)
project_one, cull_one = _ops.project, _ops.cull
depth_key_one, emit_one, range_from_count_one = _ops.depth_key, _ops.emit, _ops.range_from_count
screen_stats_one = _ops.screen_stats
geometry_backward_one, geometry_adam_one, adam_put = _ops.geometry_backward, _ops.geometry_adam, _ops.adam_put
view_direction, colour_grad = _ops.view_direction, _ops.colour_grad
route_one, route_fill_one = _ops.route, _ops.route_fill
_store_pixel = cuda.jit(device=True, inline=True)(store_pixel)
_load_front, _store_front, _load_behind, _store_behind = (cuda.jit(device=True, inline=True)(f) for f in (
    load_front, store_front, load_behind, store_behind))


# --------------------------------------------------------------------------- per Gaussian

@kernel(F2, F2, F2, F1, F3, "int64", F1, "int64", "int64", "boolean", "int64", "int64", "int64", F2, I2, I1)
def _project_kernel(means, quats, scales, logits, sh, degree, cam, W, H, antialias, tile, tiles_x, tiles_y,
                    proj, radii, counts):
    n = cuda.grid(1)
    if n < means.shape[0]:
        project_one(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias, tile, tiles_x, tiles_y,
                    proj, radii, counts)


@kernel(F2, F2, F1, "uint8[:, ::1]", "int64", "int64", "float32", "float32", "uint8[::1]", I2, I1)
def _cull_kernel(means, scales, cam, skip, byte, shift, min_px, sigmas, spare, radii, counts):
    n = cuda.grid(1)
    if n < means.shape[0]:
        cull_one(n, means, scales, cam, skip, byte, shift, min_px, sigmas, spare, radii, counts)


def cull(means, scales, cam, skip, byte, shift, min_px, sigmas, spare, radii, counts):
    _cull_kernel[per_item(means.shape[0])](means, scales, cam, skip, byte, shift, min_px, sigmas, spare, radii,
                                           counts)


@kernel(F2, I1, F1)
def _depth_key_kernel(proj, counts, keys):
    n = cuda.grid(1)
    if n < proj.shape[0]:
        depth_key_one(n, proj, counts, keys)


EMIT_WIDE = 16  # a Gaussian over this many tiles or more is emitted by its whole warp
EMIT_RUN = 4    # Gaussians consecutive in depth order that a warp's lanes take together (32 / EMIT_RUN runs)
U16 = "uint16[::1]"  # the sort keys where the tiles fit 16 bits


def _emit(key_type):
    """The emission kernel, writing its sort keys as ``key_type`` (uint32, or uint16 where the keys fit:
    the tiles' sort then takes them as they are, with no copy into a narrower type)."""
    def kernel_fn(proj, order, counts, ends, tile, tiles_x, tiles_y, W, H, view_of, keep_from, keep_to, pad, room,
                  tile_ids, ids, tally, overflow):
        """A thread per Gaussian, except that a warp emits its wide Gaussians (EMIT_WIDE tiles or more)
        together, one at a time, its lanes writing consecutive slots of each tile row: one thread over
        thousands of tiles would hold its warp (and its block) that long, with stores to 32 scattered
        places per instruction.  No shuffles: the wide ones' indices go through shared memory (a block
        barrier, which the simulator has and every thread reaches).

        A warp takes 32 / EMIT_RUN runs of EMIT_RUN Gaussians consecutive in depth order, spread over
        the order (run a of warp w is the run a * warps + w), not 32 consecutive ones: the wide ones
        cluster in depth order (the near ones), and a warp that took a cluster would emit them one
        after another while the rest of the grid had finished; within a run, lanes write neighbouring
        slots.  Slots come from ``ends``, so which thread takes a Gaussian changes no output.

        Each intersection is also counted into its tile's row of ``tally`` (``_count_tile``), from
        which ``ranges_from_counts`` makes the tiles' ranges.  Counting here rather than in a histogram
        pass over the emitted keys costs no launch and no second read of the keys; the atomic adds go
        to a small array that stays in L2, need no reply, and rarely collide: a warp's lanes emit
        different Gaussians, each at its own place in its run of tiles, and the lanes sharing a wide
        Gaussian write neighbouring tiles."""
        wide = cuda.shared.array(THREADS, int32)
        t = cuda.threadIdx.x
        lane = t % 32
        warp = cuda.grid(1) // 32
        warps = (order.shape[0] + 31) // 32
        k = ((lane // EMIT_RUN) * warps + warp) * EMIT_RUN + lane % EMIT_RUN if warp < warps else order.shape[0]
        wide[t] = -1
        if k < order.shape[0]:
            if counts[order[k]] >= EMIT_WIDE:
                wide[t] = k
            else:
                emit_one(k, proj, order, counts, ends, tile, tiles_x, tiles_y, W, H, view_of, keep_from, keep_to, pad,
                         room, tile_ids, ids, tally, overflow, 0, 1)
        cuda.syncthreads()
        for j in range(t - lane, t - lane + 32):
            if wide[j] >= 0:  # the same for every lane of the warp
                emit_one(wide[j], proj, order, counts, ends, tile, tiles_x, tiles_y, W, H, view_of, keep_from, keep_to,
                         pad, room, tile_ids, ids, tally, overflow, lane, 32)

    name = "_emit_kernel" if key_type == U1 else "_emit_u16_kernel"
    kernel_fn.__name__ = kernel_fn.__qualname__ = name  # (its PTX cache key and its KERNELS entry)
    return kernel(F2, L1, I1, L1, "int64", "int64", "int64", "int64", "int64", I1, "int64", "int64", "int64", "int64",
                  key_type, I1, I2, I1)(kernel_fn)


_emit_kernel = _emit(U1)
_emit_u16_kernel = _emit(U16)

SCAN_THREADS = 1024  # the one block that turns the tiles' counts into their ranges


@kernel(I2)
def _ranges_from_counts_kernel(ranges):
    """Each tile's [start, end) from its count in the end column of its row (``range_from_count_body``),
    in one block: each thread sums the counts of a contiguous run of tiles, the block scans those sums
    in shared memory (each thread's start: the counts of the runs before it), then each thread walks its
    run again writing the ranges.  The tiles are few enough that one block takes them in one launch."""
    sums = cuda.shared.array(SCAN_THREADS, int32)
    t = cuda.threadIdx.x
    threads = cuda.blockDim.x
    per = (ranges.shape[0] + threads - 1) // threads
    lo = min(t * per, ranges.shape[0])
    hi = min(lo + per, ranges.shape[0])
    own = 0
    for r in range(lo, hi):
        own += ranges[r, 1]
    sums[t] = own
    cuda.syncthreads()
    step = 1
    while step < threads:  # (Hillis-Steele: inclusive sums)
        before = sums[t - step] if t >= step else 0
        cuda.syncthreads()
        sums[t] += before
        cuda.syncthreads()
        step *= 2
    start = sums[t] - own
    for r in range(lo, hi):
        start += range_from_count_one(r, start, ranges)


@kernel(F2, I1, I2, "int64", "int64", "float32", "float32", I1, F1, I1, F1)
def _screen_stats_kernel(grad, counts, radii, col_u, col_v, sx, sy, skip, sums, seen, max_radius):
    n = cuda.grid(1)
    if n < grad.shape[0]:
        screen_stats_one(n, grad, counts, radii, col_u, col_v, sx, sy, skip, sums, seen, max_radius)


def screen_stats(grad, counts, radii, col_u, col_v, sx, sy, skip, sums, seen, max_radius):
    _screen_stats_kernel[per_item(grad.shape[0])](grad, counts, radii, col_u, col_v, sx, sy, skip, sums, seen,
                                                  max_radius)


SH_BLOCK = 128  # Gaussians per block of the SH backward kernel
SH_PAD = 17     # shared row of 16 per-coefficient values plus a pad word (an odd stride: no bank conflicts)
SH_ROUNDS = 2   # SH_BLOCK Gaussians x up to 16 coefficients = 16 (Gaussian, coefficient) items per thread,
SH_ILP = 8      # taken 8 at a time: their 24 loads issued together, so enough bytes are in flight


@cuda.jit(device=True, inline=True)
def _first_item(width):
    """This thread's first (Gaussian, coefficient) item of the block, and the step to its next:
    the block walks the items in memory order, SH_BLOCK at a time, so each warp access covers
    whole cache lines."""
    t = int32(cuda.threadIdx.x)
    g = t // width
    step_g = int32(SH_BLOCK) // width
    return g, t - g * width, step_g, int32(SH_BLOCK) - step_g * width


@cuda.jit(device=True, inline=True)
def _next_item(g, k, step_g, step_k, width):
    g += step_g
    k += step_k
    if k >= width:
        k -= width
        g += 1
    return g, k


def _sh_backward(fused):
    """The SH backward kernel; ``fused`` (a constant of its compilation, so the kernel without it
    has no trace of it): Adam's update of each coefficient (and its moments ``m_sh``, ``v_sh``; rates
    ``lr_sh``) in place of writing its gradient to ``d_sh`` (unread), none where skip[0] is set, and
    with ``visible`` none of the Gaussians not drawn; without ``fused`` those arguments are unread."""
    def kernel_fn(means, sh, degree, cam, proj, counts, grad, d_sh, d_dir, accumulate, m_sh, v_sh, lr_sh, visible,
                  skip, b1, b2, eps, corrections):
        """The SH gradients of a block of Gaussians in three phases, so that their 192-byte SH rows
        are read and written coalesced (a thread per Gaussian would touch 32 cache lines per access):
        1. a thread per Gaussian: basis and clamp-gated colour gradient, into shared memory;
        2. a thread per (Gaussian, coefficient) item, in memory order: the coefficient's weight in
           the view-direction gradient (reads ``sh``), then, once every thread's reads are done,
           d_sh = basis * colour gradient (writes, which may go over ``sh``; fused: the coefficient's
           Adam update);
        3. a thread per Gaussian: the view-direction gradient from those weights."""
        basis = cuda.shared.array((SH_BLOCK, SH_PAD), float32)
        weight = cuda.shared.array((SH_BLOCK, SH_PAD), float32)
        dcol = cuda.shared.array((SH_BLOCK, 3), float32)
        live = cuda.shared.array(SH_BLOCK, int32)
        if fused and skip[0] != 0:  # (the same for every thread: no barrier is left waiting)
            return
        first = cuda.blockIdx.x * SH_BLOCK
        n_here = min(SH_BLOCK, means.shape[0] - first)
        t = cuda.threadIdx.x
        used = int32((degree + 1) * (degree + 1))
        if t < n_here:
            n = first + t
            live[t] = counts[n] > 0
            if live[t]:
                nx, ny, nz, inv = view_direction(n, means, cam)
                b = sh_basis(degree, nx, ny, nz)
                for k in range(16):
                    basis[t, k] = b[k]
                dcol[t, 0], dcol[t, 1], dcol[t, 2] = colour_grad(n, proj, grad)
        cuda.syncthreads()
        c0 = cuda.local.array(SH_ILP, float32)
        c1 = cuda.local.array(SH_ILP, float32)
        c2 = cuda.local.array(SH_ILP, float32)
        gs = cuda.local.array(SH_ILP, int32)
        ks = cuda.local.array(SH_ILP, int32)
        g, k, step_g, step_k = _first_item(used)
        for r in range(SH_ROUNDS):
            for j in range(SH_ILP):  # constant trip counts: unrolled, the loads independent
                gs[j] = g
                ks[j] = k
                if g < n_here and live[g]:
                    e = 3 * k
                    c0[j] = sh[first + g, e]
                    c1[j] = sh[first + g, e + 1]
                    c2[j] = sh[first + g, e + 2]
                g, k = _next_item(g, k, step_g, step_k, used)
            for j in range(SH_ILP):
                q = gs[j]
                if q < n_here and live[q]:
                    weight[q, ks[j]] = dcol[q, 0] * c0[j] + dcol[q, 1] * c1[j] + dcol[q, 2] * c2[j]
        cuda.syncthreads()  # every coefficient read for the weights before any is written over: updated (fused),
        # or its gradient written where ``d_sh`` is ``sh`` itself (``project_backward_over_params``)
        width = int32(sh.shape[1] // 3)  # coefficients stored, maybe more than used: those get zeros
        g, k, step_g, step_k = _first_item(width)
        while g < n_here:
            if fused:
                if live[g] or not visible:
                    _adam_coefficient(sh, m_sh, v_sh, lr_sh, first + g, 3 * k, live[g] != 0 and k < used, basis[g, k],
                                      dcol, g, (b1, b2, eps, corrections[0], corrections[1]))
            elif live[g] or not accumulate:
                e = 3 * k
                for c in range(3):
                    v = basis[g, k] * dcol[g, c] if live[g] and k < used else ZERO
                    if accumulate:
                        v += d_sh[first + g, e + c]
                    d_sh[first + g, e + c] = v
            g, k = _next_item(g, k, step_g, step_k, width)
        cuda.syncthreads()
        if t < n_here:
            n = first + t
            gx = gy = gz = ZERO
            if live[t]:
                nx, ny, nz, inv = view_direction(n, means, cam)
                jx, jy, jz = sh_basis_jacobian(degree, nx, ny, nz)
                for k in range(16):
                    if k < used:
                        w = weight[t, k]
                        gx += w * jx[k]
                        gy += w * jy[k]
                        gz += w * jz[k]
            d_dir[n, 0] = gx
            d_dir[n, 1] = gy
            d_dir[n, 2] = gz

    name = "_sh_adam_kernel" if fused else "_sh_backward_kernel"
    kernel_fn.__name__ = kernel_fn.__qualname__ = name  # (its PTX cache key and its KERNELS entry)
    return kernel(F2, F2, "int64", F1, F2, I1, F2, F2, F2, "boolean", F2, F2, F1, "boolean", I1,
                  "float32", "float32", "float32", F1)(kernel_fn)


@cuda.jit(device=True, inline=True)
def _adam_coefficient(sh, m_sh, v_sh, lr_sh, n, e, drawn, basis, dcol, g, hyper):
    """Adam's update of the 3 colour channels of one SH coefficient of Gaussian n (its columns e, e + 1,
    e + 2), its gradient basis * colour gradient (row g of ``dcol``) where ``drawn``, else 0: the nine
    loads first (a load cannot pass a store that may alias it)."""
    p0, p1, p2 = sh[n, e], sh[n, e + 1], sh[n, e + 2]
    m0, m1, m2 = m_sh[n, e], m_sh[n, e + 1], m_sh[n, e + 2]
    v0, v1, v2 = v_sh[n, e], v_sh[n, e + 1], v_sh[n, e + 2]
    adam_put(sh, m_sh, v_sh, n, e, p0, m0, v0, basis * dcol[g, 0] if drawn else ZERO, lr_sh[e], hyper)
    adam_put(sh, m_sh, v_sh, n, e + 1, p1, m1, v1, basis * dcol[g, 1] if drawn else ZERO, lr_sh[e + 1], hyper)
    adam_put(sh, m_sh, v_sh, n, e + 2, p2, m2, v2, basis * dcol[g, 2] if drawn else ZERO, lr_sh[e + 2], hyper)


_sh_backward_kernel = _sh_backward(False)
_sh_adam_kernel = _sh_backward(True)


@kernel(F2, F2, F2, F1, F1, "int64", "int64", "boolean", I1, F2, F2, F2, F2, F2, F1, "boolean",
        max_registers=80)  # 93 otherwise: 2 blocks per SM instead of 3
def _geometry_backward_kernel(means, quats, scales, logits, cam, W, H, antialias, counts, grad, d_dir,
                              d_means, d_quats, d_scales, d_logits, accumulate):
    n = cuda.grid(1)
    if n < means.shape[0]:
        geometry_backward_one(n, means, quats, scales, logits, cam, W, H, antialias, counts, grad,
                              d_dir[n, 0], d_dir[n, 1], d_dir[n, 2], d_means, d_quats, d_scales, d_logits, accumulate)


@kernel(F2, F2, F2, F1, F1, "int64", "int64", "boolean", I1, F2, F2, F2, F2, F2, F1, F2, F2, F2, F1,
        F1, F1, F1, F1, "boolean", I1, "float32", "float32", "float32", F1, max_registers=80)
def _geometry_adam_kernel(means, quats, scales, logits, cam, W, H, antialias, counts, grad, d_dir,
                          m_means, m_quats, m_scales, m_logits, v_means, v_quats, v_scales, v_logits,
                          lr_means, lr_quats, lr_scales, lr_logits, visible, skip, b1, b2, eps, corrections):
    """``_geometry_backward_kernel``'s gradients applied by Adam to each Gaussian's mean, rotation,
    scale and opacity and their moments (``geometry_adam_body``), none where skip[0] is set."""
    n = cuda.grid(1)
    if n < means.shape[0] and skip[0] == 0:
        geometry_adam_one(n, means, quats, scales, logits, cam, W, H, antialias, counts, grad,
                          d_dir[n, 0], d_dir[n, 1], d_dir[n, 2], m_means, m_quats, m_scales, m_logits,
                          v_means, v_quats, v_scales, v_logits, lr_means, lr_quats, lr_scales, lr_logits,
                          (b1, b2, eps, corrections[0], corrections[1]), visible)


@kernel(F2, I1, "int64", "int64", "int64", "int64", "int64[::1]", "int64", "int32[:, :, :, ::1]")
def _route_kernel(proj, counts, tile, tiles_x, tiles_y, first_tile, bounds, b, plan):
    n = cuda.grid(1)
    if n < proj.shape[0]:
        route_one(n, proj, counts, tile, tiles_x, tiles_y, first_tile, bounds, b, plan)


@kernel(F2, I1, "int64", "int32[:, :, :, ::1]", "int64[::1]", F2, "int64[::1]")
def _route_fill_kernel(proj, counts, b, plan, slot, send, route):
    n = cuda.grid(1)
    if n < proj.shape[0]:
        route_fill_one(n, proj, counts, b, plan, slot, send, route)


def route(proj, counts, tile, tiles_x, tiles_y, first_tile, bounds, b, plan):
    _route_kernel[per_item(proj.shape[0])](proj, counts, tile, tiles_x, tiles_y, first_tile, bounds, b, plan)


def route_fill(proj, counts, b, plan, slot, send, route):
    _route_fill_kernel[per_item(proj.shape[0])](proj, counts, b, plan, slot, send, route)


def project(means, quats, scales, logits, sh, degree, cam, W, H, antialias, tile, tiles_x, tiles_y,
            proj, radii, counts):
    _project_kernel[per_item(means.shape[0])](means, quats, scales, logits, sh, degree, cam, W, H, antialias,
                                              tile, tiles_x, tiles_y, proj, radii, counts)


def depth_keys(proj, counts, keys):
    _depth_key_kernel[per_item(proj.shape[0])](proj, counts, keys)


def emit_intersections(proj, order, counts, ends, tile, tiles_x, tiles_y, W, H, view_of, keep_from, keep_to, pad,
                       room, tile_ids, ids, tally, overflow):
    k = _emit_u16_kernel if tile_ids.dtype == np.uint16 else _emit_kernel
    k[per_item(order.shape[0])](proj, order, counts, ends, tile, tiles_x, tiles_y, W, H, view_of, keep_from, keep_to,
                                pad, room, tile_ids, ids, tally, overflow)


def ranges_from_counts(ranges):
    threads = min(SCAN_THREADS, max(32, -(-ranges.shape[0] // 32) * 32))  # (a small grid of tiles: fewer)
    _ranges_from_counts_kernel[1, threads](ranges)


def project_backward(means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad,
                     d_means, d_quats, d_scales, d_logits, d_sh, accumulate):
    n = means.shape[0]
    d_dir = array_module().empty((n, 3), np.float32)
    m, v, lr, skip, corrections = _no_adam()
    _sh_backward_kernel[(n + SH_BLOCK - 1) // SH_BLOCK, SH_BLOCK](means, sh, degree, cam, proj, counts, grad,
                                                                   d_sh, d_dir, accumulate, m, v, lr, False,
                                                                   skip, ZERO, ZERO, ZERO, corrections)
    _geometry_backward_kernel[per_item(n)](means, quats, scales, logits, cam, W, H, antialias, counts, grad,
                                           d_dir, d_means, d_quats, d_scales, d_logits, accumulate)


def project_backward_over_params(means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad):
    """``project_backward`` with each Gaussian's gradients written over its parameters (the arguments of
    ``numbasplat.cpu.project_backward_over_params``): the SH kernel reads every coefficient of its block
    before a barrier and writes their gradients after it, and the geometry kernel, which runs after it (the
    SH kernel reads the means too), reads a Gaussian's parameters in its thread before writing their
    gradients.  In the simulator, which copies each numpy argument in and back out on its own, the
    parameters go in uncopied, so that a parameter and its gradient are one memory there too."""
    means, quats, scales, logits, sh = (_uncopied(a) for a in (means, quats, scales, logits, sh))
    project_backward(means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad,
                     means, quats, scales, logits, sh, False)


def _uncopied(a):
    """``a`` as a launch's argument that the simulator does not copy (its memory itself); itself on a GPU."""
    if not SIM:
        return a
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    return FakeCUDAArray(a)


def project_backward_adam(means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad,
                          m_means, m_quats, m_scales, m_logits, m_sh, v_means, v_quats, v_scales, v_logits, v_sh,
                          lr_means, lr_quats, lr_scales, lr_logits, lr_sh, visible, skip, b1, b2, eps, corrections):
    """``project_backward`` with Adam's update in place of writing the gradients (the arguments of
    ``numbasplat.cpu.project_backward_adam``): the same two launches, the SH kernel updating the sh
    group, the geometry kernel the others."""
    n = means.shape[0]
    d_dir = array_module().empty((n, 3), np.float32)
    no_d_sh = _no_adam()[0]
    _sh_adam_kernel[(n + SH_BLOCK - 1) // SH_BLOCK, SH_BLOCK](means, sh, degree, cam, proj, counts, grad, no_d_sh,
                                                               d_dir, False, m_sh, v_sh, lr_sh, visible, skip, b1, b2,
                                                               eps, corrections)
    _geometry_adam_kernel[per_item(n)](means, quats, scales, logits, cam, W, H, antialias, counts, grad, d_dir,
                                       m_means, m_quats, m_scales, m_logits, v_means, v_quats, v_scales, v_logits,
                                       lr_means, lr_quats, lr_scales, lr_logits, visible, skip, b1, b2, eps,
                                       corrections)


_NO_ADAM = {}


def _no_adam():
    """The (unread) Adam arguments of the SH backward kernel without ``fused``: moments, rates, skip flag,
    bias corrections; the first also its ``d_sh`` with ``fused``.  Arrays of their own, none the
    kernel's others: the simulator copies each array argument back after a launch, so one passed
    twice would come back as one of its copies."""
    xp = array_module()
    if xp not in _NO_ADAM:
        _NO_ADAM[xp] = (xp.zeros((1, 3), np.float32), xp.zeros((1, 3), np.float32), xp.zeros(1, np.float32),
                        xp.zeros(1, np.int32), xp.ones(2, np.float32))
    return _NO_ADAM[xp]


# --------------------------------------------------------------------------- per tile

@cuda.jit(device=True, inline=True)
def _tile_pixel(ranges, tiles_x, W, H, first_tile):
    """``pixel_of_tile`` of the block's tile (a 2D grid of tiles, its first row the one of the
    row-major tile ``first_tile``)."""
    return pixel_of_tile(first_tile + cuda.blockIdx.y * tiles_x + cuda.blockIdx.x, ranges, tiles_x, W, H)


@cuda.jit(device=True, inline=True)
def _load(proj, ids, i, rec, rid, slot):
    g = ids[i]
    rid[slot] = g
    for f in range(NF):
        rec[field(slot, f, NF)] = proj[g, f]


def _raster_forward(carry):
    """The raster forward kernel; ``carry`` (a constant of its compilation, so the kernel without it
    has no trace of it): each pixel starts from its state in ``state`` ((FRONT_FIELDS, H, W): the
    chunks of the view in front, ``blend.load_front``) instead of an empty pixel, and leaves its
    state there for the next chunk."""
    def kernel_fn(proj, ids, ranges, W, H, tiles_x, bg, image, trans, depth, last, state, first_tile):
        rec = cuda.shared.array(BATCH_WORDS, float32)
        rid = cuda.shared.array(BLOCK, int32)
        tid, lane, px, py, inside, start, end, x0, x1, y0, y1, fx, fy = _tile_pixel(ranges, tiles_x, W, H,
                                                                                    first_tile)
        T = ONE
        r = ZERO
        g = ZERO
        b = ZERO
        d = ZERO
        stop = start
        done = not inside
        if carry and inside:
            T, r, g, b, d, done = _load_front(state, py, px)
        for base in range(start, end, int32(BLOCK)):  # int32 counters (Numba's int64 ones cost ~5 instructions a pair)
            if cuda.syncthreads_count(int32(done)) == BLOCK:
                break
            if base + tid < end:
                _load(proj, ids, base + tid, rec, rid, tid)
            cuda.syncthreads()
            T, r, g, b, d, stop, done = composite_chunks(rec, NF, int32(0), int32(min(BLOCK, end - base)), base,
                                                         lane, x0, x1, y0, y1, fx, fy, T, r, g, b, d, stop, done,
                                                         True)
            cuda.syncthreads()
        if inside:
            _store_pixel(image, trans, depth, last, py, px, r, g, b, T, d, stop, bg)
            if carry:
                _store_front(state, py, px, T, r, g, b, d, done)

    name = "_raster_forward_carry_kernel" if carry else "_raster_forward_kernel"
    kernel_fn.__name__ = kernel_fn.__qualname__ = name  # (its PTX cache key and its KERNELS entry)
    return kernel(F2, I1, I2, "int64", "int64", "int64", F1, F3, F2, F2, I2, F3, "int64", fastmath=True)(kernel_fn)


_raster_forward_kernel = _raster_forward(False)
_raster_forward_carry_kernel = _raster_forward(True)


def _raster_backward(fixed, carry):
    """The raster backward kernel; ``fixed`` and ``carry`` are constants of its compilation, so the
    kernel without them has no trace of them.  ``carry``: each pixel's backward starts from its
    state in ``state`` ((BEHIND_FIELDS, H, W): the chunks of the view behind done,
    ``blend.load_behind``) instead of ``trans``, ``bg`` and ``d_alpha``, and leaves its state in
    front of the chunk there.  ``fixed``: each warp stores its sum of a record's gradient into the record's own
    slot of ``slots`` ((intersections, WARPS, NG) flat, zeroed; the slot of the record at sorted
    position p is ``perm[p]``, the position it was emitted at) instead of adding it into ``grad``
    with an atomic, whose order varies from run to run; ``_slot_sum_kernel`` then adds each
    Gaussian's slots into ``grad`` in a fixed order."""
    def kernel_fn(proj, ids, ranges, W, H, tiles_x, bg, trans, last, d_image, d_alpha, d_depth, grad, perm, slots,
                  state, first_tile):
        rec = cuda.shared.array(BATCH_WORDS, float32)
        rid = cuda.shared.array(BLOCK, int32)
        red = cuda.shared.array((NG, RED_ROWS), float32)
        block_last = cuda.shared.array(1, int32)
        tid, lane, px, py, inside, start, end, x0, x1, y0, y1, fx, fy = _tile_pixel(ranges, tiles_x, W, H,
                                                                                    first_tile)
        if tid == 0:
            block_last[0] = start
        cuda.syncthreads()
        T_end = dc0 = dc1 = dc2 = dd = da_end = ZERO  # outside the image (where no hit counts: my_last = start)
        my_last = start
        if inside:
            T_end = trans[py, px]
            dc0 = d_image[py, px, 0]
            dc1 = d_image[py, px, 1]
            dc2 = d_image[py, px, 2]
            dd = d_depth[py, px]
            da_end = d_alpha[py, px] * T_end
            my_last = last[py, px]
            cuda.atomic.max(block_last, 0, my_last)
        cuda.syncthreads()
        end = block_last[0]  # nothing behind the block's last contributor matters
        T = T_end
        s0 = T_end * bg[0]
        s1 = T_end * bg[1]
        s2 = T_end * bg[2]
        sd = ZERO
        if carry and inside:
            T, s0, s1, s2, sd, da_end = _load_behind(state, py, px)
        for top in range(end, start, int32(-BLOCK)):  # int32 counters, as in the forward pass
            lo = int32(max(start, top - BLOCK))
            if top - 1 - tid >= lo:
                _load(proj, ids, top - 1 - tid, rec, rid, tid)
            cuda.syncthreads()
            n = int32(top - lo)
            for c in range(int32(0), n, int32(32)):  # as in the forward pass: only the warp's hits
                k = int32(c + lane)
                hits = chunk_hits(k < n and record_reaches(rec, NF, k, x0, x1, y0, y1), int32(n - c))
                while hits != 0:
                    h, hits = next_hit(hits)
                    j = int32(c + h)
                    slot = perm[top - 1 - j] if fixed else 0
                    T, s0, s1, s2, sd = backward_hit(rec, NF, j, fx, fy, top - 1 - j < my_last, T, s0, s1, s2, sd,
                                                     dc0, dc1, dc2, dd, da_end, True, grad, rid, j, tid, red,
                                                     fixed, slots, slot)
            cuda.syncthreads()
        if carry and inside:
            _store_behind(state, py, px, T, s0, s1, s2, sd)

    name = "_raster_backward" + ("_fixed" if fixed else "") + ("_carry" if carry else "") + "_kernel"
    kernel_fn.__name__ = kernel_fn.__qualname__ = name  # (its PTX cache key and its KERNELS entry)
    return kernel(F2, I1, I2, "int64", "int64", "int64", F1, F2, I2, F3, F2, F2, F1, L1, F1, F3, "int64", fastmath=True,
                  max_registers=48 if carry and not fixed else None)(kernel_fn)
    # (the carry kernel: 56 registers otherwise, 47 under the cap, no spills; the fixed one needs 47 uncapped)


_raster_backward_kernel = _raster_backward(False, False)
_raster_backward_fixed_kernel = _raster_backward(True, False)
_raster_backward_carry_kernel = _raster_backward(False, True)
_raster_backward_fixed_carry_kernel = _raster_backward(True, True)


@kernel(F1, L1, I1, L1, F1)
def _slot_sum_kernel(slots, order, counts, ends, grad):
    """A thread per Gaussian (the k-th in depth order): the sum of its gradient slots, its
    intersections' as emitted (``ends[k] - counts``, ..., ``ends[k] - 1``: contiguous) and each
    intersection's WARPS warps, in that order for each field, added into its record of ``grad``
    (flat (N * NG)).  The order is fixed, so the sums are the same bits at every run.  The sum
    starts from the record's value, not from zero, so a view's tiles backpropagated in ranges of
    tile rows (the aggregate device's parts, one after another) add in the very order of one
    launch over them all, as the CPU backend adds tile by tile: the same bits however it is split."""
    k = cuda.grid(1)
    if k < order.shape[0]:
        n = order[k]
        c = counts[n]
        e = ends[k]
        if c > 0 and e * (WARPS * NG) <= slots.shape[0]:  # (with binning room, those that did not fit: none)
            acc = cuda.local.array(NG, float32)
            for f in range(NG):
                acc[f] = grad[n * NG + f]
            for row in range((e - c) * WARPS, e * WARPS):
                for f in range(NG):
                    acc[f] += slots[row * NG + f]
            for f in range(NG):
                grad[n * NG + f] = acc[f]


@kernel(F2, I1, I2, "int64", "int64", "int64", I2, F1, fastmath=True)
def _contributions_kernel(proj, ids, ranges, W, H, tiles_x, dominant, total):
    """Each pixel's dominant Gaussian, and each Gaussian's contributions added into ``total``.

    As the forward kernel: the tile's records stream through shared memory a batch at a time,
    front to back, until every pixel is done, and a warp visits only the records that may reach
    its pixels (``chunk_hits``: the others are under the alpha threshold on all of them).  A
    record's contributions are summed over the warp (``add_over_warp``), into a shared slot per
    record of the batch, then each record's sum is added into ``total`` by one global atomic."""
    rec = cuda.shared.array(BATCH_WORDS, float32)
    rid = cuda.shared.array(BLOCK, int32)
    acc = cuda.shared.array(BLOCK, float32)  # per record of the batch: its contributions over the tile
    tid, lane, px, py, inside, start, end, x0, x1, y0, y1, fx, fy = _tile_pixel(ranges, tiles_x, W, H, 0)
    T = ONE
    best = ZERO
    best_g = int32(-1)
    done = not inside
    for base in range(start, end, int32(BLOCK)):
        if cuda.syncthreads_count(int32(done)) == BLOCK:
            break
        n = int32(min(BLOCK, end - base))
        if tid < n:
            _load(proj, ids, base + tid, rec, rid, tid)
        acc[tid] = ZERO
        cuda.syncthreads()
        for c in range(int32(0), n, int32(32)):
            if warp_all(done):
                break
            k = int32(c + lane)
            hits = chunk_hits(k < n and record_reaches(rec, NF, k, x0, x1, y0, y1), int32(n - c))
            while hits != 0:
                h, hits = next_hit(hits)
                j = int32(c + h)
                mine = ZERO
                if not done:
                    w, T, done = blend_step(record_alpha(rec, NF, j, fx, fy)[0], T)
                    mine, best, best_g = dominant_step(w, rec[field(j, go.RED, NF)], rec[field(j, go.GREEN, NF)],
                                                       rec[field(j, go.BLUE, NF)], rid[j], best, best_g)
                add_over_warp(acc, j, mine, lane)
        cuda.syncthreads()
        if tid < n and acc[tid] != ZERO:  # (slot tid is this thread's to load again next batch)
            cuda.atomic.add(total, rid[tid], acc[tid])
    if inside:
        dominant[py, px] = best_g


def _tile_launch(W, H, tile_rows):
    """(the grid, the first row-major tile) of a launch over the tile rows ``tile_rows`` (first,
    last), or over every tile (None)."""
    tx, ty = tile_grid(W, H)
    if tile_rows is None:
        return (tx, ty), 0
    first, last = tile_rows
    return (tx, max(last - first, 0)), first * tx


def raster_forward(proj, ids, ranges, W, H, tile, tiles_x, bg, image, trans, depth, last, state=None,
                   tile_rows=None):
    """Composite each pixel's Gaussians front to back: one launch.  ``state`` ((FRONT_FIELDS, H, W)
    float32): start from it and leave the pixel's state there (``_raster_forward``).  ``tile_rows``
    (first, last): those rows of tiles only (None: every tile)."""
    k = _raster_forward_kernel if state is None else _raster_forward_carry_kernel
    grid, first_tile = _tile_launch(W, H, tile_rows)
    if grid[1]:
        k[grid, (TILE, TILE)](proj, ids, ranges, W, H, tiles_x, bg, image, trans, depth, last,
                              _no_state() if state is None else state, first_tile)


_NO_SLOTS = {}


def _no_slots():
    """The (unread) slot arguments of the raster backward kernel without ``fixed``."""
    xp = array_module()
    if xp not in _NO_SLOTS:
        _NO_SLOTS[xp] = (xp.zeros(1, np.int64), xp.zeros(1, np.float32))
    return _NO_SLOTS[xp]


_NO_STATE = {}


def _no_state():
    """The (unread) state argument of the raster kernels without ``carry``."""
    xp = array_module()
    if xp not in _NO_STATE:
        _NO_STATE[xp] = xp.zeros((1, 1, 1), np.float32)
    return _NO_STATE[xp]


def raster_backward(proj, ids, ranges, W, H, tile, tiles_x, bg, trans, last, d_image, d_alpha, d_depth, grad,
                    fixed=None, state=None, tile_rows=None):
    """Add each Gaussian's screen-space gradient record into ``grad`` (N, NG): with float atomics
    in whatever order the warps come, or, with ``fixed`` = (perm, order, ends, counts) (the
    binning's permutation from emitted to sorted intersections, its depth order, the running
    count of tiles in that order, the projection's tile counts), in a fixed order: the warps'
    sums into a slot each (``_raster_backward``), then a thread per Gaussian adds its slots
    (``_slot_sum_kernel``).  The slots take WARPS * NG floats (384 bytes) per intersection.
    ``state`` ((BEHIND_FIELDS, H, W) float32): each pixel's backward starts from it instead of
    ``trans``, ``bg`` and ``d_alpha``, and leaves its state there (``_raster_backward``).
    ``tile_rows`` (first, last): those rows of tiles only (None: every tile)."""
    flat = flat_records(grad)
    grid, first_tile = _tile_launch(W, H, tile_rows)
    if not grid[1]:
        return
    carry = state is not None
    state = state if carry else _no_state()
    if fixed is None:
        perm, slots = _no_slots()
        k = _raster_backward_carry_kernel if carry else _raster_backward_kernel
        k[grid, (TILE, TILE)](proj, ids, ranges, W, H, tiles_x, bg, trans, last, d_image, d_alpha, d_depth,
                              flat, perm, slots, state, first_tile)
        return
    perm, order, ends, counts = fixed
    slots = array_module().zeros(perm.shape[0] * WARPS * NG, np.float32)
    k = _raster_backward_fixed_carry_kernel if carry else _raster_backward_fixed_kernel
    k[grid, (TILE, TILE)](proj, ids, ranges, W, H, tiles_x, bg, trans, last, d_image, d_alpha, d_depth,
                          flat, perm, slots, state, first_tile)
    _slot_sum_kernel[per_item(order.shape[0])](slots, order, counts, ends, flat)


def contributions(proj, ids, ranges, W, H, tile, tiles_x, dominant, total):
    """Each pixel's dominant Gaussian into ``dominant`` (H, W); each Gaussian's contribution over
    the view added into ``total`` (N,): one launch."""
    _contributions_kernel[tile_grid(W, H), (TILE, TILE)](proj, ids, ranges, W, H, tiles_x, dominant, total)
