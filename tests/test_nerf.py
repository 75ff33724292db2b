"""data/nerf.py: Blender (NeRF-synthetic) and instant-ngp/nerfstudio scenes,
the OpenGL-to-OpenCV camera axes, and the real lego scene in ../shared
(skipped without it)."""
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import shared_dir
from data import DataError, load_dataset
from data import images
from tests.dataset_files import project, rgba_image, smooth_image, write_png


def opengl_c2w(pos, target=(0.0, 0.0, 0.0), up=(0.0, 0.0, 1.0)):
    """Camera-to-world in OpenGL/Blender axes (x right, y up, z back) looking at ``target``."""
    pos = np.asarray(pos, float)
    back = pos - np.asarray(target, float)
    back /= np.linalg.norm(back)
    right = np.cross(up, back)
    right /= np.linalg.norm(right)
    upv = np.cross(back, right)
    M = np.eye(4)
    M[:3, 0], M[:3, 1], M[:3, 2], M[:3, 3] = right, upv, back, pos
    return M


def check_gl_convention(cam, c2w, tol=1e-6):
    """Points in front of / right of / above the camera land where the GL pose says."""
    pos, right, up, back = c2w[:3, 3], c2w[:3, 0], c2w[:3, 1], c2w[:3, 2]
    ahead = pos - 3.0 * back
    u, v, z = project(cam, ahead)
    assert z == pytest.approx(3.0) and u == pytest.approx(cam.cx) and v == pytest.approx(cam.cy)
    u, v, z = project(cam, ahead + 0.6 * right + 0.3 * up)
    assert z == pytest.approx(3.0)
    assert u == pytest.approx(cam.cx + cam.fx * 0.2, abs=tol)     # right -> larger u
    assert v == pytest.approx(cam.cy - cam.fy * 0.1, abs=tol)     # up -> smaller v (y down)


def test_blender_loader_and_gl_to_cv(tmp_path):
    w = h = 24
    angle = 0.8
    for split, n in (("train", 4), ("test", 2)):
        frames = []
        for i in range(n):
            c2w = opengl_c2w([3 * math.cos(i + (split == "test")), 3 * math.sin(i), 1.5])
            write_png(tmp_path / split / f"r_{i}.png", rgba_image(w, h, i))
            frames.append({"file_path": f"./{split}/r_{i}", "rotation": 0.1, "transform_matrix": c2w.tolist()})
        (tmp_path / f"transforms_{split}.json").write_text(json.dumps({"camera_angle_x": angle, "frames": frames}))
    ds = load_dataset(tmp_path)
    assert ds.fmt == "blender" and len(ds.train) == 4 and len(ds.test) == 2
    assert ds.masked and all(v.masked for v in ds.views)  # alpha below 1: objects cut out
    assert ds.init_box == ((-1.3,) * 3, (1.3,) * 3) and len(ds.points) == 0  # 3DGS: random points in this cube
    assert ds.points.shape == (0, 3) and ds.colors.shape == (0, 3)
    meta = json.loads((tmp_path / "transforms_train.json").read_text())
    for v, fr in zip(ds.train, meta["frames"]):
        cam = v.camera
        assert cam.fx == pytest.approx(0.5 * w / math.tan(0.5 * angle)) and cam.fx == cam.fy
        assert (cam.cx, cam.cy, cam.width, cam.height) == (w / 2, h / 2, w, h)
        check_gl_convention(cam, np.array(fr["transform_matrix"]))
        # the world origin (the object) is in front of the camera, at the image centre
        u, vv, z = project(cam, [0, 0, 0])
        assert z > 0 and u == pytest.approx(w / 2) and vv == pytest.approx(h / 2)
        np.testing.assert_allclose(v.image[:4, :4], 1.0)                       # white background
        a = 128 / 255
        rgb = np.round(smooth_image(w, h, int(v.name[-5]))[-1, -1] * 255) / 255
        np.testing.assert_allclose(v.image[-1, -1], rgb * a + (1 - a), atol=1e-5)   # half transparent
    assert ds.summary(n_random=500)[1:] == [
        "images: 4 train, 2 test (transforms_test.json, for evaluation only); 24x24",
        "cameras: pinhole",
        "distortion: none",
        "initial points: random, 500 in the box (-1.3, -1.3, -1.3) to (1.3, 1.3, 1.3), because Blender scenes "
        "have no point cloud"]
    black = load_dataset(tmp_path, background=(0, 0, 0), max_width=12)
    np.testing.assert_allclose(black.train[0].image[:2, :2], 0.0)
    assert black.train[0].image.shape == (12, 12, 3)
    assert black.train[0].camera.fx == pytest.approx(0.5 * 12 / math.tan(0.5 * angle))
    # missing image: the message names the file
    (tmp_path / "test" / "r_1.png").unlink()
    with pytest.raises(DataError, match="r_1"):
        load_dataset(tmp_path)


def test_blender_without_test_json_trains_on_every_view(tmp_path):
    frames = []
    for i in range(5):
        write_png(tmp_path / "train" / f"r_{i}.png", rgba_image(16, 16, i))
        frames.append({"file_path": f"./train/r_{i}", "transform_matrix": opengl_c2w([3 * math.cos(i), 3, 1]).tolist()})
    (tmp_path / "transforms_train.json").write_text(json.dumps({"camera_angle_x": 0.8, "frames": frames}))
    ds = load_dataset(tmp_path)
    assert len(ds.train) == 5 and ds.test == []
    lines = ds.summary()
    assert lines[1] == "images: 5 train, no test views; 16x16"
    assert lines[-1] == "note: no transforms_test.json: all 5 views train, none is held out for evaluation"
    # asked for a test split (the CLI's --eval): every test_every-th training view
    ds = load_dataset(tmp_path, test_every=2)
    assert [v.name for v in ds.test] == ["train/r_0.png", "train/r_2.png", "train/r_4.png"]
    assert "3 test (every 2nd image of transforms_train.json)" in ds.summary()[1]


def write_ply_binary(path, xyz, rgb):
    header = ("ply\nformat binary_little_endian 1.0\ncomment test\nelement vertex %d\n"
              "property float x\nproperty float y\nproperty float z\n"
              "property uchar red\nproperty uchar green\nproperty uchar blue\nend_header\n") % len(xyz)
    rec = np.zeros(len(xyz), [("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("r", "u1"), ("g", "u1"), ("b", "u1")])
    rec["x"], rec["y"], rec["z"] = xyz.T
    rec["r"], rec["g"], rec["b"] = rgb.T
    Path(path).write_bytes(header.encode() + rec.tobytes())


def test_ngp_loader(tmp_path):
    W, H = 48, 36                                   # intrinsics given at this size
    n = 9
    frames = []
    for i in range(n):
        c2w = opengl_c2w([2.5 * math.cos(0.3 * i), 2.5 * math.sin(0.3 * i), 0.8])
        ext = ".png" if i % 2 else ""
        write_png(tmp_path / "images" / f"frame_{i:05d}.png", smooth_image(W // 2, H // 2, i))   # half-size files
        frames.append({"file_path": f"images/frame_{i:05d}{ext}", "transform_matrix": c2w.tolist()})
    xyz = np.random.default_rng(1).normal(size=(7, 3)).astype(np.float32)
    rgb = np.random.default_rng(2).integers(0, 256, (7, 3)).astype(np.uint8)
    write_ply_binary(tmp_path / "sparse_pc.ply", xyz, rgb)
    meta = {"fl_x": 40.0, "fl_y": 41.0, "cx": 24.5, "cy": 17.5, "w": W, "h": H,
            "k1": 0.0, "k2": 0.0, "p1": 0.0, "p2": 0.0, "frames": frames, "ply_file_path": "sparse_pc.ply"}
    (tmp_path / "transforms.json").write_text(json.dumps(meta))
    ds = load_dataset(tmp_path, test_every=8)
    assert ds.fmt == "ngp"
    names = sorted(f"images/frame_{i:05d}.png" for i in range(n))
    assert [v.name for v in ds.test] == [names[0], names[8]]
    assert len(ds.train) == 7
    for v in ds.train + ds.test:
        cam = v.camera
        assert (cam.width, cam.height) == (W // 2, H // 2)
        assert (cam.fx, cam.fy, cam.cx, cam.cy) == pytest.approx((20.0, 20.5, 12.25, 8.75))
        i = int(v.name[-9:-4])
        check_gl_convention(cam, np.array(frames[i]["transform_matrix"]))
        np.testing.assert_allclose(v.image, np.round(smooth_image(W // 2, H // 2, i) * 255) / 255, atol=1e-6)
    np.testing.assert_allclose(ds.points, xyz)
    np.testing.assert_allclose(ds.colors, rgb / 255.0, rtol=1e-6)

    # distortion: non-zero k1 -> the images are undistorted with the scaled intrinsics
    meta["k1"], meta["p2"] = -0.1, 0.002
    (tmp_path / "transforms.json").write_text(json.dumps(meta))
    dd = load_dataset(tmp_path, test_every=0)
    raw = np.round(smooth_image(W // 2, H // 2, 3) * 255).astype(np.float32) / 255
    ref, crop = images.undistort(raw, 20.0, 20.5, 12.25, 8.75, (-0.1, 0.0, 0.0, 0.0, 0.0, 0.002))
    v3 = next(v for v in dd.train if v.name.endswith("00003.png"))
    np.testing.assert_allclose(v3.image, ref, atol=1e-6)
    assert (v3.camera.cx, v3.camera.cy) == pytest.approx((12.25 - crop.x0, 8.75 - crop.y0))
    assert not np.allclose(v3.image, raw[crop.y0:crop.y0 + v3.height, crop.x0:crop.x0 + v3.width], atol=1e-3)
    assert v3.provenance.camera_model == "OPENCV" and dd.summary()[2] == "cameras: OPENCV"
    kept = load_dataset(tmp_path, test_every=0, distortion="ignore")  # as they are, as pinhole views
    k3 = next(v for v in kept.train if v.name.endswith("00003.png"))
    np.testing.assert_allclose(k3.image, raw, atol=1e-6)
    assert (k3.camera.cx, k3.camera.cy) == pytest.approx((12.25, 8.75))
    assert any(f"distortion ignored for {n} images" in line for line in kept.summary())

    # camera_angle_x instead of fl_x, per-frame override, an ASCII PLY
    meta2 = {"camera_angle_x": 1.0, "frames": [dict(f) for f in frames[:3]], "ply_file_path": "pc.ply"}
    meta2["frames"][1]["fl_x"] = 10.0
    (tmp_path / "pc.ply").write_text("ply\nformat ascii 1.0\nelement vertex 2\nproperty float x\n"
                                     "property float y\nproperty float z\nend_header\n1 2 3\n4 5 6\n")
    (tmp_path / "transforms.json").write_text(json.dumps(meta2))
    d2 = load_dataset(tmp_path, test_every=0)
    f0 = 0.5 * (W // 2) / math.tan(0.5)
    assert d2.train[0].camera.fx == pytest.approx(f0) and d2.train[0].camera.fy == pytest.approx(f0)
    assert d2.train[1].camera.fx == pytest.approx(10.0)
    np.testing.assert_allclose(d2.points, [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_allclose(d2.colors, 0.5)

    # non-finite pose names the image
    meta2["frames"][2]["transform_matrix"][0][3] = float("nan")
    (tmp_path / "transforms.json").write_text(json.dumps(meta2))
    with pytest.raises(DataError, match="frame_00002"):
        load_dataset(tmp_path)


def test_ngp_unreadable_point_cloud_loads_without_points_and_says_why(tmp_path):
    write_png(tmp_path / "images" / "frame_0.png", smooth_image(8, 6, 0))
    frame = {"file_path": "images/frame_0.png", "transform_matrix": opengl_c2w([2.0, 0.0, 0.5]).tolist()}
    (tmp_path / "transforms.json").write_text(json.dumps({"fl_x": 8.0, "frames": [frame],
                                                          "ply_file_path": "pc.ply"}))
    (tmp_path / "pc.ply").write_text("ply\nformat ascii 1.0\nelement vertex 1\nproperty float x\n"
                                     "property float y\nend_header\n1 2\n")     # no z
    ds = load_dataset(tmp_path, test_every=0)
    line = ds.summary()[-1]
    assert line.startswith("initial points: random, in a box around the cameras, because its point cloud is "
                           "unreadable") and "pc.ply" in line and ": z" in line
    assert len(ds.train) == 1 and ds.points.shape == (0, 3) and ds.colors.shape == (0, 3)


# --- the real scene ---------------------------------------------------------

def test_real_lego():
    root = shared_dir() / "data" / "lego"
    if not root.is_dir():
        pytest.skip("lego not present")
    t0 = time.perf_counter()
    ds = load_dataset(root)
    elapsed = time.perf_counter() - t0
    print(f"lego loaded in {elapsed:.2f} s")
    assert ds.fmt == "blender" and ds.masked
    assert len(ds.train) == 100 and len(ds.test) == 25
    assert ds.points.shape == (0, 3)
    for v in ds.train + ds.test:
        assert v.image.shape == (400, 400, 3) and v.image.dtype == np.float32
        assert (v.camera.width, v.camera.height) == (400, 400)
        corners = v.image[[0, 0, -1, -1], [0, -1, 0, -1]]
        np.testing.assert_allclose(corners, 1.0, atol=1e-3)          # white background composited
        u, vv, z = project(v.camera, [0, 0, 0])
        assert z > 0 and 0 <= u < 400 and 0 <= vv < 400, v.name
    assert 3.0 < ds.scene_scale < 8.0

