"""Where ``bin_tiles``' time goes, step by step, and two alternatives, on a benchmark scene.

    python scripts/bin_breakdown.py SCENE.npz [PARTS]     (GPU only; scenes from run.py bench --make)

With PARTS (the aggregate device's split on separate GPUs, ``numbasplat.placement``), its binning's steps too:
each part's tile counts, then part by part its count gather and scan, emit, the mask of its rows,
its tile argsort, the gather and the ranges (the parts share the view's depth order).

Each step runs 15 times between CUDA events; the medians (ms) are printed in pipeline order.
"""
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy as cp  # noqa: E402

from data.bench_scene import load_scene  # noqa: E402
from numbasplat import rendering as R  # noqa: E402
from numbasplat.backend import kernels  # noqa: E402
from numbasplat.gaussians import Gaussians  # noqa: E402
from numbasplat.math import gaussian_ops as go  # noqa: E402
from numbasplat.math.tiles import TILE  # noqa: E402


def timed(label, fn, reps=15):
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        out = fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    print(f"  {label:32s} {statistics.median(ts):7.3f}")
    return out


def main(path, parts=1):
    g, cam = load_scene(path)
    g = Gaussians(**{k: cp.asarray(a) for k, a in g.arrays().items()})
    p = R.project(g, cam, check=False)
    tx, ty = cam.tiles
    print(f"{int((p.counts > 0).sum())} of {len(g)} Gaussians visible")
    timed("project (whole)", lambda: R.project(g, cam, check=False))
    b = timed("bin_tiles (whole)", lambda: R.bin_tiles(p))
    print(f"  {b.n_isect} intersections; bin_tiles' steps:")
    k = kernels("cuda")
    depth = cp.empty(len(g), np.float32)
    timed("depth keys", lambda: k.depth_keys(p.proj, p.counts, depth))
    order = timed("depth argsort", lambda: cp.argsort(depth))
    ends = timed("count gather + scan", lambda: cp.cumsum(p.counts[order], dtype=np.int64))
    total = timed("total (device sync)", lambda: int(ends[-1]))
    ids, tile_of, overflow = cp.empty(total, np.int32), cp.empty(total, np.uint32), cp.zeros(1, np.int32)
    timed("emit intersections", lambda: k.emit_intersections(p.proj, order, p.counts, ends, TILE, tx, ty, cam.width,
                                                             cam.height, 0, total, tile_of, ids, overflow))
    keys = tile_of.astype(np.uint16)
    perm = timed("stable tile argsort (uint16)", lambda: cp.argsort(keys))
    timed("the gather", lambda: ids[perm])
    ranges = cp.zeros((tx * ty, 2), np.int32)
    timed("ranges (edges of the sorted runs)", lambda: k.tile_ranges(tile_of, perm, ranges))
    print("  alternatives:")
    timed("tile argsort (uint32 keys)", lambda: cp.argsort(tile_of))
    timed("ranges by bincount + scan", lambda: cp.cumsum(cp.bincount(tile_of, minlength=tx * ty + 1)))
    if parts > 1:
        split(p, order, parts)


def split(p, order, parts):
    """The binning of parts on separate devices (``Placement(shared_binning=False).bin_tiles``, exact),
    part by part."""
    from numbasplat.placement import even_ranges
    k = kernels("cuda")
    cam = p.camera
    tx, ty = cam.tiles
    rows = even_ranges(ty, parts)
    print(f"  split in {parts} parts of tile rows {rows}:")
    counts = timed("every part's tile counts", lambda: R.tile_row_counts(p, rows))
    for part, (first_row, last_row) in enumerate(rows):
        c = counts[part]
        ends = timed(f"{part}: count gather + scan", lambda: cp.cumsum(c[order], dtype=np.int64))
        total = int(ends[-1])
        ids, tile_of, overflow = cp.empty(total, np.int32), cp.empty(total, np.uint32), cp.zeros(1, np.int32)
        timed(f"{part}: emit ({total} slots)", lambda: k.emit_intersections(
            p.proj, order, c, ends, TILE, tx, ty, cam.width, cam.height, 0, total, tile_of, ids, overflow))
        first, last = first_row * tx, last_row * tx
        masked = timed(f"{part}: mask to its rows", lambda: cp.where((tile_of >= first) & (tile_of < last), tile_of,
                                                                   np.uint32(tx * ty)).astype(np.uint32))
        keys = masked.astype(np.uint16)
        perm = timed(f"{part}: stable tile argsort", lambda: cp.argsort(keys))
        timed(f"{part}: the gather", lambda: ids[perm])
        ranges = cp.zeros((tx * ty, 2), np.int32)
        timed(f"{part}: ranges", lambda: k.tile_ranges(masked, perm, ranges))
        print(f"  {part}: {int((masked < tx * ty).sum())} of its {total} slots in its rows")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 1)
