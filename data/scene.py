"""What a loaded scene is (``Dataset`` of ``View`` s), ``DataError``, and the
helpers every loader builds one with.

Its own module so that the loaders (colmap, nerf), the image pipeline and the
entry point (``dataset.load_dataset``) all import it and none of them imports
another upwards.

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

import numpy as np

from numbasplat.rendering import Camera


class DataError(ValueError):
    """Bad or unsupported input data; the message names the file."""


@dataclass
class View:
    """One training or test image with its camera."""
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
    """A loaded scene: train and test ``View`` s, the initial point cloud (float32, colours in
    [0, 1]; empty when the format has none), and the scene scale the trainer's schedules use."""
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
    """World position of a camera (the inverse of its world-to-camera translation)."""
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


def build_dataset(views_train, views_test, points, colors, source, fmt, init_box=None):
    """The ``Dataset`` a loader returns: points as float32 with the non-finite ones dropped,
    colours clipped to [0, 1], and the scene scale of the training cameras (of the test
    cameras when there is no training view)."""
    cams = [v.camera for v in views_train] or [v.camera for v in views_test]
    points = np.ascontiguousarray(np.asarray(points, np.float32).reshape(-1, 3))
    colors = np.ascontiguousarray(np.clip(np.asarray(colors, np.float32).reshape(-1, 3), 0.0, 1.0))
    if not np.isfinite(points).all():
        keep = np.isfinite(points).all(1) & np.isfinite(colors).all(1)
        points, colors = points[keep], colors[keep]
    return Dataset(train=list(views_train), test=list(views_test), points=points, colors=colors,
                   scene_scale=scene_scale(cams), source=str(source), fmt=fmt, init_box=init_box)
