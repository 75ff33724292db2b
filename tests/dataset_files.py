"""Small datasets written to disk for the data tests: COLMAP models (written by
our own writers, from the format spec, so they check ``data.colmap`` rather
than mirror it), smooth test images, and distorted renders with their pinhole
references."""
import math
import struct
from pathlib import Path

import numpy as np
from PIL import Image
from scipy.spatial.transform import Rotation

from data import images

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


def undistort_points_iter(xd, yd, dist, iters=50):
    """Invert the radial-tangential model by fixed-point iteration (test reference)."""
    x, y = xd.copy(), yd.copy()
    for _ in range(iters):
        dx, dy = images.distort(x, y, dist)
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


def rgba_image(w, h, seed):
    img = np.zeros((h, w, 4), np.uint8)
    img[..., :3] = (smooth_image(w, h, seed) * 255).round()
    img[..., 3] = 255
    img[:4, :4, 3] = 0          # transparent corner
    img[-1, -1, 3] = 128
    return img

