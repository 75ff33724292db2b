"""One Adam update of one element of the flat parameter buffer, for both backends' kernels: the
separate Adam kernels, and the projection backward's kernels that apply it as they compute the
gradients (``gaussian_ops``' ``*_adam_body``, ``rendering.project_backward_adam``).

``adam_element`` finds an element's learning rate, Gaussian and column from the buffer's layout
(groups of N * width values, a rate per column of a group); it is plain Python, compiled by each backend (an
inlined ``njit`` and an inlined CUDA device function) from this one source.
"""
import math

from numpy import float32 as f32, int32

from .jit import shared


@shared
def divide_by_width(off, w):
    """off // w for the layout's group widths, each a division by a constant: a GPU divides by a
    variable in ~20 instructions, by a constant in ~3, and Adam is otherwise pure streaming."""
    if w == 48:
        return off // int32(48)
    if w == 3:
        return off // int32(3)
    if w == 4:
        return off // int32(4)
    if w == 1:
        return off
    return off // w


def adam_element(i, bounds, widths, col0, lrs, visible, use_visible):
    """(the learning rate of flat element i (its group's column), or -1 if its Gaussian is not
    visible this step and keeps its state; its Gaussian; its column among a Gaussian's parameters):
    ``FlatParams``' layout (``bounds``, ``widths``, ``col0``) read backwards."""
    g = 0
    while i >= bounds[g + 1]:
        g += 1
    w = widths[g]
    off = i - bounds[g]  # int32 (bounds are int32): 64-bit division is slow on GPUs
    row = divide_by_width(off, w)
    column = col0[g] + off - row * w
    if use_visible and not visible[row]:
        return f32(-1.0), row, column
    return lrs[column], row, column


@shared
def adam_update(p, g, m, v, lr, b1, b2, eps, bc1, bc2):
    """One Adam step of one element: the new (parameter, first moment, second moment)."""
    m = b1 * m + (f32(1.0) - b1) * g
    v = b2 * v + (f32(1.0) - b2) * g * g
    return p - lr * (m / bc1) / (math.sqrt(v / bc2) + eps), m, v
