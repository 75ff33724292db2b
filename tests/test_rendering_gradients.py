"""Hand-written backward passes against float64 central finite differences (CPU backend)."""
import numpy as np
import pytest

import numbasplat as ns
from numbasplat.math import gaussian_ops as go
from tests.scenes import central_differences, edge_case_scene, look_at_camera

H_STEP = 1e-6
# The faint Gaussian puts many pixels near the 1/255 alpha cut, where the
# image jumps; a smaller step keeps the raster-only differences off that cut.
H_STEP_SCREEN = 1e-7
TOL = 1e-4
BG = (0.2, 0.4, 0.1)


def weights(cam, seed=1):
    rng = np.random.default_rng(seed)
    H, W = cam.height, cam.width
    return rng.normal(size=(H, W, 3)), rng.normal(size=(H, W)), rng.normal(size=(H, W)) * 0.1


def objective(g, cam, w, antialias):
    frame = ns.render(g, cam, background=BG, antialias=antialias, backend="cpu")
    r = frame.render
    return float((r.image * w[0]).sum() + (r.alpha * w[1]).sum() + (r.depth * w[2]).sum())


def rel_err(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)


@pytest.mark.parametrize("antialias", [False, True])
def test_parameter_gradients_match_finite_differences(antialias):
    g = edge_case_scene()
    cam = look_at_camera()
    w = weights(cam)
    frame = ns.render(g, cam, background=BG, antialias=antialias, backend="cpu")
    # the scene must exercise what it claims to
    counts = frame.projection.counts
    assert counts[0] == 0 and counts[3] == 0 and counts[4] > 0
    assert (frame.render.trans <= 1e-3).any(), "no pixel terminated early"
    grads, _ = ns.render_backward(g, frame, w[0], w[1], w[2], backend="cpu")
    for name, arr in g.arrays().items():
        fd = central_differences(arr, lambda: objective(g, cam, w, antialias), H_STEP)
        analytic = getattr(grads, name)
        assert np.abs(fd).sum() > 0, name
        assert rel_err(analytic, fd) <= TOL, (name, rel_err(analytic, fd))


def test_screen_space_gradients_match_finite_differences():
    """Raster backward alone: perturb the projected records with binning fixed."""
    g = edge_case_scene(seed=3)
    cam = look_at_camera()
    w = weights(cam, seed=4)
    p = ns.project(g, cam, backend="cpu")
    b = ns.bin_tiles(p, backend="cpu")

    def f():
        r = ns.rasterize(p, b, BG, backend="cpu")
        return float((r.image * w[0]).sum() + (r.alpha * w[1]).sum() + (r.depth * w[2]).sum())

    r = ns.rasterize(p, b, BG, backend="cpu")
    grad = ns.rasterize_backward(p, b, r, w[0], w[1], w[2], backend="cpu")
    visible = np.flatnonzero(p.counts)
    fd = np.zeros((p.proj.shape[0], go.PROJ_FIELDS))
    for n in visible:
        for k in range(go.PROJ_FIELDS):
            old = p.proj[n, k]
            p.proj[n, k] = old + H_STEP_SCREEN
            fp = f()
            p.proj[n, k] = old - H_STEP_SCREEN
            fm = f()
            p.proj[n, k] = old
            fd[n, k] = (fp - fm) / (2 * H_STEP_SCREEN)
    assert rel_err(grad[:, :go.PROJ_FIELDS], fd) <= TOL
    # the absolute-value variant bounds the signed one
    assert (grad[:, go.ABS_U] >= np.abs(grad[:, go.U]) - 1e-12).all()
    assert (grad[:, go.ABS_V] >= np.abs(grad[:, go.V]) - 1e-12).all()
    assert grad[visible, go.ABS_U].sum() > np.abs(grad[visible, go.U]).sum()
