"""``load_dataset``, the entry point: detect a data folder's format and dispatch
to its loader (``colmap.load``, ``nerf.load_blender``, ``nerf.load_ngp``).

What every loader returns, and its conventions, are in ``scene``.
"""
from pathlib import Path

import numpy as np

from . import colmap, nerf
from .scene import DataError

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
    require_folder(path)
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
        return colmap.load(path, images=images, background=background, test_every=test_every, max_size=max_size)
    if fmt == "blender":
        return nerf.load_blender(path, images=images, background=background, max_size=max_size)
    if fmt in ("ngp", "nerfstudio", "instant-ngp"):
        return nerf.load_ngp(path, images=images, background=background, test_every=test_every, max_size=max_size)
    raise DataError(f"unknown dataset format {fmt!r} for {path}; expected 'auto' or one of {', '.join(FORMATS)}")
