"""data/scene.py: the train/test split and the Dataset the loaders build."""
import numpy as np
import pytest

from data import DataError, View, load_dataset
from data.scene import build_dataset, split_views
from numbasplat import Camera
from tests.dataset_files import CAMS, colmap_scene


def test_split_rule(tmp_path):
    colmap_scene(tmp_path, ".bin", n_images=10, cams=[CAMS[0]])
    names = sorted(f"view_{i:02d}.png" for i in range(10))
    ds = load_dataset(tmp_path)                       # by default every view trains (Inria without --eval)
    assert ds.test == [] and [v.name for v in ds.train] == names and ds.split == ""
    assert "images: 10 train, no test views; 32x24" in ds.summary()
    ds8 = load_dataset(tmp_path, test_every=8)        # Inria's --eval: indices 0, 8
    assert [v.name for v in ds8.test] == [names[0], names[8]]
    assert [v.name for v in ds8.train] == [n for i, n in enumerate(names) if i not in (0, 8)]
    assert "images: 8 train, 2 test (every 8th image); 32x24" in ds8.summary()
    ds3 = load_dataset(tmp_path, test_every=3)
    assert [v.name for v in ds3.test] == [names[i] for i in (0, 3, 6, 9)]
    for test_every in (0, None):
        ds0 = load_dataset(tmp_path, test_every=test_every)
        assert ds0.test == [] and len(ds0.train) == 10
    for bad in (-1, 2.5, "8", True):
        with pytest.raises(DataError, match="test_every"):
            load_dataset(tmp_path, test_every=bad)
    # split_views on its own sorts by name first
    vs = [View(n, None, None) for n in ["c", "a", "b", "e", "d"]]
    tr, te = split_views(vs, 2)
    assert [v.name for v in te] == ["a", "c", "e"] and [v.name for v in tr] == ["b", "d"]



def test_summary_says_what_was_loaded(tmp_path):
    colmap_scene(tmp_path, ".bin", n_images=6)
    ds = load_dataset(tmp_path, test_every=3, resolution=2)
    assert ds.summary(n_random=100_000) == [
        f"colmap scene {tmp_path}",
        "images: 4 train, 2 test (every 3rd image); 4 at 16x12 (downscaled from 32x24: resolution 1/2), "
        "2 at 20x15 (downscaled from 40x30: resolution 1/2)",
        "cameras: OPENCV, PINHOLE, SIMPLE_RADIAL",
        "distortion: undistorted 4 of 6 images (OPENCV, SIMPLE_RADIAL); every pixel has a source pixel, none cropped",
        "initial points: 5 from sparse/0/points3D.bin"]
    # views made in memory (the demo scene) have no provenance: the lines about files are left out
    demo = build_dataset([view_at("a", -1.0), view_at("b", 1.0)], [], [], [], "demo", "synthetic")
    assert demo.summary() == ["synthetic scene demo", "images: 2 train, no test views; 2x2",
                              "initial points: random, in a box around the cameras, because the scene has none"]


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
