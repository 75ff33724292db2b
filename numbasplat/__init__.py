"""NumbaSplat: a differentiable 3D Gaussian rasterizer in Numba (CUDA and CPU).

Layers, each importing only those below it: the API (``rendering``, ``loss``, ``tile_loss``,
``optim``, ``bench``; ``gaussians`` holds the parameters they share), ``backend`` (the choice
of backend and the dispatch to it), the kernels (``cpu``, ``cuda``: the same entry points),
and ``math`` (the math both backends' kernels share).
"""
from .backend import BACKEND
from .gaussians import Gaussians
from .rendering import (Binning, Camera, Frame, Projection, Render, bin_tiles, contributions, cull, project,
                        project_backward, rasterize, rasterize_backward, render, render_backward)

__all__ = ["BACKEND", "Binning", "Camera", "Frame", "Gaussians", "Projection", "Render", "bin_tiles", "contributions",
           "cull", "project", "project_backward", "rasterize", "rasterize_backward", "render", "render_backward"]
