"""The CUDA backend: Numba ``@cuda.jit`` kernels (float32), compiled to PTX and launched
through CuPy (``launch``); under the CUDA simulator they run in Python on numpy arrays.

The entry points have the names and arguments of ``numbasplat.cpu``'s, so the API (through
``numbasplat.backend.kernels``) calls either.  Modules: ``launch`` (compiling, caching and
launching kernels), ``tile`` (the per-tile device functions the raster and fused kernels
share), ``raster`` (projection, binning, raster forward and backward), ``fused`` (raster,
tile loss and backward in one kernel: ``FUSED_TILE_LOSS``), ``loss`` (windowed SSIM),
``tile_loss`` (L1 + S3IM per tile), ``optim`` (Adam), ``rows`` (the out-of-core row table's
moves, pool rows and boxes, and per-row noise), ``sparse`` (the zero-eliding gradient messages).
"""
import numpy as np

from . import launch
from .fused import fused_budget, fused_layout, fused_raster_loss_backward
from .launch import array_module
from .loss import as_images, l1_ssim, ssim_forward
from .optim import adam, adam_rows
from .raster import (contributions, cull, depth_keys, emit_intersections, project, project_backward,
                     project_backward_adam, project_backward_over_params, ranges_from_counts, raster_backward,
                     raster_forward, route, route_fill, screen_stats)
from .rows import move_rows, pool_rows, reach_boxes, row_normals
from .sparse import decode_add, encode, scatter_add
from .tile_loss import tile_loss

STATE_DTYPE = np.float32  # the per-pixel state carried between the chunks of a view
FUSED_TILE_LOSS = True


def launch_count():
    """Kernels launched so far (the benchmark reports launches per step)."""
    return launch.launches


__all__ = ["FUSED_TILE_LOSS", "STATE_DTYPE", "adam", "adam_rows", "array_module", "as_images", "contributions", "cull",
           "decode_add", "depth_keys", "emit_intersections", "encode", "fused_budget", "fused_layout",
           "fused_raster_loss_backward", "l1_ssim", "launch_count", "move_rows", "pool_rows", "project",
           "project_backward", "project_backward_adam", "project_backward_over_params", "ranges_from_counts",
           "raster_backward", "raster_forward", "reach_boxes", "route",
           "route_fill", "row_normals", "scatter_add", "screen_stats", "ssim_forward", "tile_loss"]
