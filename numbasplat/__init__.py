"""NumbaSplat: a differentiable 3D Gaussian rasterizer in Numba (CUDA and CPU)."""
from ._backend import BACKEND
from .rendering import (Binning, Camera, Frame, Gaussians, Projection, Render, bin_tiles, project,
                        project_backward, rasterize, rasterize_backward, render, render_backward)

__all__ = ["BACKEND", "Binning", "Camera", "Frame", "Gaussians", "Projection", "Render", "bin_tiles", "project",
           "project_backward", "rasterize", "rasterize_backward", "render", "render_backward"]
