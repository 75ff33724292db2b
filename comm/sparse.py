"""ByteSplat's zero-eliding gradient encoding, and the gradient exchanges built on it.

Most gradient records sent back to a Gaussian's owner are all zero (the
Gaussian was projected but touched no pixel), so instead of the dense rows we
send one bit per row plus the non-zero rows ("packed"), and the receiver adds
each packed row straight into its gradient rows, never rebuilding the dense
block.

Message format, per destination chunk of ``n = counts[d]`` rows, all 32-bit
words (a chunk is one message of the alltoallv):

  bitmap  ceil(n/32) words; bit ``i % 32`` of word ``i // 32`` is row i,
          least significant bit first.  A row is kept iff any field is
          ``!= 0`` (NaN is kept, -0.0 is not).
  bases   ceil(n/256) words: kept rows of the chunk before each segment.
  rows    the kept rows in order, as their raw 32-bit words.

Chunks are cut into segments of ``ROWS`` = 256 rows (one CUDA block each, 8
bitmap words).  The bases let every block of the decoder find its segment's
rows without a scan, so the receiver decodes a message with one kernel
straight from the receive buffer.  GPU encode: a count kernel (per-segment
kept rows), one device-to-host copy (message sizes must reach the host
anyway), a pack kernel that writes the messages in place.  Both backends give
identical messages.
"""
import time

import numpy as np
from numba import cuda, int32, njit, prange, uint32

from numbasplat._backend import BACKEND, SIM, array_module, to_host
from numbasplat.launch import kernel

ROWS = 256          # rows per segment = threads per block
WORDS = ROWS // 32  # bitmap words per segment

F2 = "float32[:, ::1]"
F1 = "float32[::1]"
U1 = "uint32[::1]"
I1 = "int32[::1]"
L1 = "int64[::1]"
L2 = "int64[:, ::1]"


# --------------------------------------------------------------------------- layout

def word_counts(counts):
    """Bitmap words per chunk: ``ceil(counts / 32)``."""
    return (np.asarray(counts, np.int64) + 31) // 32


def _layout(counts, kept=None, row_words=0):
    """(3, P+1) int64: segment, row and message-word offsets of each chunk (the last needs ``kept``)."""
    counts = np.asarray(counts, np.int64).reshape(-1)
    if (counts < 0).any():
        raise ValueError(f"negative row count in {counts.tolist()}")
    lay = np.zeros((3, counts.size + 1), np.int64)
    segments = (counts + ROWS - 1) // ROWS
    np.cumsum(segments, out=lay[0, 1:])
    np.cumsum(counts, out=lay[1, 1:])
    if kept is not None:
        np.cumsum(word_counts(counts) + segments + np.asarray(kept, np.int64) * row_words, out=lay[2, 1:])
    return lay


def message_sizes(counts, kept, row_words):
    """Words of each chunk's message."""
    return np.diff(_layout(counts, kept, row_words)[2])


def _row_words(a):
    return a.shape[1] * a.dtype.itemsize // 4


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


def _segment_bases(lay, seg_count):
    """(kept rows per chunk, each segment's kept rows before it in its chunk), from per-segment counts."""
    before = np.zeros(seg_count.size + 1, np.int64)
    np.cumsum(seg_count, out=before[1:])
    kept = before[lay[0, 1:]] - before[lay[0, :-1]]
    chunk_start = np.repeat(before[lay[0, :-1]], np.diff(lay[0]))
    return kept, before[:-1] - chunk_start


def _encode_cuda(G, counts):
    xp = array_module("cuda")
    _check_f32(G)
    lay = _layout(counts)
    nseg = int(lay[0, -1])
    seg_count = xp.empty(nseg, np.int64)  # every block writes its own
    if nseg:
        _count_kernel[nseg, ROWS](G, xp.asarray(lay), seg_count)
    kept, seg_base = _segment_bases(lay, to_host(seg_count))  # message sizes must reach the host
    lay = _layout(counts, kept, G.shape[1])
    plan = xp.asarray(np.concatenate([lay.reshape(-1), seg_base]))  # one host-to-device copy
    msg = xp.empty(int(lay[2, -1]), np.uint32)
    if nseg:
        words = cuda.to_device(msg) if SIM else msg  # the simulator copies numpy arguments: share its array
        _pack_kernel[nseg, ROWS](G, plan[:lay.size].reshape(lay.shape), plan[lay.size:], words,
                                 words.view(np.float32))
        msg = words.copy_to_host() if SIM else msg
    return msg, np.diff(lay[2]), kept


def _decode_add_cuda(msg, lay, route, out):
    xp = array_module("cuda")
    _check_f32(out)
    nseg = int(lay[0, -1])
    if nseg:
        _unpack_add_kernel[nseg, ROWS](msg, msg.view(np.float32), xp.asarray(lay), _route32(route), out)


# --------------------------------------------------------------------------- CPU (same segments)

@njit(cache=True)
def _segment_cpu(lay, b):
    d = np.searchsorted(lay[0], b, side="right") - 1
    seg = b - lay[0, d]
    r0 = lay[1, d] + seg * ROWS
    return d, seg, r0, min(ROWS, lay[1, d + 1] - r0)


@njit(parallel=True, cache=True)
def _count_cpu(G, lay, keep, seg_count):
    F = G.shape[1]
    for b in prange(seg_count.shape[0]):
        d, seg, r0, n = _segment_cpu(lay, b)
        c = 0
        for r in range(r0, r0 + n):
            for f in range(F):
                if G[r, f] != 0:
                    keep[r] = True
                    c += 1
                    break
        seg_count[b] = c


@njit(parallel=True, cache=True)
def _pack_cpu(keep, G_words, lay, seg_base, msg):
    W = G_words.shape[1]
    for b in prange(seg_base.shape[0]):
        d, seg, r0, n = _segment_cpu(lay, b)
        m0 = lay[2, d]
        nw = (lay[1, d + 1] - lay[1, d] + 31) // 32
        msg[m0 + nw + seg] = seg_base[b]
        p = m0 + nw + (lay[0, d + 1] - lay[0, d]) + seg_base[b] * W
        for k in range((n + 31) // 32):
            w = np.uint32(0)
            for j in range(min(32, n - 32 * k)):
                r = r0 + 32 * k + j
                if keep[r]:
                    w |= np.uint32(1) << np.uint32(j)
                    msg[p:p + W] = G_words[r]
                    p += W
            msg[m0 + seg * WORDS + k] = w


@njit(cache=True)
def _unpack_add_cpu(bitmap, packed, lay, route, out):
    """Serial (several rows may add into the same output row); ``lay[2]``: bitmap-word offsets."""
    p = 0
    for d in range(lay.shape[1] - 1):
        w0 = lay[2, d]
        r0 = lay[1, d]
        for i in range(lay[1, d + 1] - r0):
            if (bitmap[w0 + i // 32] >> np.uint32(i % 32)) & np.uint32(1):
                if p >= packed.shape[0]:
                    raise ValueError("decode_add: the bitmaps set more rows than the messages hold")
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

    Returns ``(message, sizes, kept)``: the uint32 words of every chunk's
    message (format above) back to back, of ``G``'s kind (CuPy or numpy); the
    words and the kept rows per destination (int64 numpy).
    """
    counts = np.asarray(counts, np.int64).reshape(-1)
    if G.ndim != 2 or G.shape[0] != counts.sum():
        raise ValueError(f"encode: G of shape {G.shape} does not hold the {counts.sum()} rows of counts")
    if _use_cuda(G, backend):
        return _encode_cuda(G, counts)
    G = np.ascontiguousarray(G)
    lay = _layout(counts)
    keep = np.zeros(G.shape[0], np.bool_)
    seg_count = np.zeros(int(lay[0, -1]), np.int64)
    _count_cpu(G, lay, keep, seg_count)
    kept, seg_base = _segment_bases(lay, seg_count)
    lay = _layout(counts, kept, _row_words(G))
    msg = np.empty(int(lay[2, -1]), np.uint32)
    _pack_cpu(keep, G.view(np.uint32).reshape(G.shape[0], _row_words(G)), lay, seg_base, msg)
    return msg, np.diff(lay[2]), kept


def message_parts(message, counts, kept, width, dtype=np.float32):
    """(bitmap, bases, packed rows) of encoded messages, each part's chunks back to back (host arrays)."""
    message = to_host(message)
    lay = _layout(counts, kept, width * np.dtype(dtype).itemsize // 4)
    nw, ns = word_counts(counts), np.diff(lay[0])
    parts = [[], [], []]
    for d, m0 in enumerate(lay[2, :-1]):
        ends = np.cumsum([m0, nw[d], ns[d]])
        for part, a, b in zip(parts, ends, list(ends[1:]) + [lay[2, d + 1]]):
            part.append(message[a:b])
    bitmap, bases, rows = (np.concatenate(p) if p else np.zeros(0, np.uint32) for p in parts)
    return bitmap, bases, rows.view(dtype).reshape(-1, width)


def decode_add(message, counts, kept, route, out, backend=None):
    """``out[route[i]] += row i`` for every kept row i of the messages, chunk by chunk.

    ``counts`` and ``kept`` are the dense and kept row counts per source (what
    ``encode`` was given and returned on the senders); ``route`` (one integer
    per dense row; int32 avoids a conversion on the GPU) names each row's
    target row of ``out``.  No dense block is built.
    """
    counts = np.asarray(counts, np.int64).reshape(-1)
    lay = _layout(counts, kept, _row_words(out) if out.ndim == 2 else 0)
    if message.ndim != 1 or message.shape[0] != lay[2, -1] or route.shape[0] != lay[1, -1]:
        raise ValueError(f"decode_add: {message.shape} message words / {route.shape[0]} routes for counts "
                         f"{counts.tolist()}, kept {np.asarray(kept).tolist()} and rows of {out.shape[-1]} "
                         f"(want {lay[2, -1]} / {lay[1, -1]})")
    if _use_cuda(out, backend):
        _decode_add_cuda(message, lay, route, out)
        return
    bitmap, _, packed = message_parts(message, counts, kept, out.shape[1], out.dtype)
    lay[2, 1:] = np.cumsum(word_counts(counts))
    used = _unpack_add_cpu(bitmap, packed, lay, route, out)
    if used != packed.shape[0]:
        raise ValueError(f"decode_add: the bitmaps set {used} rows, the messages hold {packed.shape[0]}")


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


def _sync(a, timed=True):
    """Wait for the device work on ``a``, when the phases are timed (else the host runs ahead)."""
    if timed and not isinstance(a, np.ndarray):
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def exchange_sparse(exchange, G, counts, route_recv, out, backend=None, timed=True):
    """Send gradient rows ``G`` (grouped by destination) as zero-eliding messages; add them into ``out``.

    One Alltoall of (dense, kept) counts, then one alltoallv of the messages
    (``encode``), decoded straight from the receive buffer (``decode_add``).
    Returns stats: bytes sent dense/sparse, zero-row fraction, seconds per phase (the device's
    with ``timed``, which syncs at each phase's end; else the host's).
    """
    _sync(G, timed)  # the phases' times exclude the still-running work that produced G
    t0 = time.perf_counter()
    message, sizes, kept = encode(G, counts, backend)
    t1 = time.perf_counter()
    counts = np.asarray(counts, np.int64)
    got = exchange.alltoall_ints(np.stack([counts, kept], axis=1))
    recv_counts, recv_kept = got[:, 0].copy(), got[:, 1].copy()
    if route_recv.shape[0] != recv_counts.sum():
        raise ValueError(f"exchange_sparse: route_recv has {route_recv.shape[0]} rows, "
                         f"{recv_counts.sum()} arrive")
    received, _ = exchange.alltoallv(message, sizes, message_sizes(recv_counts, recv_kept, _row_words(G)))
    _sync(received, timed)  # an NCCL transfer runs on the stream: time it here, not in the decoder
    t2 = time.perf_counter()
    decode_add(received, recv_counts, recv_kept, route_recv, out, backend)
    _sync(out, timed)
    t3 = time.perf_counter()
    rows = int(counts.sum())
    return {
        "dense_bytes": int(G.nbytes),
        "sparse_bytes": int(message.nbytes),
        "zero_fraction": 1.0 - int(kept.sum()) / rows if rows else 0.0,
        "t_encode": t1 - t0, "t_exchange": t2 - t1, "t_decode": t3 - t2,
    }


def exchange_dense(exchange, G, counts, route_recv, out, backend=None, timed=True, recv_counts=None):
    """Same result as ``exchange_sparse`` by sending every row: alltoallv of ``G``, scatter-add by route.
    ``recv_counts``, when the caller knows them, saves the exchange of the counts.

    Same stats keys; ``zero_fraction`` is None (not measured: it would cost a pass over ``G``).
    """
    _sync(G, timed)
    t0 = time.perf_counter()
    recv, recv_counts = exchange.alltoallv(G, counts, recv_counts)
    if route_recv.shape[0] != recv.shape[0]:
        raise ValueError(f"exchange_dense: route_recv has {route_recv.shape[0]} rows, {recv.shape[0]} arrive")
    _sync(recv, timed)
    t1 = time.perf_counter()
    scatter_add(recv, route_recv, out, backend)
    _sync(out, timed)
    t2 = time.perf_counter()
    return {
        "dense_bytes": int(G.nbytes), "sparse_bytes": int(G.nbytes), "zero_fraction": None,  # not measured
        "t_encode": 0.0, "t_exchange": t1 - t0, "t_decode": t2 - t1,
    }
