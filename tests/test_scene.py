"""data/scene.py: the train/test split and the Dataset the loaders build."""
import numpy as np
import pytest

from data import View, load_dataset
from data.scene import build_dataset, split_views
from numbasplat import Camera
from tests.dataset_files import CAMS, colmap_scene


def test_split_rule(tmp_path):
    colmap_scene(tmp_path, ".bin", n_images=10, cams=[CAMS[0]])
    names = sorted(f"view_{i:02d}.png" for i in range(10))
    ds = load_dataset(tmp_path)                       # test_every=8: indices 0, 8
    assert [v.name for v in ds.test] == [names[0], names[8]]
    assert [v.name for v in ds.train] == [n for i, n in enumerate(names) if i not in (0, 8)]
    ds3 = load_dataset(tmp_path, test_every=3)
    assert [v.name for v in ds3.test] == [names[i] for i in (0, 3, 6, 9)]
    ds0 = load_dataset(tmp_path, test_every=0)
    assert ds0.test == [] and len(ds0.train) == 10
    # split_views on its own sorts by name first
    vs = [View(n, None, None) for n in ["c", "a", "b", "e", "d"]]
    tr, te = split_views(vs, 2)
    assert [v.name for v in te] == ["a", "c", "e"] and [v.name for v in tr] == ["b", "d"]



def view_at(name, x):
    """A View whose camera sits at (x, 0, 0), axes aligned with the world's."""
    viewmat = np.eye(4)
    viewmat[0, 3] = -x
    return View(name, np.zeros((2, 2, 3), np.float32), Camera(viewmat, 2.0, 2.0, 1.0, 1.0, 2, 2))


def test_build_dataset_cleans_points_and_scales_by_the_training_cameras():
    train, test = [view_at("a", -2.0), view_at("b", 2.0)], [view_at("t", 10.0)]
    points = [[0.0, 0.0, 0.0], [np.nan, 1.0, 1.0], [1.0, 2.0, 3.0]]
    colors = [[-0.5, 0.5, 1.5], [0.1, 0.2, 0.3], [0.2, 0.4, 0.6]]
    ds = build_dataset(train, test, points, colors, "somewhere", "colmap", init_box=((0,) * 3, (1,) * 3))
    assert ds.points.dtype == ds.colors.dtype == np.float32 and ds.points.flags.c_contiguous
    np.testing.assert_array_equal(ds.points, np.float32([[0, 0, 0], [1, 2, 3]]))       # the NaN point dropped
    np.testing.assert_array_equal(ds.colors, np.float32([[0.0, 0.5, 1.0], [0.2, 0.4, 0.6]]))  # clipped to [0, 1]
    assert ds.scene_scale == pytest.approx(1.1 * 2.0)      # the test camera far away does not count
    assert (ds.source, ds.fmt, ds.init_box) == ("somewhere", "colmap", ((0,) * 3, (1,) * 3))
    assert [v.name for v in ds.views] == ["a", "b", "t"] and not ds.masked
    # no training view: the test cameras give the scale
    assert build_dataset([], test + [view_at("u", 12.0)], [], [], "", "ngp").scene_scale == pytest.approx(1.1)
