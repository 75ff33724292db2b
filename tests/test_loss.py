"""Tests for numbasplat.loss: values against an independent float64 reference,
gradients against central finite differences, CUDA kernels (simulator) against
the CPU backend."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from scipy.signal import convolve2d

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import simulator_test  # noqa: E402
from numbasplat import loss  # noqa: E402


# ---------------------------------------------------------------------------
# Independent reference (float64, scipy), written from the 3DGS definition.
# ---------------------------------------------------------------------------

def ref_window():
    x = np.arange(11) - 5.0
    g = np.exp(-x ** 2 / (2 * 1.5 ** 2))
    g /= g.sum()
    return np.outer(g, g)


def ref_filter(a, win):
    """torch conv2d(padding=5, groups=3) on an (H, W, 3) image (window symmetric)."""
    return np.stack([convolve2d(a[..., c], win, mode="same", boundary="fill")
                     for c in range(a.shape[2])], axis=-1)


def ref_ssim(img, gt):
    x = img.astype(np.float64)
    y = gt.astype(np.float64)
    win = ref_window()
    mu1, mu2 = ref_filter(x, win), ref_filter(y, win)
    s11 = ref_filter(x * x, win) - mu1 ** 2
    s22 = ref_filter(y * y, win) - mu2 ** 2
    s12 = ref_filter(x * y, win) - mu1 * mu2
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    m = ((2 * mu1 * mu2 + c1) * (2 * s12 + c2)) / ((mu1 ** 2 + mu2 ** 2 + c1) * (s11 + s22 + c2))
    return m.mean()


def ref_loss(img, gt, lam=0.2):
    l1 = np.abs(img.astype(np.float64) - gt.astype(np.float64)).mean()
    return (1 - lam) * l1 + lam * (1 - ref_ssim(img, gt))


def make_pair(h, w, dtype, seed=0, n_equal=0):
    rng = np.random.default_rng(seed)
    gt = rng.random((h, w, 3))
    img = np.clip(gt + 0.2 * rng.standard_normal((h, w, 3)), 0, 1)
    if n_equal:
        idx = rng.choice(img.size, n_equal, replace=False)
        img.reshape(-1)[idx] = gt.reshape(-1)[idx]
    return img.astype(dtype), gt.astype(dtype)


# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(13, 17), (40, 29), (4, 6)])
def test_loss_value_float64(shape):
    img, gt = make_pair(*shape, np.float64, seed=1)
    for lam in (0.0, 0.2, 1.0):
        val, dimg = loss.l1_ssim_loss(img, gt, lam=lam, backend="cpu")
        assert isinstance(val, float)
        assert dimg.shape == img.shape and dimg.dtype == np.float64
        assert abs(val - ref_loss(img, gt, lam)) < 1e-12
    assert abs(loss.ssim(img, gt, backend="cpu") - ref_ssim(img, gt)) < 1e-12


def test_loss_value_float32():
    img, gt = make_pair(37, 50, np.float32, seed=2)
    val, dimg = loss.l1_ssim_loss(img, gt, backend="cpu")
    assert dimg.dtype == np.float32 and dimg.flags.c_contiguous
    assert abs(val - ref_loss(img, gt)) < 1e-6
    assert abs(loss.ssim(img, gt, backend="cpu") - ref_ssim(img, gt)) < 1e-6


def test_identical_images():
    img, _ = make_pair(21, 18, np.float32, seed=3)
    val, dimg = loss.l1_ssim_loss(img, img.copy(), backend="cpu")
    assert abs(val) < 1e-6
    assert np.abs(dimg).max() < 1e-6
    assert abs(loss.ssim(img, img, backend="cpu") - 1.0) < 1e-6
    assert loss.psnr(img, img) == float("inf")


def test_l1_gradient_is_sign():
    img, gt = make_pair(9, 11, np.float64, seed=4, n_equal=10)
    _, dimg = loss.l1_ssim_loss(img, gt, lam=0.0, backend="cpu")
    np.testing.assert_allclose(dimg, np.sign(img - gt) / img.size, rtol=0, atol=1e-15)
    assert np.count_nonzero(dimg == 0) == 10


def tile_mask(h, w, lo, hi):
    """(h, w) pixels of row-major 16x16 tiles lo..hi-1."""
    gx = -(-w // 16)
    t = (np.arange(h)[:, None] // 16) * gx + np.arange(w)[None, :] // 16
    return (t >= lo) & (t < hi)


def test_tile_shares_add_up_and_need_only_a_halo():
    """A renderer's share (tiles=...) needs its tiles right and one tile row around them."""
    img, gt = make_pair(61, 75, np.float64, seed=8)  # 5 x 4 tiles, cut at both borders
    full, d_full = loss.l1_ssim_loss(img, gt, backend="cpu")
    cuts = [0, 3, 9, 14, 20]
    shares = [loss.l1_ssim_loss(img, gt, backend="cpu", tiles=(a, b))[0] for a, b in zip(cuts, cuts[1:])]
    assert abs(sum(shares) - full) < 1e-12 and min(shares) > 0
    lo, hi, gx = 9, 14, 5
    wrong = img.copy()
    outside = ~tile_mask(61, 75, lo - gx - 1, hi + gx + 1)
    assert outside.sum() > 0
    wrong[outside] = 1.0 - wrong[outside]  # the other renderers' pixels, far enough away
    share, d = loss.l1_ssim_loss(wrong, gt, backend="cpu", tiles=(lo, hi))
    assert abs(share - shares[2]) < 1e-12
    mine = tile_mask(61, 75, lo, hi)
    np.testing.assert_allclose(d[mine], d_full[mine], rtol=0, atol=1e-15)
    assert np.abs(d[~mine] - d_full[~mine]).max() > 1e-6  # not trivially equal elsewhere


def test_lazy_loss_reads_the_same_value():
    """lazy=True defers the read of the partial sums; the value and the gradient are the same."""
    img, gt = make_pair(61, 75, np.float32, seed=9)
    for tiles in (None, (3, 9)):
        value, d = loss.l1_ssim_loss(img, gt, backend="cpu", tiles=tiles)
        lazy, d_lazy = loss.l1_ssim_loss(img, gt, backend="cpu", tiles=tiles, lazy=True)
        assert isinstance(lazy, loss.LazyLoss) and float(lazy) == value and value > 0
        np.testing.assert_array_equal(d_lazy, d)


def test_lazy_loss_again_reads_its_sums_afresh():
    """A step graph's kept loss: each ``again()`` reads the partial sums as they are then; a loss
    already read has let them go."""
    partials = np.array([[1.0, 2.0], [3.0, 4.0]])
    kept = loss.LazyLoss(partials, lambda sums: sums.sum())
    first = kept.again()
    assert float(first) == 10.0
    partials[0, 0] = 11.0  # the next replay's sums
    assert float(kept.again()) == 20.0 and float(first) == 10.0
    with pytest.raises(RuntimeError, match="read"):
        first.again()


def test_psnr():
    img, gt = make_pair(12, 10, np.float32, seed=5)
    mse = np.mean((img.astype(np.float64) - gt.astype(np.float64)) ** 2)
    assert abs(loss.psnr(img, gt) - (-10 * np.log10(mse))) < 1e-9


def test_bad_shapes():
    a = np.zeros((8, 8, 3), np.float32)
    with pytest.raises(ValueError):
        loss.l1_ssim_loss(a, np.zeros((8, 9, 3), np.float32), backend="cpu")
    with pytest.raises(ValueError):
        loss.l1_ssim_loss(a, a, backend="metal")


# ---------------------------------------------------------------------------
# Gradients vs central finite differences (float64, CPU backend)
# ---------------------------------------------------------------------------

def fd_grad(img, gt, lam, h=1e-6):
    g = np.zeros_like(img)
    x = img.copy()
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        v = flat[i]
        flat[i] = v + h
        fp, _ = loss.l1_ssim_loss(x, gt, lam=lam, backend="cpu")
        flat[i] = v - h
        fm, _ = loss.l1_ssim_loss(x, gt, lam=lam, backend="cpu")
        flat[i] = v
        gflat[i] = (fp - fm) / (2 * h)
    return g


@pytest.mark.parametrize("lam", [1.0, 0.2])
def test_gradient_finite_differences(lam):
    img, gt = make_pair(13, 17, np.float64, seed=6, n_equal=6)
    _, dimg = loss.l1_ssim_loss(img, gt, lam=lam, backend="cpu")
    fd = fd_grad(img, gt, lam)
    # |img - gt| is not differentiable at 0: with an L1 term, leave out the
    # entries within FD reach of the kink (the analytic sign(0)=0 is tested above).
    mask = np.ones(img.shape, bool) if lam == 1.0 else np.abs(img - gt) > 1e-4
    assert (~mask).sum() == (0 if lam == 1.0 else 6)
    err = np.linalg.norm((dimg - fd)[mask]) / np.linalg.norm(fd[mask])
    assert err <= 1e-4, err


# ---------------------------------------------------------------------------
# CUDA kernels under the simulator vs the CPU backend (subprocess through
# conftest.run_sim: the simulator must be on before numba.cuda is imported).
# ---------------------------------------------------------------------------

SIM_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numbasplat import backend, loss
    assert backend.SIM
    rng = np.random.default_rng(7)
    # 21 x 16: an edge tile in y; 5 x 7: image smaller than the halo
    for h, w in [(21, 16), (5, 7)]:
        gt = rng.random((h, w, 3)).astype(np.float32)
        img = np.clip(gt + 0.2 * rng.standard_normal((h, w, 3)), 0, 1).astype(np.float32)
        img.reshape(-1)[::17] = gt.reshape(-1)[::17]
        lc, dc = loss.l1_ssim_loss(img, gt, lam=0.2, backend="cpu")
        lg, dg = loss.l1_ssim_loss(img, gt, lam=0.2, backend="cuda")
        assert type(dg) is np.ndarray and dg.shape == img.shape and dg.dtype == np.float32
        rel = np.linalg.norm(dg - dc) / np.linalg.norm(dc)
        sc, sg = loss.ssim(img, gt, backend="cpu"), loss.ssim(img, gt, backend="cuda")
        print(f"{h}x{w}: loss {lc:.9f} {lg:.9f} dimg rel {rel:.2e} ssim {sc:.9f} {sg:.9f}")
        assert abs(lc - lg) <= 1e-5, (lc, lg)
        assert rel <= 1e-4, rel
        assert abs(sc - sg) <= 1e-5, (sc, sg)
        # sign(0) = 0 on the L1 term in both backends
        eq = img == gt
        assert np.abs(dg - dc)[eq].max() < 0.01 * 0.8 / img.size
        if h < 16:  # the image inside the halo: its whole loss only (a renderer's shares: the 45 x 40 below)
            continue
        # lazy losses in flight keep their own partial sums (no scratch shared with later calls)
        first = loss.l1_ssim_loss(img, gt, lam=0.2, backend="cuda", lazy=True)[0]
        loss.l1_ssim_loss(gt, gt, lam=0.2, backend="cuda", lazy=True)
        assert abs(float(first) - lg) <= 1e-7, (float(first), lg)
    # a renderer's tiles only (3 x 3 tiles): the kernels run on its tile rows and one more each
    # side for the maps; the gradient is right on its tiles and zero off the rows it ran on
    gt = rng.random((45, 40, 3)).astype(np.float32)
    img = np.clip(gt + 0.2 * rng.standard_normal(gt.shape), 0, 1).astype(np.float32)
    _, d_full = loss.l1_ssim_loss(img, gt, lam=0.2, backend="cpu")
    row = np.arange(45)[:, None] // 16 + 0 * np.arange(40)[None, :]
    tile = row * 3 + np.arange(40)[None, :] // 16
    for lo, hi in [(4, 7), (0, 2), (7, 9), (5, 5)]:
        share_c, _ = loss.l1_ssim_loss(img, gt, lam=0.2, backend="cpu", tiles=(lo, hi))
        share_g, dg = loss.l1_ssim_loss(img, gt, lam=0.2, backend="cuda", tiles=(lo, hi))
        assert abs(share_c - share_g) <= 1e-6, (lo, hi, share_c, share_g)
        mine = (tile >= lo) & (tile < hi)
        if mine.any():
            assert np.abs(dg[mine] - d_full[mine]).max() <= 1e-4 * np.abs(d_full[mine]).max(), (lo, hi)
        ran = (row >= lo // 3) & (row < -(-hi // 3))
        assert (dg[~ran] == 0).all(), (lo, hi)
    print("SIM OK")
""")

test_cuda_simulator_matches_cpu = simulator_test(SIM_SCRIPT, "SIM OK", timeout=600)


def run_python(code, **env):
    e = dict(os.environ)
    e.pop("NUMBASPLAT_BACKEND", None)
    e.pop("NUMBA_ENABLE_CUDASIM", None)
    e.update(env)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-c", code], env=e, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(600)
def test_import_without_gpu():
    code = ("import numbasplat.loss as L, numpy as np; "
            "a = np.full((6, 5, 3), 0.5, np.float32); "
            "v, g = L.l1_ssim_loss(a, a * 0.9); assert type(g) is np.ndarray; print(v)")
    r = run_python(code, NUMBASPLAT_BACKEND="cpu")
    assert r.returncode == 0, r.stderr
