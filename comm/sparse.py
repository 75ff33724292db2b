"""ByteSplat's zero-eliding gradient encoding, and the gradient exchanges built on it.

Most gradient records sent back to a Gaussian's owner are all zero (the
Gaussian was projected but touched no pixel), so instead of the dense rows we
send one bit per row plus the non-zero rows ("packed"), and the receiver adds
each packed row straight into its gradient rows, never rebuilding the dense
block.

Format, per destination chunk of ``counts[d]`` rows: ``ceil(counts[d]/32)``
uint32 words (bit ``i % 32`` of word ``i // 32`` is row i, least significant
bit first), so every chunk's bitmap starts at a word boundary and travels as
its own alltoallv message.  A row is kept iff any field is ``!= 0`` (NaN is
kept, -0.0 is not).

Both backends cut every chunk into segments of ``ROWS`` = 256 rows (one CUDA
block each; a segment is 8 whole words) and number kept rows by a prefix sum
over the segment's bitmap words (popcounts), so they give identical output.
GPU encode: a mark kernel (bits and per-segment counts), a host scan of the
segment counts (the packed size must reach the host anyway), a scatter
kernel.  GPU decode: a per-segment popcount kernel, a device cumsum, an
atomic scatter-add kernel (several rows may map to one output row).
"""
import time

import numpy as np
from numba import cuda, int32, njit, prange, uint32

from numbasplat._backend import BACKEND, SIM, array_module, array_module_of, to_host
from numbasplat.launch import kernel

ROWS = 256          # rows per segment = threads per block
WORDS = ROWS // 32  # bitmap words per segment

F2 = "float32[:, ::1]"
U1 = "uint32[::1]"
I1 = "int32[::1]"
L1 = "int64[::1]"
L2 = "int64[:, ::1]"


# --------------------------------------------------------------------------- layout

def _layout(counts):
    """(3, P+1) int64: segment, row and bitmap-word offsets of each chunk."""
    counts = np.asarray(counts, np.int64).reshape(-1)
    if (counts < 0).any():
        raise ValueError(f"negative row count in {counts.tolist()}")
    lay = np.zeros((3, counts.size + 1), np.int64)
    np.cumsum((counts + ROWS - 1) // ROWS, out=lay[0, 1:])
    np.cumsum(counts, out=lay[1, 1:])
    np.cumsum((counts + 31) // 32, out=lay[2, 1:])
    return lay


def word_counts(counts):
    """Bitmap words per chunk: ``ceil(counts / 32)``."""
    return (np.asarray(counts, np.int64) + 31) // 32


def _use_cuda(a, backend):
    """CUDA kernels for CuPy arrays, or numpy arrays under the simulator with the CUDA backend."""
    if backend is not None:
        return backend == "cuda"
    if not isinstance(a, np.ndarray):
        return True
    return SIM and BACKEND == "cuda"


# --------------------------------------------------------------------------- CUDA

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
def _local_ranks(bitmap, lay, d, seg, n, t, words, rank):
    """rank[t] = index of row t among the segment's kept rows, or -1 (block-wide prefix sum by popcount)."""
    if t < WORDS:
        w = uint32(0)
        if t * 32 < n:
            w = bitmap[lay[2, d] + seg * WORDS + t]
        words[t] = w
    cuda.syncthreads()
    wi = t // 32
    bit = uint32(t % 32)
    pre = 0
    for k in range(wi):
        pre += cuda.popc(words[k])
    w = words[wi]
    pre += cuda.popc(w & ((uint32(1) << bit) - uint32(1)))
    rank[t] = pre if (w >> bit) & uint32(1) else -1
    cuda.syncthreads()


@kernel(F2, L2, U1, L1)
def _mark_kernel(G, lay, bitmap, seg_count):
    flags = cuda.shared.array(ROWS, int32)
    words = cuda.shared.array(WORDS, uint32)
    b = cuda.blockIdx.x
    t = cuda.threadIdx.x
    d, seg, r0, n = _segment(lay, b)
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
        if t * 32 < n:
            bitmap[lay[2, d] + seg * WORDS + t] = w
    cuda.syncthreads()
    if t == 0:
        c = 0
        for k in range(WORDS):
            c += cuda.popc(words[k])
        seg_count[b] = c


@kernel(F2, L2, U1, L1, F2)
def _pack_kernel(G, lay, bitmap, seg_base, packed):
    words = cuda.shared.array(WORDS, uint32)
    rank = cuda.shared.array(ROWS, int32)
    b = cuda.blockIdx.x
    t = cuda.threadIdx.x
    d, seg, r0, n = _segment(lay, b)
    _local_ranks(bitmap, lay, d, seg, n, t, words, rank)
    F = G.shape[1]
    base = seg_base[b]
    for e in range(t, n * F, ROWS):
        i = e // F
        k = rank[i]
        if k >= 0:
            packed[base + k, e % F] = G[r0 + i, e % F]


@kernel(U1, L2, L1)
def _count_kernel(bitmap, lay, seg_count):
    b = cuda.grid(1)
    if b < seg_count.shape[0]:
        d, seg, r0, n = _segment(lay, b)
        c = 0
        for k in range(WORDS):
            if k * 32 < n:
                c += cuda.popc(bitmap[lay[2, d] + seg * WORDS + k])
        seg_count[b] = c


@kernel(U1, F2, L2, L1, I1, F2)
def _unpack_add_kernel(bitmap, packed, lay, seg_base, route, out):
    words = cuda.shared.array(WORDS, uint32)
    rank = cuda.shared.array(ROWS, int32)
    b = cuda.blockIdx.x
    t = cuda.threadIdx.x
    d, seg, r0, n = _segment(lay, b)
    _local_ranks(bitmap, lay, d, seg, n, t, words, rank)
    F = packed.shape[1]
    base = seg_base[b]
    for e in range(t, n * F, ROWS):
        i = e // F
        k = rank[i]
        if k >= 0:
            v = packed[base + k, e % F]
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


def _encode_cuda(G, lay):
    xp = array_module("cuda")
    _check_f32(G)
    nseg = int(lay[0, -1])
    bitmap = xp.zeros(int(lay[2, -1]), np.uint32)
    seg_count = xp.zeros(nseg, np.int64)
    lay_d = xp.asarray(lay)
    if nseg:
        _mark_kernel[nseg, ROWS](G, lay_d, bitmap, seg_count)
    counts_h = to_host(seg_count)  # the packed size must reach the host: scan there
    base = np.zeros(nseg + 1, np.int64)
    np.cumsum(counts_h, out=base[1:])
    packed = xp.empty((int(base[-1]), G.shape[1]), np.float32)
    if nseg and base[-1]:
        _pack_kernel[nseg, ROWS](G, lay_d, bitmap, xp.asarray(base[:-1]), packed)
    return bitmap, packed, np.diff(base[lay[0]])


def _decode_add_cuda(bitmap, packed, lay, route, out):
    xp = array_module("cuda")
    _check_f32(packed, out)
    route = _route32(route)
    nseg = int(lay[0, -1])
    if nseg == 0 or packed.shape[0] == 0:
        return
    lay_d = xp.asarray(lay)
    seg_count = xp.empty(nseg, np.int64)
    _count_kernel[(nseg + ROWS - 1) // ROWS, ROWS](bitmap, lay_d, seg_count)
    seg_base = xp.cumsum(seg_count) - seg_count
    _unpack_add_kernel[nseg, ROWS](bitmap, packed, lay_d, seg_base, route, out)


# --------------------------------------------------------------------------- CPU (same segments)

@njit(cache=True)
def _segment_cpu(lay, b):
    d = np.searchsorted(lay[0], b, side="right") - 1
    seg = b - lay[0, d]
    r0 = lay[1, d] + seg * ROWS
    return d, seg, r0, min(ROWS, lay[1, d + 1] - r0)


@njit(parallel=True, cache=True)
def _mark_cpu(G, lay, bitmap, seg_count):
    F = G.shape[1]
    for b in prange(seg_count.shape[0]):
        d, seg, r0, n = _segment_cpu(lay, b)
        c = 0
        for k in range((n + 31) // 32):
            w = np.uint32(0)
            for j in range(min(32, n - 32 * k)):
                r = r0 + 32 * k + j
                for f in range(F):
                    if G[r, f] != 0:
                        w |= np.uint32(1) << np.uint32(j)
                        c += 1
                        break
            bitmap[lay[2, d] + seg * WORDS + k] = w
        seg_count[b] = c


@njit(parallel=True, cache=True)
def _pack_cpu(G, lay, bitmap, seg_base, packed):
    for b in prange(seg_base.shape[0]):
        d, seg, r0, n = _segment_cpu(lay, b)
        p = seg_base[b]
        for i in range(n):
            if (bitmap[lay[2, d] + seg * WORDS + i // 32] >> np.uint32(i % 32)) & np.uint32(1):
                packed[p] = G[r0 + i]
                p += 1


@njit(cache=True)
def _unpack_add_cpu(bitmap, packed, lay, route, out):
    """Serial: several rows may add into the same output row."""
    p = 0
    for d in range(lay.shape[1] - 1):
        w0 = lay[2, d]
        r0 = lay[1, d]
        for i in range(lay[1, d + 1] - r0):
            if (bitmap[w0 + i // 32] >> np.uint32(i % 32)) & np.uint32(1):
                if p >= packed.shape[0]:
                    raise ValueError("decode_add: the bitmap sets more rows than packed holds")
                o = route[r0 + i]
                for f in range(packed.shape[1]):
                    v = packed[p, f]
                    if v != 0:
                        out[o, f] += v
                p += 1
    return p


@njit(cache=True)
def _scatter_add_cpu(rows, route, out):
    for i in range(rows.shape[0]):
        o = route[i]
        for f in range(rows.shape[1]):
            v = rows[i, f]
            if v != 0:
                out[o, f] += v


# --------------------------------------------------------------------------- public API

def encode(G, counts, backend=None):
    """Zero-eliding encoding of rows ``G`` (M x F) grouped by destination (``counts``).

    Returns ``(bitmap, packed, packed_counts)``: uint32 words with
    ``ceil(counts[d]/32)`` per chunk, the non-zero rows in order, and kept rows
    per destination (int64 numpy).  Arrays are of ``G``'s kind (CuPy or numpy).
    """
    lay = _layout(counts)
    if G.ndim != 2 or G.shape[0] != lay[1, -1]:
        raise ValueError(f"encode: G of shape {G.shape} does not hold the {lay[1, -1]} rows of counts")
    if _use_cuda(G, backend):
        return _encode_cuda(G, lay)
    G = np.ascontiguousarray(G)
    nseg = int(lay[0, -1])
    bitmap = np.zeros(int(lay[2, -1]), np.uint32)
    seg_count = np.zeros(nseg, np.int64)
    _mark_cpu(G, lay, bitmap, seg_count)
    base = np.zeros(nseg + 1, np.int64)
    np.cumsum(seg_count, out=base[1:])
    packed = np.empty((int(base[-1]), G.shape[1]), G.dtype)
    _pack_cpu(G, lay, bitmap, base[:-1], packed)
    return bitmap, packed, np.diff(base[lay[0]])


def decode_add(bitmap, packed, counts, route, out, backend=None):
    """``out[route[i]] += packed row`` for every set bit i, chunk by chunk.

    ``counts`` are the dense row counts per source (what ``encode`` was given
    on the senders, i.e. the dense ``recv_counts``); ``route`` (one integer per
    dense row; int32 avoids a conversion on the GPU) names each row's target row
    of ``out``.  No dense block is built.
    """
    lay = _layout(counts)
    if bitmap.shape[0] != lay[2, -1] or route.shape[0] != lay[1, -1]:
        raise ValueError(f"decode_add: {bitmap.shape[0]} bitmap words / {route.shape[0]} routes for counts "
                         f"{np.asarray(counts).tolist()} (want {lay[2, -1]} / {lay[1, -1]})")
    if packed.ndim != 2 or out.ndim != 2 or packed.shape[1] != out.shape[1]:
        raise ValueError(f"decode_add: packed {packed.shape} and out {out.shape} differ in width")
    if _use_cuda(out, backend):
        _decode_add_cuda(bitmap, packed, lay, route, out)
        return
    used = _unpack_add_cpu(bitmap, np.ascontiguousarray(packed), lay, route, out)
    if used != packed.shape[0]:
        raise ValueError(f"decode_add: the bitmap sets {used} rows, packed holds {packed.shape[0]}")


def scatter_add(rows, route, out, backend=None):
    """``out[route[i]] += rows[i]`` (duplicates in ``route`` add up)."""
    if rows.shape[0] != route.shape[0]:
        raise ValueError(f"scatter_add: {rows.shape[0]} rows, {route.shape[0]} routes")
    if _use_cuda(out, backend):
        _check_f32(rows, out)
        route = _route32(route)
        n = rows.shape[0] * rows.shape[1]
        if n:
            _scatter_add_kernel[(n + ROWS - 1) // ROWS, ROWS](rows, route, out)
        return
    _scatter_add_cpu(np.ascontiguousarray(rows), route, out)


def _sync(a):
    if not isinstance(a, np.ndarray):
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def exchange_sparse(exchange, G, counts, route_recv, out, backend=None):
    """Send gradient rows ``G`` (grouped by destination) as bitmap + packed rows; add them into ``out``.

    One Alltoall of (dense, kept) counts, then one alltoallv whose message to
    each rank is its chunk's bitmap words followed by its packed rows (as
    32-bit words), then ``decode_add``.
    Returns stats: bytes sent dense/sparse, zero-row fraction, seconds per phase.
    """
    _sync(G)  # the phases' times exclude the still-running work that produced G
    t0 = time.perf_counter()
    bitmap, packed, kept = encode(G, counts, backend)
    t1 = time.perf_counter()
    counts = np.asarray(counts, np.int64)
    got = exchange.alltoall_ints(np.stack([counts, kept], axis=1))
    recv_counts, recv_kept = got[:, 0].copy(), got[:, 1].copy()
    if route_recv.shape[0] != recv_counts.sum():
        raise ValueError(f"exchange_sparse: route_recv has {route_recv.shape[0]} rows, "
                         f"{recv_counts.sum()} arrive")
    F = G.shape[1]
    words = F * G.dtype.itemsize // 4  # a row's 32-bit words: the message is words, copied bit-exactly
    message = _interleave(bitmap, word_counts(counts), packed.reshape(-1).view(np.uint32), kept * words)
    got, _ = exchange.alltoallv(message, word_counts(counts) + kept * words,
                                word_counts(recv_counts) + recv_kept * words)
    rbitmap, rpacked = _split(got, word_counts(recv_counts), recv_kept * words)
    _sync(rpacked)  # an NCCL transfer runs on the stream: time it here, not in the decoder
    t2 = time.perf_counter()
    decode_add(rbitmap, rpacked.view(G.dtype).reshape(-1, F), recv_counts, route_recv, out, backend)
    _sync(out)
    t3 = time.perf_counter()
    rows = int(counts.sum())
    return {
        "dense_bytes": int(G.nbytes),
        "sparse_bytes": int(bitmap.nbytes + packed.nbytes),
        "zero_fraction": 1.0 - int(kept.sum()) / rows if rows else 0.0,
        "t_encode": t1 - t0, "t_exchange": t2 - t1, "t_decode": t3 - t2,
    }


def _interleave(a, a_counts, b, b_counts):
    """One 1D array: chunk 0 of a, chunk 0 of b, chunk 1 of a, ... (chunks of the given lengths)."""
    xp = array_module_of(a)
    ao, bo = np.cumsum(a_counts) - a_counts, np.cumsum(b_counts) - b_counts
    parts = [a[:0]]
    for d in range(len(a_counts)):
        parts += [a[ao[d]:ao[d] + a_counts[d]], b[bo[d]:bo[d] + b_counts[d]]]
    return xp.concatenate(parts)


def _split(m, a_counts, b_counts):
    """The inverse of ``_interleave``: (a, b)."""
    xp = array_module_of(m)
    start = np.cumsum(a_counts + b_counts) - (a_counts + b_counts)
    a = [m[:0]] + [m[s:s + n] for s, n in zip(start, a_counts)]
    b = [m[:0]] + [m[s + na:s + na + n] for s, na, n in zip(start, a_counts, b_counts)]
    return xp.concatenate(a), xp.concatenate(b)


def exchange_dense(exchange, G, counts, route_recv, out, backend=None):
    """Same result as ``exchange_sparse`` by sending every row: alltoallv of ``G``, scatter-add by route.

    Same stats keys; ``zero_fraction`` is None (not measured: it would cost a pass over ``G``).
    """
    _sync(G)
    t0 = time.perf_counter()
    recv, recv_counts = exchange.alltoallv(G, counts)
    if route_recv.shape[0] != recv.shape[0]:
        raise ValueError(f"exchange_dense: route_recv has {route_recv.shape[0]} rows, {recv.shape[0]} arrive")
    _sync(recv)
    t1 = time.perf_counter()
    scatter_add(recv, route_recv, out, backend)
    _sync(out)
    t2 = time.perf_counter()
    return {
        "dense_bytes": int(G.nbytes), "sparse_bytes": int(G.nbytes), "zero_fraction": None,  # not measured
        "t_encode": 0.0, "t_exchange": t1 - t0, "t_decode": t2 - t1,
    }
