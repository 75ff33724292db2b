"""Fused Adam over the flat parameter buffer: one ``njit`` loop, parallel over elements; and the moves
of rows between a row table and the flat buffers (``numbasplat.math.rows``)."""
from numba import njit, prange

from ..math.adam import adam_lr, adam_update
from ..math.rows import flat_element

_adam_lr = njit(inline="always")(adam_lr)


@njit(parallel=True, cache=True)
def adam(params, grads, m, v, bounds, widths, col0, lrs, visible, use_visible, b1, b2, eps, bc1, bc2):
    """One Adam step of every element of ``params``: ``bounds``, ``widths``, ``col0`` are the
    layout of ``FlatParams``, ``lrs`` the per-column rates, ``bc1``, ``bc2`` the bias corrections."""
    for i in prange(params.shape[0]):
        lr = _adam_lr(i, bounds, widths, col0, lrs, visible, use_visible)
        if lr >= 0:
            params[i], m[i], v[i] = adam_update(params[i], grads[i], m[i], v[i], lr, b1, b2, eps, bc1, bc2)



@njit(parallel=True, cache=True)
def rows_to_flat(table, rows, plan, params, m, v, stats):
    """Rows ``rows`` of ``table`` into the flat buffers: column j goes to buffer plan[0, j]
    (0 params, 1 m, 2 v, 3 stats) at flat_element(n, r, plan[1:4, j])."""
    n = rows.shape[0]
    for r in prange(n):
        src = rows[r]
        for j in range(table.shape[1]):
            k = flat_element(n, r, plan[1, j], plan[2, j], plan[3, j])
            x = table[src, j]
            t = plan[0, j]
            if t == 0:
                params[k] = x
            elif t == 1:
                m[k] = x
            elif t == 2:
                v[k] = x
            else:
                stats[k] = x


@njit(parallel=True, cache=True)
def flat_to_rows(params, m, v, stats, rows, plan, table):
    """The inverse of ``rows_to_flat``: the flat buffers back into rows ``rows`` of ``table``."""
    n = rows.shape[0]
    for r in prange(n):
        dst = rows[r]
        for j in range(table.shape[1]):
            k = flat_element(n, r, plan[1, j], plan[2, j], plan[3, j])
            t = plan[0, j]
            if t == 0:
                table[dst, j] = params[k]
            elif t == 1:
                table[dst, j] = m[k]
            elif t == 2:
                table[dst, j] = v[k]
            else:
                table[dst, j] = stats[k]
