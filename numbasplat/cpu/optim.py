import numpy as np
from numba import njit, prange

from ..math.adam import adam_element, adam_update

_adam_element = njit(inline="always")(adam_element)
_NO_TABLE, _NO_ROWS, _NO_COLUMNS = np.zeros((0, 0), np.float32), np.zeros(0, np.int64), np.zeros(3, np.int32)
_NO_MOMENTS = np.zeros(0, np.float32)


@njit(parallel=True, cache=True)
def _adam(params, grads, m, v, in_table, table, rows, columns, bounds, widths, col0, lrs, visible, use_visible, skip,
          b1, b2, eps, corrections):
    """One Adam step of every element of ``params``: ``bounds``, ``widths``, ``col0`` are the layout of
    ``FlatParams``, ``lrs`` the per-column rates, ``corrections`` the two bias corrections (arrays on the
    device, so that a captured step reads each step's: ``Adam.set_step``); none where skip[0] is set.  The
    moments of element i (Gaussian k's column c): m[i] and v[i], or ``in_table`` columns ``columns[1] + c``
    and ``columns[2] + c`` of row ``rows[k]`` of ``table``, whose column ``columns[0] + c`` takes the new
    parameter too."""
    if skip[0] != 0:
        return
    bc1, bc2 = corrections[0], corrections[1]
    for i in prange(params.shape[0]):
        lr, k, c = _adam_element(i, bounds, widths, col0, lrs, visible, use_visible)
        if lr < 0:
            continue
        r = rows[k] if in_table else 0
        mi, vi = (table[r, columns[1] + c], table[r, columns[2] + c]) if in_table else (m[i], v[i])
        p, mi, vi = adam_update(params[i], grads[i], mi, vi, lr, b1, b2, eps, bc1, bc2)
        params[i] = p
        if in_table:
            table[r, columns[0] + c], table[r, columns[1] + c], table[r, columns[2] + c] = p, mi, vi
        else:
            m[i], v[i] = mi, vi


def adam(params, grads, m, v, *args):
    """One Adam step of every element of ``params`` (its moments ``m``, ``v``: flat buffers like it); ``args``:
    ``_adam``'s from ``bounds`` on."""
    _adam(params, grads, m, v, False, _NO_TABLE, _NO_ROWS, _NO_COLUMNS, *args)


def adam_rows(table, rows, columns, params, grads, *args):
    """``adam``'s step with the moments in a row table: element i of ``params`` (Gaussian k's column c)
    has its moments in row ``rows[k]`` of ``table``, columns ``columns[1] + c`` and ``columns[2] + c``;
    its new value goes to ``params`` and to column ``columns[0] + c`` of that row."""
    _adam(params, grads, _NO_MOMENTS, _NO_MOMENTS, True, table, rows, columns, *args)
