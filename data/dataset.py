"""``load_dataset``, the entry point: detect a data folder's format and dispatch
to its loader (``colmap.load``, ``nerf.load_blender``, ``nerf.load_ngp``).

What every loader returns, and its conventions, are in ``scene``.
"""
from pathlib import Path

import numpy as np

from . import colmap, nerf
from .images import DEFAULT_MAX_WIDTH, DISTORTION, Downscale
from .scene import DataError, check_test_every, first_training_views

FORMATS = ("colmap", "blender", "ngp")


def require_folder(path):
    """DataError unless ``path`` is an existing folder."""
    if not path.exists():
        raise DataError(f"data folder {path} does not exist")
    if not path.is_dir():
        raise DataError(f"data path {path} is not a folder")


def detect_format(path):
    """'colmap', 'blender' or 'ngp' for the data folder ``path``; DataError otherwise."""
    path = Path(path)
    require_folder(path)
    if colmap.model_dir(path) is not None:
        return "colmap"
    if (path / "transforms_train.json").is_file():
        return "blender"
    if (path / "transforms.json").is_file():
        return "ngp"
    raise DataError(
        f"cannot detect the dataset format of {path}: looked for a COLMAP model "
        f"(sparse/0/ or sparse/ with cameras, images, points3D .bin or .txt), "
        f"transforms_train.json (Blender/NeRF-synthetic) and transforms.json (instant-ngp/nerfstudio)")


def load_dataset(path, fmt="auto", images=None, background=(1.0, 1.0, 1.0), test_every=None, resolution=None,
                 max_width=DEFAULT_MAX_WIDTH, train_views=None, distortion="undistort"):
    """Load a COLMAP, Blender (NeRF-synthetic) or instant-ngp/nerfstudio scene.

    ``images``: image folder name for COLMAP (default ``images``; e.g.
    ``images_4``) or the folder replacing ``images/`` in ngp file paths.
    ``background``: RGB in [0, 1] that RGBA images are composited on.
    ``test_every``: hold out the sorted images whose index % test_every == 0
    for testing (8: Inria's ``--eval`` split); 0 or None: none, every view
    trains.  Blender scenes use transforms_test.json instead (without it,
    test_every splits the training views).
    ``resolution``: as Inria's ``-r``, an integer downscale factor up to 8
    (None: 1), or above 8 the images' width in pixels (``images.Downscale``);
    ``max_width``: images still wider are narrowed to it (None or 0: no
    limit; by default 1600 px, as Inria).  Intrinsics follow the images.
    ``distortion``: "undistort" (default) undistorts the images of cameras with distortion and
    crops them to the pixels that have a source; "ignore" trains on them as they are, as pinhole
    views (as trainers that do not undistort do: to compare with them).
    ``train_views``: keep the first that many training views and no test
    views (None: all); a COLMAP capture then reads only their images, the
    other formats read every image and drop the rest.

    ``Dataset.summary()`` says what was loaded and what was decided.
    """
    path = Path(path)
    require_folder(path)
    background = np.asarray(background, np.float32).reshape(-1)
    if background.shape != (3,) or not np.isfinite(background).all():
        raise ValueError(f"background must be 3 finite floats, got {background}")
    check_test_every(test_every)
    if distortion not in DISTORTION:
        raise ValueError(f"distortion must be one of {', '.join(DISTORTION)}, got {distortion!r}")
    options = dict(images=images, background=background, test_every=test_every,
                   downscale=Downscale(resolution, max_width), distortion=distortion)
    fmt = (fmt or "auto").lower()
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "colmap":
        dataset = colmap.load(path, **options, train_views=train_views)
    elif fmt == "blender":
        dataset = nerf.load_blender(path, **options)
    elif fmt in ("ngp", "nerfstudio", "instant-ngp"):
        dataset = nerf.load_ngp(path, **options)
    else:
        raise DataError(f"unknown dataset format {fmt!r} for {path}; expected 'auto' or one of {', '.join(FORMATS)}")
    return first_training_views(dataset, train_views) if train_views else dataset
