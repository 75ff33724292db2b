"""Composition of partial images in depth order: pixel-level distributed rendering (Splaxel).

Each rank renders its own Gaussians (one box of a spatial partition) on a zero background into a
partial image: premultiplied colour C_m and transmittance T_m per pixel.  In the boxes'
front-to-back order m = 0 .. M-1 the pixel is

    C = sum_m (prod_{k<m} T_k) C_m + (prod_k T_k) background,

which, written from the back, is R_M = background, R_m = C_m + T_m R_{m+1}, C = R_0.  With
A_m = prod_{k<m} T_k the light that reaches layer m and g = dL/dC,

    dL/dC_m = A_m g,    dL/dT_m = A_m <g, R_{m+1}>   (summed over the colour channels),

with no division by a transmittance, so opaque layers are exact.  A partial render's gradients
then go through ``rasterize_backward`` (``d_image = dL/dC_m``, ``d_alpha = -dL/dT_m``: its alpha
is 1 - T).  The sums run on whole arrays of the backend's array module (NumPy or CuPy).
"""
from . import backend as _backend


def compose(colours, trans, background):
    """The composed image (H, W, 3) of M partial images, front to back: ``colours`` (M, H, W, 3),
    ``trans`` (M, H, W), ``background`` RGB or an (H, W, 3) image; and the transmittance left
    behind the last layer (H, W)."""
    xp = _backend.array_module_of(colours)
    reach = xp.ones(trans.shape[1:], trans.dtype)
    image = xp.zeros(colours.shape[1:], colours.dtype)
    for c, t in zip(colours, trans):
        image += reach[..., None] * c
        reach = reach * t
    return image + reach[..., None] * xp.asarray(background, colours.dtype), reach


def compose_backward(colours, trans, background, d_image):
    """(dL/d colours (M, H, W, 3), dL/d trans (M, H, W)) from ``d_image`` = dL/d ``compose``'s image."""
    xp = _backend.array_module_of(colours)
    reach = [xp.ones(trans.shape[1:], trans.dtype)]  # A_m: the light that reaches layer m
    for t in trans[:-1]:
        reach.append(reach[-1] * t)
    d_colours = xp.empty_like(colours)
    d_trans = xp.empty_like(trans)
    behind = xp.broadcast_to(xp.asarray(background, colours.dtype), colours.shape[1:])  # R_{m+1}
    for m in range(len(colours) - 1, -1, -1):
        d_colours[m] = reach[m][..., None] * d_image
        d_trans[m] = reach[m] * (d_image * behind).sum(axis=-1)
        behind = colours[m] + trans[m][..., None] * behind
    return d_colours, d_trans
