"""The zero-eliding gradient messages' CUDA kernels (``comm.sparse``; format in
``numbasplat.math.sparse``): a block per 256-row segment.

Encode: a count kernel (per-segment kept rows), one device-to-host copy (message sizes must
reach the host anyway), a pack kernel that writes the messages in place.  Decode: one kernel
adds each kept row straight from the receive buffer into its target row.
"""
import numpy as np
from numba import cuda, int32, uint32

from ..math.jit import SIM
from ..math.sparse import ROWS, WORDS, layout, segment_bases
from .launch import F1, F2, I1, L1, L2, U1, array_module, kernel


@cuda.jit(device=True, inline=True)
def _segment(lay, b):
    """Chunk d of segment b (binary search of the segment offsets), its first row and its row count."""
    lo = 0
    hi = lay.shape[1] - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if lay[0, mid] <= b:
            lo = mid
        else:
            hi = mid - 1
    seg = b - lay[0, lo]
    r0 = lay[1, lo] + seg * ROWS
    return lo, seg, r0, min(ROWS, lay[1, lo + 1] - r0)


@cuda.jit(device=True, inline=True)
def _chunk(lay, d):
    """(first message word, bitmap words, segments) of chunk d's message."""
    return lay[2, d], (lay[1, d + 1] - lay[1, d] + 31) // 32, lay[0, d + 1] - lay[0, d]


@cuda.jit(device=True, inline=True)
def _mark(G, r0, n, t, flags, words):
    """words[0:WORDS] = the bitmap of rows r0..r0+n of G (every thread of the block calls it)."""
    F = G.shape[1]
    flags[t] = 0
    cuda.syncthreads()
    for e in range(t, n * F, ROWS):  # coalesced: consecutive threads read consecutive fields
        if G[r0 + e // F, e % F] != 0:
            flags[e // F] = 1
    cuda.syncthreads()
    if t < WORDS:
        w = uint32(0)
        for k in range(32):
            if flags[t * 32 + k] != 0:
                w |= uint32(1) << uint32(k)
        words[t] = w
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _rank(words, t, rank):
    """rank[t] = index of row t among the segment's kept rows, or -1 (prefix popcount of the bitmap)."""
    wi = t // 32
    bit = uint32(t % 32)
    pre = 0
    for k in range(wi):
        pre += cuda.popc(words[k])
    w = words[wi]
    pre += cuda.popc(w & ((uint32(1) << bit) - uint32(1)))
    rank[t] = pre if (w >> bit) & uint32(1) else -1
    cuda.syncthreads()


@kernel(F2, L2, L1)
def _count_kernel(G, lay, seg_count):
    flags = cuda.shared.array(ROWS, int32)
    words = cuda.shared.array(WORDS, uint32)
    t = cuda.threadIdx.x
    d, seg, r0, n = _segment(lay, cuda.blockIdx.x)
    _mark(G, r0, n, t, flags, words)
    if t == 0:
        c = 0
        for k in range(WORDS):
            c += cuda.popc(words[k])
        seg_count[cuda.blockIdx.x] = c


@kernel(F2, L2, L1, U1, F1)
def _pack_kernel(G, lay, seg_base, msg, msg_f):
    """Segment b's bitmap words, base and kept rows, in place in its chunk's message
    (``msg_f``: the same buffer as float32, for the rows)."""
    flags = cuda.shared.array(ROWS, int32)
    words = cuda.shared.array(WORDS, uint32)
    b = cuda.blockIdx.x
    t = cuda.threadIdx.x
    d, seg, r0, n = _segment(lay, b)
    _mark(G, r0, n, t, flags, words)
    _rank(words, t, flags)
    m0, nw, nseg = _chunk(lay, d)
    if t < WORDS and t * 32 < n:
        msg[m0 + seg * WORDS + t] = words[t]
    if t == 0:
        msg[m0 + nw + seg] = uint32(seg_base[b])
    F = G.shape[1]
    rows = m0 + nw + nseg + seg_base[b] * F
    for e in range(t, n * F, ROWS):
        k = flags[e // F]
        if k >= 0:
            msg_f[rows + k * F + e % F] = G[r0 + e // F, e % F]


@kernel(U1, F1, L2, I1, F2)
def _unpack_add_kernel(msg, msg_f, lay, route, out):
    """out[route[row]] += each kept row of segment b, read straight from the received messages."""
    words = cuda.shared.array(WORDS, uint32)
    rank = cuda.shared.array(ROWS, int32)
    t = cuda.threadIdx.x
    d, seg, r0, n = _segment(lay, cuda.blockIdx.x)
    m0, nw, nseg = _chunk(lay, d)
    if t < WORDS:
        words[t] = msg[m0 + seg * WORDS + t] if t * 32 < n else uint32(0)
    cuda.syncthreads()
    _rank(words, t, rank)
    F = out.shape[1]
    rows = m0 + nw + nseg + msg[m0 + nw + seg] * F
    for e in range(t, n * F, ROWS):
        i = e // F
        k = rank[i]
        if k >= 0:
            v = msg_f[rows + k * F + e % F]
            if v != 0:
                cuda.atomic.add(out, (route[r0 + i], e % F), v)


@kernel(F2, I1, F2)
def _scatter_add_kernel(rows, route, out):
    e = cuda.grid(1)
    F = rows.shape[1]
    if e < rows.shape[0] * F:
        v = rows[e // F, e % F]
        if v != 0:
            cuda.atomic.add(out, (route[e // F], e % F), v)


def _check_f32(*arrays):
    for a in arrays:
        if a.dtype != np.float32 or a.ndim != 2 or not a.flags.c_contiguous:
            raise TypeError(f"CUDA path needs C-contiguous 2D float32 rows, got {a.dtype} {a.shape}")


def _route32(route):
    """The kernels take int32 routes; other integer routes are converted (a small device copy)."""
    if route.ndim != 1 or route.dtype.kind not in "iu":
        raise TypeError(f"route must be a 1D integer array, got {route.dtype} {route.shape}")
    return route if route.dtype == np.int32 and route.flags.c_contiguous else route.astype(np.int32)


def encode(G, counts):
    """(message, sizes, kept) of rows ``G`` grouped by destination (``counts``, int64)."""
    xp = array_module()
    _check_f32(G)
    lay = layout(counts)
    nseg = int(lay[0, -1])
    seg_count = xp.empty(nseg, np.int64)  # every block writes its own
    if nseg:
        _count_kernel[nseg, ROWS](G, xp.asarray(lay), seg_count)
    kept, seg_base = segment_bases(lay, seg_count if SIM else seg_count.get())  # sizes must reach the host
    lay = layout(counts, kept, G.shape[1])
    plan = xp.asarray(np.concatenate([lay.reshape(-1), seg_base]))  # one host-to-device copy
    msg = xp.empty(int(lay[2, -1]), np.uint32)
    if nseg:
        words = cuda.to_device(msg) if SIM else msg  # the simulator copies numpy arguments: share its array
        _pack_kernel[nseg, ROWS](G, plan[:lay.size].reshape(lay.shape), plan[lay.size:], words,
                                 words.view(np.float32))
        msg = words.copy_to_host() if SIM else msg
    return msg, np.diff(lay[2]), kept


def decode_add(msg, counts, kept, lay, route, out):
    """out[route[row]] += each kept row of the messages (``lay``: their layout)."""
    xp = array_module()
    _check_f32(out)
    nseg = int(lay[0, -1])
    if nseg:
        _unpack_add_kernel[nseg, ROWS](msg, msg.view(np.float32), xp.asarray(lay), _route32(route), out)


def scatter_add(rows, route, out):
    """out[route[i]] += rows[i]."""
    _check_f32(rows, out)
    route = _route32(route)
    n = rows.shape[0] * rows.shape[1]
    if n:
        _scatter_add_kernel[(n + ROWS - 1) // ROWS, ROWS](rows, route, out)
