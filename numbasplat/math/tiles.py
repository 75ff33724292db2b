"""The 16x16 pixel tiles that the rasterizer, both losses and the distributed renderers share.

The raster kernels run a block per tile, the losses sum per tile (so a renderer's tiles name
its share of the loss), and the renderers trade whole tiles: one ``TILE`` for them all.
Tiles are numbered row-major; the last column and row are cut by the image's border.
"""
import numpy as np

TILE = 16
TILE_PIXELS = TILE * TILE  # pixels (and threads of a tile's CUDA block) per tile


def tile_grid(W, H):
    """(tiles_x, tiles_y): the tiles that cover a W x H image."""
    return -(-W // TILE), -(-H // TILE)


def tile_pixels(W, H):
    """(tiles,) pixels inside the image of each row-major tile."""
    tiles_x, tiles_y = tile_grid(W, H)
    rows = np.minimum(TILE, H - TILE * np.arange(tiles_y))
    cols = np.minimum(TILE, W - TILE * np.arange(tiles_x))
    return np.outer(rows, cols).ravel()
