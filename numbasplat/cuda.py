"""CUDA backend: Numba ``@cuda.jit`` kernels (float32), launched from Python.

Per-Gaussian kernels run the bodies of ``gaussian_ops`` one thread per
Gaussian.  The raster kernels run one 16x16 thread block per tile and stream
the tile's depth-sorted Gaussians through shared memory in batches of 256,
32 at a time: each lane tests one against its warp's 8x4 pixels
(``blend.reaches_box``) and the warp visits only those that can reach a pixel.
The backward pass walks each pixel back to front and sums every Gaussian's
gradient across the warp (a transpose reduction by shuffles) before one atomic
instruction per warp; the CUDA simulator has no shuffles, so there the sum
goes through shared memory.  The per-pixel math is ``blend``'s, shared with
the CPU backend.
"""
import numpy as np
from numba import cuda, float32, int32, uint32

from . import gaussian_ops as go
from . import geometry as geo
from .sh import sh_basis, sh_basis_jacobian
from .blend import blend_step, blend_vjp, gaussian_alpha, reaches_box
from ._backend import SIM, array_module
from .launch import kernel
from .optim import adam_lr, adam_update

BLOCK = 256                 # threads per tile block = Gaussians per shared-memory batch
BATCH_WORDS = BLOCK * go.PROJ_FIELDS  # a batch of records in shared memory (a constant, as Numba needs)
TILE = 16
WARP_W, WARP_H = 8, 4        # a warp's pixels in its tile: 8x4 meets fewer Gaussians than 16x2 (17% on the 1M scene)
THREADS = 256               # threads per block of the per-Gaussian kernels
FULL_MASK = 0xFFFFFFFF
NF = go.PROJ_FIELDS
NG = go.GRAD_FIELDS

_ops = go.build(cuda.jit(device=True))
project_one, visit_tiles = _ops.project, _ops.visit_tiles
geometry_backward_one = _ops.geometry_backward
view_direction, colour_grad = _ops.view_direction, _ops.colour_grad
route_one, route_fill_one = _ops.route, _ops.route_fill

ALPHA_MIN = float32(geo.ALPHA_MIN)
ALPHA_MAX = float32(geo.ALPHA_MAX)
HALF = float32(0.5)
ONE = float32(1.0)
ZERO = float32(0.0)

F1 = "float32[::1]"
F2 = "float32[:, ::1]"
F3 = "float32[:, :, ::1]"
I1 = "int32[::1]"
I2 = "int32[:, ::1]"
U1 = "uint32[::1]"


def _grid(n):
    return (n + THREADS - 1) // THREADS, THREADS


# --------------------------------------------------------------------------- per Gaussian

@kernel(F2, F2, F2, F1, F3, "int64", F1, "int64", "int64", "boolean", "int64", "int64", "int64", F2, I2, I1,
        max_registers=64)  # 68 otherwise: 3 blocks per SM instead of 4
def _project_kernel(means, quats, scales, logits, sh, degree, cam, W, H, antialias, tile, tiles_x, tiles_y,
                    proj, radii, counts):
    n = cuda.grid(1)
    if n < means.shape[0]:
        project_one(n, means, quats, scales, logits, sh, degree, cam, W, H, antialias, tile, tiles_x, tiles_y,
                    proj, radii, counts)


@kernel(F2, "int64[::1]", I1, I1, "int64", "int64", "int64", "int64", "int64", "int64", U1, I1)
def _emit_kernel(proj, order, counts, offsets, tile, tiles_x, tiles_y, W, H, key_base, tile_ids, ids):
    k = cuda.grid(1)
    if k < order.shape[0]:
        n = order[k]
        if counts[n] > 0:
            visit_tiles(n, proj, tile, tiles_x, tiles_y, W, H, key_base, offsets[k], counts[n], tile_ids, ids, True)


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


@kernel(F2, F2, "int64", F1, F2, I1, F2, F2, F2, "boolean")
def _sh_backward_kernel(means, sh, degree, cam, proj, counts, grad, d_sh, d_dir, accumulate):
    """The SH gradients of a block of Gaussians in three phases, so that their 192-byte SH rows
    are read and written coalesced (a thread per Gaussian would touch 32 cache lines per access):
    1. a thread per Gaussian: basis and clamp-gated colour gradient, into shared memory;
    2. a thread per (Gaussian, coefficient) item, in memory order: the coefficient's weight in
       the view-direction gradient (reads ``sh``), then d_sh = basis * colour gradient (writes);
    3. a thread per Gaussian: the view-direction gradient from those weights."""
    basis = cuda.shared.array((SH_BLOCK, SH_PAD), float32)
    weight = cuda.shared.array((SH_BLOCK, SH_PAD), float32)
    dcol = cuda.shared.array((SH_BLOCK, 3), float32)
    live = cuda.shared.array(SH_BLOCK, int32)
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
    width = int32(d_sh.shape[1] // 3)  # coefficients stored, maybe more than used: those get zeros
    g, k, step_g, step_k = _first_item(width)
    while g < n_here:
        if live[g] or not accumulate:
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


@kernel(F2, F2, F2, F1, F1, "int64", "int64", "boolean", I1, F2, F2, F2, F2, F2, F1, "boolean",
        max_registers=80)  # 93 otherwise: 2 blocks per SM instead of 3
def _geometry_backward_kernel(means, quats, scales, logits, cam, W, H, antialias, counts, grad, d_dir,
                              d_means, d_quats, d_scales, d_logits, accumulate):
    n = cuda.grid(1)
    if n < means.shape[0]:
        geometry_backward_one(n, means, quats, scales, logits, cam, W, H, antialias, counts, grad,
                              d_dir[n, 0], d_dir[n, 1], d_dir[n, 2], d_means, d_quats, d_scales, d_logits, accumulate)


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
    _route_kernel[_grid(proj.shape[0])](proj, counts, tile, tiles_x, tiles_y, first_tile, bounds, b, plan)


def route_fill(proj, counts, b, plan, slot, send, route):
    _route_fill_kernel[_grid(proj.shape[0])](proj, counts, b, plan, slot, send, route)


def project(means, quats, scales, logits, sh, degree, cam, W, H, antialias, tile, tiles_x, tiles_y,
            proj, radii, counts):
    _project_kernel[_grid(means.shape[0])](means, quats, scales, logits, sh, degree, cam, W, H, antialias,
                                           tile, tiles_x, tiles_y, proj, radii, counts)


def emit_intersections(proj, order, counts, offsets, tile, tiles_x, tiles_y, W, H, key_base, tile_ids, ids):
    _emit_kernel[_grid(order.shape[0])](proj, order, counts, offsets, tile, tiles_x, tiles_y, W, H, key_base,
                                        tile_ids, ids)


def project_backward(means, quats, scales, logits, sh, degree, cam, W, H, antialias, proj, counts, grad,
                     d_means, d_quats, d_scales, d_logits, d_sh, accumulate):
    n = means.shape[0]
    d_dir = array_module("cuda").empty((n, 3), np.float32)
    _sh_backward_kernel[(n + SH_BLOCK - 1) // SH_BLOCK, SH_BLOCK](means, sh, degree, cam, proj, counts, grad,
                                                                   d_sh, d_dir, accumulate)
    _geometry_backward_kernel[_grid(n)](means, quats, scales, logits, cam, W, H, antialias, counts, grad, d_dir,
                                        d_means, d_quats, d_scales, d_logits, accumulate)


# --------------------------------------------------------------------------- per tile

@cuda.jit(device=True, inline=True)
def record_alpha(rec, stride, j, px, py):
    return gaussian_alpha(rec[field(j, go.U, stride)], rec[field(j, go.V, stride)], rec[field(j, go.CA, stride)],
                          rec[field(j, go.CB, stride)], rec[field(j, go.CC, stride)],
                          rec[field(j, go.OPAC, stride)], px, py)


@cuda.jit(device=True, inline=True)
def record_reaches(rec, stride, j, x0, x1, y0, y1):
    return reaches_box(rec[field(j, go.U, stride)], rec[field(j, go.V, stride)], rec[field(j, go.CA, stride)],
                         rec[field(j, go.CB, stride)], rec[field(j, go.CC, stride)],
                         rec[field(j, go.OPAC, stride)], x0, x1, y0, y1)


@cuda.jit(device=True, inline=True)
def warp_box(lane, px, py):
    """The pixel centres of this thread's warp: columns x0..x1 of rows y0..y1 (``_pixel_of_tile``)."""
    x0 = float32(px - lane % WARP_W) + HALF
    y0 = float32(py - lane // WARP_W) + HALF
    return x0, x0 + float32(WARP_W - 1), y0, y0 + float32(WARP_H - 1)


@cuda.jit(device=True, inline=True)
def composite_chunks(rec, stride, lo, hi, first, lane, x0, x1, y0, y1, fx, fy, T, r, g, b, d, stop, done, depth):
    """Front-to-back compositing of records lo..hi-1 of ``rec`` into this thread's pixel, 32 at a
    time, visiting only the warp's hits.  ``first``: the tile-list index of record 0 (``stop``
    is the index after the pixel's last contributor); ``depth``: the records hold depth, sum it.
    Returns the updated (T, r, g, b, d, stop, done)."""
    for c in range(lo, hi, int32(32)):
        if warp_all(done):
            break
        k = int32(c + lane)
        hits = chunk_hits(k < hi and record_reaches(rec, stride, k, x0, x1, y0, y1), int32(hi - c))
        while hits != 0:
            h, hits = next_hit(hits)
            j = int32(c + h)
            if not done:
                alpha, vis, dx, dy = record_alpha(rec, stride, j, fx, fy)
                w, T, done = blend_step(alpha, T)
                if w > ZERO:
                    r += w * rec[field(j, go.RED, stride)]
                    g += w * rec[field(j, go.GREEN, stride)]
                    b += w * rec[field(j, go.BLUE, stride)]
                    if depth:
                        d += w * rec[field(j, go.DEPTH, stride)]
                    stop = int32(first + j + 1)
    return T, r, g, b, d, stop, done


@cuda.jit(device=True, inline=True)
def masked(valid, alpha):
    """(alpha, 1) for a lane whose Gaussian counts, else (0, 0): with alpha 0 the backward step
    keeps T and the sums (1 / (1 - 0) is exactly 1), and the zero output gradient zeroes the record."""
    if valid:
        return alpha, ONE
    return ZERO, ZERO


@cuda.jit(device=True, inline=True)
def _tile_pixel(ranges, tiles_x, W, H):
    """This thread's pixel in the block's tile (a 2D grid of tiles)."""
    return _pixel_of_tile(cuda.blockIdx.y * tiles_x + cuda.blockIdx.x, ranges, tiles_x, W, H)


@cuda.jit(device=True, inline=True)
def _pixel_of_tile(t, ranges, tiles_x, W, H):
    """This thread's pixel in tile t: (thread id, px, py, inside the image, tile range start, end).
    Warp w takes the WARP_W x WARP_H pixels at block (w % 2, w // 2) of the tile, lane l the pixel
    (l % WARP_W, l // WARP_W) of it."""
    tid = cuda.threadIdx.y * TILE + cuda.threadIdx.x
    w = tid >> 5
    lane = tid & 31
    px = (t % tiles_x) * TILE + (w % (TILE // WARP_W)) * WARP_W + lane % WARP_W
    py = (t // tiles_x) * TILE + (w // (TILE // WARP_W)) * WARP_H + lane // WARP_W
    return tid, px, py, px < W and py < H, ranges[t, 0], ranges[t, 1]


@cuda.jit(device=True, inline=True)
def _load(proj, ids, i, rec, rid, slot):
    g = ids[i]
    rid[slot] = g
    for f in range(NF):
        rec[field(slot, f, NF)] = proj[g, f]


@kernel(F2, I1, I2, "int64", "int64", "int64", F1, F3, F2, F2, I2, fastmath=True)
def _raster_forward_kernel(proj, ids, ranges, W, H, tiles_x, bg, image, trans, depth, last):
    rec = cuda.shared.array(BATCH_WORDS, float32)
    rid = cuda.shared.array(BLOCK, int32)
    tid, px, py, inside, start, end = _tile_pixel(ranges, tiles_x, W, H)
    lane = tid & 31
    x0, x1, y0, y1 = warp_box(lane, px, py)
    fx = float32(px) + HALF
    fy = float32(py) + HALF
    T = ONE
    r = ZERO
    g = ZERO
    b = ZERO
    d = ZERO
    stop = start
    done = not inside
    for base in range(start, end, int32(BLOCK)):  # int32 counters (Numba's int64 ones cost ~5 instructions a pair)
        if cuda.syncthreads_count(int32(done)) == BLOCK:
            break
        if base + tid < end:
            _load(proj, ids, base + tid, rec, rid, tid)
        cuda.syncthreads()
        T, r, g, b, d, stop, done = composite_chunks(rec, NF, int32(0), int32(min(BLOCK, end - base)), base, lane,
                                                     x0, x1, y0, y1, fx, fy, T, r, g, b, d, stop, done, True)
        cuda.syncthreads()
    if inside:
        image[py, px, 0] = r + T * bg[0]
        image[py, px, 1] = g + T * bg[1]
        image[py, px, 2] = b + T * bg[2]
        trans[py, px] = T
        depth[py, px] = d
        last[py, px] = stop


if SIM:
    RED_ROWS = BLOCK

    @cuda.jit(device=True)
    def warp_any(p):
        """Every thread goes on: the simulator's block-wide reduction needs them all."""
        return True

    @cuda.jit(device=True)
    def field(j, f, stride):
        """The index of field f of record j in a flat shared array of ``stride``-float records
        (plain integers: numpy's uint32 conversions cost the simulator more than the reads)."""
        return j * stride + f

    @cuda.jit(device=True)
    def warp_all(p):
        """This thread's own p: nothing in the loop it ends synchronises, so a thread that is done
        stops there (the whole block going on ran every thread through every Gaussian)."""
        return p

    @cuda.jit(device=True)
    def chunk_hits(hit, left):
        """Every Gaussian of the chunk, as a plain int: the whole block visits the same Gaussians
        (the reduction needs it)."""
        return (1 << min(int(left), 32)) - 1

    @cuda.jit(device=True)
    def next_hit(m):
        """(index of the lowest set bit, m without it), in Python integers: the simulator's
        ``ffs`` formats strings, and it ran once a Gaussian and thread."""
        low = m & -m
        return low.bit_length() - 1, m ^ low

    @cuda.jit(device=True)
    def _reduce_add(grad, g, tid, red, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11):
        """Block sum through shared memory (the simulator has no warp shuffles).
        ``grad`` is the flat (N * NG) view of the gradient records."""
        v = (v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11)
        for f in range(NG):
            red[f, tid] = v[f]
        cuda.syncthreads()
        if tid < NG:
            s = ZERO
            for k in range(BLOCK):
                s += red[tid, k]
            if s != ZERO:
                cuda.atomic.add(grad, g * NG + tid, s)
        cuda.syncthreads()
else:
    RED_ROWS = 1

    @cuda.jit(device=True, inline=True)
    def warp_any(p):
        """Whether p holds for any lane of the warp (the same answer on every lane)."""
        return cuda.any_sync(FULL_MASK, p)

    @cuda.jit(device=True, inline=True)
    def field(j, f, stride):
        """The index of field f of record j in a flat shared array of ``stride``-float records.
        Unsigned on purpose: Numba wraps every signed index into a shared array for negative
        values, about 10 integer instructions per read."""
        return uint32(j) * uint32(stride) + uint32(f)

    @cuda.jit(device=True, inline=True)
    def warp_all(p):
        """Whether p holds on every lane of the warp."""
        return cuda.all_sync(FULL_MASK, p)

    @cuda.jit(device=True, inline=True)
    def chunk_hits(hit, left):
        """Bit l set: lane l's Gaussian of a chunk of up to 32 (``left`` of them remain) may reach the
        warp's pixels.  The raster loops visit only these, lowest bit first (``next_hit``)."""
        m = uint32(cuda.ballot_sync(FULL_MASK, hit))
        if left < 32:
            m = uint32(m & uint32((uint32(1) << uint32(left)) - uint32(1)))  # uint32 throughout: Numba widens
        return m

    @cuda.jit(device=True, inline=True)
    def next_hit(m):
        """(index of the lowest set bit, m without it)."""
        return int32(cuda.ffs(m) - 1), uint32(m & uint32(m - uint32(1)))

    @cuda.jit(device=True, inline=True)
    def _fold(lane, bit, lo, hi):
        """One transpose-reduction step: keep the half of the pair this lane
        owns (by ``bit`` of its lane id) and add the partner's copy of it."""
        mine = hi if lane & bit else lo
        theirs = lo if lane & bit else hi
        return mine + cuda.shfl_xor_sync(FULL_MASK, theirs, bit)

    @cuda.jit(device=True, inline=True)
    def _fold3(lane, bit, x0, x1, x2, y0, y1, y2):
        """Three transpose-reduction steps: pairs (x0, y0), (x1, y1), (x2, y2)."""
        return _fold(lane, bit, x0, y0), _fold(lane, bit, x1, y1), _fold(lane, bit, x2, y2)

    @cuda.jit(device=True, inline=True)
    def _reduce_add(grad, g, tid, red, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11):
        """Warp sum of 12 values in 13 shuffles, then one atomic instruction.

        Each step halves the values a lane carries (12, 6, 3, then 2 with a zero
        pad, 1) and the lanes sharing them, so even lane L ends with the warp sum
        of value 6 b4 + 3 b3 + 2 b2 + b1 (b: the bits of L; b2 = b1 = 1 is the pad),
        instead of 12 full 5-shuffle reductions and 12 serial atomics.  ``grad`` is
        the flat (N * NG) view of the gradient records: a 2D index costs a dozen
        64-bit instructions a Gaussian."""
        lane = tid & 31
        a0, a1, a2 = _fold3(lane, 16, v0, v1, v2, v6, v7, v8)
        a3, a4, a5 = _fold3(lane, 16, v3, v4, v5, v9, v10, v11)
        b0, b1, b2 = _fold3(lane, 8, a0, a1, a2, a3, a4, a5)
        c0 = _fold(lane, 4, b0, b2)
        c1 = _fold(lane, 4, b1, ZERO)
        d = _fold(lane, 2, c0, c1)
        d += cuda.shfl_xor_sync(FULL_MASK, d, 1)
        k = (lane >> 1) & 3  # 2 b2 + b1
        if lane & 1 == 0 and k < 3:
            f = 6 * ((lane >> 4) & 1) + 3 * ((lane >> 3) & 1) + k
            cuda.atomic.add(grad, uint32(g) * uint32(NG) + uint32(f), d)


@cuda.jit(device=True, inline=True)
def backward_hit(rec, stride, j, fx, fy, counts, T, s0, s1, s2, sd, dc0, dc1, dc2, dd, da_end, depth_terms,
                 grad, ids, at, tid, red):
    """One hit of a backward pass: record j un-blended from this thread's pixel (``counts``: it is
    in front of the pixel's last contributor), its gradient summed over the warp into record
    ``ids[at]`` of ``grad``.  The raster and fused kernels share it.  Returns (T, s0, s1, s2, sd)."""
    alpha, vis, dx, dy = record_alpha(rec, stride, j, fx, fy)
    valid = counts and alpha >= ALPHA_MIN
    if warp_any(valid):  # the other lanes take alpha 0 and no gradient: exact zeros, no branch
        a, m = masked(valid, alpha)
        z = rec[field(j, go.DEPTH, stride)] if depth_terms else ZERO
        T, s0, s1, s2, sd, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11 = blend_vjp(
            a, vis, dx, dy, rec[field(j, go.OPAC, stride)], rec[field(j, go.CA, stride)],
            rec[field(j, go.CB, stride)], rec[field(j, go.CC, stride)], rec[field(j, go.RED, stride)],
            rec[field(j, go.GREEN, stride)], rec[field(j, go.BLUE, stride)], z,
            T, s0, s1, s2, sd, dc0 * m, dc1 * m, dc2 * m, dd * m, da_end * m, depth_terms)
        _reduce_add(grad, ids[at], tid, red, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11)
    return T, s0, s1, s2, sd


@kernel(F2, I1, I2, "int64", "int64", "int64", F1, F2, I2, F3, F2, F2, F1, fastmath=True)
def _raster_backward_kernel(proj, ids, ranges, W, H, tiles_x, bg, trans, last, d_image, d_alpha, d_depth, grad):
    rec = cuda.shared.array(BATCH_WORDS, float32)
    rid = cuda.shared.array(BLOCK, int32)
    red = cuda.shared.array((NG, RED_ROWS), float32)
    block_last = cuda.shared.array(1, int32)
    tid, px, py, inside, start, end = _tile_pixel(ranges, tiles_x, W, H)
    lane = tid & 31
    x0, x1, y0, y1 = warp_box(lane, px, py)
    if tid == 0:
        block_last[0] = start
    cuda.syncthreads()
    fx = float32(px) + HALF
    fy = float32(py) + HALF
    T_end = ZERO
    dc0 = ZERO
    dc1 = ZERO
    dc2 = ZERO
    dd = ZERO
    da_end = ZERO
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
                T, s0, s1, s2, sd = backward_hit(rec, NF, j, fx, fy, top - 1 - j < my_last, T, s0, s1, s2, sd,
                                                 dc0, dc1, dc2, dd, da_end, True, grad, rid, j, tid, red)
        cuda.syncthreads()


def flat_records(grad):
    """The flat view of (N, NG) gradient records that the raster kernels add into (a copy would
    silently lose the gradients: refuse a non-contiguous array)."""
    if not grad.flags.c_contiguous:
        raise ValueError("gradient records must be a C-contiguous (N, %d) array" % NG)
    return grad.reshape(-1)


def _tiles(W, H):
    return (W + TILE - 1) // TILE, (H + TILE - 1) // TILE


def raster_forward(proj, ids, ranges, W, H, tile, tiles_x, bg, image, trans, depth, last):
    _raster_forward_kernel[_tiles(W, H), (TILE, TILE)](proj, ids, ranges, W, H, tiles_x, bg, image, trans,
                                                       depth, last)


def raster_backward(proj, ids, ranges, W, H, tile, tiles_x, bg, trans, last, d_image, d_alpha, d_depth, grad):
    _raster_backward_kernel[_tiles(W, H), (TILE, TILE)](proj, ids, ranges, W, H, tiles_x, bg, trans, last,
                                                        d_image, d_alpha, d_depth, flat_records(grad))


_adam_lr = cuda.jit(device=True, inline=True)(adam_lr)


@kernel(F1, F1, F1, F1, I1, I1, I1, F1, "boolean[::1]", "boolean",
        "float32", "float32", "float32", "float32", "float32", fastmath=True)
def _adam_kernel(params, grads, m, v, bounds, widths, col0, lrs, visible, use_visible, b1, b2, eps, bc1, bc2):
    """Adam streams 28 bytes per element, so it is bound by its instructions unless they are
    few: fast division and square root (within 1e-6 of the CPU's), no division by a variable."""
    i = int32(cuda.grid(1))
    if i < params.shape[0]:
        lr = _adam_lr(i, bounds, widths, col0, lrs, visible, use_visible)
        if lr >= ZERO:
            params[i], m[i], v[i] = adam_update(params[i], grads[i], m[i], v[i], lr, b1, b2, eps, bc1, bc2)


def adam(params, *args):
    _adam_kernel[_grid(params.shape[0])](params, *args)
