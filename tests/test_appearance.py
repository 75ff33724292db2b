"""engine/recipe/appearance.py: the per-image colour correction's gradients against float64 finite
differences, its Adam, and training with it (it learns a view's exposure, resumes exactly, and
refuses the tile loss and several ranks)."""
from dataclasses import replace

import numpy as np
import pytest

from engine.recipe.appearance import IDENTITY, ColourCorrection
from engine.tools.demo import ground_truth, make_dataset
from engine.pipelines.single_gpu import SingleGPUTrainer
from engine.recipe.trainer import SNAPSHOT
from test_trainer import small_config


def corrected_loss(c, image, i, weights):
    return float((weights * c.apply(image, i)).sum())


@pytest.mark.parametrize("transform", ["identity", "random"])
def test_gradients_match_finite_differences(transform):
    rng = np.random.default_rng(3)
    c = ColourCorrection(3, lr=1e-3, backend="cpu")
    c.params = np.tile(IDENTITY, (3, 1)).astype(np.float64)
    if transform == "random":
        c.params[1] += rng.normal(0, 0.3, 12)
    image = rng.uniform(0, 1, (4, 5, 3))
    weights = rng.normal(0, 1, (4, 5, 3))  # L = sum(weights * out): dL/dout = weights
    d_image, row = c.gradients(weights, image, 1)
    h = 1e-6
    fd_image = np.zeros_like(image)
    for idx in np.ndindex(image.shape):
        up, down = image.copy(), image.copy()
        up[idx] += h
        down[idx] -= h
        fd_image[idx] = (corrected_loss(c, up, 1, weights) - corrected_loss(c, down, 1, weights)) / (2 * h)
    np.testing.assert_allclose(d_image, fd_image, rtol=1e-6, atol=1e-8)
    fd_row = np.zeros(12)
    for k in range(12):
        keep = c.params[1, k]
        c.params[1, k] = keep + h
        up = corrected_loss(c, image, 1, weights)
        c.params[1, k] = keep - h
        down = corrected_loss(c, image, 1, weights)
        c.params[1, k] = keep
        fd_row[k] = (up - down) / (2 * h)
    np.testing.assert_allclose(row, fd_row, rtol=1e-6, atol=1e-8)
    if transform == "identity":
        np.testing.assert_array_equal(d_image, weights)  # the identity passes the gradient through


def test_adam_moves_only_the_rendered_image_by_its_learning_rate():
    c = ColourCorrection(3, lr=0.01, backend="cpu")
    image = np.full((2, 2, 3), 0.5, np.float32)
    d_out = np.ones((2, 2, 3), np.float32)  # the loss grows with every channel: the transform must lower it
    c.backward(d_out, image, 2)
    np.testing.assert_array_equal(c.params[:2], np.tile(IDENTITY, (2, 1)))  # the others untouched
    np.testing.assert_allclose(c.params[2], IDENTITY - 0.01, rtol=1e-5)  # Adam's first step: lr x sign
    assert c.steps.tolist() == [0, 0, 1]


def test_training_learns_an_exposure_and_resumes_exactly(tmp_path):
    """From the true scene, held still: the corrections of the views shot 25% brighter brighten, the
    others, which the scene renders exactly, stay the identity."""
    data = make_dataset(size=32, n_views=8, backend="cpu")
    for k, v in enumerate(data.train):  # the odd views shot brighter
        if k % 2:
            data.train[k] = replace(v, image=np.clip(v.image * 1.25, 0, 1).astype(np.float32))
    still = dict.fromkeys(("lr_means", "lr_means_final", "lr_scales", "lr_quats", "lr_opacities", "lr_sh"), 1e-12)
    cfg = small_config(iterations=96, appearance=True, lr_appearance=0.05, densify_from=1000, sh_increase_every=1, **still)

    def trainer(folder):
        t = SingleGPUTrainer(data, tmp_path / folder, replace(cfg), backend="cpu")
        t.start_from({"params": ground_truth(0).arrays()})
        return t
    whole = trainer("a")
    whole.train(progress=False)
    grey = np.array([whole.appearance.apply(np.full((1, 1, 3), 0.5, np.float32), k).mean()
                     for k in range(len(data.train))])  # what each view's correction makes of mid-grey
    assert (grey[1::2] > 0.515).all() and (abs(grey[0::2] - 0.5) < 0.002).all(), grey
    first = trainer("b")
    first.train(progress=False, until=40)
    resumed = SingleGPUTrainer(data, tmp_path / "b", replace(cfg), backend="cpu")
    resumed.load_snapshot(tmp_path / "b" / SNAPSHOT)
    np.testing.assert_array_equal(resumed.appearance.params, first.appearance.params)
    resumed.train(progress=False)
    for k in ("params", "m", "v", "steps"):
        np.testing.assert_array_equal(resumed.appearance.state()[k], whole.appearance.state()[k], err_msg=k)
    np.testing.assert_array_equal(resumed.model.host_arrays()["means"], whole.model.host_arrays()["means"])


def test_appearance_refuses_the_tile_loss(tmp_path):
    data = make_dataset(size=16, n_views=2, backend="cpu")
    with pytest.raises(ValueError, match="--appearance needs --loss global"):
        SingleGPUTrainer(data, tmp_path, small_config(appearance=True, loss="tile"), backend="cpu")


def test_appearance_refuses_several_ranks(tmp_path):
    from mpi4py import MPI
    from engine.pipelines.gaussian_exchange import GaussianExchangeTrainer
    data = make_dataset(size=16, n_views=2, backend="cpu")
    with pytest.raises(ValueError, match="--appearance runs in one process"):
        GaussianExchangeTrainer(data, tmp_path, small_config(appearance=True), MPI.COMM_SELF, backend="cpu")


def _gained_capture(gains, points=True):
    """Grey points (colour 0.5) on a plane 4 in front of cameras looking down +z, each image a flat
    0.5 times its per-channel gain: the exposure spread is the gains' log spread."""
    from data.scene import View, build_dataset
    from numbasplat.rendering import Camera
    rng = np.random.default_rng(0)
    pts = np.c_[rng.uniform(-1, 1, (500, 2)), np.full(500, 4.0)]
    views = []
    for i, g in enumerate(gains):
        view = np.eye(4)
        view[0, 3] = 0.01 * i
        image = np.ascontiguousarray(np.broadcast_to(0.5 * np.asarray(g, np.float32), (24, 32, 3)))
        views.append(View(f"v{i}.png", image, Camera(view, 20.0, 20.0, 16.0, 12.0, 32, 24)))
    pts = pts if points else np.zeros((0, 3))
    return build_dataset(views, [], pts, np.full((len(pts), 3), 0.5), "test", "test")


def test_exposure_spread_measures_the_images_gains():
    """Steady images give 0, per-channel gains exp(0.2 z) about 0.2 (the std of their logs), and a
    capture without points no measure."""
    from engine.recipe.appearance import EXPOSURE_SPREAD_HINT, exposure_spread
    assert exposure_spread(_gained_capture([(1, 1, 1)] * 6)) == pytest.approx(0.0, abs=1e-6)
    z = np.random.default_rng(1).normal(size=(40, 3))
    gains = np.clip(np.exp(0.2 * z), 0.1, 1.9)  # (images stay within [0, 1])
    want = float(np.log(gains).std(axis=0).mean())
    assert exposure_spread(_gained_capture(gains)) == pytest.approx(want, rel=1e-3)
    assert want > EXPOSURE_SPREAD_HINT
    assert exposure_spread(_gained_capture([(1, 1, 1)] * 6, points=False)) is None


def test_in_front_keeps_the_nearest_points_of_each_square():
    """The exposure spread's visibility: in each square of ``cell`` pixels the points within 10% of
    the nearest depth count as seen, those farther behind do not; other squares are apart."""
    from engine.recipe.appearance import in_front
    u = np.array([0, 3, 1, 9, 12, 12])
    w = np.array([0, 2, 1, 0, 0, 9])
    z = np.array([1.0, 1.05, 2.0, 5.0, 1.0, 3.0])  # square (0, 0): 1, 1.05 seen, 2 behind; the rest alone
    np.testing.assert_array_equal(in_front(u, w, z, cell=4.0), [True, True, False, True, True, True])
    np.testing.assert_array_equal(in_front(u, w, z, cell=16.0), [True, True, False, False, True, False])
    assert in_front(u[:0], w[:0], z[:0], cell=4.0).shape == (0,)
