"""How many Gaussian-tile pairs and renderer records NumbaSplat's culling sends, against 3DGS's 3-sigma square.

3DGS (and Grendel, ByteSplat's baseline) bins a Gaussian into every tile its
square of radius ceil(3 sqrt(lambda_max)) touches; many of those pairs never
reach alpha >= 1/255 at any pixel, and their gradient records are exactly zero.
NumbaSplat bins with the exact opacity-aware ellipse test (which is smaller than
the square unless the opacity is near 1), so most of those pairs are never made
and their records never sent.  This prints, for the views of a
trained model and P contiguous tile ranges (balanced by intersections, as the
distributed trainer does), both counts and the fraction our culling removes.

Usage: python scripts/record_stats.py --data DIR --model OUT_OR_PLY [--images images_8] [--ranks 4] [--views 8]
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numbasplat as ns  # noqa: E402
from numbasplat.backend import to_host  # noqa: E402
from numbasplat.math import gaussian_ops as go  # noqa: E402
from numbasplat.math.tiles import TILE  # noqa: E402


def box_tiles(proj, valid, tx, ty):
    """Per Gaussian: (x0, x1, y0, y1) tile rectangle of 3DGS's 3-sigma square (empty where culled)."""
    a, b, c = proj[:, go.CA], proj[:, go.CB], proj[:, go.CC]
    det = np.maximum(a * c - b * b, 1e-30)
    sxx, syy, sxy = c / det, a / det, -b / det          # the 2D covariance is the conic's inverse
    mid = 0.5 * (sxx + syy)
    lam = mid + np.sqrt(np.maximum(mid * mid - (sxx * syy - sxy * sxy), 0.1))
    r = np.ceil(3.0 * np.sqrt(lam))
    u, v = proj[:, go.U], proj[:, go.V]
    x0 = np.clip(((u - r) // TILE).astype(np.int64), 0, tx)
    x1 = np.clip(((u + r) // TILE).astype(np.int64) + 1, 0, tx)
    y0 = np.clip(((v - r) // TILE).astype(np.int64), 0, ty)
    y1 = np.clip(((v + r) // TILE).astype(np.int64) + 1, 0, ty)
    empty = ~valid | (x1 <= x0) | (y1 <= y0)
    x1[empty] = x0[empty]
    return x0, x1, y0, y1


def view_stats(model, camera, degree, P):
    p = ns.project(model, camera, sh_degree=degree, backend="cpu")
    b = ns.bin_tiles(p, backend="cpu")
    tx, ty = camera.tiles
    proj, counts = to_host(p.proj), to_host(p.counts)
    ids, ranges = to_host(b.ids), to_host(b.ranges)
    per_tile = ranges[:, 1] - ranges[:, 0]
    cost = np.concatenate([[0], np.cumsum(per_tile)])
    bounds = np.searchsorted(cost, np.linspace(0, cost[-1], P + 1)[1:-1])  # balanced contiguous ranges
    bounds = np.concatenate([[0], bounds, [len(per_tile)]])
    # exact culling: the ranks owning a tile each Gaussian was binned into
    tile_of = np.repeat(np.arange(len(per_tile)), per_tile)
    rank_of = np.searchsorted(bounds, tile_of, side="right") - 1
    exact_records = len(np.unique(ids.astype(np.int64) * P + rank_of))
    # 3-sigma squares
    valid = counts > 0
    x0, x1, y0, y1 = box_tiles(proj, proj[:, go.DEPTH] > 0.01, tx, ty)
    box_pairs = int(((x1 - x0) * (y1 - y0)).sum())
    n_rows = np.maximum(y1 - y0, 0)
    g = np.repeat(np.arange(len(proj)), n_rows)
    row = np.concatenate([np.arange(a, c) for a, c in zip(y0, y1)]) if len(g) else np.zeros(0, np.int64)
    first = np.searchsorted(bounds, row * tx + x0[g], side="right") - 1
    last = np.searchsorted(bounds, row * tx + x1[g] - 1, side="right") - 1
    reps = last - first + 1
    gg = np.repeat(g, reps)
    kk = np.repeat(first, reps) + (np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps))
    box_records = len(np.unique(gg.astype(np.int64) * P + kk))
    return {"pairs_exact": int(per_tile.sum()), "pairs_box": box_pairs, "records_exact": exact_records,
            "records_box": box_records, "visible_exact": int(valid.sum())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", required=True, help="training output folder, snapshot .h5 or .ply")
    ap.add_argument("--images", default=None)
    ap.add_argument("--white-background", action="store_true")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--views", type=int, default=8)
    a = ap.parse_args()
    from data import load_dataset
    from data.ply import load_ply
    from engine.recipe.model import GaussianModel
    from engine.tools.snapshot import read_snapshot
    bg = (1.0, 1.0, 1.0) if a.white_background else (0.0, 0.0, 0.0)
    data = load_dataset(a.data, images=a.images, background=bg)
    src = Path(a.model)
    if src.suffix == ".ply":
        arrays = load_ply(src)
    else:
        snap = read_snapshot(src / "snapshot.h5" if src.is_dir() else src)
        arrays = {k.split("/", 1)[1]: v for k, v in snap[0].items() if k.startswith("params/")}
    model = GaussianModel(arrays, "cpu").gaussians
    degree = model.sh_degree()
    tot = {}
    for v in data.train[:a.views]:
        for k, x in view_stats(model, v.camera, degree, a.ranks).items():
            tot[k] = tot.get(k, 0) + x
    print(f"{len(arrays['means'])} Gaussians, {a.views} views, {a.ranks} tile ranges")
    print(f"Gaussian-tile pairs: exact {tot['pairs_exact']}, 3-sigma square {tot['pairs_box']} "
          f"({1 - tot['pairs_exact'] / max(tot['pairs_box'], 1):.1%} never made)")
    print(f"renderer records:    exact {tot['records_exact']}, 3-sigma square {tot['records_box']} "
          f"({1 - tot['records_exact'] / max(tot['records_box'], 1):.1%} never sent)")


if __name__ == "__main__":
    main()
