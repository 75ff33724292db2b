"""The 16x16 pixel tiles that the rasterizer, both losses and the distributed renderers share.

The raster kernels run a block per tile, the losses sum per tile (so a renderer's tiles name
its share of the loss), and the renderers trade whole tiles: one ``TILE`` for them all.
Tiles are numbered row-major; the last column and row are cut by the image's border.
"""
import numpy as np

TILE = 16
TILE_PIXELS = TILE * TILE  # pixels (and threads of a tile's CUDA block) per tile
TILE_LOSS_ROWS = 9         # rows of TILE_PIXELS float32 of the tile loss's shared scratch (cuda/tile_loss.py)
H200_SMEM_PER_BLOCK = 227 * 1024  # shared memory a block may opt in to on an H200 (sm_90)


def fused_smem_layout():
    """(M_fixed, M_g) in bytes of the fused kernel (numbasplat/cuda/fused.py), from the constants its
    shared arrays are declared with: the tile loss's scratch, a row of gradient sums per field and
    one flag (fixed), and one cached record, its fields before depth (a Gaussian).  On a GPU the
    compiled kernel's own count is used; it may be lower, by what the compiler drops, never higher
    (the GPU check compares them): a budget from these is never too large."""
    from .gaussian_ops import DEPTH, GRAD_FIELDS
    return 4 * (TILE_LOSS_ROWS * TILE_PIXELS + GRAD_FIELDS + 1), 4 * DEPTH


def tile_grid(W, H):
    """(tiles_x, tiles_y): the tiles that cover a W x H image."""
    return -(-W // TILE), -(-H // TILE)


def tile_pixels(W, H):
    """(tiles,) pixels inside the image of each row-major tile."""
    tiles_x, tiles_y = tile_grid(W, H)
    rows = np.minimum(TILE, H - TILE * np.arange(tiles_y))
    cols = np.minimum(TILE, W - TILE * np.arange(tiles_x))
    return np.outer(rows, cols).ravel()
