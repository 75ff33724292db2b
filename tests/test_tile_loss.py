"""Tests for numbasplat.tile_loss: values against an independent float64
reference, gradients against central finite differences, the permutations,
the CUDA kernel (simulator) against the CPU backend (its PTX: tests/test_cuda_launch.py)."""
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import simulator_test  # noqa: E402
from numbasplat import tile_loss as TL  # noqa: E402
from numbasplat.loss import LazyLoss  # noqa: E402
from numbasplat.math.tiles import tile_pixels  # noqa: E402


# ---------------------------------------------------------------------------
# Independent reference (float64, plain loops), written from the definition.
# ---------------------------------------------------------------------------

def ref_tile_loss(img, gt, perms, lam=0.2):
    x = img.astype(np.float64)
    y = gt.astype(np.float64)
    H, W, _ = x.shape
    R = perms.shape[0]
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    total = 0.0
    for ty in range(0, H, 16):
        for tx in range(0, W, 16):
            for r in range(R):
                for k in range(16):
                    slots = perms[r, 16 * k:16 * k + 16]
                    rows, cols = ty + slots // 16, tx + slots % 16
                    keep = (rows < H) & (cols < W)
                    if not keep.any():
                        continue
                    for ch in range(3):
                        a = x[rows[keep], cols[keep], ch]
                        b = y[rows[keep], cols[keep], ch]
                        mx, my = a.mean(), b.mean()
                        vx, vy = (a * a).mean() - mx ** 2, (b * b).mean() - my ** 2
                        cov = (a * b).mean() - mx * my
                        s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
                        total += keep.sum() * s
    s3im = total / (R * 3 * H * W)
    l1 = np.abs(x - y).mean()
    return (1 - lam) * l1 + lam * (1 - s3im)


def make_pair(h, w, dtype, seed=0, min_diff=0.0):
    """gt uniform in [0, 1]; img = gt + noise, |img - gt| >= min_diff everywhere."""
    rng = np.random.default_rng(seed)
    gt = rng.random((h, w, 3))
    noise = 0.15 * rng.standard_normal((h, w, 3))
    noise = np.sign(noise) * np.maximum(np.abs(noise), min_diff)
    return (gt + noise).astype(dtype), gt.astype(dtype)


# ---------------------------------------------------------------------------
# Permutations
# ---------------------------------------------------------------------------

def test_permutations():
    p = TL.s3im_permutations(np.random.default_rng(3), repeats=10)
    assert p.shape == (10, 256) and p.dtype == np.int32
    assert list(p[0, :20]) == [0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7]
    for k in range(16):  # window k of the identity row = 4x4 block (k // 4, k % 4)
        ly, lx = np.divmod(p[0, 16 * k:16 * k + 16], 16)
        assert set(zip(ly, lx)) == {(4 * (k // 4) + i, 4 * (k % 4) + j) for i in range(4) for j in range(4)}
    for r in range(10):
        assert np.array_equal(np.sort(p[r]), np.arange(256))
    assert not np.array_equal(p[1], p[2])
    same = TL.s3im_permutations(np.random.default_rng(3), repeats=10)
    other = TL.s3im_permutations(np.random.default_rng(4), repeats=10)
    assert np.array_equal(p, same)
    assert np.array_equal(p[0], other[0]) and not np.array_equal(p[1:], other[1:])
    assert TL.s3im_permutations(np.random.default_rng(0), repeats=1).shape == (1, 256)


# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(37, 29), (32, 48), (5, 7)])
def test_value_matches_reference(shape):
    img, gt = make_pair(*shape, np.float64, seed=1)
    perms = TL.s3im_permutations(np.random.default_rng(2), repeats=4)
    for lam in (0.0, 0.2, 1.0):
        val, dimg = TL.tile_loss(img, gt, perms, lam=lam, backend="cpu")
        assert isinstance(val, float)
        assert dimg.shape == img.shape and dimg.dtype == np.float64
        assert abs(val - ref_tile_loss(img, gt, perms, lam)) < 1e-12
    # float32 input: float32 gradient, value close to the float64 one
    val32, d32 = TL.tile_loss(img.astype(np.float32), gt.astype(np.float32), perms, backend="cpu")
    assert d32.dtype == np.float32
    assert abs(val32 - ref_tile_loss(img.astype(np.float32), gt.astype(np.float32), perms)) < 1e-6


def test_shares_of_disjoint_tiles_add_up_to_the_loss():
    """Each renderer under MPI computes its tiles' share; the shares sum to the image's loss."""
    img, gt = make_pair(37, 50, np.float64, seed=3)
    perms = TL.s3im_permutations(np.random.default_rng(4), repeats=3)
    full, dfull = TL.tile_loss(img, gt, perms, backend="cpu")
    owner = np.random.default_rng(5).integers(0, 3, tile_pixels(50, 37).size)
    shares = [TL.tile_loss(img, gt, perms, backend="cpu", tiles=owner == r) for r in range(3)]
    assert abs(sum(v for v, _ in shares) - full) < 1e-12
    assert all(np.array_equal(d, dfull) for _, d in shares)  # the gradient does not depend on the share
    assert TL.tile_loss(gt, gt, perms, backend="cpu", tiles=owner == 0)[0] < 1e-12
    lazy = TL.tile_loss(img, gt, perms, backend="cpu", tiles=owner == 1, lazy=True)[0]
    assert isinstance(lazy, LazyLoss) and float(lazy) == shares[1][0]


def test_multiple_of_16_is_plain_mean_and_identity_is_zero():
    img, gt = make_pair(32, 16, np.float64, seed=5)
    perms = TL.s3im_permutations(np.random.default_rng(0), repeats=3)
    # lam = 1: loss = 1 - mean(ssim_w); with every window full the mean is unweighted
    val, _ = TL.tile_loss(img, gt, perms, lam=1.0, backend="cpu")
    assert abs(val - ref_tile_loss(img, gt, perms, lam=1.0)) < 1e-12
    val, dimg = TL.tile_loss(gt, gt.copy(), perms, backend="cpu")
    assert abs(val) < 1e-12 and np.abs(dimg).max() < 1e-12


def test_bad_inputs():
    a = np.zeros((8, 9, 3), np.float32)
    with pytest.raises(ValueError):
        TL.tile_loss(a, a, np.zeros((2, 255), np.int32), backend="cpu")
    with pytest.raises(ValueError):
        TL.tile_loss(a, a[:, :8], TL.s3im_permutations(np.random.default_rng(0)), backend="cpu")


# ---------------------------------------------------------------------------
# Gradients vs central finite differences (float64, every entry)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("lam", [1.0, 0.2])
def test_gradient_finite_differences(lam):
    img, gt = make_pair(20, 18, np.float64, seed=3, min_diff=0.02)  # |d| >> h: L1 is smooth there
    perms = TL.s3im_permutations(np.random.default_rng(1), repeats=5)
    _, dimg = TL.tile_loss(img, gt, perms, lam=lam, backend="cpu")
    h = 1e-6
    fd = np.empty_like(img)
    x = img.copy()
    for i in range(img.size):
        x.flat[i] = img.flat[i] + h
        fp, _ = TL.tile_loss(x, gt, perms, lam=lam, backend="cpu")
        x.flat[i] = img.flat[i] - h
        fm, _ = TL.tile_loss(x, gt, perms, lam=lam, backend="cpu")
        x.flat[i] = img.flat[i]
        fd.flat[i] = (fp - fm) / (2 * h)
    rel = np.abs(fd - dimg).max() / np.abs(dimg).max()
    assert rel <= 1e-4, rel
    assert np.linalg.norm(fd - dimg) / np.linalg.norm(dimg) <= 1e-5


def test_l1_gradient_sign_zero():
    img, gt = make_pair(9, 11, np.float64, seed=4)
    img[2, 3] = gt[2, 3]
    perms = TL.s3im_permutations(np.random.default_rng(0), repeats=2)
    _, d0 = TL.tile_loss(img, gt, perms, lam=0.0, backend="cpu")
    assert np.all(d0[2, 3] == 0.0)
    n = img.size
    assert np.allclose(np.abs(np.delete(d0.reshape(-1, 3), 2 * 11 + 3, axis=0)), 1.0 / n, rtol=1e-12)


# ---------------------------------------------------------------------------
# CUDA kernel under the simulator vs the CPU backend (subprocess: the
# simulator must be on before numba.cuda is imported).
# ---------------------------------------------------------------------------

SIM_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numbasplat import backend, tile_loss as TL
    assert backend.SIM
    rng = np.random.default_rng(7)
    perms = TL.s3im_permutations(rng, repeats=3)
    for h, w in [(24, 20), (5, 7)]:          # partial tiles; image smaller than a tile
        gt = rng.random((h, w, 3)).astype(np.float32)
        img = np.clip(gt + 0.2 * rng.standard_normal((h, w, 3)), 0, 1).astype(np.float32)
        img.reshape(-1)[::17] = gt.reshape(-1)[::17]
        lc, dc = TL.tile_loss(img, gt, perms, lam=0.2, backend="cpu")
        lg, dg = TL.tile_loss(img, gt, perms, lam=0.2, backend="cuda")
        assert type(dg) is np.ndarray and dg.shape == img.shape and dg.dtype == np.float32
        rel = np.linalg.norm(dg - dc) / np.linalg.norm(dc)
        rel_max = np.abs(dg - dc).max() / np.abs(dc).max()
        print(f"{h}x{w}: loss {lc:.9f} {lg:.9f} dimg rel {rel:.2e} max {rel_max:.2e}")
        assert abs(lc - lg) <= 1e-5, (lc, lg)
        assert rel <= 1e-4 and rel_max <= 1e-4, (rel, rel_max)
    print("SIM OK")
""")

test_cuda_simulator_matches_cpu = simulator_test(SIM_SCRIPT, "SIM OK", timeout=600)
