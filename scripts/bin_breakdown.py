"""Where ``bin_tiles``' time goes, step by step, and two alternatives, on a benchmark scene.

    python scripts/bin_breakdown.py SCENE.npz [PARTS]     (GPU only; scenes from run.py bench --make)

With PARTS (the aggregate device's split on separate GPUs, ``numbasplat.placement``), its binning's steps too:
each part's tile counts, then part by part its count gather and scan, emit (its rows' keys, counted per tile),
its tile argsort, the gather and the ranges from the counts (the parts share the view's depth order).

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


def _copied(counts, ranges):
    """``ranges`` holding the tiles' ``counts`` again (``ranges_from_counts`` turns them into ranges in place)."""
    ranges[...] = counts
    return ranges


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
    key_dtype = R.tile_key_dtype(tx * ty)
    ids, tile_of, overflow = cp.empty(total, np.int32), cp.empty(total, key_dtype), cp.zeros(1, np.int32)
    ranges = cp.zeros((tx * ty, 2), np.int32)
    no_views = cp.zeros(0, np.int32)

    def emit():
        ranges.fill(0)  # (the counts start from zero each time)
        k.emit_intersections(p.proj, order, p.counts, ends, TILE, tx, ty, cam.width, cam.height, no_views, 0,
                             tx * ty, tx * ty, total, tile_of, ids, ranges, overflow)
    timed("emit intersections (+ zero counts)", emit)
    counts = ranges.copy()
    perm = timed(f"stable tile argsort ({key_dtype})", lambda: cp.argsort(tile_of))
    timed("the gather", lambda: ids[perm])
    timed("ranges from the counts (+ their copy)", lambda: k.ranges_from_counts(_copied(counts, ranges)))
    print("  alternatives:")
    timed("tile argsort (uint32 keys)", lambda: cp.argsort(tile_of.astype(np.uint32)))
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
        ids, tile_of = cp.empty(total, np.int32), cp.empty(total, R.tile_key_dtype(tx * ty))
        overflow, ranges = cp.zeros(1, np.int32), cp.zeros((tx * ty, 2), np.int32)
        first, last = first_row * tx, min(last_row * tx, tx * ty)

        def emit():
            ranges.fill(0)
            k.emit_intersections(p.proj, order, c, ends, TILE, tx, ty, cam.width, cam.height, cp.zeros(0, np.int32),
                                 first, last, tx * ty, total, tile_of, ids, ranges, overflow)
        timed(f"{part}: emit its rows' keys ({total} slots)", emit)
        counts = ranges.copy()
        perm = timed(f"{part}: stable tile argsort", lambda: cp.argsort(tile_of))
        timed(f"{part}: the gather", lambda: ids[perm])
        timed(f"{part}: ranges from the counts (+ their copy)", lambda: k.ranges_from_counts(_copied(counts, ranges)))
        print(f"  {part}: {int(counts[:, 1].sum())} of its {total} slots in its rows")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 1)
