"""Where a row table's element goes in the flat buffers (``numbasplat.optim.FlatParams``'s layout).

The out-of-core trainer keeps a Gaussian as one row of a table (its parameters, its statistics and
both Adam moments side by side) and trains on flat, group-major buffers, held back to back in one
array in the row's order: the parameters (``FlatParams``' layout for n Gaussians), each statistic's
n values, m, v.  A plan has a column (a, b, d, j) per table column j that moves: row r (of n) of column
j goes to element n * a + r * b + d -- a group's first column (counting the buffers before it), its
width, the column within it.  The CPU and CUDA kernels that move rows between the two layouts both
call this (a plan of some columns moves those alone: one buffer of a model, as the flat one), through
``move_element``.

``row_reach``: how far a Gaussian reaches past its centre, for the boxes of a table's row segments
(the out-of-core trainer's blocks, which views cull by); ``pool_row``: where a Gaussian's row sits in
the device's pool of block slots."""
import math

from .jit import shared


@shared
def flat_element(n, r, a, b, d):
    """The flat index of row ``r`` of ``n`` for a column whose plan is (a, b, d)."""
    return n * a + r * b + d


def move_element(table, rows, plan, flat, to_flat, n, r, c):
    """One element of a move between rows ``rows`` (n of them) of ``table`` and ``flat``: column
    ``plan[3, c]`` of the r-th row and its flat element (``to_flat``: table -> flat, else back).  Plain
    Python, compiled by each backend's kernel: it takes arrays, which a ``shared`` function cannot
    under the CUDA simulator."""
    j = plan[3, c]
    k = flat_element(n, r, plan[0, c], plan[1, c], plan[2, c])
    if to_flat:
        flat[k] = table[rows[r], j]
    else:
        table[rows[r], j] = flat[k]


@shared
def pool_row(slot, block_rows, position):
    """The row of the pool of slots of ``block_rows`` rows that holds the ``position``-th row of the
    block in ``slot``."""
    return slot * block_rows + position


@shared
def row_reach(s0, s1, s2, reach_sigmas):
    """``reach_sigmas`` times the largest of a row's scales, from its log-scales (float32 in, float32
    out: the GPU computes in float32)."""
    return reach_sigmas * math.exp(max(s0, max(s1, s2)))
