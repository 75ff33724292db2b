"""NumbaSplat: a differentiable 3D Gaussian rasterizer in Numba (CUDA and CPU).

Layers, each importing only those below it: the API (``rendering``, ``chunks``, ``loss``, ``tile_loss``,
``compose``, ``optim``, ``rows``, ``device``, ``bench``; ``gaussians`` holds the parameters they
share), ``backend`` (the choice of backend and the dispatch to it), the kernels (``cpu``, ``cuda``:
the same entry points), and ``math`` (the math both backends' kernels share).

Of that math, the API re-exports what the layers above numbasplat use (they import it from here,
never from ``numbasplat.math``): the record layouts (``PROJ_FIELDS`` values in a projected record,
``GRAD_FIELDS`` in a gradient record, whose columns ``U``, ``V`` hold the screen-space mean
gradient and ``ABS_U``, ``ABS_V`` its absolute values summed per pixel), the tile size (``TILE``,
``TILE_PIXELS``), the compositing thresholds (``ALPHA_MIN``, ``T_MIN``), the SH band-0 constant
``C0`` and the sizes of the sparse gradient messages (``message_sizes``).
"""
from .backend import BACKEND
from .gaussians import Gaussians
from .math.gaussian_ops import ABS_U, ABS_V, GRAD_FIELDS, PROJ_FIELDS, U, V
from .math.geometry import ALPHA_MIN, T_MIN
from .math.sh import C0
from .math.sparse import message_sizes
from .math.tiles import TILE, TILE_PIXELS
from .rendering import (Binning, Camera, Frame, Projection, Render, behind_state, bin_tiles, contributions, cull,
                        front_state, project, project_backward, rasterize, rasterize_backward, render, render_backward)
from .chunks import ChunkedFrame, depth_chunks, render_chunked, render_chunked_backward

__all__ = ["ABS_U", "ABS_V", "ALPHA_MIN", "BACKEND", "Binning", "C0", "Camera", "ChunkedFrame", "Frame",
           "GRAD_FIELDS", "Gaussians", "PROJ_FIELDS", "Projection", "Render", "TILE", "TILE_PIXELS", "T_MIN", "U", "V",
           "behind_state", "bin_tiles", "contributions", "cull", "depth_chunks", "front_state", "message_sizes",
           "project", "project_backward", "rasterize", "rasterize_backward", "render", "render_backward",
           "render_chunked", "render_chunked_backward"]
