"""What a loaded scene is (``Dataset`` of ``View`` s), ``DataError``, and the
helpers every loader builds one with.

Its own module so that the loaders (colmap, nerf), the image pipeline and the
entry point (``dataset.load_dataset``) all import it and none of them imports
another upwards.

Conventions shared by every loader:

* ``View.image`` is (H, W, 3) float32 in [0, 1], C-contiguous, undistorted
  and alpha-composited on the background.  Undistortion crops the image to
  the largest rectangle of pixels that have a source pixel (the camera's
  cx, cy follow), so no view trains on edges smeared by clamping.
* ``View.camera`` is a ``numbasplat.Camera``: world-to-camera ``viewmat`` in
  OpenCV axes (x right, y down, z forward), intrinsics in pixels of the
  loaded image, with pixel ``i`` covering ``[i, i + 1)`` (centre ``i + 0.5``,
  the COLMAP convention, which is also what the rasterizer samples).
* Everything that is wrong with the input raises ``DataError`` (a
  ``ValueError``) naming the offending file or image.
* What a loader decides on the user's behalf (downscaling, renamed files
  paired in sorted order, random initial points, no test split, ...) is
  told in ``Dataset.summary()``, never through ``warnings``: every MPI rank
  loads the data, and a warning would print its Python source line once per
  rank, where the summary is printed once by whoever presents it.
"""
import numbers
from dataclasses import dataclass, field, replace

import numpy as np

from numbasplat.rendering import Camera


class DataError(ValueError):
    """Bad or unsupported input data; the message names the file."""


@dataclass(frozen=True)
class Provenance:
    """Where a ``View`` came from and what loading did to it, for ``Dataset.summary``."""
    camera_model: str = "pinhole"   # COLMAP's model name, or 'pinhole' (Blender), or the ngp camera_model
    file_size: tuple = (0, 0)       # (width, height) of the image file
    scaled_size: tuple = (0, 0)     # after downscaling, before the undistortion crop
    clamped: float = None           # None: not undistorted; else the share of the undistorted pixels
                                    # that had no source pixel (sampled outside the image), cropped away


@dataclass
class View:
    """One training or test image with its camera."""
    name: str               # image file name (relative), for sorting/splitting and messages
    image: np.ndarray       # (H, W, 3) float32 in [0, 1], C-contiguous
    camera: Camera
    masked: bool = False    # an alpha channel put some pixels on the background
    provenance: Provenance = None   # None for views not read from files (the demo and benchmark scenes)

    @property
    def width(self):
        return self.camera.width

    @property
    def height(self):
        return self.camera.height


@dataclass
class Dataset:
    """A loaded scene: train and test ``View`` s, the initial point cloud (float32, colours in
    [0, 1]; empty when the format has none), and the scene scale the trainer's schedules use.

    What loading found and decided is in ``summary()``, a few lines for people: its facts come
    from the fields below and from each view's ``provenance``, and ``notes`` adds the decisions
    a user should know of (renamed files paired in sorted order, a missing test split, ...).
    """
    train: list
    test: list
    points: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.float32))
    colors: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.float32))
    scene_scale: float = 1.0
    source: str = ""
    fmt: str = ""
    init_box: tuple = None   # (lo, hi) for random initial points when there are none; None: around the cameras
    split: str = ""          # how the test views were chosen ("every 8th image", ...); "" when there are none
    points_origin: str = ""  # the file the points were read from, or, when there are none, why
    downscale: object = None  # the ``images.Downscale`` the images were loaded with
    images: str = ""          # the image folder the views were read from, as the ``images`` option names it
                              # ("images" for COLMAP by default; "" where the format's files name theirs)
    notes: list = field(default_factory=list)   # one line each

    @property
    def views(self):
        return list(self.train) + list(self.test)

    @property
    def masked(self):
        """Objects cut out onto a plain background (RGBA images, as in Blender scenes)."""
        return any(v.masked for v in self.train)

    def summary(self, n_random=None, points=True):
        """Lines saying what was loaded: the views and their size, camera models, undistortion,
        the initial points (``n_random``: how many random points the trainer draws when there
        are none; ``points=False``: no line, for a run that starts from a snapshot's model), then
        the ``notes``."""
        views = self.views
        models = sorted({v.provenance.camera_model for v in views if v.provenance is not None})
        lines = [f"{self.fmt} scene {self.source}", self._images_line()]
        if models:
            lines += ["cameras: " + ", ".join(models), self._distortion_line(views)]
        if points:
            lines.append(self._points_line(n_random))
        return lines + [f"note: {n}" for n in self.notes]

    def _images_line(self):
        test = f"{len(self.test)} test ({self.split})" if self.test else "no test views"
        sizes = {}
        for v in self.views:
            p = v.provenance
            key = (v.width, v.height, p.file_size if p else None, p.scaled_size if p else None)
            sizes[key] = sizes.get(key, 0) + 1
        phrases = []
        for (w, h, file_size, scaled), n in sorted(sizes.items(), key=lambda item: -item[1]):   # the most first
            phrase = f"{w}x{h}"
            if file_size is not None and scaled != file_size:
                phrase += f" (downscaled from {file_size[0]}x{file_size[1]}{self._downscale_reason(file_size)})"
            phrases.append(phrase if len(sizes) == 1 else f"{n} at {phrase}")
        if len(phrases) > 3:
            phrases = phrases[:3] + [f"{len(phrases) - 3} other sizes"]
        return f"images: {len(self.train)} train, {test}; {', '.join(phrases)}"

    def _downscale_reason(self, file_size):
        d = self.downscale
        if d is None:
            return ""
        divisor = d.resolution_divisor(file_size[0])
        if d.target_width:
            why = [f"resolution {d.target_width} px wide"]
        else:
            why = [f"resolution 1/{d.resolution}"] if divisor > 1 else []
        if d.max_width and file_size[0] / divisor > d.max_width:
            why.append(f"max width {d.max_width} px")
        return f": {', '.join(why)}" if why else ""

    @staticmethod
    def _distortion_line(views):
        undistorted = [v for v in views if v.provenance is not None and v.provenance.clamped is not None]
        if not undistorted:
            return "distortion: none"
        n_loaded = sum(v.provenance is not None for v in views)
        models = ", ".join(sorted({v.provenance.camera_model for v in undistorted}))
        line = f"distortion: undistorted {len(undistorted)} of {n_loaded} images ({models}); "
        share = float(np.mean([v.provenance.clamped for v in undistorted]))
        if share == 0.0:
            return line + "every pixel has a source pixel, none cropped"
        crops = sorted({f"{v.provenance.scaled_size[0]}x{v.provenance.scaled_size[1]} to {v.width}x{v.height}"
                        for v in undistorted if v.provenance.scaled_size != (v.width, v.height)})
        return line + (f"{100 * share:.1f}% of the pixels had no source pixel (beyond the border): cropped "
                       + ", ".join(crops))

    def _points_line(self, n_random):
        if len(self.points):
            return f"initial points: {len(self.points):,} from {self.points_origin}"
        count = f"{n_random:,} " if n_random else ""
        if self.init_box is None:
            where = "in a box around the cameras"
        else:
            lo, hi = self.init_box
            where = f"in the box {_fmt_vec(lo)} to {_fmt_vec(hi)}"
        return f"initial points: random, {count}{where}, because {self.points_origin or 'the scene has none'}"


def _fmt_vec(v):
    return "(" + ", ".join(f"{float(x):g}" for x in v) + ")"


# ----------------------------------------------------------------------------- helpers

def check_test_every(test_every):
    """``test_every`` as an int >= 0 (0 for None: no held-out views); DataError naming it otherwise."""
    if test_every is None:
        return 0
    if isinstance(test_every, bool) or not isinstance(test_every, numbers.Integral) or test_every < 0:
        raise DataError(f"test_every must be a whole number >= 0 (0 or None: no held-out test views; 8: "
                        f"every 8th image, as Inria's --eval), got {test_every!r}")
    return int(test_every)


def split_indices(names, test_every=None):
    """(train, test): the indices of ``names`` in name order; index % test_every == 0 of that
    order goes to test (0 or None: no test split).  A loader can split before it reads images."""
    order = sorted(range(len(names)), key=lambda i: names[i])
    k = check_test_every(test_every)
    if k == 0:
        return order, []
    return [n for i, n in enumerate(order) if i % k != 0], [n for i, n in enumerate(order) if i % k == 0]


def split_views(views, test_every=None):
    """Sort by name; index % test_every == 0 goes to test (0 or None: no test split)."""
    train, test = split_indices([v.name for v in views], test_every)
    return [views[i] for i in train], [views[i] for i in test]


def first_training_views(dataset, n):
    """``dataset`` with its first ``n`` training views only and no test views (its scene scale
    theirs): what a measurement that trains on part of a large capture uses."""
    train = dataset.train[:n]
    if len(train) == len(dataset.train) and not dataset.test:
        return dataset
    notes = dataset.notes + [f"kept the first {len(train)} training views (of {len(dataset.train)} loaded), "
                             "no test views"]
    return replace(dataset, train=train, test=[], split="", scene_scale=scene_scale(v.camera for v in train),
                   notes=notes)


def every_nth(test_every):
    """How ``split_views`` chose the test views, for ``Dataset.split``."""
    k = check_test_every(test_every)
    if k <= 1:
        return "every image" if k else ""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"every {k}{suffix} image"


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


def build_dataset(views_train, views_test, points, colors, source, fmt, init_box=None, split="",
                  points_origin="", downscale=None, images="", notes=()):
    """The ``Dataset`` a loader returns: points as float32 with the non-finite ones dropped,
    colours clipped to [0, 1], and the scene scale of the training cameras (of the test
    cameras when there is no training view).

    ``points_origin``: the file the points come from, or, when there are none, why (it ends
    "initial points: random ..., because <points_origin>").  When every point is NaN or
    infinite the dataset has none and says so there; when some are, a note says how many
    were dropped."""
    cams = [v.camera for v in views_train] or [v.camera for v in views_test]
    points = np.ascontiguousarray(np.asarray(points, np.float32).reshape(-1, 3))
    colors = np.ascontiguousarray(np.clip(np.asarray(colors, np.float32).reshape(-1, 3), 0.0, 1.0))
    notes = list(notes)
    if not np.isfinite(points).all():
        keep = np.isfinite(points).all(1) & np.isfinite(colors).all(1)
        if not keep.any():
            points_origin = f"all {len(points):,} points of {points_origin} are NaN or infinite"
        else:
            notes.append(f"dropped {int((~keep).sum()):,} of {len(points):,} points of {points_origin}: "
                         "NaN or infinite")
        points, colors = points[keep], colors[keep]
    return Dataset(train=list(views_train), test=list(views_test), points=points, colors=colors,
                   scene_scale=scene_scale(cams), source=str(source), fmt=fmt, init_box=init_box,
                   split=split if views_test else "", points_origin=points_origin, downscale=downscale,
                   images=images, notes=notes)
