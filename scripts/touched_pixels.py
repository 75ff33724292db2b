"""Would the pixel exchange send fewer bytes pixel by pixel than tile by tile?

``engine/pixel_exchange.py`` sends a composer every partial tile that a rank's Gaussians cover
(16x16 pixels of colour and transmittance).  A stream of single pixels could leave out those that
the rank's render does not touch (transmittance exactly 1: no Gaussian of its box reached them
above the rasterizer's alpha cut-off), at the cost of a 256-bit mask a tile.  This counts, for a
model and its training views, the pixels of the tiles sent forward (to other composers, their
range and halo: ``ViewPlan``) and those touched, over P kd-tree boxes.  A count: the CPU backend
gives what a GPU would.

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
from engine.partition import SpatialPartition  # noqa: E402
from engine.pixel_exchange import ViewPlan  # noqa: E402
from numbasplat.math.tiles import TILE, TILE_PIXELS  # noqa: E402


def sent_and_touched(g, cams, ranks, backend="cpu"):
    """-> (partial tiles sent forward, pixels of theirs that the sender's render touches)."""
    means = np.asarray(g.means)
    part = SpatialPartition.build(means, ranks)
    owner = part.owner(means)
    boxes = [g.take(owner == r) for r in range(ranks)]
    sent = touched = 0
    for cam in cams:
        plan = ViewPlan(cam, range(ranks), part)
        tx, ty = cam.tiles
        for r, box in enumerate(boxes):
            p = ns.project(box, cam, sh_degree=0, backend=backend, check=False)
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
            touched += int((per_tile[goes] < 1).sum())
    return sent, touched


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
        sent, touched = sent_and_touched(g, cams, ranks)
        share = touched / max(sent * TILE_PIXELS, 1)
        stream = (touched * 16 + sent * TILE_PIXELS // 8) / max(sent * TILE_PIXELS * 16, 1)  # + a bit a pixel
        print(f"P = {ranks}: {sent} partial tiles sent over {len(cams)} views, {share:.1%} of their pixels touched; "
              f"a pixel stream with a mask a tile: {stream:.1%} of the tiles' bytes")


if __name__ == "__main__":
    main()
