"""data/images.py: undistortion, alpha compositing, and the errors of unreadable
or inconsistently sized images (each names the file)."""
import numpy as np
import pytest

from data import DataError, load_dataset
from data import images
from tests.dataset_files import colmap_scene, distorted_render, pattern, rgba_image, smooth_image, write_png


def test_undistort_opencv_recovers_pinhole_image():
    w, h, fx, fy, cx, cy = 160, 120, 120.0, 118.0, 81.0, 59.0
    dist = (-0.12, 0.03, 0.0, 0.0, 0.004, -0.003)           # k1, k2, k3, k4, p1, p2
    distorted, pinhole = distorted_render(w, h, fx, fy, cx, cy, dist)
    # the distortion is significant
    assert np.sqrt(np.mean((distorted - pinhole)[10:-10, 10:-10] ** 2)) > 0.01
    out, crop = images.undistort(distorted, fx, fy, cx, cy, dist)
    assert (crop.x0, crop.y0, crop.clamped) == (0, 0, 0.0)   # barrel: every pixel has a source
    assert out.shape == pinhole.shape and out.dtype == np.float32 and out.flags.c_contiguous
    rmse = np.sqrt(np.mean((out - pinhole)[10:-10, 10:-10] ** 2))
    assert rmse < 0.003, rmse


def test_undistort_identity_without_coefficients():
    img = smooth_image(37, 23, 3).astype(np.float32)
    out, crop = images.undistort(img, 30.0, 31.0, 18.0, 11.0, (0.0,) * 6)
    np.testing.assert_array_equal(out, img)
    assert (crop.x0, crop.y0, crop.clamped) == (0, 0, 0.0)
    # the remap itself is exact for an identity map
    mx, my = images.undistort_map(37, 23, 30.0, 31.0, 18.0, 11.0, (0.0,) * 6)
    np.testing.assert_allclose(images.remap_bilinear(img, mx, my), img, atol=1e-6)


def test_largest_rectangle():
    valid = np.zeros((7, 9), bool)
    assert images.largest_rectangle(valid) is None
    valid[1:6, 2:8] = True          # 5 x 6
    valid[3, 0:9] = True            # a wide row: 9 x 1 is smaller
    valid[2, 4] = False             # a hole splits rows 1-5: best is rows 3-5, columns 2-7 (3 x 6)
    assert images.largest_rectangle(valid) == (2, 3, 8, 6)
    assert images.largest_rectangle(np.ones((4, 5), bool)) == (0, 0, 5, 4)


def test_pincushion_capture_is_cropped_to_pixels_with_a_source(tmp_path):
    """A synthetic OPENCV capture whose corners (k1 > 0) would sample outside the distorted
    image: the loaded views are cropped so that every pixel has a source pixel, and their
    pinhole cameras still see the scene where it is (the principal point moved with the crop)."""
    w, h = 64, 48
    params = [50.0, 49.0, 32.3, 23.8, 0.12, 0.02, 0.004, -0.003]
    fx, fy, cx, cy = params[:4]
    dist = (params[4], params[5], 0.0, 0.0, params[6], params[7])
    distorted, _ = distorted_render(w, h, fx, fy, cx, cy, dist)
    colmap_scene(tmp_path, ".bin", cams=[{"id": 1, "model": "OPENCV", "w": w, "h": h, "params": params}], n_images=2)
    for i in range(2):
        write_png(tmp_path / "images" / f"view_{i:02d}.png", distorted)
    ds = load_dataset(tmp_path)
    v = ds.train[0]
    cam = v.camera
    x0, y0 = cx - cam.cx, cy - cam.cy
    assert x0 == round(x0) and y0 == round(y0) and (cam.fx, cam.fy) == (fx, fy)
    assert v.image.shape == (cam.height, cam.width, 3) and cam.width < w and cam.height < h
    # no clamped pixel: every output pixel centre, through the distortion, lands inside the source image
    def inside(u0, u1, v0, v1):
        """Whether the output pixels [u0, u1) x [v0, v1) (of the cropped view) all have a source."""
        vv, uu = np.mgrid[v0:v1, u0:u1] + 0.5
        xd, yd = images.distort((uu - cam.cx) / fx, (vv - cam.cy) / fy, dist)
        su, sv = fx * xd + cx, fy * yd + cy
        return su.min() >= 0 and su.max() < w and sv.min() >= 0 and sv.max() < h

    assert inside(0, cam.width, 0, cam.height)
    # ... and a row or column more on any side would not: the crop is as large as it may be
    assert not inside(-1, 0, 0, cam.height) or x0 == 0
    assert not inside(cam.width, cam.width + 1, 0, cam.height) or x0 + cam.width == w
    assert not inside(0, cam.width, -1, 0) or y0 == 0
    assert not inside(0, cam.width, cam.height, cam.height + 1) or y0 + cam.height == h
    assert v.provenance.clamped > 0 and v.provenance.scaled_size == (w, h)
    vv, uu = np.mgrid[0:cam.height, 0:cam.width] + 0.5
    # reprojection: the loaded pinhole image is the scene seen through the loaded camera, borders included
    expected = pattern((uu - cam.cx) / fx, (vv - cam.cy) / fy)
    err = np.abs(v.image - expected)
    assert np.sqrt(np.mean(err ** 2)) < 0.01 and err.max() < 0.05, (np.sqrt(np.mean(err ** 2)), err.max())
    line = ds.summary()[3]
    assert line.startswith("distortion: undistorted 2 of 2 images (OPENCV); ")
    assert f"% of the pixels had no source pixel (beyond the border): cropped 64x48 to {cam.width}x{cam.height}" \
        in line


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


def test_error_undistortion_without_any_source_pixel(tmp_path):
    cams = [{"id": 1, "model": "SIMPLE_RADIAL", "w": 32, "h": 24, "params": [30.0, -40.0, 12.0, 1.0]}]
    colmap_scene(tmp_path, ".bin", cams=cams, n_images=2)
    with pytest.raises(DataError, match="view_00.png") as err:
        load_dataset(tmp_path)
    assert "no pixel inside the image" in str(err.value)


def test_error_inconsistent_image_size(tmp_path):
    colmap_scene(tmp_path, ".bin")
    write_png(tmp_path / "images" / "view_03.png", smooth_image(30, 24, 0))   # camera 1 is 32x24
    with pytest.raises(DataError, match="view_03.png") as err:
        load_dataset(tmp_path)
    assert "30x24" in str(err.value)

