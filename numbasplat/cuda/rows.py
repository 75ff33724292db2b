"""Kernels over the rows of a row table (the out-of-core trainer's layout, ``numbasplat.math.rows``),
the CUDA twins of ``numbasplat.cpu.rows``: the moves of rows between a row table and the flat
buffers, a thread per table element; the rows of a pool of block slots that a set of blocks holds;
the boxes that row segments reach, a block per segment; and Gaussian noise for rows by their global
index (``numbasplat.math.noise``), a thread per element."""
import numpy as np
from numba import cuda, float32

from ..math.noise import hashed_normal
from ..math.rows import move_element, pool_row, row_reach
from .launch import F1, F2, I1, I2, L1, array_module, kernel, per_item

INF = float32(float("inf"))
_move_element = cuda.jit(device=True, inline=True)(move_element)


@kernel(F2, L1, I2, F1, "boolean")
def _move_rows_kernel(table, rows, plan, flat, to_flat):
    n, cols = rows.shape[0], plan.shape[1]
    i = cuda.grid(1)
    if i < n * cols:
        _move_element(table, rows, plan, flat, to_flat, n, i // cols, i % cols)


def move_rows(table, rows, plan, flat, to_flat):
    """Between rows ``rows`` of ``table`` and ``flat``, a thread per element (``numbasplat.cpu.move_rows``)."""
    if rows.shape[0]:
        _move_rows_kernel[per_item(rows.shape[0] * plan.shape[1])](table, rows, plan, flat, to_flat)


@kernel(I1, L1, I1)
def _has_slot_kernel(block, slot, flags):
    r = cuda.grid(1)
    if r < block.shape[0]:
        flags[r] = 1 if slot[block[r]] >= 0 else 0


@kernel(I1, I1, L1, "int64", I1, L1)
def _pool_rows_kernel(block, position, slot, block_rows, ends, out):
    r = cuda.grid(1)
    if r < block.shape[0]:
        s = slot[block[r]]
        if s >= 0:
            out[ends[r] - 1] = pool_row(s, block_rows, position[r])


def pool_rows(block, position, slot, block_rows, out):
    """``numbasplat.cpu.pool_rows`` (``block``, ``position`` int32): which rows have a slot, their
    running count (a scan, int32: 8 bytes a row for the two, as the out-of-core trainer budgets),
    each one's pool row written at its count."""
    n = block.shape[0]
    if n:
        flags = array_module().empty(n, np.int32)
        _has_slot_kernel[per_item(n)](block, slot, flags)
        ends = array_module().cumsum(flags, dtype=np.int32)
        _pool_rows_kernel[per_item(n)](block, position, slot, np.int64(block_rows), ends, out)


BOX_THREADS = 128  # threads reducing one segment's box


@kernel(F2, L1, L1, "int64", "int64", "float32", F2, F2)
def _reach_boxes_kernel(table, starts, sizes, means_col, scales_col, reach_sigmas, lo, hi):
    red = cuda.shared.array((6, BOX_THREADS), float32)   # each thread's lows (0-2) and negated highs (3-5)
    b, t = cuda.blockIdx.x, cuda.threadIdx.x
    for k in range(6):
        red[k, t] = INF
    for r in range(starts[b] + t, starts[b] + sizes[b], BOX_THREADS):
        reach = row_reach(table[r, scales_col], table[r, scales_col + 1], table[r, scales_col + 2], reach_sigmas)
        for d in range(3):
            c = table[r, means_col + d]
            red[d, t] = min(red[d, t], c - reach)
            red[3 + d, t] = min(red[3 + d, t], -(c + reach))
    cuda.syncthreads()
    half = BOX_THREADS // 2
    while half > 0:
        if t < half:
            for k in range(6):
                red[k, t] = min(red[k, t], red[k, t + half])
        cuda.syncthreads()
        half //= 2
    if t < 3:
        lo[b, t] = red[t, 0]
        hi[b, t] = -red[3 + t, 0]


def reach_boxes(table, starts, sizes, means_col, scales_col, reach_sigmas, lo, hi):
    """The boxes of ``table``'s row segments, a block per segment (``numbasplat.cpu.reach_boxes``)."""
    if starts.shape[0]:
        _reach_boxes_kernel[starts.shape[0], BOX_THREADS](table, starts, sizes, means_col, scales_col,
                                                          reach_sigmas, lo, hi)


@kernel("int64", "int64", "int64", L1, F2)
def _row_normals_kernel(key, offset, stride, rows, out):
    width = out.shape[1]
    i = cuda.grid(1)
    if i < rows.shape[0] * width:
        j, c = i // width, i % width
        out[j, c] = hashed_normal(key, (offset + stride * rows[j]) * width + c)


def row_normals(key, offset, stride, rows, out):
    """The standard normal draws of ``numbasplat.cpu.row_normals``, a thread per element."""
    if rows.shape[0]:
        _row_normals_kernel[per_item(rows.shape[0] * out.shape[1])](key, offset, stride, rows, out)
