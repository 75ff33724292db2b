"""The per-tile device functions that the raster kernels (``raster``) and the fused kernel
(``fused``) share: which pixel a thread takes, the warp's pixel box, reading the records a block
caches in shared memory, compositing them, and the backward step with its warp reduction.

A tile is a 16x16 thread block.  Warp w takes the WARP_W x WARP_H pixels at block (w % 2, w // 2)
of the tile (``pixel_of_tile``).  Records are streamed through
shared memory 32 at a time: each lane tests one against its warp's box (``blend.reaches_box``)
and the warp visits only those that can reach a pixel (``chunk_hits``, ``next_hit``).  The
backward pass sums every Gaussian's gradient across the warp (a transpose reduction by shuffles)
before one atomic instruction per warp, or (``fixed``: deterministic training) a plain store of the
warp's sum into its own slot, which a second kernel adds up in a fixed order; the CUDA simulator has
no shuffles, so there the sum goes through shared memory, and a few other functions have simulator
variants too.  The per-pixel math is ``numbasplat.math.blend``'s, shared with the CPU backend.
"""
from numba import cuda, float32, int32, uint32

from ..math import gaussian_ops as go
from ..math import geometry as geo
from ..math.blend import blend_step, blend_vjp, gaussian_alpha, reaches_box
from ..math.jit import SIM
from ..math.tiles import TILE

BLOCK = 256                 # threads per tile block = Gaussians per shared-memory batch
WARP_W, WARP_H = 8, 4       # a warp's pixels in its tile: 8x4 meets fewer Gaussians than 16x2
FULL_MASK = 0xFFFFFFFF
NF = go.PROJ_FIELDS
NG = go.GRAD_FIELDS
WARPS = BLOCK // 32         # warps of a tile block: the slots a record's gradient has with ``fixed``

ALPHA_MIN = float32(geo.ALPHA_MIN)
HALF = float32(0.5)
ONE = float32(1.0)
ZERO = float32(0.0)


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
    """The pixel centres of this thread's warp: columns x0..x1 of rows y0..y1 (``pixel_of_tile``)."""
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
def pixel_of_tile(t, ranges, tiles_x, W, H):
    """This thread's pixel in tile t, as every tile kernel starts: (thread id, lane, px, py, inside
    the image, tile range start, end, the warp's box x0, x1, y0, y1 (``warp_box``), the pixel
    centre fx, fy).  Warp w takes the WARP_W x WARP_H pixels at block (w % 2, w // 2) of the
    tile, lane l the pixel (l % WARP_W, l // WARP_W) of it."""
    tid = cuda.threadIdx.y * TILE + cuda.threadIdx.x
    w = tid >> 5
    lane = tid & 31
    px = (t % tiles_x) * TILE + (w % (TILE // WARP_W)) * WARP_W + lane % WARP_W
    py = (t // tiles_x) * TILE + (w // (TILE // WARP_W)) * WARP_H + lane // WARP_W
    x0, x1, y0, y1 = warp_box(lane, px, py)
    return (tid, lane, px, py, px < W and py < H, ranges[t, 0], ranges[t, 1], x0, x1, y0, y1,
            float32(px) + HALF, float32(py) + HALF)


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
    def add_over_warp(acc, j, v, lane):
        """``acc[j] += v`` from every thread (no shuffles here: one shared atomic a thread)."""
        if v != ZERO:
            cuda.atomic.add(acc, j, v)

    @cuda.jit(device=True)
    def _reduce_add(grad, g, tid, red, fixed, slots, slot, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11):
        """Block sum through shared memory (the simulator has no warp shuffles).
        ``grad`` is the flat (N * NG) view of the gradient records.  ``fixed``: each warp's sum
        (its 32 threads' values, in lane order) stored into its slot of ``slots`` instead."""
        v = (v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11)
        for f in range(NG):
            red[f, tid] = v[f]
        cuda.syncthreads()
        if fixed:
            if tid < WARPS * NG:
                w = tid // NG
                f = tid - w * NG
                s = ZERO
                for k in range(w * 32, w * 32 + 32):
                    s += red[f, k]
                slots[(slot * WARPS + w) * NG + f] = s
        elif tid < NG:
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
    def add_over_warp(acc, j, v, lane):
        """``acc[j] += v`` summed over the warp first (5 shuffles), then one atomic from lane 0
        instead of up to 32 on the same address.  Every lane of the warp must call it."""
        for bit in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL_MASK, v, bit)
        if lane == 0 and v != ZERO:
            cuda.atomic.add(acc, j, v)

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
    def _reduce_add(grad, g, tid, red, fixed, slots, slot, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11):
        """Warp sum of 12 values in 13 shuffles, then one atomic instruction (``fixed``: a store
        into the warp's slot ``slot`` of ``slots``, (slots, WARPS, NG) flat, no atomic).

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
            if fixed:
                slots[(slot * WARPS + (tid >> 5)) * NG + f] = d
            else:
                cuda.atomic.add(grad, uint32(g) * uint32(NG) + uint32(f), d)


@cuda.jit(device=True, inline=True)
def backward_hit(rec, stride, j, fx, fy, counts, T, s0, s1, s2, sd, dc0, dc1, dc2, dd, da_end, depth_terms,
                 grad, ids, at, tid, red, fixed, slots, slot):
    """One hit of a backward pass: record j un-blended from this thread's pixel (``counts``: it is
    in front of the pixel's last contributor), its gradient summed over the warp into record
    ``ids[at]`` of ``grad``, or with ``fixed`` (a compile-time constant) stored into the warp's
    slot of intersection ``slot`` in ``slots`` (``_reduce_add``).  The raster and fused kernels
    share it.  Returns (T, s0, s1, s2, sd)."""
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
        _reduce_add(grad, ids[at], tid, red, fixed, slots, slot, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11)
    return T, s0, s1, s2, sd


def flat_records(grad):
    """The flat view of (N, NG) gradient records that the raster kernels add into (a copy would
    silently lose the gradients: refuse a non-contiguous array)."""
    if not grad.flags.c_contiguous:
        raise ValueError("gradient records must be a C-contiguous (N, %d) array" % NG)
    return grad.reshape(-1)

