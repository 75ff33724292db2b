"""Real spherical harmonics of degree 0..3 (the 3DGS basis) and their Jacobian.

The colour of a Gaussian is ``max(0, sum_k b_k(dir) * sh[k] + 0.5)`` with
``dir`` the unit vector from the camera centre to the mean.  Functions return
16-tuples; entries beyond the active degree are zero.
"""
from numpy import float32 as f32

from .jit import shared

C0 = f32(0.28209479177387814)
C1 = f32(0.4886025119029199)
C2 = tuple(f32(c) for c in (1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792,
                            0.5462742152960396))
C3 = tuple(f32(c) for c in (-0.5900435899266435, 2.890611442640554, -0.4570457994644658, 0.3731763325901154,
                            -0.4570457994644658, 1.445305721320277, -0.5900435899266435))


def num_bases(degree):
    return (degree + 1) ** 2


@shared
def sh_basis(degree, x, y, z):
    zero = x * f32(0.0)  # in the dtype of the inputs, so the tuple is uniform
    b1 = b2 = b3 = b4 = b5 = b6 = b7 = b8 = zero
    b9 = b10 = b11 = b12 = b13 = b14 = b15 = zero
    if degree > 0:
        b1 = -C1 * y
        b2 = C1 * z
        b3 = -C1 * x
    if degree > 1:
        xx = x * x
        yy = y * y
        zz = z * z
        b4 = C2[0] * x * y
        b5 = C2[1] * y * z
        b6 = C2[2] * (f32(2.0) * zz - xx - yy)
        b7 = C2[3] * x * z
        b8 = C2[4] * (xx - yy)
        if degree > 2:
            b9 = C3[0] * y * (f32(3.0) * xx - yy)
            b10 = C3[1] * x * y * z
            b11 = C3[2] * y * (f32(4.0) * zz - xx - yy)
            b12 = C3[3] * z * (f32(2.0) * zz - f32(3.0) * xx - f32(3.0) * yy)
            b13 = C3[4] * x * (f32(4.0) * zz - xx - yy)
            b14 = C3[5] * z * (xx - yy)
            b15 = C3[6] * x * (xx - f32(3.0) * yy)
    return (C0 + zero, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15)


@shared
def sh_basis_jacobian(degree, x, y, z):
    """Derivatives of each basis function with respect to x, y and z (three 16-tuples)."""
    zero = x * f32(0.0)
    gx1 = gx2 = gx3 = gx4 = gx5 = gx6 = gx7 = gx8 = gx9 = gx10 = gx11 = gx12 = gx13 = gx14 = gx15 = zero
    gy1 = gy2 = gy3 = gy4 = gy5 = gy6 = gy7 = gy8 = gy9 = gy10 = gy11 = gy12 = gy13 = gy14 = gy15 = zero
    gz1 = gz2 = gz3 = gz4 = gz5 = gz6 = gz7 = gz8 = gz9 = gz10 = gz11 = gz12 = gz13 = gz14 = gz15 = zero
    if degree > 0:
        gy1 = -C1
        gz2 = C1
        gx3 = -C1
    if degree > 1:
        xx = x * x
        yy = y * y
        zz = z * z
        gx4 = C2[0] * y
        gy4 = C2[0] * x
        gy5 = C2[1] * z
        gz5 = C2[1] * y
        gx6 = -f32(2.0) * C2[2] * x
        gy6 = -f32(2.0) * C2[2] * y
        gz6 = f32(4.0) * C2[2] * z
        gx7 = C2[3] * z
        gz7 = C2[3] * x
        gx8 = f32(2.0) * C2[4] * x
        gy8 = -f32(2.0) * C2[4] * y
        if degree > 2:
            gx9 = C3[0] * f32(6.0) * x * y
            gy9 = C3[0] * f32(3.0) * (xx - yy)
            gx10 = C3[1] * y * z
            gy10 = C3[1] * x * z
            gz10 = C3[1] * x * y
            gx11 = -f32(2.0) * C3[2] * x * y
            gy11 = C3[2] * (f32(4.0) * zz - xx - f32(3.0) * yy)
            gz11 = f32(8.0) * C3[2] * y * z
            gx12 = -f32(6.0) * C3[3] * x * z
            gy12 = -f32(6.0) * C3[3] * y * z
            gz12 = C3[3] * (f32(6.0) * zz - f32(3.0) * xx - f32(3.0) * yy)
            gx13 = C3[4] * (f32(4.0) * zz - f32(3.0) * xx - yy)
            gy13 = -f32(2.0) * C3[4] * x * y
            gz13 = f32(8.0) * C3[4] * x * z
            gx14 = f32(2.0) * C3[5] * x * z
            gy14 = -f32(2.0) * C3[5] * y * z
            gz14 = C3[5] * (xx - yy)
            gx15 = C3[6] * f32(3.0) * (xx - yy)
            gy15 = -f32(6.0) * C3[6] * x * y
    return ((zero, gx1, gx2, gx3, gx4, gx5, gx6, gx7, gx8, gx9, gx10, gx11, gx12, gx13, gx14, gx15),
            (zero, gy1, gy2, gy3, gy4, gy5, gy6, gy7, gy8, gy9, gy10, gy11, gy12, gy13, gy14, gy15),
            (zero, gz1, gz2, gz3, gz4, gz5, gz6, gz7, gz8, gz9, gz10, gz11, gz12, gz13, gz14, gz15))
