"""data/colmap.py: binary and text models, the COLMAP loader, its image
matching and its errors (each names the file or image), and the real fern
scene in ../shared (skipped without it)."""
import time

import numpy as np
import pytest
from PIL import Image
from scipy.spatial.transform import Rotation

from conftest import shared_dir
from data import DataError, View, load_dataset
from data import colmap, images
from tests.dataset_files import (CAMS, colmap_scene, distorted_render, project, smooth_image, write_colmap_bin,
                                 write_colmap_txt, write_png)


def test_colmap_binary_and_text_readers_agree(tmp_path):
    cams, imgs, pts = colmap_scene(tmp_path / "b", ".bin")
    colmap_scene(tmp_path / "t", ".txt")
    mb = colmap.read_model(tmp_path / "b/sparse/0")
    mt = colmap.read_model(tmp_path / "t/sparse/0")
    for m in (mb, mt):
        c, im, p = m
        assert sorted(c) == [1, 2, 3]
        assert [c[k].model for k in (1, 2, 3)] == ["PINHOLE", "SIMPLE_RADIAL", "OPENCV"]
        for ref in cams:
            assert (c[ref["id"]].width, c[ref["id"]].height) == (ref["w"], ref["h"])
            np.testing.assert_array_equal(c[ref["id"]].params, ref["params"])
        assert sorted(im) == [r["id"] for r in imgs]
        for ref in imgs:
            got = im[ref["id"]]
            assert got.name == ref["name"] and got.camera_id == ref["cam"]
            np.testing.assert_array_equal(got.qvec, ref["q"])
            np.testing.assert_array_equal(got.tvec, ref["t"])
            np.testing.assert_array_equal(got.xys, np.array([r[:2] for r in ref["p2d"]]).reshape(-1, 2))
            np.testing.assert_array_equal(got.point3D_ids, [r[2] for r in ref["p2d"]])
        np.testing.assert_array_equal(p.ids, [r["id"] for r in pts])
        np.testing.assert_array_equal(p.xyz, [r["xyz"] for r in pts])
        np.testing.assert_array_equal(p.rgb, [r["rgb"] for r in pts])
        np.testing.assert_array_equal(p.error, [r["err"] for r in pts])

    db = load_dataset(tmp_path / "b", test_every=0)
    dt = load_dataset(tmp_path / "t", test_every=0)
    assert db.fmt == dt.fmt == "colmap"
    assert [v.name for v in db.train] == [v.name for v in dt.train] == sorted(r["name"] for r in imgs)
    for vb, vt in zip(db.train, dt.train):
        np.testing.assert_array_equal(vb.camera.viewmat, vt.camera.viewmat)
        assert (vb.camera.fx, vb.camera.fy, vb.camera.cx, vb.camera.cy) == \
               (vt.camera.fx, vt.camera.fy, vt.camera.cx, vt.camera.cy)
        np.testing.assert_array_equal(vb.image, vt.image)
    np.testing.assert_array_equal(db.points, dt.points)
    np.testing.assert_array_equal(db.colors, dt.colors)
    assert db.scene_scale == dt.scene_scale


def test_colmap_views_poses_and_intrinsics(tmp_path):
    cams, imgs, pts = colmap_scene(tmp_path, ".bin")
    ds = load_dataset(tmp_path, test_every=0)
    by_name = {v.name: v for v in ds.train}
    byid = {c["id"]: c for c in cams}
    for ref in imgs:
        v = by_name[ref["name"]]
        assert isinstance(v, View)
        assert v.image.dtype == np.float32 and v.image.flags.c_contiguous
        assert v.image.shape == (byid[ref["cam"]]["h"], byid[ref["cam"]]["w"], 3)
        assert 0.0 <= v.image.min() and v.image.max() <= 1.0
        R = Rotation.from_quat([*ref["q"][1:], ref["q"][0]]).as_matrix()
        np.testing.assert_allclose(v.camera.viewmat[:3, :3], R, atol=1e-12)
        np.testing.assert_allclose(v.camera.viewmat[:3, 3], ref["t"], atol=1e-12)
        # the scene centre (origin) is in front of every camera and projects near the principal point
        u, vv, z = project(v.camera, [0, 0, 0])
        assert z > 0 and 0 <= u < v.camera.width and 0 <= vv < v.camera.height
        p = byid[ref["cam"]]["params"]
        if ref["cam"] == 1:
            assert (v.camera.fx, v.camera.fy, v.camera.cx, v.camera.cy) == tuple(p)
            # PINHOLE: the image is used as is
            np.testing.assert_allclose(v.image, np.round(smooth_image(32, 24, imgs.index(ref)) * 255) / 255,
                                       atol=1e-6)
        elif ref["cam"] == 2:
            assert (v.camera.fx, v.camera.fy, v.camera.cx, v.camera.cy) == (p[0], p[0], p[1], p[2])
    np.testing.assert_allclose(ds.points, [r["xyz"] for r in pts], rtol=1e-6)
    np.testing.assert_allclose(ds.colors, np.array([r["rgb"] for r in pts]) / 255.0, rtol=1e-6)
    assert ds.points.dtype == ds.colors.dtype == np.float32
    centres = np.stack([-v.camera.viewmat[:3, :3].T @ v.camera.viewmat[:3, 3] for v in ds.train])
    assert ds.scene_scale == pytest.approx(1.1 * np.linalg.norm(centres - centres.mean(0), axis=1).max())


def test_colmap_intrinsics_scaled_to_image_folder(tmp_path):
    colmap_scene(tmp_path, ".bin")
    colmap_scene(tmp_path, ".bin", folder="images_2", image_scale=0.5)
    full = load_dataset(tmp_path, test_every=0)
    half = load_dataset(tmp_path, images="images_2", test_every=0)
    for a, b in zip(full.train, half.train):
        assert a.name == b.name
        assert (b.camera.width, b.camera.height) == (a.camera.width // 2, a.camera.height // 2)
        assert b.image.shape == (a.camera.height // 2, a.camera.width // 2, 3)
        for k in ("fx", "fy", "cx", "cy"):
            assert getattr(b.camera, k) == pytest.approx(0.5 * getattr(a.camera, k))
        np.testing.assert_array_equal(a.camera.viewmat, b.camera.viewmat)
    # a folder that does not exist: DataError listing those that do
    with pytest.raises(DataError, match="images_4") as err:
        load_dataset(tmp_path, images="images_4")
    assert "images_2" in str(err.value) and "images," in str(err.value) + ","


def test_resolution_factor_and_max_width_scale_images_and_intrinsics(tmp_path):
    colmap_scene(tmp_path, ".bin")                        # 32x24 and 40x30 images
    full = load_dataset(tmp_path)
    assert all(v.provenance.file_size == (v.width, v.height) for v in full.train)
    assert "downscaled" not in "\n".join(full.summary())
    # a factor (Inria's -r): sizes rounded, each axis's intrinsics scaled by its own ratio
    for factor in (2, 3):
        ds = load_dataset(tmp_path, resolution=factor)
        for a, b in zip(full.train, ds.train):
            assert (b.width, b.height) == (round(a.width / factor), round(a.height / factor))
            assert b.image.shape == (b.height, b.width, 3)
            sx, sy = b.width / a.width, b.height / a.height
            assert (b.camera.fx, b.camera.cx) == pytest.approx((a.camera.fx * sx, a.camera.cx * sx))
            assert (b.camera.fy, b.camera.cy) == pytest.approx((a.camera.fy * sy, a.camera.cy * sy))
        images_line = ds.summary()[1]
        assert f"downscaled from 32x24: resolution 1/{factor}" in images_line
    # max_width: wider images narrowed to it, the others kept; one line says so
    ds = load_dataset(tmp_path, max_width=36)
    for a, b in zip(full.train, ds.train):
        assert b.width == min(a.width, 36)
        assert b.camera.fx == pytest.approx(a.camera.fx * b.width / a.width)
        assert b.camera.cy == pytest.approx(a.camera.cy * b.height / a.height)
    lines = [line for line in ds.summary() if "downscaled" in line]
    assert len(lines) == 1 and "36x27 (downscaled from 40x30: max width 36 px)" in lines[0]
    # both: the smaller size wins
    ds = load_dataset(tmp_path, resolution=2, max_width=18)
    assert sorted({(v.width, v.height) for v in ds.train}) == [(16, 12), (18, 14)]


def test_colmap_sorted_order_matching(tmp_path):
    names = [f"IMG_{4030 - i}.JPG" for i in range(5)]           # model names, not on disk
    files = [f"image{i:03d}.png" for i in range(5)]             # renamed files, same sorted order
    cams = [dict(CAMS[0])]
    # pair by sorted order: the k-th sorted model name <-> the k-th sorted file
    order = np.argsort(names)
    files_for = [None] * 5
    for k, i in enumerate(order):
        files_for[i] = files[k]
    _, imgs, _ = colmap_scene(tmp_path, ".bin", names=names, files=files_for, cams=cams)
    ds = load_dataset(tmp_path, test_every=0)
    (note,) = [line for line in ds.summary() if line.startswith("note:")]
    assert "sorted order" in note and f"{sorted(names)[0]} -> {files[0]}" in note
    assert [v.name for v in ds.train] == files
    for v in ds.train:
        i = files_for.index(v.name)
        ref = next(r for r in imgs if r["name"] == names[i])
        np.testing.assert_allclose(v.camera.viewmat[:3, 3], ref["t"])
        np.testing.assert_allclose(v.image, np.round(smooth_image(32, 24, i) * 255) / 255, atol=1e-6)


def test_colmap_names_with_other_extension(tmp_path):
    names = [f"IMG_{i}.JPG" for i in range(3)]
    colmap_scene(tmp_path, ".bin", names=names, files=[f"IMG_{i}.png" for i in range(3)], cams=[CAMS[0]])
    ds = load_dataset(tmp_path, test_every=0)
    assert [v.name for v in ds.train] == ["IMG_0.png", "IMG_1.png", "IMG_2.png"]


def test_colmap_text_model_in_plain_sparse_folder(tmp_path):
    colmap_scene(tmp_path, ".txt", sparse="sparse", cams=[CAMS[1]], n_images=3)
    ds = load_dataset(tmp_path, fmt="colmap", test_every=0)
    assert len(ds.train) == 3 and len(ds.points) == 5


def test_colmap_opencv_images_are_undistorted_on_load(tmp_path):
    w, h = 96, 72
    params = [80.0, 78.0, 48.5, 35.5, -0.15, 0.04, 0.003, -0.002]
    dist = (params[4], params[5], 0.0, 0.0, params[6], params[7])
    distorted, pinhole = distorted_render(w, h, *params[:4], dist)
    cams = [{"id": 1, "model": "OPENCV", "w": w, "h": h, "params": params}]
    colmap_scene(tmp_path, ".bin", cams=cams, n_images=2)
    for i in range(2):
        write_png(tmp_path / "images" / f"view_{i:02d}.png", distorted)
    ds = load_dataset(tmp_path, test_every=0)
    img = ds.train[0].image
    cam = ds.train[0].camera
    assert (cam.fx, cam.fy, cam.cx, cam.cy, cam.width, cam.height) == (*params[:4], w, h)
    rmse = np.sqrt(np.mean((img - pinhole)[6:-6, 6:-6] ** 2))
    assert rmse < 0.004, rmse
    # and loading at half size (images_2) scales the intrinsics before undistorting
    small = np.asarray(Image.fromarray((distorted * 255).round().astype(np.uint8)).resize((w // 2, h // 2),
                                                                                         Image.Resampling.BOX))
    for i in range(2):
        write_png(tmp_path / "images_2" / f"view_{i:02d}.png", small)
    ds2 = load_dataset(tmp_path, images="images_2", test_every=0)
    pin2 = np.asarray(Image.fromarray((pinhole * 255).round().astype(np.uint8)).resize((w // 2, h // 2),
                                                                                      Image.Resampling.BOX)) / 255.0
    assert ds2.train[0].camera.fx == pytest.approx(params[0] / 2)
    rmse2 = np.sqrt(np.mean((ds2.train[0].image - pin2)[4:-4, 4:-4] ** 2))
    assert rmse2 < 0.006, rmse2
    # --distortion ignore: the images as they are, the same intrinsics without distortion, and a note
    raw = load_dataset(tmp_path, test_every=0, distortion="ignore")
    np.testing.assert_allclose(raw.train[0].image, np.round(distorted * 255) / 255, atol=1e-6)
    cam = raw.train[0].camera
    assert (cam.fx, cam.fy, cam.cx, cam.cy, cam.width, cam.height) == (*params[:4], w, h)
    summary = raw.summary()
    assert "distortion: none" in summary and any("distortion ignored for 2 images" in line for line in summary)
    assert not any("distortion ignored" in line for line in ds.summary())
    with pytest.raises(ValueError, match="distortion must be one of undistort, ignore, got 'keep'"):
        load_dataset(tmp_path, distortion="keep")


# --- errors -----------------------------------------------------------------

def test_error_missing_image(tmp_path):
    colmap_scene(tmp_path, ".bin")
    (tmp_path / "images" / "view_03.png").unlink()
    with pytest.raises(DataError, match="view_03.png") as err:
        load_dataset(tmp_path)
    assert "more" not in str(err.value)
    for name in ("view_01.png", "view_05.png"):
        (tmp_path / "images" / name).unlink()
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    assert "missing 3 of the 6 image files" in str(err.value)
    assert "view_01.png, view_03.png, view_05.png" in str(err.value)


def test_error_missing_image_of_renamed_files_names_the_gap(tmp_path):
    """The LLFF renaming (IMG_4026.JPG ... in the model, image000.png ... on disk) with one
    file deleted: the message names the file missing from the sequence."""
    names = [f"IMG_{4026 + i}.JPG" for i in range(10)]
    colmap_scene(tmp_path, ".bin", names=names, files=[f"image{i:03d}.png" for i in range(10)], cams=[CAMS[0]])
    (tmp_path / "images" / "image003.png").unlink()
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"missing image file {tmp_path / 'images' / 'image003.png'}: ")
    assert "holds 9 image files" in msg and "the 10 images of the COLMAP model" in msg and "more" not in msg
    (tmp_path / "images" / "image009.png").unlink()          # the last: numbered from 0, the sequence ends at 9
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    assert str(err.value).startswith(f"missing image files {tmp_path / 'images' / 'image003.png'}, "
                                     f"{tmp_path / 'images' / 'image009.png'}: {tmp_path / 'images'} holds 8 "
                                     "image files (image000.png ... image008.png) for the 10 images"), err.value


def test_error_missing_first_image_of_renamed_files_names_it(tmp_path):
    """The LLFF renaming with its first file deleted (issue 58: fern's message named no file): numbered
    from 0 it is image000.png; numbered from 1 it would be image010.png, and the message says both."""
    names = [f"IMG_{4026 + i}.JPG" for i in range(10)]
    colmap_scene(tmp_path, ".bin", names=names, files=[f"image{i:03d}.png" for i in range(10)], cams=[CAMS[0]])
    (tmp_path / "images" / "image000.png").unlink()
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    assert str(err.value).startswith(f"missing image file {tmp_path / 'images' / 'image000.png'} if the numbers "
                                     "start at 0, or image010.png if they start at 1: "), err.value


def test_error_empty_image_folder(tmp_path):
    colmap_scene(tmp_path, ".bin")
    for f in (tmp_path / "images").iterdir():
        f.unlink()
    with pytest.raises(DataError, match="holds no image files") as err:
        load_dataset(tmp_path)
    assert str(tmp_path / "images") in str(err.value) and "view_00.png" in str(err.value)


def test_all_sfm_points_non_finite_fall_back_to_random_points(tmp_path):
    cams, imgs, pts = colmap_scene(tmp_path, ".bin")
    for p in pts:
        p["xyz"] = [float("nan"), 0.0, 1.0]
    pts[0]["xyz"] = [0.0, float("inf"), 1.0]
    write_colmap_bin(tmp_path / "sparse/0", cams, imgs, pts)
    ds = load_dataset(tmp_path)
    assert ds.points.shape == ds.colors.shape == (0, 3)
    line = ds.summary(n_random=1000)[-1]
    assert line == ("initial points: random, 1,000 in a box around the cameras, because all 5 points of "
                    "sparse/0/points3D.bin are NaN or infinite")
    # some of them: dropped, and a note says how many
    pts[0]["xyz"] = [0.0, 0.5, 1.0]
    write_colmap_bin(tmp_path / "sparse/0", cams, imgs, pts)
    lines = load_dataset(tmp_path).summary()
    assert "initial points: 1 from sparse/0/points3D.bin" in lines
    assert "note: dropped 4 of 5 points of sparse/0/points3D.bin: NaN or infinite" in lines
    # and without a points3D file at all
    (tmp_path / "sparse/0/points3D.bin").unlink()
    assert load_dataset(tmp_path).summary()[-1] == ("initial points: random, in a box around the cameras, "
                                                    "because the COLMAP model sparse/0 has no points3D file")


@pytest.mark.parametrize("ext", [".bin", ".txt"])
@pytest.mark.parametrize("model", ["FULL_OPENCV", "OPENCV_FISHEYE"])
def test_error_unsupported_model(tmp_path, ext, model):
    cams = [dict(CAMS[0]), {"id": 2, "model": model, "w": 32, "h": 24,
                            "params": [30.0, 30, 16, 12] + [0.0] * (8 if model == "FULL_OPENCV" else 4)}]
    colmap_scene(tmp_path, ext, cams=cams)
    with pytest.raises(DataError, match=model) as err:
        load_dataset(tmp_path)
    assert f"cameras{ext}" in str(err.value)


def test_error_non_finite_pose(tmp_path):
    _, imgs, pts = colmap_scene(tmp_path, ".bin")
    imgs[2]["t"] = np.array([0.0, np.nan, 1.0])
    write_colmap_bin(tmp_path / "sparse/0", CAMS, imgs, pts)
    with pytest.raises(DataError, match=imgs[2]["name"]):
        load_dataset(tmp_path)
    imgs[2]["t"] = np.array([0.0, 0.0, 1.0])
    imgs[4]["q"] = np.array([np.inf, 0.0, 0.0, 0.0])
    write_colmap_txt(tmp_path / "t/sparse/0", CAMS, imgs, pts)
    (tmp_path / "t/images").symlink_to(tmp_path / "images")
    with pytest.raises(DataError, match=imgs[4]["name"]):
        load_dataset(tmp_path / "t")


def test_error_non_finite_intrinsics(tmp_path):
    cams = [dict(CAMS[0], params=[30.0, float("nan"), 16.0, 12.0])]
    colmap_scene(tmp_path, ".bin", cams=cams, n_images=2)
    with pytest.raises(DataError, match="view_00.png") as err:
        load_dataset(tmp_path)
    assert "non-finite" in str(err.value) and "cameras.bin" in str(err.value)


@pytest.mark.parametrize("which,cut", [("images", 10), ("images", 100), ("cameras", 30), ("points3D", 40),
                                       ("images", 4)])
def test_error_truncated_bin(tmp_path, which, cut):
    colmap_scene(tmp_path, ".bin")
    p = tmp_path / "sparse/0" / f"{which}.bin"
    data = p.read_bytes()
    p.write_bytes(data[:cut] if cut < len(data) else data[:-5])
    with pytest.raises(DataError, match=f"{which}.bin") as err:
        load_dataset(tmp_path)
    assert "truncated" in str(err.value)


def test_error_malformed_text(tmp_path):
    colmap_scene(tmp_path, ".txt")
    p = tmp_path / "sparse/0/images.txt"
    p.write_text(p.read_text().replace(" 1 view_00.png", " x view_00.png"))
    with pytest.raises(DataError, match="images.txt"):
        load_dataset(tmp_path)


# --- the real scene ---------------------------------------------------------

def test_real_fern():
    root = shared_dir() / "data" / "fern"
    if not root.is_dir():
        pytest.skip("fern not present")
    t0 = time.perf_counter()
    ds = load_dataset(root, images="images_8", test_every=8)
    elapsed = time.perf_counter() - t0
    print(f"fern (images_8) loaded in {elapsed:.2f} s")
    assert ds.fmt == "colmap" and not ds.masked
    assert any("sorted order" in line for line in ds.summary())
    views = ds.train + ds.test
    assert len(views) == 20 and len(ds.train) == 17 and len(ds.test) == 3
    assert [v.name for v in ds.test] == ["image000.png", "image008.png", "image016.png"]
    cams, _, _ = colmap.read_model(root / "sparse" / "0")
    (cam,) = cams.values()
    assert cam.model == "SIMPLE_RADIAL" and (cam.width, cam.height) == (4032, 3024)
    f, cx, cy, k = cam.params
    fx, fy, cx, cy = f * 504 / 4032, f * 378 / 3024, cx * 504 / 4032, cy * 378 / 3024
    crop = images.undistortion(504, 378, fx, fy, cx, cy, (k, 0, 0, 0, 0, 0))
    height, width = crop.mx.shape
    assert 0 < crop.clamped < 0.05 and 490 < width < 504 and 370 < height < 378  # k > 0: corners have no source
    for v in views:
        assert v.image.shape == (height, width, 3) and v.provenance.scaled_size == (504, 378)
        assert (v.camera.fx, v.camera.fy) == pytest.approx((fx, fy))
        assert (v.camera.cx, v.camera.cy) == pytest.approx((cx - crop.x0, cy - crop.y0))
    assert len(ds.points) > 1000 and ds.points.dtype == np.float32
    assert 0.0 <= ds.colors.min() and ds.colors.max() <= 1.0
    # the pose convention: most SfM points are in front of each camera and inside its image
    P = np.c_[ds.points.astype(np.float64), np.ones(len(ds.points))]
    for v in views:
        pc = P @ v.camera.viewmat.T
        z = pc[:, 2]
        u = v.camera.fx * pc[:, 0] / z + v.camera.cx
        w = v.camera.fy * pc[:, 1] / z + v.camera.cy
        inside = (z > 0) & (u >= 0) & (u < v.width) & (w >= 0) & (w < v.height)
        assert inside.mean() > 0.5, (v.name, inside.mean())

