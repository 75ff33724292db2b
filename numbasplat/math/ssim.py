"""Per-pixel math of the training losses, shared by the CPU and CUDA kernels.

Windowed SSIM (``numbasplat.loss``), as in the reference 3DGS code: per channel an 11x11
Gaussian window (sigma 1.5, normalized 1D window, outer product) with zero padding of 5,
C1 = 0.01**2, C2 = 0.03**2.  With G the (symmetric, zero-padded) window filter and, per pixel
p, the five moments mu_x = G*x, mu_y = G*y, Exx = G*(x^2), Eyy = G*(y^2), Exy = G*(xy),
SSIM(p) is a closed-form function of them.  Since G is its own adjoint (symmetric kernel,
zero padding), the chain rule gives

    dSSIM_mean/dx = (1/N) [ G*a + 2x (G*b) + y (G*c) ]

with a, b, c the per-pixel partials of SSIM(p) w.r.t. mu_x, Exx, Exy (``ssim_terms``).  So
one evaluation is two filter stages: moments -> SSIM map and a, b, c; then filter a, b, c
-> dloss/dimg (``ssim_loss_grad``).  These two are plain Python, compiled by each backend
(``njit`` and a CUDA device function) from this one source.  No float literals in them:
Numba types those float64 and would promote the GPU's float32 arithmetic, so doubling is
written v + v.

S3IM windows (``numbasplat.tile_loss``): ``window_ssim`` is the SSIM of one window of
``WSIZE`` tile pixels from uniform-weight sums, and its gradient coefficients; ``l1_grad``
the L1 term's.
"""
import numpy as np
from numpy import float32 as f32

from .jit import shared

C1 = 0.01 ** 2
C2 = 0.03 ** 2
WIN = 11            # SSIM window size
RAD = WIN // 2      # zero padding / halo width
SIGMA = 1.5
NWIN = 16           # S3IM windows per tile and repeat
WSIZE = 16          # tile pixels per S3IM window


def gauss_window(size=WIN, sigma=SIGMA):
    """The normalized 1D SSIM window (float64)."""
    x = np.arange(size, dtype=np.float64) - size // 2
    g = np.exp(-x * x / (2.0 * sigma * sigma))
    return g / g.sum()


WINDOW64 = gauss_window()
WINDOW32 = WINDOW64.astype(np.float32)


def ssim_terms(mx, my, exx, eyy, exy, c1, c2):
    """SSIM at one pixel from its five windowed moments, plus dSSIM/dmu_x,
    dSSIM/dExx and dSSIM/dExy (the moments that depend on img)."""
    mxy = mx * my
    a1 = mxy + mxy + c1                          # 2 mu_x mu_y + C1
    sxy = exy - mxy
    a2 = sxy + sxy + c2                          # 2 sigma_xy + C2
    b1 = mx * mx + my * my + c1                  # mu_x^2 + mu_y^2 + C1
    b2 = (exx - mx * mx) + (eyy - my * my) + c2  # sigma_x^2 + sigma_y^2 + C2
    s = (a1 * a2) / (b1 * b2)
    # log-derivative: dS/dmu_x = S (2my/A1 - 2my/A2 - 2mx/B1 + 2mx/B2)
    d_mx = s * ((my / a1 - my / a2) + (mx / b2 - mx / b1))
    d_exy = s / a2
    return s, d_mx + d_mx, -s / b2, d_exy + d_exy


def ssim_loss_grad(x, y, ga, gb, gc, l1_scale):
    """dloss/dimg at one value from the filtered SSIM partials (already scaled
    by -lam/N) and the L1 term; sign(0) = 0."""
    g = ga + (gb + gb) * x + gc * y
    d = x - y
    if d > 0:
        g += l1_scale
    elif d < 0:
        g -= l1_scale
    return g


@shared
def window_ssim(n, sx, sy, sxx, syy, sxy, c1, c2):
    """SSIM of one window from the sums of x, y, x^2, y^2, xy over its n > 0
    valid pixels, and (a, b, c) with d ssim / d x_i = (a + b x_i + c y_i) / n.

    Chain rule through mu_x, var_x, cov: d mu_x/dx_i = 1/n,
    d var_x/dx_i = 2 (x_i - mu_x)/n, d cov/dx_i = (y_i - mu_y)/n."""
    two = f32(2.0)
    mx = sx / n
    my = sy / n
    vx = sxx / n - mx * mx
    vy = syy / n - my * my
    cov = sxy / n - mx * my
    a1 = two * mx * my + c1
    a2 = two * cov + c2
    b1 = mx * mx + my * my + c1
    b2 = vx + vy + c2
    s = (a1 * a2) / (b1 * b2)
    s_mu = s * (two * my / a1 - two * mx / b1)   # d s / d mu_x at fixed var_x, cov
    s_var = -s / b2
    s_cov = two * s / a2
    return s, s_mu - two * s_var * mx - s_cov * my, two * s_var, s_cov


@shared
def l1_grad(d, scale):
    """scale * sign(d), sign(0) = 0."""
    if d > f32(0.0):
        return scale
    if d < f32(0.0):
        return -scale
    return scale * f32(0.0)
