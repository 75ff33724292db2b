import numpy as np
from numba import njit, prange

from ..math.adam import adam_element, adam_update

_adam_element = njit(inline="always")(adam_element)


@njit(parallel=True, cache=True)
def _adam(params, grads, m, v, bounds, widths, col0, lrs, visible, use_visible, skip, b1, b2, eps, corrections):
    """One Adam step of every element of ``params``: ``bounds``, ``widths``, ``col0`` are the layout of
    ``FlatParams``, ``lrs`` the per-column rates, ``corrections`` the two bias corrections (arrays on the
    device, so that a captured step reads each step's: ``Adam.set_step``); none where skip[0] is set.  The
    moments of element i are m[i] and v[i]."""
    if skip[0] != 0:
        return
    bc1, bc2 = corrections[0], corrections[1]
    for i in prange(params.shape[0]):
        lr, k, c = _adam_element(i, bounds, widths, col0, lrs, visible, use_visible)
        if lr < 0:
            continue
        params[i], m[i], v[i] = adam_update(params[i], grads[i], m[i], v[i], lr, b1, b2, eps, bc1, bc2)


@njit(parallel=True, cache=True)
def _adam_table(table, rows, columns, params, grads, params_from_table, bounds, widths, col0, lrs, visible,
                use_visible, skip, b1, b2, eps, corrections):
    """``_adam``'s step with the moments in a row table, Gaussian by Gaussian: a Gaussian's columns are one
    stretch of its row, so the host's caches read each row once, and each element's group and column come
    from the loops, not from a search of the layout (BENCHMARKS.md, out of core).  Gaussian k's parameter in
    column c is element ``bounds[g] + k * widths[g] + c - col0[g]`` of ``params`` (its group g's); its
    moments are in row ``rows[k]`` of ``table``, columns ``columns[1] + c`` and ``columns[2] + c``, and column
    ``columns[0] + c`` takes the new parameter too.  ``params_from_table``: the step reads the parameters
    from column ``columns[0] + c`` and writes every Gaussian's (stepped or not) to ``params`` (the host's
    Adam, whose ``params`` the device's working copy is uploaded from).  The loops index with unsigned
    integers: Numba then adds no wrap-around of negative indices to each access, which slowed them
    (BENCHMARKS.md, out of core)."""
    if skip[0] != 0:
        return
    bc1, bc2 = corrections[0], corrections[1]
    c_p, c_m, c_v = np.uint64(columns[0]), np.uint64(columns[1]), np.uint64(columns[2])
    for k in prange(rows.shape[0]):
        row = table[rows[k]]
        stepped = not use_visible or visible[k]
        for g in range(widths.shape[0]):
            w = np.uint64(widths[g])
            first, c0 = np.uint64(bounds[g]) + np.uint64(k) * w, np.uint64(col0[g])
            for j in range(w):
                c, i = c0 + np.uint64(j), first + np.uint64(j)
                p = row[c_p + c] if params_from_table else params[i]
                if stepped:
                    p, mi, vi = adam_update(p, grads[i], row[c_m + c], row[c_v + c], lrs[c], b1, b2, eps, bc1, bc2)
                    row[c_p + c], row[c_m + c], row[c_v + c] = p, mi, vi
                    params[i] = p
                elif params_from_table:
                    params[i] = p


def adam(params, grads, m, v, *args):
    """One Adam step of every element of ``params`` (its moments ``m``, ``v``: flat buffers like it); ``args``:
    ``_adam``'s from ``bounds`` on."""
    _adam(params, grads, m, v, *args)


def adam_rows(table, rows, columns, params, grads, *args):
    """``adam``'s step with the moments in a row table: element i of ``params`` (Gaussian k's column c)
    has its moments in row ``rows[k]`` of ``table``, columns ``columns[1] + c`` and ``columns[2] + c``;
    its new value goes to ``params`` and to column ``columns[0] + c`` of that row."""
    _adam_table(table, rows, columns, params, grads, False, *args)


def adam_table_rows(table, rows, columns, params, grads, *args):
    """``adam_rows``' step reading the parameters from the table (column ``columns[0] + c``), not from
    ``params``, which takes every Gaussian's parameters, stepped or not: the host's Adam of a working set
    (``HostAdam``), whose table holds the parameters that the device's copy had its gradients written over."""
    _adam_table(table, rows, columns, params, grads, True, *args)
