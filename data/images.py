"""Image reading, resizing and undistortion.

Pixel convention: pixel ``i`` covers ``[i, i + 1)``; its centre is ``i + 0.5``
(as COLMAP, and as the rasterizer samples).  Intrinsics therefore scale
exactly with the image: ``fx *= W_new / W_old``, ``cx *= W_new / W_old``.

Distortion is the radial-tangential (OpenCV / COLMAP) model on normalized
camera coordinates ``(x, y) = ((u - cx) / fx, (v - cy) / fy)``::

    r2 = x^2 + y^2
    radial = k1 r2 + k2 r2^2 + k3 r2^3 + k4 r2^4
    xd = x + x radial + 2 p1 x y + p2 (r2 + 2 x^2)
    yd = y + y radial + p1 (r2 + 2 y^2) + 2 p2 x y

SIMPLE_RADIAL (k), RADIAL (k1, k2) and OPENCV (k1, k2, p1, p2) are special
cases.  ``undistort`` maps every output (pinhole) pixel forward through the
model and samples the distorted source bilinearly, so no iterative inversion
is needed.  Output pixels whose source falls outside the image would only
repeat the border (pincushion distortion puts the corners there): the output
is cropped to the largest rectangle without them, and the principal point
moves with the crop.

Scaling (``Downscale``) follows Inria's 3DGS: an integer factor or a target width
(``-r``), and by default no image wider than 1600 px.
"""
import numbers
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from .scene import DataError, Provenance, View, make_camera

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
NO_DISTORTION = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)   # k1, k2, k3, k4, p1, p2
DISTORTION = ("undistort", "ignore")            # what loading does with a camera's distortion
EIGHT_BIT_LEVEL = np.float32(1.0 / 255.0)      # an 8-bit file's level u loads as u x this (float32)


def is_image_file(path):
    return Path(path).suffix.lower() in IMAGE_EXTENSIONS


def list_image_files(folder):
    """Sorted names of the image files directly in ``folder``."""
    folder = Path(folder)
    return sorted(p.name for p in folder.iterdir() if p.is_file() and is_image_file(p))


# ----------------------------------------------------------------------------- reading

def _has_alpha(im):
    return im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info


def _to_float_rgb(im, background):
    """(image, masked): masked where an alpha channel made some pixel show the background."""
    mode = im.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        gray = np.asarray(im, np.float32) / 65535.0
        rgb = np.repeat(np.clip(gray, 0.0, 1.0)[..., None], 3, axis=2)
        return np.ascontiguousarray(rgb, np.float32), False
    if mode == "F":
        gray = np.clip(np.asarray(im, np.float32), 0.0, 1.0)
        return np.ascontiguousarray(np.repeat(gray[..., None], 3, axis=2), np.float32), False
    if _has_alpha(im):
        rgba = np.asarray(im.convert("RGBA"), np.float32) * EIGHT_BIT_LEVEL
        a = rgba[..., 3:4]
        bg = np.asarray(background, np.float32).reshape(1, 1, 3)
        rgb = rgba[..., :3] * a + bg * (1.0 - a)
        return np.ascontiguousarray(rgb, np.float32), bool((a < 1.0).any())
    rgb = np.asarray(im.convert("RGB"), np.float32) * EIGHT_BIT_LEVEL
    return np.ascontiguousarray(rgb, np.float32), False


def read_image(path, background=(1.0, 1.0, 1.0)):
    """((H, W, 3) float32 in [0, 1], masked); RGBA composited on ``background``, and ``masked``
    when the alpha channel hid some pixel (an object cut out of its surroundings).

    Raises DataError naming the file if it is missing or unreadable.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing image file {path}")
    try:
        with Image.open(path) as im:
            im.load()
            return _to_float_rgb(im, background)
    except DataError:
        raise
    except Exception as exc:  # PIL raises many kinds (OSError, SyntaxError, ValueError, struct.error...)
        raise DataError(f"cannot read image file {path}: {type(exc).__name__}: {exc}") from None


def image_size(path):
    """(width, height) from the header only; DataError if missing/unreadable."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing image file {path}")
    try:
        with Image.open(path) as im:
            return im.size
    except Exception as exc:
        raise DataError(f"cannot read image file {path}: {type(exc).__name__}: {exc}") from None


DEFAULT_MAX_WIDTH = 1600   # Inria's 3DGS scales wider images down to this width unless told a resolution


def _whole(value, name, low, meaning):
    """``value`` as an int >= ``low`` (None stays None); DataError naming ``name`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise DataError(f"{name} must be a whole number >= {low} ({meaning}), got {value!r}")
    return int(value)


MAX_FACTOR = 8   # a resolution up to this divides the images' size; a larger one is their width in pixels


@dataclass(frozen=True)
class Downscale:
    """How images are scaled on loading, as Inria's ``-r``: a ``resolution`` up to ``MAX_FACTOR``
    divides the width and height (None: 1), a larger one is the width in pixels to scale them to
    (``-r 500``: 500 px wide; Inria takes 3, 5, 6 and 7 for widths too, here they are factors); then,
    if still wider than ``max_width`` pixels, they are narrowed to it (None or 0: no limit).  Both
    limits hold: the smaller size wins (where Inria drops its 1600 px limit once ``-r`` is given,
    ``run.py``'s ``--resolution`` does so too; here that is ``max_width=0``).  Intrinsics follow."""
    resolution: int = None
    max_width: int = DEFAULT_MAX_WIDTH

    def __post_init__(self):
        object.__setattr__(self, "resolution", _whole(self.resolution, "resolution", 1,
                                                      f"a downscale factor up to {MAX_FACTOR}, or a width in pixels"))
        object.__setattr__(self, "max_width", _whole(self.max_width, "max_width", 0,
                                                     "the largest image width in pixels; 0: no limit"))

    @property
    def target_width(self):
        """The width ``resolution`` asks for, or None where it is a factor."""
        return self.resolution if (self.resolution or 1) > MAX_FACTOR else None

    def resolution_divisor(self, width):
        """What ``resolution`` divides the size of an image ``width`` pixels wide by."""
        return width / self.target_width if self.target_width else float(self.resolution or 1)

    def size(self, width, height):
        """(width, height) of a ``width`` x ``height`` image after scaling."""
        s = self.resolution_divisor(width)
        if self.max_width and width / s > self.max_width:
            s = width / self.max_width
        if s == 1.0:
            return int(width), int(height)
        return max(1, int(round(width / s))), max(1, int(round(height / s)))


def resize(image, width, height):
    """Resize an (H, W, 3) float32 image (box filter down, bicubic up)."""
    h0, w0 = image.shape[:2]
    if (w0, h0) == (width, height):
        return image
    resample = Image.Resampling.BOX if width <= w0 and height <= h0 else Image.Resampling.BICUBIC
    out = np.empty((height, width, image.shape[2]), np.float32)
    for c in range(image.shape[2]):
        ch = Image.fromarray(np.ascontiguousarray(image[..., c], np.float32))
        out[..., c] = np.asarray(ch.resize((width, height), resample), np.float32)
    return np.clip(out, 0.0, 1.0, out=out)


# ----------------------------------------------------------------------------- distortion

def distort(x, y, dist):
    """Forward radial-tangential distortion of normalized coordinates."""
    k1, k2, k3, k4, p1, p2 = (float(d) for d in dist)
    r2 = x * x + y * y
    radial = r2 * (k1 + r2 * (k2 + r2 * (k3 + r2 * k4)))
    xy = x * y
    xd = x + x * radial + 2.0 * p1 * xy + p2 * (r2 + 2.0 * x * x)
    yd = y + y * radial + p1 * (r2 + 2.0 * y * y) + 2.0 * p2 * xy
    return xd, yd


def has_distortion(dist):
    return dist is not None and any(float(d) != 0.0 for d in dist)


_MAP_CACHE = {}
_MAP_LOCK = threading.Lock()


def undistort_map(width, height, fx, fy, cx, cy, dist):
    """Source pixel coordinates (index space: centre of pixel i is i) for every output pixel."""
    key = (int(width), int(height), float(fx), float(fy), float(cx), float(cy), tuple(float(d) for d in dist))
    with _MAP_LOCK:
        hit = _MAP_CACHE.get(key)
    if hit is not None:
        return hit
    u = (np.arange(width, dtype=np.float64) + 0.5 - cx) / fx
    v = (np.arange(height, dtype=np.float64) + 0.5 - cy) / fy
    x, y = np.meshgrid(u, v)
    xd, yd = distort(x, y, dist)
    mx = (fx * xd + cx - 0.5).astype(np.float32)
    my = (fy * yd + cy - 0.5).astype(np.float32)
    with _MAP_LOCK:
        if len(_MAP_CACHE) > 16:
            _MAP_CACHE.clear()
        _MAP_CACHE[key] = (mx, my)
    return mx, my


def remap_bilinear(image, mx, my):
    """Sample ``image`` at (mx, my) (index coordinates) bilinearly, clamping to the edges."""
    h, w = image.shape[:2]
    mx = np.clip(mx, 0.0, w - 1)
    my = np.clip(my, 0.0, h - 1)
    x0 = np.minimum(np.floor(mx).astype(np.intp), max(w - 2, 0))
    y0 = np.minimum(np.floor(my).astype(np.intp), max(h - 2, 0))
    x1 = np.minimum(x0 + 1, w - 1)
    y1 = np.minimum(y0 + 1, h - 1)
    wx = (mx - x0)[..., None].astype(np.float32)
    wy = (my - y0)[..., None].astype(np.float32)
    top = image[y0, x0] * (1 - wx) + image[y0, x1] * wx
    bot = image[y1, x0] * (1 - wx) + image[y1, x1] * wx
    out = top * (1 - wy) + bot * wy
    return np.ascontiguousarray(np.clip(out, 0.0, 1.0), np.float32)


def has_source(mx, my, width, height):
    """Where a map (index coordinates) samples inside a ``width`` x ``height`` image: on one of
    its pixels, which cover [-0.5, width - 0.5) x [-0.5, height - 0.5)."""
    return (mx >= -0.5) & (mx < width - 0.5) & (my >= -0.5) & (my < height - 0.5)


def largest_rectangle(valid):
    """(x0, y0, x1, y1), exclusive ends, of the largest rectangle of True in ``valid``
    (None if there is no True): each row contributes its longest run of True, and every
    band of rows the run common to all of them."""
    h, w = valid.shape
    left = np.full(h, w, np.int64)      # the longest run of row r is [left[r], right[r])
    right = np.zeros(h, np.int64)
    padded = np.zeros((h, w + 2), np.int8)
    padded[:, 1:-1] = valid
    for r in range(h):
        edges = np.flatnonzero(np.diff(padded[r]))
        if len(edges):
            starts, ends = edges[0::2], edges[1::2]
            k = int(np.argmax(ends - starts))
            left[r], right[r] = starts[k], ends[k]
    best, box = 0, None
    for top in range(h):
        widths = np.minimum.accumulate(right[top:]) - np.maximum.accumulate(left[top:])
        areas = np.maximum(widths, 0) * np.arange(1, h - top + 1)
        k = int(np.argmax(areas))
        if areas[k] > best:
            best = int(areas[k])
            x0 = int(np.max(left[top:top + k + 1]))
            box = (x0, top, x0 + int(widths[k]), top + k + 1)
    return box


@dataclass(frozen=True)
class Undistortion:
    """The source coordinates of a cropped undistorted image, where the crop starts in the
    uncropped one, and the share of the uncropped pixels that had no source pixel."""
    mx: np.ndarray
    my: np.ndarray
    x0: int
    y0: int
    clamped: float


def undistortion(width, height, fx, fy, cx, cy, dist):
    """``Undistortion`` of a ``width`` x ``height`` image; None if no pixel has a source."""
    key = ("crop", int(width), int(height), float(fx), float(fy), float(cx), float(cy),
           tuple(float(d) for d in dist))
    with _MAP_LOCK:
        hit = _MAP_CACHE.get(key)
    if hit is not None:
        return hit
    mx, my = undistort_map(width, height, fx, fy, cx, cy, dist)
    valid = has_source(mx, my, width, height)
    box = largest_rectangle(valid)
    if box is None:
        return None
    x0, y0, x1, y1 = box
    out = Undistortion(np.ascontiguousarray(mx[y0:y1, x0:x1]), np.ascontiguousarray(my[y0:y1, x0:x1]),
                       x0, y0, float(1.0 - valid.mean()))
    with _MAP_LOCK:
        _MAP_CACHE[key] = out
    return out


def undistort(image, fx, fy, cx, cy, dist):
    """(pinhole image, ``Undistortion``): the image undistorted to a pinhole camera with the same
    focal lengths, cropped to the pixels that have a source (its principal point is
    (cx - x0, cy - y0)).  DataError if none has."""
    h, w = image.shape[:2]
    u = undistortion(w, h, fx, fy, cx, cy, dist)
    if u is None:
        raise DataError(f"undistorting a {w}x{h} image with fx={fx}, fy={fy}, cx={cx}, cy={cy} and distortion "
                        f"{tuple(dist)} leaves no pixel inside the image: check the distortion parameters")
    return remap_bilinear(image, u.mx, u.my), u


# ----------------------------------------------------------------------------- the per-view pipeline

@dataclass
class Intrinsics:
    """Intrinsics in pixels of a reference size, plus radial-tangential distortion."""
    fx: float
    fy: float
    cx: float
    cy: float
    width: float      # the size the intrinsics refer to
    height: float
    dist: tuple = NO_DISTORTION

    def finite(self):
        vals = (self.fx, self.fy, self.cx, self.cy, self.width, self.height) + tuple(self.dist)
        return all(np.isfinite(float(v)) for v in vals)

    def as_loaded(self, distortion):
        """These intrinsics as the images are loaded: ``distortion`` "undistort" keeps the
        distortion (the images are undistorted), "ignore" drops it (they train as they are,
        as pinhole views: what trainers that do not undistort do)."""
        if distortion not in DISTORTION:
            raise ValueError(f"distortion must be one of {', '.join(DISTORTION)}, got {distortion!r}")
        return self if distortion == "undistort" else replace(self, dist=NO_DISTORTION)


def ignored_distortion_note(intrinsics, distortion):
    """The dataset note for a load that ignores the distortion of some of ``intrinsics`` (None
    where none is ignored)."""
    n = sum(has_distortion(i.dist) for i in intrinsics) if distortion == "ignore" else 0
    return (f"distortion ignored for {n} images (--distortion ignore): they train as pinhole views, "
            "not undistorted") if n else None


@dataclass
class LoadedImage:
    image: np.ndarray   # final (H, W, 3) float32
    native: tuple       # (width, height) of the file
    scaled: tuple       # (width, height) after downscaling, before the undistortion crop
    fx: float
    fy: float
    cx: float
    cy: float
    masked: bool = False  # some pixel shows the background through an alpha channel
    clamped: float = None  # undistorted: the share of pixels without a source, cropped away; else None

    @property
    def width(self):
        return self.image.shape[1]

    @property
    def height(self):
        return self.image.shape[0]

    def view(self, name, viewmat, camera_model):
        """The ``View`` of this image seen from ``viewmat``."""
        camera = make_camera(name, viewmat, self.fx, self.fy, self.cx, self.cy, self.width, self.height)
        return View(name, self.image, camera, self.masked,
                    Provenance(camera_model, self.native, self.scaled, self.clamped))


def load_image(path, intr, background=(1.0, 1.0, 1.0), downscale=Downscale()):
    """Read, downscale, scale the intrinsics to the result, and undistort (cropping the pixels
    without a source)."""
    img, masked = read_image(path, background)
    h0, w0 = img.shape[:2]
    w, h = downscale.size(w0, h0)
    img = resize(img, w, h)
    sx = w / float(intr.width)
    sy = h / float(intr.height)
    fx, fy, cx, cy = intr.fx * sx, intr.fy * sy, intr.cx * sx, intr.cy * sy
    clamped = None
    if has_distortion(intr.dist):
        if not (np.isfinite([fx, fy, cx, cy]).all() and fx > 0 and fy > 0):
            raise DataError(f"image {path}: invalid intrinsics fx={fx}, fy={fy}, cx={cx}, cy={cy}")
        try:
            img, u = undistort(img, fx, fy, cx, cy, intr.dist)
        except DataError as exc:
            raise DataError(f"image {path}: {exc}") from None
        cx, cy, clamped = cx - u.x0, cy - u.y0, u.clamped
    return LoadedImage(np.ascontiguousarray(img, np.float32), (w0, h0), (w, h), fx, fy, cx, cy, masked, clamped)


def parallel_map(fn, items, workers=None):
    """``[fn(x) for x in items]`` on a thread pool (PIL decoding releases the GIL)."""
    items = list(items)
    if workers is None:
        workers = min(16, os.cpu_count() or 1, max(1, len(items)))
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def check_sizes(loaded, names, groups, what="camera"):
    """DataError if images of one group (camera) have different native sizes."""
    first = {}
    for li, name, g in zip(loaded, names, groups):
        if g not in first:
            first[g] = (li.native, name)
        elif li.native != first[g][0]:
            (w0, h0), other = first[g]
            w, h = li.native
            raise DataError(f"image {name} is {w}x{h} but {other} of the same {what} is {w0}x{h0}")
