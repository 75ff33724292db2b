"""Fused Adam over the flat parameter buffer: one CUDA kernel, a thread per element; and its twin whose
moments live in a row table (``adam_rows``)."""
from numba import cuda, float32, int32

from ..math.adam import adam_element, adam_update
from .launch import F1, F2, I1, L1, kernel, per_item

ZERO = float32(0.0)
_adam_element = cuda.jit(device=True, inline=True)(adam_element)


@kernel(F1, F1, F1, F1, I1, I1, I1, F1, "boolean[::1]", "boolean", I1,
        "float32", "float32", "float32", F1, fastmath=True)
def _adam_kernel(params, grads, m, v, bounds, widths, col0, lrs, visible, use_visible, skip, b1, b2, eps, corrections):
    """Adam streams 28 bytes per element, so it is bound by its instructions unless they are
    few: fast division and square root (within 1e-6 of the CPU's), no division by a variable."""
    i = int32(cuda.grid(1))
    if i < params.shape[0] and skip[0] == 0:
        lr, _, _ = _adam_element(i, bounds, widths, col0, lrs, visible, use_visible)
        if lr >= ZERO:
            params[i], m[i], v[i] = adam_update(params[i], grads[i], m[i], v[i], lr, b1, b2, eps,
                                                  corrections[0], corrections[1])


def adam(params, *args):
    """One Adam step of every element of ``params`` (the arguments of ``numbasplat.cpu.adam``)."""
    _adam_kernel[per_item(params.shape[0])](params, *args)


@kernel(F2, L1, I1, F1, F1, I1, I1, I1, F1, "boolean[::1]", "boolean", I1,
        "float32", "float32", "float32", F1, fastmath=True)
def _adam_rows_kernel(table, rows, columns, params, grads, bounds, widths, col0, lrs, visible, use_visible, skip,
                      b1, b2, eps, corrections):
    i = int32(cuda.grid(1))
    if i < params.shape[0] and skip[0] == 0:
        lr, k, c = _adam_element(i, bounds, widths, col0, lrs, visible, use_visible)
        if lr >= ZERO:
            r = rows[k]
            p, m, v = adam_update(params[i], grads[i], table[r, columns[1] + c], table[r, columns[2] + c], lr,
                                  b1, b2, eps, corrections[0], corrections[1])
            table[r, columns[1] + c] = m
            table[r, columns[2] + c] = v
            table[r, columns[0] + c] = p
            params[i] = p


def adam_rows(table, rows, columns, params, *args):
    """``adam``'s step with the moments in rows of a row table, a thread per element of ``params``
    (the arguments of ``numbasplat.cpu.adam_rows``)."""
    _adam_rows_kernel[per_item(params.shape[0])](table, rows, columns, params, *args)
