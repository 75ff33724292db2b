"""Kernels over the rows of a row table (the out-of-core trainer's layout, ``numbasplat.math.rows``),
each an ``njit`` loop, parallel over rows or segments: the moves of rows between a row table and the
flat buffers, the rows of a pool of block slots that a set of blocks holds, the boxes that row
segments reach, Gaussian noise for rows by their global index (``numbasplat.math.noise``), and the
host's own copies of columns between the rows of two host tables (``copy_table_rows``: the out-of-core
tiers' gathers and scatters, on every core)."""
import numpy as np
from numba import njit, prange

from ..math.noise import hashed_normal
from ..math.rows import move_element, pool_row, row_reach

_move_element = njit(inline="always")(move_element)


@njit(parallel=True, cache=True)
def move_rows(table, rows, plan, flat, to_flat):
    """Between rows ``rows`` of ``table`` and ``flat`` (``to_flat``: table -> flat, else back): for each
    column (a, b, d, j) of ``plan``, column j of row r is flat element flat_element(n, r, a, b, d)."""
    n = rows.shape[0]
    for r in prange(n):
        for c in range(plan.shape[1]):
            _move_element(table, rows, plan, flat, to_flat, n, r, c)


POOL_ROWS_CHUNK = 1 << 16  # rows a thread scans at a time in ``pool_rows``


@njit(parallel=True, cache=True)
def pool_rows(block, position, slot, block_rows, out):
    """``out``: the pool rows of the rows whose block has a slot (``slot[block[r]]`` >= 0), in row
    order: chunks of rows counted, then filled, in parallel."""
    n = block.shape[0]
    chunks = (n + POOL_ROWS_CHUNK - 1) // POOL_ROWS_CHUNK
    ends = np.zeros(chunks + 1, np.int64)
    for c in prange(chunks):
        k = 0
        for r in range(c * POOL_ROWS_CHUNK, min(n, (c + 1) * POOL_ROWS_CHUNK)):
            if slot[block[r]] >= 0:
                k += 1
        ends[c + 1] = k
    for c in range(chunks):
        ends[c + 1] += ends[c]
    if ends[chunks] != out.shape[0]:
        raise ValueError("pool_rows: out's length is not the count of rows with a slot")
    for c in prange(chunks):
        k = ends[c]
        for r in range(c * POOL_ROWS_CHUNK, min(n, (c + 1) * POOL_ROWS_CHUNK)):
            s = slot[block[r]]
            if s >= 0:
                out[k] = pool_row(s, block_rows, position[r])
                k += 1


@njit(parallel=True, cache=True)
def reach_boxes(table, starts, sizes, means_col, scales_col, reach_sigmas, lo, hi):
    """Box b (``lo``/``hi`` (B, 3), float32) of rows ``starts[b]`` .. ``starts[b] + sizes[b]`` of
    ``table``: the smallest holding every row's centre (columns ``means_col``..+3) -+ its reach
    (``row_reach`` of columns ``scales_col``..+3); empty segments get (inf, -inf)."""
    for b in prange(starts.shape[0]):
        for d in range(3):
            lo[b, d] = np.inf
            hi[b, d] = -np.inf
        for r in range(starts[b], starts[b] + sizes[b]):
            reach = row_reach(table[r, scales_col], table[r, scales_col + 1], table[r, scales_col + 2],
                              reach_sigmas)
            for d in range(3):
                c = table[r, means_col + d]
                lo[b, d] = min(lo[b, d], c - reach)
                hi[b, d] = max(hi[b, d], c + reach)


@njit(parallel=True, cache=True)
def row_normals(key, offset, stride, rows, out):
    """``out[j, c]``: the standard normal draw under ``key`` for column c of global row
    ``offset + stride * rows[j]`` (element (global row) * width + c, width ``out.shape[1]``)."""
    width = out.shape[1]
    for j in prange(rows.shape[0]):
        first = (offset + stride * rows[j]) * width
        for c in range(width):
            out[j, c] = hashed_normal(key, first + c)


@njit(parallel=True, cache=True)
def copy_table_rows(src, src_rows, dst, dst_rows, spans, n):
    """``dst[dst_rows[j], c:c + k] = src[src_rows[j], a:a + k]`` for j < ``n`` and every span (a, c, k) of
    ``spans`` ((S, 3) int64), parallel over j (``dst_rows`` distinct); rows given empty: j itself."""
    for i in prange(n):
        j = np.int64(i)
        r = src_rows[j] if src_rows.shape[0] else j
        q = dst_rows[j] if dst_rows.shape[0] else j
        for s in range(spans.shape[0]):
            a, c = spans[s, 0], spans[s, 1]
            for k in range(spans[s, 2]):
                dst[q, c + k] = src[r, a + k]
