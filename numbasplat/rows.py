"""Kernels over the rows of a row table: the out-of-core trainer keeps a Gaussian as one row (its
parameters, both Adam moments and its statistics side by side: ``numbasplat.math.rows``) and trains
on flat buffers (``optim.FlatParams``'s layout).  Here: the moves of rows between a table and the
flat buffers (``rows_to_flat``, ``flat_to_rows``), the rows of a pool of block slots that a set of
blocks holds (``pool_rows``), the boxes that row segments reach (``reach_boxes``), and Gaussian
noise for rows by their global index (``row_normals``), each one kernel of the backend
(``numbasplat.cpu.rows``, ``numbasplat.cuda.rows``); and the host's copies of rows between two host
tables (``copy_host_rows``), the CPU backend's kernel on every core whatever the backend.
"""
import numpy as np

from . import backend as _backend


def rows_to_flat(table, rows, plan, flat, backend=None):
    """Rows ``rows`` (int64) of the row ``table`` (float32, (R, C)) into ``flat`` (float32, len(rows) * C),
    in one kernel; ``plan`` (4, C) int32: each moving column's (a, b, d, j) of ``numbasplat.math.rows``.  The
    out-of-core trainer's working set, from its pool of blocks, as flat buffers back to back."""
    _backend.kernels(backend or _backend.backend_of(table)).move_rows(table, rows, plan, flat, True)


def flat_to_rows(flat, rows, plan, table, backend=None):
    """The inverse of ``rows_to_flat``: ``flat`` into rows ``rows`` of ``table``, in one kernel."""
    _backend.kernels(backend or _backend.backend_of(table)).move_rows(table, rows, plan, flat, False)


def pool_rows(block, position, slot, block_rows, total, backend=None):
    """-> (``total``,) int64 on ``block``'s device: ``slot[block[r]] * block_rows + position[r]`` for
    every row r whose block has a slot (>= 0), in row order (``block``, ``position``: (N,) int32, each
    row's block and its place in it; ``slot``: (B,) int64, each block's slot or -1).  The out-of-core
    trainer's working set in its pool of blocks, in model order; ``total`` (the rows with a slot)
    comes from the host, which knows the blocks' sizes, so the device is not waited for."""
    backend = backend or _backend.backend_of(block)
    out = _backend.array_module(backend).empty(int(total), np.int64)
    _backend.kernels(backend).pool_rows(block, position, slot, int(block_rows), out)
    return out


def reach_boxes(table, starts, sizes, means_col, scales_col, reach_sigmas, backend=None):
    """-> (lo, hi), float32 (B, 3) on ``table``'s device: for each segment b of the row ``table``
    (float32 (R, C); rows ``starts[b]`` .. ``starts[b] + sizes[b]``, int64), the box that its rows
    reach, every centre (columns ``means_col``..+3) -+ ``reach_sigmas`` times its largest scale
    (log-scales in columns ``scales_col``..+3); (inf, -inf) for an empty segment.  One kernel: the
    out-of-core trainer's block boxes, from the device's pool after a step or from the host's rows."""
    backend = backend or _backend.backend_of(table)
    xp = _backend.array_module(backend)
    lo, hi = xp.empty((len(starts), 3), np.float32), xp.empty((len(starts), 3), np.float32)
    _backend.kernels(backend).reach_boxes(table, starts, sizes, int(means_col), int(scales_col),
                                          np.float32(reach_sigmas), lo, hi)
    return lo, hi


def row_normals(key, rows, width, offset=0, stride=1, backend=None):
    """-> (len(rows), ``width``) float32 standard normal draws on ``rows``' device, in one kernel:
    row j's are those of global row ``offset + stride * rows[j]`` under ``key`` (an int below 2**63;
    ``numbasplat.math.noise``), so a rank holding some rows of a sharded model draws what one process
    holding them all would, and nothing is drawn for rows it does not hold."""
    backend = backend or _backend.backend_of(rows)
    xp = _backend.array_module(backend)
    rows = xp.ascontiguousarray(rows, dtype=np.int64)
    out = xp.empty((len(rows), int(width)), np.float32)
    _backend.kernels(backend).row_normals(int(key), int(offset), int(stride), rows, out)
    return out


def copy_host_rows(src, src_rows, dst, dst_rows=None, spans=None):
    """``dst[dst_rows[j], c:c + k] = src[src_rows[j], a:a + k]`` for every j and each span (a, c, k) of
    ``spans`` (``src``'s first column, ``dst``'s first column, columns; None: whole rows of one width), in one
    parallel kernel on the host (numpy's fancy indexing is single-threaded: the out-of-core tiers move
    gigabytes a step this way).  ``src``, ``dst``: float32 host tables; ``src_rows``, ``dst_rows``: row numbers
    (None: 0, 1, ...; ``dst_rows`` distinct)."""
    n = len(src_rows) if src_rows is not None else len(dst_rows) if dst_rows is not None else len(src)
    if src_rows is not None and dst_rows is not None and len(dst_rows) != n:
        raise ValueError(f"copy_host_rows: {n} src_rows but {len(dst_rows)} dst_rows")
    spans = np.asarray(spans if spans is not None else ((0, 0, src.shape[1]),), np.int64).reshape(-1, 3)
    if spans[:, 0].min(initial=0) < 0 or (spans[:, 0] + spans[:, 2]).max(initial=0) > src.shape[1] \
            or (spans[:, 1] + spans[:, 2]).max(initial=0) > dst.shape[1]:
        raise ValueError(f"copy_host_rows: spans {spans.tolist()} reach past the tables' "
                         f"{src.shape[1]} / {dst.shape[1]} columns")
    for rows, table, name in ((src_rows, src, "src_rows"), (dst_rows, dst, "dst_rows")):
        if rows is None and n > len(table) or rows is not None and n and not 0 <= rows.min() <= rows.max() < len(table):
            raise ValueError(f"copy_host_rows: {name} reach past the table's {len(table)} rows")
    given = (lambda rows: np.empty(0, np.int64) if rows is None else np.asarray(rows, np.int64))  # (empty: 0, 1, ..)
    _backend.kernels("cpu").copy_table_rows(src, given(src_rows), dst, given(dst_rows), spans, n)
