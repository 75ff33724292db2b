"""data/images.py: undistortion, alpha compositing, and the errors of unreadable
or inconsistently sized images (each names the file)."""
import numpy as np
import pytest

from data import DataError, load_dataset
from data import images
from tests.dataset_files import colmap_scene, distorted_render, rgba_image, smooth_image, write_png


def test_undistort_opencv_recovers_pinhole_image():
    w, h, fx, fy, cx, cy = 160, 120, 120.0, 118.0, 81.0, 59.0
    dist = (-0.12, 0.03, 0.0, 0.0, 0.004, -0.003)           # k1, k2, k3, k4, p1, p2
    distorted, pinhole = distorted_render(w, h, fx, fy, cx, cy, dist)
    # the distortion is significant
    assert np.sqrt(np.mean((distorted - pinhole)[10:-10, 10:-10] ** 2)) > 0.01
    out = images.undistort(distorted, fx, fy, cx, cy, dist)
    assert out.shape == pinhole.shape and out.dtype == np.float32 and out.flags.c_contiguous
    rmse = np.sqrt(np.mean((out - pinhole)[10:-10, 10:-10] ** 2))
    assert rmse < 0.003, rmse


def test_undistort_identity_without_coefficients():
    img = smooth_image(37, 23, 3).astype(np.float32)
    out = images.undistort(img, 30.0, 31.0, 18.0, 11.0, (0.0,) * 6)
    np.testing.assert_array_equal(out, img)
    # the remap itself is exact for an identity map
    mx, my = images.undistort_map(37, 23, 30.0, 31.0, 18.0, 11.0, (0.0,) * 6)
    np.testing.assert_allclose(images.remap_bilinear(img, mx, my), img, atol=1e-6)


def test_masked_only_where_alpha_shows_the_background(tmp_path):
    img = rgba_image(8, 6, 0)
    write_png(tmp_path / "cut.png", img)
    img[..., 3] = 255
    write_png(tmp_path / "opaque.png", img)
    write_png(tmp_path / "rgb.png", img[..., :3])
    assert [images.read_image(tmp_path / f)[1] for f in ("cut.png", "opaque.png", "rgb.png")] == [True, False, False]


# --- errors -----------------------------------------------------------------

def test_error_corrupt_image(tmp_path):
    colmap_scene(tmp_path, ".bin")
    (tmp_path / "images" / "view_02.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    with pytest.raises(DataError, match="view_02.png"):
        load_dataset(tmp_path)
    # truncated PNG data (valid header, cut body)
    colmap_scene(tmp_path / "b", ".bin")
    p = tmp_path / "b" / "images" / "view_04.png"
    p.write_bytes(p.read_bytes()[:60])
    with pytest.raises(DataError, match="view_04.png"):
        load_dataset(tmp_path / "b")


def test_error_inconsistent_image_size(tmp_path):
    colmap_scene(tmp_path, ".bin")
    write_png(tmp_path / "images" / "view_03.png", smooth_image(30, 24, 0))   # camera 1 is 32x24
    with pytest.raises(DataError, match="view_03.png") as err:
        load_dataset(tmp_path)
    assert "30x24" in str(err.value)

