"""numbasplat/compose.py: depth-ordered composition of partial images (Splaxel), its hand-written
gradients against float64 finite differences (opaque and empty layers included), and that the
partial renders of depth-separated boxes compose to the single render exactly."""
import numpy as np
import pytest

import numbasplat as ns
from numbasplat.compose import compose, compose_backward
from engine.tools.camera_path import look_at


def layers(m, h=3, w=4, seed=0, opaque=False):
    rng = np.random.default_rng(seed)
    trans = rng.uniform(0.05, 1.0, (m, h, w))
    if opaque:
        trans[0, 0, 0] = 0.0          # an opaque pixel in front
        trans[-1, 1, :] = 1.0         # an empty layer's row at the back
    colours = rng.uniform(0, 1, (m, h, w, 3)) * (1 - trans[..., None])  # premultiplied
    return colours, trans


@pytest.mark.parametrize("m,opaque,background", [(1, False, (0.2, 0.5, 0.9)), (3, False, (1.0, 1.0, 1.0)),
                                                  (4, True, (0.3, 0.1, 0.7))])
def test_gradients_match_finite_differences(m, opaque, background):
    colours, trans = layers(m, opaque=opaque, seed=m)
    weights = np.random.default_rng(9).normal(size=colours.shape[1:])

    def loss(c, t):
        return float((weights * compose(c, t, background)[0]).sum())
    d_colours, d_trans = compose_backward(colours, trans, background, weights)
    h = 1e-6
    for arr, grad in ((colours, d_colours), (trans, d_trans)):
        fd = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            keep = arr[idx]
            arr[idx] = keep + h
            up = loss(colours, trans)
            arr[idx] = keep - h
            down = loss(colours, trans)
            arr[idx] = keep
            fd[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
    if opaque:  # behind an opaque pixel nothing matters
        assert (d_colours[1:, 0, 0] == 0).all() and (d_trans[1:, 0, 0] == 0).all()


def test_one_layer_is_the_render_itself():
    colours, trans = layers(1, seed=4)
    image, left = compose(colours, trans, (0.5, 0.25, 1.0))
    np.testing.assert_array_equal(image, colours[0] + trans[0][..., None] * np.array([0.5, 0.25, 1.0]))
    np.testing.assert_array_equal(left, trans[0])


def depth_separated_scene():
    """Semi-transparent Gaussians in two slabs, z in [-1, 0] and [1, 2], seen from above (z = 6):
    every ray meets the upper slab first."""
    rng = np.random.default_rng(2)
    n = 60
    means = np.concatenate([rng.uniform([-1, -1, 1], [1, 1, 2], (n, 3)), rng.uniform([-1, -1, -1], [1, 1, 0], (n, 3))])
    g = ns.Gaussians(means.astype(np.float32), np.log(rng.uniform(0.05, 0.15, (2 * n, 3))).astype(np.float32),
                     rng.normal(size=(2 * n, 4)).astype(np.float32),
                     rng.uniform(-2.0, 0.0, 2 * n).astype(np.float32),  # opacity 0.12-0.5: no pixel saturates
                     rng.normal(0, 0.5, (2 * n, 1, 3)).astype(np.float32))
    cam = ns.Camera(look_at((0.3, 0.2, 6.0), (0, 0, 0.5), up=(0, 1, 0)), 40.0, 40.0, 24.0, 20.0, 48, 40)
    return g, cam, [np.arange(n), np.arange(n, 2 * n)]  # front box first


def test_partial_renders_of_depth_separated_boxes_compose_to_the_single_render():
    g, cam, boxes = depth_separated_scene()
    bg = np.array([0.1, 0.3, 0.6], np.float32)
    whole = ns.render(g, cam, background=bg, backend="cpu")
    subs = [ns.Gaussians(*(a[rows] for a in g.arrays().values())) for rows in boxes]
    parts = [ns.render(sub, cam, background=np.zeros(3, np.float32), backend="cpu") for sub in subs]
    colours, trans = np.stack([p.image for p in parts]), np.stack([p.render.trans for p in parts])
    image, left = compose(colours, trans, bg)
    np.testing.assert_allclose(image, whole.image, atol=2e-6)
    np.testing.assert_allclose(left, whole.render.trans, atol=2e-6)
    assert whole.render.trans.min() > 1e-3  # no pixel saturated: the renders skip nothing the composition keeps
    # the parameters' gradients through the composition and the partial renders equal the single render's
    d_image = np.random.default_rng(5).normal(size=whole.image.shape).astype(np.float32)
    expected, _ = ns.render_backward(g, whole, d_image, backend="cpu")
    d_colours, d_trans = compose_backward(colours, trans, bg, d_image)
    for m, (rows, sub, part) in enumerate(zip(boxes, subs, parts)):
        got, _ = ns.render_backward(sub, part, d_colours[m], d_alpha=-d_trans[m], backend="cpu")
        for name, a in got.arrays().items():
            np.testing.assert_allclose(a, expected.arrays()[name][rows], rtol=1e-4, atol=1e-5, err_msg=name)
