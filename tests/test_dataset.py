"""data/dataset.py: format detection and its errors; the package: importing it
from the repository root, and its modules' layering."""
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from data import DataError, load_dataset
from tests.dataset_files import colmap_scene


def test_error_undetectable_folder(tmp_path):
    (tmp_path / "stuff").mkdir()
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "stuff")
    msg = str(err.value)
    assert "stuff" in msg and "sparse" in msg and "transforms_train.json" in msg and "transforms.json" in msg
    with pytest.raises(DataError, match="nowhere"):
        load_dataset(tmp_path / "nowhere")
    with pytest.raises(DataError, match="fmt|format"):
        load_dataset(tmp_path / "stuff", fmt="llff")
    assert issubclass(DataError, ValueError)


@pytest.mark.parametrize("option,bad", [("resolution", 0), ("resolution", -2), ("resolution", 1.5),
                                        ("resolution", "4"), ("resolution", True), ("max_width", -1),
                                        ("max_width", 800.0)])
def test_bad_resolution_values_name_the_parameter(tmp_path, option, bad):
    colmap_scene(tmp_path, ".bin", n_images=2)
    with pytest.raises(DataError, match=f"^{option} must be a whole number") as err:
        load_dataset(tmp_path, **{option: bad})
    assert repr(bad) in str(err.value)


def test_no_width_limit(tmp_path):
    wide = {"id": 1, "model": "PINHOLE", "w": 2000, "h": 8, "params": [1000.0, 1000.0, 1000.0, 4.0]}
    colmap_scene(tmp_path, ".bin", n_images=2, cams=[wide])
    default = load_dataset(tmp_path)
    assert (default.train[0].width, default.train[0].height) == (1600, 6)             # Inria's default
    assert "1600x6 (downscaled from 2000x8: max width 1600 px)" in default.summary()[1]
    for no_limit in (0, None):
        assert load_dataset(tmp_path, max_width=no_limit).train[0].width == 2000


def test_a_resolution_above_8_is_the_width(tmp_path):
    """As Inria's -r: up to 8 a factor, above it the width in pixels (500 made 2x2 images of a
    1000 px capture when it was a factor)."""
    wide = {"id": 1, "model": "PINHOLE", "w": 2000, "h": 8, "params": [1000.0, 1000.0, 1000.0, 4.0]}
    colmap_scene(tmp_path, ".bin", n_images=2, cams=[wide])
    ds = load_dataset(tmp_path, resolution=500)
    assert (ds.train[0].width, ds.train[0].height) == (500, 2)
    assert ds.train[0].camera.fx == pytest.approx(250.0)
    assert "500x2 (downscaled from 2000x8: resolution 500 px wide)" in ds.summary()[1]
    assert load_dataset(tmp_path, resolution=8, max_width=0).train[0].width == 250
    assert load_dataset(tmp_path, resolution=9, max_width=0).train[0].width == 9


def test_the_first_training_views_only(tmp_path, monkeypatch):
    """``train_views``: a COLMAP capture reads the images of those views alone; every format keeps
    them and no test views, the scene scale theirs."""
    from data import colmap
    from data.scene import first_training_views, scene_scale
    colmap_scene(tmp_path, ".bin", n_images=7)
    whole = load_dataset(tmp_path, test_every=3)
    read = []
    real = colmap.load_image
    monkeypatch.setattr(colmap, "load_image", lambda path, *a, **k: read.append(path.name) or real(path, *a, **k))
    some = load_dataset(tmp_path, test_every=3, train_views=2)
    assert [v.name for v in some.train] == [v.name for v in whole.train[:2]] == sorted(read) and some.test == []
    assert some.scene_scale == scene_scale(v.camera for v in some.train)
    assert "read the first 2 of the 4 training views, no test views" in some.summary()[-1]
    kept = first_training_views(whole, 3)
    assert [v.name for v in kept.train] == [v.name for v in whole.train[:3]] and kept.test == [] and not kept.split
    assert kept.notes[-1] == "kept the first 3 training views (of 4 loaded), no test views"
    assert first_training_views(some, 5) is some


def test_import_from_repo_root():
    proc = subprocess.run([sys.executable, "-c", "import data; print(data.load_dataset.__name__)"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "load_dataset"
