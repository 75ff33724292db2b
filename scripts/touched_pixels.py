"""Would the pixel exchange send fewer bytes pixel by pixel than tile by tile?

``engine/pipelines/pixel_exchange.py`` sends a composer every partial tile that a rank's Gaussians cover
(16x16 pixels of colour and transmittance).  A stream of single pixels could leave out those that
the rank's render does not touch (transmittance exactly 1: no Gaussian of its box reached them
above the rasterizer's alpha cut-off), at the cost of a 256-bit mask a tile, and those that the
boxes in front saturate (less than ``SATURATED`` of the light reaches them), where saturation
reduction now skips a tile only when all its pixels are.  This counts, for a model and its
training views, the pixels of the tiles sent forward (to other composers, their range and halo:
``ViewPlan``, saturation reduction left out), those of the tiles that saturation reduction keeps
(``Saturation.saturated``, on marks as fresh as the counted model), those touched, and those
touched and not saturated, over P kd-tree boxes.  A count: the CPU backend gives what a GPU would.

    python scripts/touched_pixels.py --data CITY [--model PLY] [--ranks 2,4,8]
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numbasplat as ns  # noqa: E402
from data.dataset import load_dataset  # noqa: E402
from data.ply import load_ply  # noqa: E402
from engine.pipelines.partition import SpatialPartition  # noqa: E402
from engine.pipelines.pixel_exchange import SATURATED, ViewPlan  # noqa: E402
from numbasplat.math.tiles import TILE, TILE_PIXELS  # noqa: E402


def sent_and_touched(g, cams, ranks, backend="cpu"):
    """-> (partial tiles sent forward, of those the tiles that saturation reduction keeps, their
    pixels that the sender's render touches, of those the ones that the boxes in front leave at
    least ``SATURATED`` of the light)."""
    means = np.asarray(g.means)
    part = SpatialPartition.build(means, ranks)
    owner = part.owner(means)
    boxes = [g.take(owner == r) for r in range(ranks)]
    sent = kept = touched = lit = 0
    for cam in cams:
        plan = ViewPlan(cam, range(ranks), part)
        tx, ty = cam.tiles
        reach = np.ones((ty * tx, TILE_PIXELS))  # the light the boxes in front leave, per pixel
        for r in plan.order:
            p = ns.project(boxes[r], cam, sh_degree=0, backend=backend, check=False)
            b = ns.bin_tiles(p, backend)
            trans = ns.rasterize(p, b, np.zeros(3, np.float32), backend).trans
            padded = np.ones((ty * TILE, tx * TILE))
            padded[:trans.shape[0], :trans.shape[1]] = trans
            per_tile = padded.reshape(ty, TILE, tx, TILE).transpose(0, 2, 1, 3).reshape(ty * tx, TILE_PIXELS)
            goes = np.zeros(ty * tx, bool)
            for j in range(ranks):
                if j != r:
                    goes[plan.need_lo[j]:plan.need_hi[j]] = True
            goes &= (b.ranges[:, 1] - b.ranges[:, 0]) > 0
            sent += int(goes.sum())
            kept += int((goes & (reach.max(axis=1) >= SATURATED)).sum())
            touched += int((per_tile[goes] < 1).sum())
            lit += int(((per_tile[goes] < 1) & (reach[goes] >= SATURATED)).sum())
            reach *= per_tile
    return sent, kept, touched, lit


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a dataset folder (its training views are counted)")
    ap.add_argument("--model", help="a 3DGS PLY (default: DATA/ground_truth.ply, the generator's)")
    ap.add_argument("--ranks", default="2,4,8")
    a = ap.parse_args()
    data = load_dataset(a.data)
    g = ns.Gaussians(**load_ply(a.model or str(Path(a.data) / "ground_truth.ply")))
    cams = [v.camera for v in data.train]
    for ranks in (int(r) for r in a.ranks.split(",")):
        sent, kept, touched, lit = sent_and_touched(g, cams, ranks)
        pixels = max(sent * TILE_PIXELS, 1)

        def stream(n):  # n pixels of 4 float32, and a bit a pixel of each tile sent
            return (n * 16 + sent * TILE_PIXELS // 8) / (pixels * 16)
        print(f"P = {ranks}: {sent} partial tiles sent over {len(cams)} views, {kept / max(sent, 1):.1%} kept by "
              f"saturation reduction; of their pixels {touched / pixels:.1%} touched, {lit / pixels:.1%} touched and "
              f"not saturated; a pixel stream with a mask a tile would send {stream(touched):.1%} / {stream(lit):.1%} "
              f"of the tiles' bytes")


if __name__ == "__main__":
    main()
