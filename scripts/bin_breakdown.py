"""Where ``bin_tiles``' time goes, step by step, and two alternatives, on a benchmark scene.

    python scripts/bin_breakdown.py SCENE.npz      (GPU only; scenes from shared/bench/scene_gen.py)

Each step runs 15 times between CUDA events; the medians (ms) are printed in pipeline order.
"""
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy as cp  # noqa: E402

from numbasplat import bench, rendering as R  # noqa: E402
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


def main(path):
    g, cam = bench.load_scene(path)
    g = Gaussians(**{k: cp.asarray(a) for k, a in g.arrays().items()})
    p = R.project(g, cam, check=False)
    tx, ty = cam.tiles
    print(f"{int((p.counts > 0).sum())} of {len(g)} Gaussians visible")
    timed("project (whole)", lambda: R.project(g, cam, check=False))
    b = timed("bin_tiles (whole)", lambda: R.bin_tiles(p))
    print(f"  {b.n_isect} intersections; bin_tiles' steps:")
    depth = timed("depth keys", lambda: cp.where(p.counts > 0, p.proj[:, go.DEPTH], np.inf).astype(np.float32))
    order = timed("depth argsort", lambda: cp.argsort(depth))
    counts, ends = timed("count gather + scan", lambda: (p.counts[order], cp.cumsum(p.counts[order], dtype=np.int64)))
    total = timed("total (device sync)", lambda: int(ends[-1]))
    ids, tile_of = cp.empty(total, np.int32), cp.empty(total, np.uint32)
    offsets = (ends - counts).astype(np.int32)
    emit = kernels("cuda").emit_intersections
    timed("emit intersections", lambda: emit(p.proj, order, p.counts, offsets, TILE, tx, ty, cam.width, cam.height, 0,
                                             tile_of, ids))
    keys = tile_of.astype(np.uint16)
    perm = timed("stable tile argsort (uint16)", lambda: cp.argsort(keys))
    timed("the two gathers", lambda: (ids[perm], tile_of[perm]))
    sorted_tiles = tile_of[perm]
    timed("ranges (searchsorted)", lambda: cp.searchsorted(sorted_tiles, cp.arange(tx * ty + 1, dtype=np.uint32)))
    print("  alternatives:")
    timed("tile argsort (uint32 keys)", lambda: cp.argsort(tile_of))
    timed("ranges by bincount + scan", lambda: cp.cumsum(cp.bincount(tile_of, minlength=tx * ty + 1)))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
