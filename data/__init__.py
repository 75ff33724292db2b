"""Scene loading: COLMAP, Blender (NeRF-synthetic) and instant-ngp/nerfstudio datasets.

>>> from data import load_dataset
>>> ds = load_dataset("../shared/data/fern", images="images_8", test_every=8)
>>> ds.train[0].image.shape, ds.train[0].camera.fx, len(ds.points)
>>> print("\n".join(ds.summary()))

Every loader returns a ``Dataset`` of ``View`` s whose images are (H, W, 3)
float32 in [0, 1], undistorted and alpha-composited, with ``numbasplat.Camera``
s in OpenCV axes.  Bad input raises ``DataError`` (a ValueError) naming the file.

Modules, each importing only ones listed after it: ``synthetic_city`` (the
procedural city benchmark: writes a COLMAP dataset), ``bench_scene`` (the benchmark
scenes of ``run.py bench``: ``make_scene``, ``load_scene``), ``dataset`` (``load_dataset``:
detect the format, dispatch to a loader), ``colmap`` and ``nerf`` (the loaders),
``images`` (reading, resizing, undistortion), ``ply`` (PLY files: Gaussians and
point clouds), ``atomic`` (write-then-rename), ``scene`` (``Dataset``, ``View``,
``DataError`` and the helpers the loaders share).
"""
from .dataset import load_dataset
from .scene import DataError, Dataset, View

__all__ = ["DataError", "Dataset", "View", "load_dataset"]
