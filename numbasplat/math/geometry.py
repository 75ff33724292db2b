"""Projection of one 3D Gaussian to the image plane (EWA splatting) and its VJP.

Conventions (those of the reference 3DGS code and gsplat): unnormalized wxyz
quaternions, log-scales, OpenCV camera axes, pinhole intrinsics.  The camera is
passed as a 12-tuple ``view = (r00, r01, r02, r10, ..., r22, t0, t1, t2)``.
All functions are scalar-in, tuple-out so both backends can inline them.
"""
import math

from numpy import float32 as f32

from .jit import shared

# float32 constants (and f32(...) literals below): Numba types a bare Python
# float as float64, which would turn GPU float32 math into float64.
NEAR = f32(0.01)         # near plane (camera z)
EPS2D = f32(0.3)         # screen-space dilation added to the 2D covariance diagonal
ALPHA_MIN = f32(1.0 / 255.0)
ALPHA_MAX = f32(0.99)
T_MIN = f32(1e-4)        # transmittance at which a pixel stops compositing


@shared
def quat_to_rotmat(w, x, y, z):
    """Row-major 3x3 rotation of the normalized quaternion."""
    inv = f32(1.0) / math.sqrt(w * w + x * x + y * y + z * z)
    w *= inv
    x *= inv
    y *= inv
    z *= inv
    return (f32(1.0) - f32(2.0) * (y * y + z * z), f32(2.0) * (x * y - w * z), f32(2.0) * (x * z + w * y),
            f32(2.0) * (x * y + w * z), f32(1.0) - f32(2.0) * (x * x + z * z), f32(2.0) * (y * z - w * x),
            f32(2.0) * (x * z - w * y), f32(2.0) * (y * z + w * x), f32(1.0) - f32(2.0) * (x * x + y * y))


@shared
def quat_to_rotmat_vjp(w, x, y, z, g):
    """Gradient of the unnormalized quaternion from dL/dR (row-major 9-tuple)."""
    n = math.sqrt(w * w + x * x + y * y + z * z)
    inv = f32(1.0) / n
    w *= inv
    x *= inv
    y *= inv
    z *= inv
    dw = f32(2.0) * (x * (g[7] - g[5]) + y * (g[2] - g[6]) + z * (g[3] - g[1]))
    dx = f32(2.0) * (-f32(2.0) * x * (g[4] + g[8]) + y * (g[1] + g[3]) + z * (g[2] + g[6]) + w * (g[7] - g[5]))
    dy = f32(2.0) * (x * (g[1] + g[3]) - f32(2.0) * y * (g[0] + g[8]) + z * (g[5] + g[7]) + w * (g[2] - g[6]))
    dz = f32(2.0) * (x * (g[2] + g[6]) + y * (g[5] + g[7]) - f32(2.0) * z * (g[0] + g[4]) + w * (g[3] - g[1]))
    dot = w * dw + x * dx + y * dy + z * dz
    return (dw - w * dot) * inv, (dx - x * dot) * inv, (dy - y * dot) * inv, (dz - z * dot) * inv


@shared
def covar_world(qw, qx, qy, qz, ls0, ls1, ls2):
    """World covariance R S S^T R^T as (xx, xy, xz, yy, yz, zz)."""
    R = quat_to_rotmat(qw, qx, qy, qz)
    s0 = math.exp(ls0)
    s1 = math.exp(ls1)
    s2 = math.exp(ls2)
    m00 = R[0] * s0
    m01 = R[1] * s1
    m02 = R[2] * s2
    m10 = R[3] * s0
    m11 = R[4] * s1
    m12 = R[5] * s2
    m20 = R[6] * s0
    m21 = R[7] * s1
    m22 = R[8] * s2
    return (m00 * m00 + m01 * m01 + m02 * m02, m00 * m10 + m01 * m11 + m02 * m12,
            m00 * m20 + m01 * m21 + m02 * m22, m10 * m10 + m11 * m11 + m12 * m12,
            m10 * m20 + m11 * m21 + m12 * m22, m20 * m20 + m21 * m21 + m22 * m22)


@shared
def covar_world_vjp(qw, qx, qy, qz, ls0, ls1, ls2, g):
    """Gradients of (quaternion, log-scales) from dL/dSigma (full symmetric 3x3, row-major 9-tuple)."""
    R = quat_to_rotmat(qw, qx, qy, qz)
    s = (math.exp(ls0), math.exp(ls1), math.exp(ls2))
    # dM = 2 G M with M = R diag(s);  dR_ij = dM_ij s_j;  ds_j = sum_i dM_ij R_ij
    M = (R[0] * s[0], R[1] * s[1], R[2] * s[2],
         R[3] * s[0], R[4] * s[1], R[5] * s[2],
         R[6] * s[0], R[7] * s[1], R[8] * s[2])
    dM00 = f32(2.0) * (g[0] * M[0] + g[1] * M[3] + g[2] * M[6])
    dM01 = f32(2.0) * (g[0] * M[1] + g[1] * M[4] + g[2] * M[7])
    dM02 = f32(2.0) * (g[0] * M[2] + g[1] * M[5] + g[2] * M[8])
    dM10 = f32(2.0) * (g[3] * M[0] + g[4] * M[3] + g[5] * M[6])
    dM11 = f32(2.0) * (g[3] * M[1] + g[4] * M[4] + g[5] * M[7])
    dM12 = f32(2.0) * (g[3] * M[2] + g[4] * M[5] + g[5] * M[8])
    dM20 = f32(2.0) * (g[6] * M[0] + g[7] * M[3] + g[8] * M[6])
    dM21 = f32(2.0) * (g[6] * M[1] + g[7] * M[4] + g[8] * M[7])
    dM22 = f32(2.0) * (g[6] * M[2] + g[7] * M[5] + g[8] * M[8])
    dRm = (dM00 * s[0], dM01 * s[1], dM02 * s[2],
           dM10 * s[0], dM11 * s[1], dM12 * s[2],
           dM20 * s[0], dM21 * s[1], dM22 * s[2])
    dq = quat_to_rotmat_vjp(qw, qx, qy, qz, dRm)
    dls0 = (dM00 * R[0] + dM10 * R[3] + dM20 * R[6]) * s[0]
    dls1 = (dM01 * R[1] + dM11 * R[4] + dM21 * R[7]) * s[1]
    dls2 = (dM02 * R[2] + dM12 * R[5] + dM22 * R[8]) * s[2]
    return dq[0], dq[1], dq[2], dq[3], dls0, dls1, dls2


@shared
def _jacobian(x, y, z, fx, fy, cx, cy, W, H):
    """Perspective Jacobian entries (J00, J02, J11, J12) with the frustum clamp.

    Also returns the clamped x/z, y/z and whether each was clamped (its
    derivative with respect to x or y is then zero).
    """
    W = f32(W)
    H = f32(H)
    tan_x = f32(0.5) * W / fx
    tan_y = f32(0.5) * H / fy
    lim_xp = (W - cx) / fx + f32(0.3) * tan_x
    lim_xn = cx / fx + f32(0.3) * tan_x
    lim_yp = (H - cy) / fy + f32(0.3) * tan_y
    lim_yn = cy / fy + f32(0.3) * tan_y
    rx = x / z
    ry = y / z
    clx = rx > lim_xp or rx < -lim_xn
    cly = ry > lim_yp or ry < -lim_yn
    rx = min(lim_xp, max(-lim_xn, rx))
    ry = min(lim_yp, max(-lim_yn, ry))
    return fx / z, -fx * rx / z, fy / z, -fy * ry / z, rx, ry, clx, cly


@shared
def _screen_transform(J00, J02, J11, J12, view):
    """T = J W (2x3): maps camera-rotated world offsets to pixels."""
    return (J00 * view[0] + J02 * view[6], J00 * view[1] + J02 * view[7], J00 * view[2] + J02 * view[8],
            J11 * view[3] + J12 * view[6], J11 * view[4] + J12 * view[7], J11 * view[5] + J12 * view[8])


@shared
def to_camera(mx, my, mz, view):
    return (view[0] * mx + view[1] * my + view[2] * mz + view[9],
            view[3] * mx + view[4] * my + view[5] * mz + view[10],
            view[6] * mx + view[7] * my + view[8] * mz + view[11])


@shared
def _screen_covariance(x, y, z, qw, qx, qy, qz, ls0, ls1, ls2, view, fx, fy, cx, cy, W, H):
    """The 2D covariance T S T^T of the Gaussian at camera point (x, y, z), before the dilation,
    as (a, b, c) of [[a, b], [b, c]]; then what ``project_vjp`` differentiates through: S
    (``covar_world``), T (``_screen_transform``) and ``_jacobian``'s clamped x/z, y/z and clamp flags."""
    S = covar_world(qw, qx, qy, qz, ls0, ls1, ls2)
    J00, J02, J11, J12, rx, ry, clx, cly = _jacobian(x, y, z, fx, fy, cx, cy, W, H)
    T = _screen_transform(J00, J02, J11, J12, view)
    # rows of T S
    a0 = T[0] * S[0] + T[1] * S[1] + T[2] * S[2]
    a1 = T[0] * S[1] + T[1] * S[3] + T[2] * S[4]
    a2 = T[0] * S[2] + T[1] * S[4] + T[2] * S[5]
    b0 = T[3] * S[0] + T[4] * S[1] + T[5] * S[2]
    b1 = T[3] * S[1] + T[4] * S[3] + T[5] * S[4]
    b2 = T[3] * S[2] + T[4] * S[4] + T[5] * S[5]
    ca = a0 * T[0] + a1 * T[1] + a2 * T[2]
    cb = a0 * T[3] + a1 * T[4] + a2 * T[5]
    cc = b0 * T[3] + b1 * T[4] + b2 * T[5]
    return ca, cb, cc, S, T, rx, ry, clx, cly


@shared
def project(mx, my, mz, qw, qx, qy, qz, ls0, ls1, ls2, view, fx, fy, cx, cy, W, H, antialias):
    """EWA projection of one Gaussian.

    Returns (ok, u, v, depth, conic_a, conic_b, conic_c, compensation, cov_a, cov_b, cov_c)
    where cov is the dilated 2D covariance and conic its inverse.  ``ok`` is
    False behind the near plane or for a degenerate 2D covariance.
    """
    x, y, z = to_camera(mx, my, mz, view)
    if not z >= NEAR:  # also rejects NaN
        return False, f32(0.0), f32(0.0), z, f32(0.0), f32(0.0), f32(0.0), f32(0.0), f32(0.0), f32(0.0), f32(0.0)
    ca, cb, cc = _screen_covariance(x, y, z, qw, qx, qy, qz, ls0, ls1, ls2, view, fx, fy, cx, cy, W, H)[:3]
    det0 = ca * cc - cb * cb
    pa = ca + EPS2D
    pc = cc + EPS2D
    det = pa * pc - cb * cb
    if not det > f32(0.0):
        return False, f32(0.0), f32(0.0), z, f32(0.0), f32(0.0), f32(0.0), f32(0.0), f32(0.0), f32(0.0), f32(0.0)
    comp = f32(1.0)
    if antialias:
        comp = math.sqrt(max(f32(0.0), det0 / det))
    inv = f32(1.0) / det
    u = fx * x / z + cx
    v = fy * y / z + cy
    return True, u, v, z, pc * inv, -cb * inv, pa * inv, comp, pa, cb, pc


@shared
def project_vjp(mx, my, mz, qw, qx, qy, qz, ls0, ls1, ls2, view, fx, fy, cx, cy, W, H, antialias,
                du, dv, ddepth, dca, dcb, dcc, dcomp):
    """Gradients of (mean, quaternion, log-scale) from those of project's outputs.

    Returns (dmx, dmy, dmz, dqw, dqx, dqy, dqz, dls0, dls1, dls2).  Call only
    where ``project`` returned ok.
    """
    x, y, z = to_camera(mx, my, mz, view)
    # the forward's intermediate values, recomputed (``project`` keeps none of them)
    ca, cb, cc, S, T, rx, ry, clx, cly = _screen_covariance(x, y, z, qw, qx, qy, qz, ls0, ls1, ls2, view,
                                                            fx, fy, cx, cy, W, H)
    pa = ca + EPS2D
    pc = cc + EPS2D
    det = pa * pc - cb * cb
    inv = f32(1.0) / det
    X0 = pc * inv
    X1 = -cb * inv
    X2 = pa * inv
    # conic = inverse(cov):  dL/dcov = -X Gbar X, Gbar = [[dca, dcb/2], [dcb/2, dcc]]
    h = f32(0.5) * dcb
    m00 = X0 * dca + X1 * h
    m01 = X0 * h + X1 * dcc
    m10 = X1 * dca + X2 * h
    m11 = X1 * h + X2 * dcc
    ga = -(m00 * X0 + m01 * X1)
    gb = -f32(2.0) * (m00 * X1 + m01 * X2)
    gc = -(m10 * X1 + m11 * X2)
    if antialias:
        det0 = ca * cc - cb * cb
        if det0 > f32(0.0):
            comp = math.sqrt(det0 / det)
            k = f32(0.5) * comp * dcomp
            ga += k * (cc / det0 - pc * inv)
            gc += k * (ca / det0 - pa * inv)
            gb += k * (-f32(2.0) * cb / det0 + f32(2.0) * cb * inv)
    # cov2 = T S T^T, Hf = [[ga, gb/2], [gb/2, gc]]
    hb = f32(0.5) * gb
    # U = Hf T (2x3)
    u0 = ga * T[0] + hb * T[3]
    u1 = ga * T[1] + hb * T[4]
    u2 = ga * T[2] + hb * T[5]
    w0 = hb * T[0] + gc * T[3]
    w1 = hb * T[1] + gc * T[4]
    w2 = hb * T[2] + gc * T[5]
    # dS = T^T Hf T (full symmetric, row-major)
    dS = (T[0] * u0 + T[3] * w0, T[0] * u1 + T[3] * w1, T[0] * u2 + T[3] * w2,
          T[1] * u0 + T[4] * w0, T[1] * u1 + T[4] * w1, T[1] * u2 + T[4] * w2,
          T[2] * u0 + T[5] * w0, T[2] * u1 + T[5] * w1, T[2] * u2 + T[5] * w2)
    dq0, dq1, dq2, dq3, dl0, dl1, dl2 = covar_world_vjp(qw, qx, qy, qz, ls0, ls1, ls2, dS)
    # dT = 2 Hf T S = 2 U S
    dT0 = f32(2.0) * (u0 * S[0] + u1 * S[1] + u2 * S[2])
    dT1 = f32(2.0) * (u0 * S[1] + u1 * S[3] + u2 * S[4])
    dT2 = f32(2.0) * (u0 * S[2] + u1 * S[4] + u2 * S[5])
    dT3 = f32(2.0) * (w0 * S[0] + w1 * S[1] + w2 * S[2])
    dT4 = f32(2.0) * (w0 * S[1] + w1 * S[3] + w2 * S[4])
    dT5 = f32(2.0) * (w0 * S[2] + w1 * S[4] + w2 * S[5])
    # T = J W  ->  dJ = dT W^T
    dJ00 = dT0 * view[0] + dT1 * view[1] + dT2 * view[2]
    dJ02 = dT0 * view[6] + dT1 * view[7] + dT2 * view[8]
    dJ11 = dT3 * view[3] + dT4 * view[4] + dT5 * view[5]
    dJ12 = dT3 * view[6] + dT4 * view[7] + dT5 * view[8]
    iz = f32(1.0) / z
    iz2 = iz * iz
    # mean2d and depth
    dx = fx * iz * du
    dy = fy * iz * dv
    dz = -(fx * x * du + fy * y * dv) * iz2 + ddepth
    # J00 = fx/z, J02 = -fx rx/z  (same for y)
    dz += -fx * iz2 * dJ00 - fy * iz2 * dJ11 + fx * rx * iz2 * dJ02 + fy * ry * iz2 * dJ12
    drx = -fx * iz * dJ02
    dry = -fy * iz * dJ12
    if not clx:
        dx += drx * iz
        dz -= drx * x * iz2
    if not cly:
        dy += dry * iz
        dz -= dry * y * iz2
    # camera point = W m + t
    dmx = view[0] * dx + view[3] * dy + view[6] * dz
    dmy = view[1] * dx + view[4] * dy + view[7] * dz
    dmz = view[2] * dx + view[5] * dy + view[8] * dz
    return dmx, dmy, dmz, dq0, dq1, dq2, dq3, dl0, dl1, dl2


@shared
def footprint_px(dx, dy, dz, ls0, ls1, ls2, focal, sigmas):
    """The level-of-detail footprint of a Gaussian, in pixels: ``sigmas`` standard deviations of
    its largest axis (log-scales ``ls*``) times ``focal`` over its distance (``d*``: centre minus
    camera centre).  On the optical axis it is the projection's radius, before the blur."""
    distance = max(math.sqrt(dx * dx + dy * dy + dz * dz), f32(1e-12))
    return sigmas * focal * math.exp(max(ls0, max(ls1, ls2))) / distance


@shared
def opacity_extent(opacity):
    """Squared Mahalanobis radius at which alpha drops to 1/255 (<=0: never visible)."""
    if not opacity > ALPHA_MIN:
        return f32(0.0)
    return f32(2.0) * math.log(opacity / ALPHA_MIN)


@shared
def tile_rect(u, v, cov_a, cov_c, ext, tile, tiles_x, tiles_y):
    """Inclusive tile range (tx0, tx1, ty0, ty1) of the ellipse's bounding box; empty if tx0 > tx1."""
    hx = math.sqrt(ext * cov_a)
    hy = math.sqrt(ext * cov_c)
    tile = f32(tile)
    # pixel centres of tile t span [t*tile + 0.5, t*tile + tile - 0.5]
    tx0 = max(0, int(math.ceil((u - hx - tile + f32(0.5)) / tile)))
    tx1 = min(tiles_x - 1, int(math.floor((u + hx - f32(0.5)) / tile)))
    ty0 = max(0, int(math.ceil((v - hy - tile + f32(0.5)) / tile)))
    ty1 = min(tiles_y - 1, int(math.floor((v + hy - f32(0.5)) / tile)))
    return tx0, tx1, ty0, ty1


@shared
def ellipse_rows(X0, X1, X2, ext, cov_a, cov_c):
    """What ``row_span`` needs of the ellipse X0 x^2 + 2 X1 x y + X2 y^2 <= ext (2D covariance
    diagonal ``cov_a``, ``cov_c``), computed once a Gaussian: (its half-height, squared and not,
    the y of its leftmost point (the rightmost is at minus that), sqrt(X0 X2 - X1^2))."""
    hy2 = ext * cov_c
    return hy2, math.sqrt(hy2), X1 * math.sqrt(ext * cov_a) / X2, math.sqrt(X0 * X2 - X1 * X1)


@shared
def row_span(u, v, X0, X1, rows, ty, tile, tiles_x, W, H):
    """Inclusive range (a, b) of the tiles of row ty that the ellipse around (u, v) (``rows``:
    ``ellipse_rows`` of it) reaches at a pixel centre; empty if a > b.

    The ellipse's part within the row's band of pixel centres is convex, so its x-extent is one
    interval [xl, xr]: each arc's extreme over the band, at the ellipse's leftmost or rightmost
    point clamped into the band (the arcs are convex and concave in y).  A tile is reached where
    its span of pixel centres meets that interval: the exact per-tile test (some pixel centre at
    alpha >= 1/255) for the whole row at once, in a constant number of operations, so a Gaussian
    over thousands of tiles costs its rows, not its tiles."""
    hy2, hy, y_peak, root = rows
    ya = max(f32(ty * tile) + f32(0.5) - v, -hy)
    yb = min(f32(min(ty * tile + tile, H)) - f32(0.5) - v, hy)
    if ya > yb:
        return 0, -1
    y_left = min(max(y_peak, ya), yb)
    y_right = min(max(-y_peak, ya), yb)
    xl = u + (-X1 * y_left - root * math.sqrt(max(hy2 - y_left * y_left, f32(0.0)))) / X0
    xr = u + (-X1 * y_right + root * math.sqrt(max(hy2 - y_right * y_right, f32(0.0)))) / X0
    if xl > f32(W) - f32(0.5):             # right of the last pixel centre
        return 0, -1
    t = f32(tile)
    a = max(0, int(math.ceil((xl + f32(0.5) - t) / t)))     # first tile whose last centre >= xl
    b = min(tiles_x - 1, int(math.floor((xr - f32(0.5)) / t)))  # last tile whose first centre <= xr
    return a, b
