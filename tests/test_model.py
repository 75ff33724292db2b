"""The model: the grid k-nearest-neighbour distances are exact, and ``state()`` / ``from_state()`` round-trip."""
import numpy as np
import pytest

from engine.recipe.model import GaussianModel, init_from_points, knn_rms_distance
from numbasplat.optim import GROUPS


def brute_force(pts, k=3):
    d2 = ((pts[:, None] - pts[None]) ** 2).sum(-1)
    np.fill_diagonal(d2, np.inf)
    return np.sqrt(np.maximum(np.sort(d2, 1)[:, :k], 1e-14).mean(1))


@pytest.mark.parametrize("kind", ["normal", "flat", "duplicates", "clustered"])
def test_knn_matches_brute_force(kind):
    rng = np.random.default_rng(1)
    pts = {"normal": rng.normal(size=(1500, 3)),
           "flat": rng.uniform(size=(1200, 3)) * [10.0, 1.0, 1e-4],
           "duplicates": np.repeat(rng.normal(size=(200, 3)), 3, 0),
           "clustered": np.concatenate([rng.normal(0, 0.01, (600, 3)), rng.normal(50, 5, (40, 3))])}[kind]
    np.testing.assert_allclose(knn_rms_distance(pts), brute_force(pts), rtol=1e-12, atol=1e-12)


def test_init_uses_points_or_a_random_box():
    a = init_from_points(np.zeros((0, 3)), np.zeros((0, 3)), 3, rng=np.random.default_rng(0), n_random=500,
                         box=(np.zeros(3), np.ones(3)))
    assert a["means"].shape == (500, 3) and a["sh"].shape == (500, 16, 3)
    assert (a["means"] >= 0).all() and (a["means"] <= 1).all()
    np.testing.assert_allclose(1 / (1 + np.exp(-a["opacities"])), 0.1, rtol=1e-6)
    b = init_from_points(np.eye(3) * 2, np.full((3, 3), 0.75), 0)
    np.testing.assert_allclose(b["sh"][:, 0] * 0.28209479177387814 + 0.5, 0.75, rtol=1e-6)


def test_state_round_trips_parameters_moments_and_step():
    model = GaussianModel(init_from_points(np.random.default_rng(2).normal(size=(50, 3)), np.full((50, 3), 0.5), 1),
                          "cpu")
    model.adam.m[...] = np.arange(model.params.size, dtype=np.float32)
    model.adam.v[...] = 2.0
    model.adam.step_count = 17
    state = model.state()
    back = GaussianModel.from_state(state, "cpu")
    assert back.adam.step_count == 17 and len(back) == 50
    again = back.state()
    for which in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(again[which][g], state[which][g], err_msg=f"{which} {g}")
    fresh = GaussianModel.from_state({"params": state["params"]}, "cpu", b1=0.5)  # a new model: Adam at zero
    assert fresh.adam.step_count == 0 and not fresh.adam.m.any() and not fresh.adam.v.any() and fresh.adam.b1 == 0.5
    np.testing.assert_array_equal(fresh.params.data, model.params.data)
