"""Tests for the ``data`` package: COLMAP (binary and text), Blender and
instant-ngp/nerfstudio loaders, undistortion, splitting, error messages, and
the real scenes in ../shared (skipped without it)."""
import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy.spatial.transform import Rotation

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import shared_dir  # noqa: E402

from data import DataError, View, load_dataset, split_views  # noqa: E402
from data import colmap, images as dimages  # noqa: E402


# ---------------------------------------------------------------------------
# helpers: poses, images, independent COLMAP writers (from the format spec)
# ---------------------------------------------------------------------------

MODEL_IDS = {"SIMPLE_PINHOLE": 0, "PINHOLE": 1, "SIMPLE_RADIAL": 2, "RADIAL": 3, "OPENCV": 4,
             "OPENCV_FISHEYE": 5, "FULL_OPENCV": 6}


def look_at_opencv(pos, target=(0.0, 0.0, 0.0), up=(0.0, 0.0, 1.0)):
    """World-to-camera (OpenCV axes) of a camera at ``pos`` looking at ``target``."""
    pos = np.asarray(pos, float)
    f = np.asarray(target, float) - pos
    f /= np.linalg.norm(f)
    r = np.cross(f, up)
    r /= np.linalg.norm(r)
    d = np.cross(f, r)
    R = np.stack([r, d, f])
    M = np.eye(4)
    M[:3, :3] = R
    M[:3, 3] = -R @ pos
    return M


def quat_wxyz(R):
    x, y, z, w = Rotation.from_matrix(R).as_quat()
    return np.array([w, x, y, z])


def project(camera, p):
    pc = camera.viewmat @ np.append(np.asarray(p, float), 1.0)
    return camera.fx * pc[0] / pc[2] + camera.cx, camera.fy * pc[1] / pc[2] + camera.cy, pc[2]


def smooth_image(w, h, seed, scale=1.0):
    """A smooth colourful float image (sinusoids + gradient) of size w x h."""
    rng = np.random.default_rng(seed)
    v, u = np.mgrid[0:h, 0:w].astype(np.float64)
    u = (u + 0.5) / w * scale
    v = (v + 0.5) / h * scale
    chans = []
    for _ in range(3):
        a, b, c, d = rng.uniform(1.0, 4.0, 4)
        chans.append(0.5 + 0.25 * np.sin(a * u * 2 + c) * np.cos(b * v * 2 + d) + 0.2 * (u - 0.5))
    return np.clip(np.stack(chans, -1), 0, 1)


def write_png(path, arr):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.asarray(arr)
    if arr.dtype != np.uint8:
        arr = np.clip(np.round(arr * 255), 0, 255).astype(np.uint8)
    Image.fromarray(arr).save(path)


def write_colmap_bin(folder, cams, imgs, pts):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "cameras.bin", "wb") as f:
        f.write(struct.pack("<Q", len(cams)))
        for c in cams:
            f.write(struct.pack("<iiQQ", c["id"], MODEL_IDS[c["model"]], c["w"], c["h"]))
            f.write(struct.pack(f"<{len(c['params'])}d", *c["params"]))
    with open(folder / "images.bin", "wb") as f:
        f.write(struct.pack("<Q", len(imgs)))
        for im in imgs:
            f.write(struct.pack("<i", im["id"]))
            f.write(struct.pack("<7d", *im["q"], *im["t"]))
            f.write(struct.pack("<i", im["cam"]))
            f.write(im["name"].encode() + b"\x00")
            f.write(struct.pack("<Q", len(im["p2d"])))
            for x, y, pid in im["p2d"]:
                f.write(struct.pack("<ddq", x, y, pid))
    with open(folder / "points3D.bin", "wb") as f:
        f.write(struct.pack("<Q", len(pts)))
        for p in pts:
            f.write(struct.pack("<Q", p["id"]))
            f.write(struct.pack("<3d", *p["xyz"]))
            f.write(struct.pack("<3B", *p["rgb"]))
            f.write(struct.pack("<d", p["err"]))
            f.write(struct.pack("<Q", len(p["track"])))
            for iid, idx in p["track"]:
                f.write(struct.pack("<ii", iid, idx))


def write_colmap_txt(folder, cams, imgs, pts):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "cameras.txt", "w") as f:
        f.write("# Camera list with one line of data per camera:\n#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]\n")
        f.write(f"# Number of cameras: {len(cams)}\n")
        for c in cams:
            f.write(f"{c['id']} {c['model']} {c['w']} {c['h']} " + " ".join(repr(p) for p in c["params"]) + "\n")
    with open(folder / "images.txt", "w") as f:
        f.write("# Image list with two lines of data per image:\n")
        f.write("#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME\n#   POINTS2D[] as (X, Y, POINT3D_ID)\n")
        for im in imgs:
            f.write(f"{im['id']} " + " ".join(repr(float(v)) for v in (*im["q"], *im["t"]))
                    + f" {im['cam']} {im['name']}\n")
            f.write(" ".join(f"{x!r} {y!r} {pid}" for x, y, pid in im["p2d"]) + "\n")
    with open(folder / "points3D.txt", "w") as f:
        f.write("# 3D point list with one line of data per point:\n")
        for p in pts:
            f.write(f"{p['id']} " + " ".join(repr(float(v)) for v in p["xyz"]) + " "
                    + " ".join(str(v) for v in p["rgb"]) + f" {p['err']!r} "
                    + " ".join(f"{a} {b}" for a, b in p["track"]) + "\n")


CAMS = [
    {"id": 1, "model": "PINHOLE", "w": 32, "h": 24, "params": [30.0, 31.0, 16.5, 11.5]},
    {"id": 2, "model": "SIMPLE_RADIAL", "w": 32, "h": 24, "params": [28.0, 16.0, 12.0, 0.05]},
    {"id": 3, "model": "OPENCV", "w": 40, "h": 30, "params": [35.0, 34.0, 20.2, 14.8, -0.08, 0.02, 0.003, -0.002]},
]


def colmap_scene(root, ext=".bin", n_images=6, names=None, files=None, cams=CAMS, folder="images",
                 image_scale=1.0, sparse="sparse/0"):
    """A small COLMAP scene; returns (cams, imgs, pts) as written."""
    root = Path(root)
    rng = np.random.default_rng(0)
    names = names or [f"view_{i:02d}.png" for i in range(n_images)]
    files = files or names
    imgs = []
    for i, name in enumerate(names):
        ang = 2 * math.pi * i / len(names)
        M = look_at_opencv([4 * math.cos(ang), 4 * math.sin(ang), 1.0 + 0.1 * i])
        cam = cams[i % len(cams)]
        p2d = [] if i == 1 else [(float(x), float(y), int(p)) for x, y, p in
                                 zip(rng.uniform(0, 30, 3), rng.uniform(0, 20, 3), [1, 2, -1])]
        imgs.append({"id": 10 + i, "q": quat_wxyz(M[:3, :3]), "t": M[:3, 3], "cam": cam["id"],
                     "name": name, "p2d": p2d})
        w, h = int(round(cam["w"] * image_scale)), int(round(cam["h"] * image_scale))
        write_png(root / folder / files[i], smooth_image(w, h, seed=i))
    pts = [{"id": j + 1, "xyz": rng.normal(size=3).tolist(), "rgb": [int(v) for v in rng.integers(0, 256, 3)],
            "err": float(rng.uniform(0.1, 1)), "track": [(10, j), (11, j + 1)][: j % 3]} for j in range(5)]
    writer = write_colmap_bin if ext == ".bin" else write_colmap_txt
    writer(root / sparse, cams, imgs, pts)
    return cams, imgs, pts


# ---------------------------------------------------------------------------
# COLMAP
# ---------------------------------------------------------------------------

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
    # max_size: longest side limited, intrinsics follow
    small = load_dataset(tmp_path, test_every=0, max_size=20)
    for a, s in zip(full.train, small.train):
        assert max(s.camera.width, s.camera.height) == 20
        sx = s.camera.width / a.camera.width
        assert s.camera.fx == pytest.approx(a.camera.fx * sx)
        assert s.camera.cx == pytest.approx(a.camera.cx * sx)
        assert s.image.shape == (s.camera.height, s.camera.width, 3)
    # a folder that does not exist: DataError listing those that do
    with pytest.raises(DataError, match="images_4") as err:
        load_dataset(tmp_path, images="images_4")
    assert "images_2" in str(err.value) and "images," in str(err.value) + ","


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
    with pytest.warns(UserWarning, match="sorted order"):
        ds = load_dataset(tmp_path, test_every=0)
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


def test_colmap_text_model_in_plain_sparse_folder(tmp_path):
    colmap_scene(tmp_path, ".txt", sparse="sparse", cams=[CAMS[1]], n_images=3)
    ds = load_dataset(tmp_path, fmt="colmap", test_every=0)
    assert len(ds.train) == 3 and len(ds.points) == 5


# --- errors -----------------------------------------------------------------

def test_error_missing_image(tmp_path):
    colmap_scene(tmp_path, ".bin")
    (tmp_path / "images" / "view_03.png").unlink()
    with pytest.raises(DataError, match="view_03.png"):
        load_dataset(tmp_path)


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


# ---------------------------------------------------------------------------
# undistortion
# ---------------------------------------------------------------------------

def undistort_points_iter(xd, yd, dist, iters=50):
    """Invert the radial-tangential model by fixed-point iteration (test reference)."""
    x, y = xd.copy(), yd.copy()
    for _ in range(iters):
        dx, dy = dimages.distort(x, y, dist)
        x, y = x - (dx - xd), y - (dy - yd)
    return x, y


def pattern(x, y):
    """A smooth function of normalized camera coordinates (the 'scene')."""
    return np.stack([0.5 + 0.4 * np.sin(6 * x) * np.cos(5 * y),
                     0.5 + 0.3 * np.cos(7 * x + 1) + 0.1 * y,
                     0.5 + 0.4 * np.sin(4 * (x + y))], -1)


def distorted_render(w, h, fx, fy, cx, cy, dist):
    """The distorted image a camera with ``dist`` sees of ``pattern``, and the pinhole one."""
    v, u = np.mgrid[0:h, 0:w].astype(np.float64) + 0.5
    xd, yd = (u - cx) / fx, (v - cy) / fy
    x, y = undistort_points_iter(xd, yd, dist)
    distorted = pattern(x, y)
    pinhole = pattern((u - cx) / fx, (v - cy) / fy)
    return distorted.astype(np.float32), pinhole.astype(np.float32)


def test_undistort_opencv_recovers_pinhole_image():
    w, h, fx, fy, cx, cy = 160, 120, 120.0, 118.0, 81.0, 59.0
    dist = (-0.12, 0.03, 0.0, 0.0, 0.004, -0.003)           # k1, k2, k3, k4, p1, p2
    distorted, pinhole = distorted_render(w, h, fx, fy, cx, cy, dist)
    # the distortion is significant
    assert np.sqrt(np.mean((distorted - pinhole)[10:-10, 10:-10] ** 2)) > 0.01
    out = dimages.undistort(distorted, fx, fy, cx, cy, dist)
    assert out.shape == pinhole.shape and out.dtype == np.float32 and out.flags.c_contiguous
    rmse = np.sqrt(np.mean((out - pinhole)[10:-10, 10:-10] ** 2))
    assert rmse < 0.003, rmse


def test_undistort_identity_without_coefficients():
    img = smooth_image(37, 23, 3).astype(np.float32)
    out = dimages.undistort(img, 30.0, 31.0, 18.0, 11.0, (0.0,) * 6)
    np.testing.assert_array_equal(out, img)
    # the remap itself is exact for an identity map
    mx, my = dimages.undistort_map(37, 23, 30.0, 31.0, 18.0, 11.0, (0.0,) * 6)
    np.testing.assert_allclose(dimages.remap_bilinear(img, mx, my), img, atol=1e-6)


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


# ---------------------------------------------------------------------------
# Blender and instant-ngp / nerfstudio
# ---------------------------------------------------------------------------

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


def rgba_image(w, h, seed):
    img = np.zeros((h, w, 4), np.uint8)
    img[..., :3] = (smooth_image(w, h, seed) * 255).round()
    img[..., 3] = 255
    img[:4, :4, 3] = 0          # transparent corner
    img[-1, -1, 3] = 128
    return img


def test_masked_only_where_alpha_shows_the_background(tmp_path):
    from data.images import read_image
    img = rgba_image(8, 6, 0)
    write_png(tmp_path / "cut.png", img)
    img[..., 3] = 255
    write_png(tmp_path / "opaque.png", img)
    write_png(tmp_path / "rgb.png", img[..., :3])
    assert [read_image(tmp_path / f)[1] for f in ("cut.png", "opaque.png", "rgb.png")] == [True, False, False]


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
    black = load_dataset(tmp_path, background=(0, 0, 0), max_size=12)
    np.testing.assert_allclose(black.train[0].image[:2, :2], 0.0)
    assert black.train[0].image.shape == (12, 12, 3)
    assert black.train[0].camera.fx == pytest.approx(0.5 * 12 / math.tan(0.5 * angle))
    # missing image: the message names the file
    (tmp_path / "test" / "r_1.png").unlink()
    with pytest.raises(DataError, match="r_1"):
        load_dataset(tmp_path)


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
    ds = load_dataset(tmp_path)
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
    ref = dimages.undistort(raw, 20.0, 20.5, 12.25, 8.75, (-0.1, 0.0, 0.0, 0.0, 0.0, 0.002))
    v3 = next(v for v in dd.train if v.name.endswith("00003.png"))
    np.testing.assert_allclose(v3.image, ref, atol=1e-6)
    assert not np.allclose(v3.image, raw, atol=1e-3)

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


# ---------------------------------------------------------------------------
# real scenes (../shared)
# ---------------------------------------------------------------------------

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


def test_real_fern():
    root = shared_dir() / "data" / "fern"
    if not root.is_dir():
        pytest.skip("fern not present")
    t0 = time.perf_counter()
    with pytest.warns(UserWarning, match="sorted order"):
        ds = load_dataset(root, images="images_8")
    elapsed = time.perf_counter() - t0
    print(f"fern (images_8) loaded in {elapsed:.2f} s")
    assert ds.fmt == "colmap" and not ds.masked
    views = ds.train + ds.test
    assert len(views) == 20 and len(ds.train) == 17 and len(ds.test) == 3
    assert [v.name for v in ds.test] == ["image000.png", "image008.png", "image016.png"]
    cams, _, _ = colmap.read_model(root / "sparse" / "0")
    (cam,) = cams.values()
    assert cam.model == "SIMPLE_RADIAL" and (cam.width, cam.height) == (4032, 3024)
    for v in views:
        assert v.image.shape == (378, 504, 3)
        assert v.camera.fx == pytest.approx(cam.params[0] * 504 / 4032)
        assert v.camera.fy == pytest.approx(cam.params[0] * 378 / 3024)
        assert v.camera.cx == pytest.approx(cam.params[1] * 504 / 4032)
    assert len(ds.points) > 1000 and ds.points.dtype == np.float32
    assert 0.0 <= ds.colors.min() and ds.colors.max() <= 1.0
    # the pose convention: most SfM points are in front of each camera and inside its image
    P = np.c_[ds.points.astype(np.float64), np.ones(len(ds.points))]
    for v in views:
        pc = P @ v.camera.viewmat.T
        z = pc[:, 2]
        u = v.camera.fx * pc[:, 0] / z + v.camera.cx
        w = v.camera.fy * pc[:, 1] / z + v.camera.cy
        inside = (z > 0) & (u >= 0) & (u < 504) & (w >= 0) & (w < 378)
        assert inside.mean() > 0.5, (v.name, inside.mean())


def test_import_from_repo_root():
    proc = subprocess.run([sys.executable, "-c", "import data; print(data.load_dataset.__name__)"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "load_dataset"
