"""The CPU backend: Numba ``njit`` kernels with the semantics of the CUDA ones.

It is the reference the CUDA kernels are checked against, and it runs in the dtype it is
given, so float64 inputs give float64 gradients for finite-difference checks.  Its arrays are
numpy arrays.  The entry points have the names and arguments of ``numbasplat.cuda``'s, so the
API (through ``numbasplat.backend.kernels``) calls either.  It has no fused raster+loss kernel
(``FUSED_TILE_LOSS``): every tile takes raster forward, tile loss and raster backward.
"""
import numpy as np

from ..math.jit import drop_stale_caches
from . import loss, optim, raster, rows, sparse, tile_loss as _tile_loss
from .loss import as_images, l1_ssim, ssim_forward
from .optim import adam, adam_rows, adam_table_rows
from .raster import (contributions, cull, depth_keys, emit_intersections, project, project_backward,
                     project_backward_adam, project_backward_over_params, ranges_from_counts, raster_backward,
                     raster_forward, route, route_fill, screen_stats)
from .rows import copy_table_rows, move_rows, pool_rows, reach_boxes, row_normals
from .sparse import decode_add, encode, scatter_add
from .tile_loss import tile_loss

STATE_DTYPE = np.float64  # the per-pixel state carried between the chunks of a view
FUSED_TILE_LOSS = False

drop_stale_caches([loss, optim, raster, rows, sparse, _tile_loss])  # the kernels inline numbasplat.math (other files)


def array_module():
    """numpy: the module of this backend's arrays."""
    return np


def fused_layout():
    """(M_budget, M_fixed, M_g, where M_budget comes from) of the CUDA fused kernel, for pruning to
    its budget without a GPU: an H200's shared memory per block and the kernel's declared layout."""
    from ..math.tiles import H200_SMEM_PER_BLOCK, fused_smem_layout
    return (H200_SMEM_PER_BLOCK, *fused_smem_layout(), "an H200's (no GPU here)")


def launch_count():
    """None: CPU kernels are plain calls, there are no launches to count."""
    return None


__all__ = ["FUSED_TILE_LOSS", "STATE_DTYPE", "adam", "adam_rows", "adam_table_rows", "array_module", "as_images", "contributions", "copy_table_rows", "cull", "decode_add",
           "depth_keys", "emit_intersections", "encode", "fused_layout", "l1_ssim", "launch_count", "move_rows",
           "pool_rows", "project", "project_backward", "project_backward_adam", "project_backward_over_params",
           "ranges_from_counts", "raster_backward", "raster_forward",
           "reach_boxes", "route", "route_fill", "row_normals", "scatter_add", "screen_stats", "ssim_forward", "tile_loss"]
