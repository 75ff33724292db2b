"""The zero-eliding gradient messages' CPU kernels (``comm.sparse``; format in
``numbasplat.math.sparse``): ``njit`` loops over the same 256-row segments as the CUDA
kernels, so both give identical messages.
"""
import numpy as np
from numba import njit, prange

from ..math.sparse import ROWS, WORDS, layout, message_parts, row_words, segment_bases, word_counts


@njit(cache=True)
def _segment(lay, b):
    d = np.searchsorted(lay[0], b, side="right") - 1
    seg = b - lay[0, d]
    r0 = lay[1, d] + seg * ROWS
    return d, seg, r0, min(ROWS, lay[1, d + 1] - r0)


@njit(parallel=True, cache=True)
def _count(G, lay, keep, seg_count):
    F = G.shape[1]
    for b in prange(seg_count.shape[0]):
        d, seg, r0, n = _segment(lay, b)
        c = 0
        for r in range(r0, r0 + n):
            for f in range(F):
                if G[r, f] != 0:
                    keep[r] = True
                    c += 1
                    break
        seg_count[b] = c


@njit(parallel=True, cache=True)
def _pack(keep, G_words, lay, seg_base, msg):
    W = G_words.shape[1]
    for b in prange(seg_base.shape[0]):
        d, seg, r0, n = _segment(lay, b)
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
def _unpack_add(bitmap, packed, lay, route, out):
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
def _scatter_add(rows, route, out):
    for i in range(rows.shape[0]):
        o = route[i]
        for f in range(rows.shape[1]):
            v = rows[i, f]
            if v != 0:
                out[o, f] += v


def encode(G, counts):
    """(message, sizes, kept) of rows ``G`` grouped by destination (``counts``, int64)."""
    G = np.ascontiguousarray(G)
    lay = layout(counts)
    keep = np.zeros(G.shape[0], np.bool_)
    seg_count = np.zeros(int(lay[0, -1]), np.int64)
    _count(G, lay, keep, seg_count)
    kept, seg_base = segment_bases(lay, seg_count)
    lay = layout(counts, kept, row_words(G))
    msg = np.empty(int(lay[2, -1]), np.uint32)
    _pack(keep, G.view(np.uint32).reshape(G.shape[0], row_words(G)), lay, seg_base, msg)
    return msg, np.diff(lay[2]), kept


def decode_add(message, counts, kept, lay, route, out):
    """out[route[row]] += each kept row of the messages (``lay``: their layout)."""
    bitmap, _, packed = message_parts(message, counts, kept, out.shape[1], out.dtype)
    lay = lay.copy()
    lay[2, 1:] = np.cumsum(word_counts(counts))
    used = _unpack_add(bitmap, packed, lay, route, out)
    if used != packed.shape[0]:
        raise ValueError(f"decode_add: the bitmaps set {used} rows, the messages hold {packed.shape[0]}")


def scatter_add(rows, route, out):
    """out[route[i]] += rows[i]."""
    _scatter_add(np.ascontiguousarray(rows), route, out)
