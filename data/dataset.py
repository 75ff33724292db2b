"""Common types, format detection, the train/test split and ``load_dataset``.

Conventions shared by every loader:

* ``View.image`` is (H, W, 3) float32 in [0, 1], C-contiguous, undistorted
  and alpha-composited on the background.
* ``View.camera`` is a ``numbasplat.Camera``: world-to-camera ``viewmat`` in
  OpenCV axes (x right, y down, z forward), intrinsics in pixels of the
  loaded image, with pixel ``i`` covering ``[i, i + 1)`` (centre ``i + 0.5``,
  the COLMAP convention, which is also what the rasterizer samples).
* Everything that is wrong with the input raises ``DataError`` (a
  ``ValueError``) naming the offending file or image.
"""
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from numbasplat.rendering import Camera

FORMATS = ("colmap", "blender", "ngp")


class DataError(ValueError):
    """Bad or unsupported input data; the message names the file."""


@dataclass
class View:
    name: str               # image file name (relative), for sorting/splitting and messages
    image: np.ndarray       # (H, W, 3) float32 in [0, 1], C-contiguous
    camera: Camera
    masked: bool = False    # an alpha channel put some pixels on the background

    @property
    def width(self):
        return self.camera.width

    @property
    def height(self):
        return self.camera.height


@dataclass
class Dataset:
    train: list
    test: list
    points: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.float32))
    colors: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.float32))
    scene_scale: float = 1.0
    source: str = ""
    fmt: str = ""
    init_box: tuple = None   # (lo, hi) for random initial points when there are none; None: around the cameras

    @property
    def views(self):
        return list(self.train) + list(self.test)

    @property
    def masked(self):
        """Objects cut out onto a plain background (RGBA images, as in Blender scenes)."""
        return any(v.masked for v in self.train)


# ----------------------------------------------------------------------------- helpers

def colmap_model_dir(path):
    """The folder holding a COLMAP model (``sparse/0`` or ``sparse``), or None."""
    path = Path(path)
    for cand in (path / "sparse" / "0", path / "sparse"):
        if all(any((cand / f"{m}{ext}").is_file() for ext in (".bin", ".txt")) for m in ("cameras", "images")):
            return cand
    return None


def detect_format(path):
    """'colmap', 'blender' or 'ngp' for the data folder ``path``; DataError otherwise."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data folder {path} does not exist")
    if not path.is_dir():
        raise DataError(f"data path {path} is not a folder")
    if colmap_model_dir(path) is not None:
        return "colmap"
    if (path / "transforms_train.json").is_file():
        return "blender"
    if (path / "transforms.json").is_file():
        return "ngp"
    raise DataError(
        f"cannot detect the dataset format of {path}: looked for a COLMAP model "
        f"(sparse/0/ or sparse/ with cameras, images, points3D .bin or .txt), "
        f"transforms_train.json (Blender/NeRF-synthetic) and transforms.json (instant-ngp/nerfstudio)")


def split_views(views, test_every=8):
    """Sort by name; index % test_every == 0 goes to test (0 or None: no test split)."""
    views = sorted(views, key=lambda v: v.name)
    if test_every is None or int(test_every) <= 0:
        return views, []
    k = int(test_every)
    train = [v for i, v in enumerate(views) if i % k != 0]
    test = [v for i, v in enumerate(views) if i % k == 0]
    return train, test


def camera_center(camera):
    R = camera.viewmat[:3, :3]
    t = camera.viewmat[:3, 3]
    return -R.T @ t


def scene_scale(cameras):
    """1.1 * the largest distance of the camera centres from their mean (3DGS's nerf_normalization)."""
    cameras = list(cameras)
    if not cameras:
        return 1.0
    centres = np.stack([camera_center(c) for c in cameras])
    radius = 1.1 * float(np.max(np.linalg.norm(centres - centres.mean(0), axis=1)))
    return max(radius, 1e-6)


def make_camera(name, viewmat, fx, fy, cx, cy, width, height):
    """``numbasplat.Camera`` with a DataError naming the image on bad values."""
    viewmat = np.asarray(viewmat, np.float64)
    if not np.isfinite(viewmat).all():
        raise DataError(f"image {name}: the camera pose has non-finite values")
    vals = {"fx": fx, "fy": fy, "cx": cx, "cy": cy}
    bad = [k for k, v in vals.items() if not np.isfinite(v)]
    if bad:
        raise DataError(f"image {name}: non-finite intrinsics ({', '.join(f'{k}={vals[k]}' for k in bad)})")
    try:
        return Camera(viewmat, fx, fy, cx, cy, width, height)
    except ValueError as exc:
        raise DataError(f"image {name}: {exc}") from None


def finish(views_train, views_test, points, colors, source, fmt, init_box=None):
    cams = [v.camera for v in views_train] or [v.camera for v in views_test]
    points = np.ascontiguousarray(np.asarray(points, np.float32).reshape(-1, 3))
    colors = np.ascontiguousarray(np.clip(np.asarray(colors, np.float32).reshape(-1, 3), 0.0, 1.0))
    if not np.isfinite(points).all():
        keep = np.isfinite(points).all(1) & np.isfinite(colors).all(1)
        points, colors = points[keep], colors[keep]
    return Dataset(train=list(views_train), test=list(views_test), points=points, colors=colors,
                   scene_scale=scene_scale(cams), source=str(source), fmt=fmt, init_box=init_box)


# ----------------------------------------------------------------------------- entry point

def load_dataset(path, fmt="auto", images=None, background=(1.0, 1.0, 1.0), test_every=8, max_size=None):
    """Load a COLMAP, Blender (NeRF-synthetic) or instant-ngp/nerfstudio scene.

    ``images``: image folder name for COLMAP (default ``images``; e.g.
    ``images_4``) or the folder replacing ``images/`` in ngp file paths.
    ``background``: RGB in [0, 1] that RGBA images are composited on.
    ``test_every``: COLMAP/ngp hold out sorted index % test_every == 0 (0: none);
    Blender uses transforms_test.json.  ``max_size``: longest-side limit in
    pixels (downscales, intrinsics follow).
    """
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"data folder {path} does not exist" if not path.exists() else
                        f"data path {path} is not a folder")
    background = np.asarray(background, np.float32).reshape(-1)
    if background.shape != (3,) or not np.isfinite(background).all():
        raise ValueError(f"background must be 3 finite floats, got {background}")
    if max_size is not None:
        max_size = int(max_size)
        if max_size <= 0:
            raise ValueError(f"max_size must be positive, got {max_size}")
    fmt = (fmt or "auto").lower()
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "colmap":
        from . import colmap
        return colmap.load(path, images=images, background=background, test_every=test_every, max_size=max_size)
    if fmt == "blender":
        from . import nerf
        return nerf.load_blender(path, images=images, background=background, max_size=max_size)
    if fmt in ("ngp", "nerfstudio", "instant-ngp"):
        from . import nerf
        return nerf.load_ngp(path, images=images, background=background, test_every=test_every, max_size=max_size)
    raise DataError(f"unknown dataset format {fmt!r} for {path}; expected 'auto' or one of {', '.join(FORMATS)}")
