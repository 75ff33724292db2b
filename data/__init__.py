"""Scene loading: COLMAP, Blender (NeRF-synthetic) and instant-ngp/nerfstudio datasets.

>>> from data import load_dataset
>>> ds = load_dataset("../shared/data/fern", images="images_8")
>>> ds.train[0].image.shape, ds.train[0].camera.fx, len(ds.points)

Every loader returns a ``Dataset`` of ``View`` s whose images are (H, W, 3)
float32 in [0, 1], undistorted and alpha-composited, with ``numbasplat.Camera``
s in OpenCV axes.  Bad input raises ``DataError`` (a ValueError) naming the file.
"""
from .dataset import DataError, Dataset, View, detect_format, load_dataset, scene_scale, split_views

__all__ = ["DataError", "Dataset", "View", "detect_format", "load_dataset", "scene_scale", "split_views"]
