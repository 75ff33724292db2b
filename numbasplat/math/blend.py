"""Per-pixel alpha compositing and its VJP, shared by both backends' raster kernels.

A pixel composites its tile's Gaussians front to back:
``C = sum_i c_i a_i T_i + T_N bg`` with ``T_i = prod_{j<i} (1 - a_j)``.  The
backward pass walks the same Gaussians back to front, recovering ``T_i`` by
division and carrying ``s`` (what lies behind Gaussian i, background included).
The contributions pass walks them front to back as the forward pass does, finding each
pixel's dominant Gaussian (``dominant_step``: the largest ``w_i |c_i|``, ``w_i = a_i T_i``).

A view can be composited in depth-ordered chunks of its Gaussians (``numbasplat.chunks``):
both passes then start from a per-pixel state that the previous chunk left, instead of an
empty pixel, and leave theirs for the next (``load_front``/``store_front`` in front-to-back
order, ``load_behind``/``store_behind`` back to front).  The state is exactly what the
unchunked loops carry from one Gaussian to the next, so the chunks composite exactly as one
pass would: the transmittance (the forward's early stop at T_MIN included, by its ``done``
flag), the colour and depth summed so far, and backwards the transmittance and the colour and
depth behind (``s``: what ``compose_backward`` calls A_{m+1} R_{m+1}) with the alpha gradient
of the final transmittance.
"""
import math

from numpy import float32 as f32

from .jit import shared
from .geometry import ALPHA_MAX, ALPHA_MIN, T_MIN


@shared
def blend_step(alpha, T):
    """One Gaussian of the front-to-back pass: (weight, next T, done).

    Alpha under 1/255 is skipped (weight 0, T kept); a Gaussian that would take T
    to T_MIN or below ends the pixel without contributing (as 3DGS does)."""
    if alpha < ALPHA_MIN:
        return T * f32(0.0), T, False
    nT = T * (f32(1.0) - alpha)
    if nT <= T_MIN:
        return T * f32(0.0), T, True
    return alpha * T, nT, False


@shared
def dominant_step(w, c0, c1, c2, g, best, best_g):
    """One Gaussian's contribution to a pixel and the pixel's dominant Gaussian after it:
    (contribution, best contribution, its Gaussian).

    The contribution is ``w |c|``: the weight ``w = T alpha`` from ``blend_step`` times the L2
    norm of the Gaussian's RGB colour (c0, c1, c2).  It is the length of the Gaussian's term
    ``w c`` in the pixel's colour, so it measures what the Gaussian adds to the colour
    (ByteSplat's T alpha |c|): a dark Gaussian adds little even where it is opaque.  The
    dominant Gaussian is the largest contributor: a strictly larger contribution replaces
    ``best``, so ties keep the first in front-to-back order, and with ``best`` starting at 0 a
    Gaussian that contributes nothing never becomes the pixel's."""
    k = w * math.sqrt(c0 * c0 + c1 * c1 + c2 * c2)
    if k > best:
        return k, k, g
    return k, best, best_g


def store_pixel(image, trans, depth, last, py, px, r, g, b, T, d, stop, bg):
    """A pixel's outputs of the front-to-back pass: its colour over the background ``bg``, the
    transmittance left, depth and ``stop`` (the index after its last contributor).  Plain Python,
    compiled by each backend's raster kernel: it takes arrays, which a ``shared`` function cannot
    under the CUDA simulator."""
    image[py, px, 0] = r + T * bg[0]
    image[py, px, 1] = g + T * bg[1]
    image[py, px, 2] = b + T * bg[2]
    trans[py, px] = T
    depth[py, px] = d
    last[py, px] = stop


FRONT_FIELDS = 6   # a pixel's state between chunks, front to back: T, r, g, b, depth, done (0 or 1)
BEHIND_FIELDS = 6  # back to front: T, s0, s1, s2, sd (what lies behind), da_end (d_alpha * final T)


def load_front(state, py, px):
    """(T, r, g, b, d, done) of a pixel after the chunks in front, from ``state`` (FRONT_FIELDS,
    H, W).  Plain Python like ``store_pixel``."""
    return (state[0, py, px], state[1, py, px], state[2, py, px], state[3, py, px], state[4, py, px],
            state[5, py, px] != f32(0.0))


def store_front(state, py, px, T, r, g, b, d, done):
    """The pixel's state after this chunk, for the next one (``load_front``)."""
    state[0, py, px] = T
    state[1, py, px] = r
    state[2, py, px] = g
    state[3, py, px] = b
    state[4, py, px] = d
    state[5, py, px] = f32(1.0) if done else f32(0.0)


def load_behind(state, py, px):
    """(T, s0, s1, s2, sd, da_end) of a pixel before the chunks behind (their backward done),
    from ``state`` (BEHIND_FIELDS, H, W): where the backward of the chunk in front starts."""
    return state[0, py, px], state[1, py, px], state[2, py, px], state[3, py, px], state[4, py, px], state[5, py, px]


def store_behind(state, py, px, T, s0, s1, s2, sd):
    """The pixel's backward state in front of this chunk, for the chunk before it (``da_end`` stays)."""
    state[0, py, px] = T
    state[1, py, px] = s0
    state[2, py, px] = s1
    state[3, py, px] = s2
    state[4, py, px] = sd


@shared
def gaussian_alpha(u, v, ca, cb, cc, opacity, px, py):
    """(alpha, exp(-sigma), dx, dy) of a projected Gaussian at pixel centre (px, py);
    alpha is 0 where sigma < 0 (a numerically non-positive conic)."""
    dx = u - px
    dy = v - py
    sigma = f32(0.5) * (ca * dx * dx + cc * dy * dy) + cb * dx * dy
    if sigma < f32(0.0):
        zero = dx * f32(0.0)
        return zero, zero, dx, dy
    vis = math.exp(-sigma)
    return min(ALPHA_MAX, opacity * vis), vis, dx, dy


@shared
def _row_min_sigma(ca, cb, cc, dx_lo, dx_hi, dy):
    """The least sigma (``gaussian_alpha``'s) along one pixel row, over dx in [dx_lo, dx_hi]
    (ca > 0), and the size of its terms (for the rounding margin)."""
    dx = min(max(-cb * dy / ca, dx_lo), dx_hi)
    a = f32(0.5) * ca * dx * dx
    b = cb * dx * dy
    c = f32(0.5) * cc * dy * dy
    return a + b + c, a + abs(b) + c


@shared
def reaches_box(u, v, ca, cb, cc, opacity, x0, x1, y0, y1):
    """False when the Gaussian has alpha under ALPHA_MIN at every pixel centre (x, y) with
    x0 <= x <= x1 and y = y0, y0 + 1, ..., y1: a warp's pixel rows.  The raster kernels test 32
    Gaussians at once this way, a lane each, and skip those no pixel of the warp would take,
    instead of evaluating each at all 32 pixels.  Conservative: a margin covers rounding
    (sigma is evaluated differently here), and a conic that is not positive definite is kept."""
    if not (ca > f32(0.0) and ca * cc > cb * cb):
        return True
    limit = math.log(opacity / ALPHA_MIN) + f32(1e-4)  # alpha >= ALPHA_MIN <=> sigma <= log(opacity / ALPHA_MIN)
    y = y0
    while y <= y1:
        s, m = _row_min_sigma(ca, cb, cc, u - x1, u - x0, v - y)
        if not s - f32(1e-5) * m > limit:  # NaN: kept
            return True
        y += f32(1.0)
    return False


@shared
def blend_vjp(alpha, vis, dx, dy, opacity, ca, cb, cc, c0, c1, c2, z, T, s0, s1, s2, sd, dc0, dc1, dc2, dd, da_end,
              depth_terms):
    """One Gaussian of the back-to-front pass over a pixel.

    In: the Gaussian's alpha terms, record fields and colour/depth; the running
    transmittance T (behind it) and sums s0..s2, sd of what lies behind it;
    the pixel's output gradients (dc, dd, and d_alpha_out * T_final).
    ``depth_terms`` False (a constant at the call) drops the depth and alpha
    terms for a loss without them: x * 0 is not folded away (it could be NaN).
    Out: the updated T, s0, s1, s2, sd, then the 12 gradient-record entries
    (u, v, conic a, b, c, opacity, r, g, b, depth, |u|, |v|)."""
    ra = f32(1.0) / (f32(1.0) - alpha)
    T = T * ra
    w = alpha * T
    d_a = dc0 * (c0 * T - s0 * ra) + dc1 * (c1 * T - s1 * ra) + dc2 * (c2 * T - s2 * ra)
    d_z = w * f32(0.0)
    if depth_terms:
        d_a += dd * (z * T - sd * ra) + da_end * ra
        sd = sd + w * z
        d_z = w * dd
    s0 = s0 + w * c0
    s1 = s1 + w * c1
    s2 = s2 + w * c2
    d_o = d_a * f32(0.0)
    ds = d_o
    if opacity * vis <= ALPHA_MAX:  # the 0.99 clamp has no gradient
        d_o = vis * d_a
        ds = -opacity * vis * d_a
    gu = ds * (ca * dx + cb * dy)
    gv = ds * (cb * dx + cc * dy)
    return (T, s0, s1, s2, sd, gu, gv, f32(0.5) * ds * dx * dx, ds * dx * dy, f32(0.5) * ds * dy * dy, d_o,
            w * dc0, w * dc1, w * dc2, d_z, abs(gu), abs(gv))
