from numba import njit, prange

from ..math.adam import adam_element, adam_update

_adam_element = njit(inline="always")(adam_element)


@njit(parallel=True, cache=True)
def adam(params, grads, m, v, bounds, widths, col0, lrs, visible, use_visible, skip, b1, b2, eps, corrections):
    """One Adam step of every element of ``params``: ``bounds``, ``widths``, ``col0`` are the
    layout of ``FlatParams``, ``lrs`` the per-column rates, ``corrections`` the two bias
    corrections (arrays on the device, so that a captured step reads each step's: ``Adam.set_step``);
    none where skip[0] is set."""
    if skip[0] != 0:
        return
    bc1, bc2 = corrections[0], corrections[1]
    for i in prange(params.shape[0]):
        lr, _, _ = _adam_element(i, bounds, widths, col0, lrs, visible, use_visible)
        if lr >= 0:
            params[i], m[i], v[i] = adam_update(params[i], grads[i], m[i], v[i], lr, b1, b2, eps, bc1, bc2)


@njit(parallel=True, cache=True)
def adam_rows(table, rows, columns, params, grads, bounds, widths, col0, lrs, visible, use_visible, skip, b1, b2,
              eps, corrections):
    """``adam``'s step with the moments in a row table: element i of ``params`` (Gaussian k's column c)
    has its moments in row ``rows[k]`` of ``table``, columns ``columns[1] + c`` and ``columns[2] + c``;
    its new value goes to ``params`` and to column ``columns[0] + c`` of that row."""
    if skip[0] != 0:
        return
    bc1, bc2 = corrections[0], corrections[1]
    for i in prange(params.shape[0]):
        lr, k, c = _adam_element(i, bounds, widths, col0, lrs, visible, use_visible)
        if lr >= 0:
            r = rows[k]
            p, m, v = adam_update(params[i], grads[i], table[r, columns[1] + c], table[r, columns[2] + c], lr,
                                  b1, b2, eps, bc1, bc2)
            table[r, columns[1] + c] = m
            table[r, columns[2] + c] = v
            table[r, columns[0] + c] = p
            params[i] = p
