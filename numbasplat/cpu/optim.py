"""Fused Adam over the flat parameter buffer: one ``njit`` loop, parallel over elements."""
from numba import njit, prange

from ..math.adam import adam_lr, adam_update

_adam_lr = njit(inline="always")(adam_lr)


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
        lr = _adam_lr(i, bounds, widths, col0, lrs, visible, use_visible)
        if lr >= 0:
            params[i], m[i], v[i] = adam_update(params[i], grads[i], m[i], v[i], lr, b1, b2, eps, bc1, bc2)
