"""Where the importance pass's time goes (issue 27: the pass must stay under 5% of a run).

Loads a generated dataset's ground-truth Gaussians (``run.py synth`` writes ground_truth.ply) or
a trained model's folder, then times, over its first V training views: the whole pass as
training runs it (``engine.workload.importance_scores``, nothing synced between views), and each
stage alone with the device synced around it (projection, binning, the contributions kernel, the
masks' bookkeeping), median milliseconds a view.

    python scripts/pass_profile.py --data city [--views 64] [--repeats 3]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import numbasplat as ns  # noqa: E402
from numbasplat import backend as _backend  # noqa: E402
from engine.workload import importance_scores, set_view_bit  # noqa: E402
from engine.scaling import data_workload  # noqa: E402


def synced(xp):
    if hasattr(xp, "cuda"):
        xp.cuda.Device().synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a dataset folder with ground_truth.ply")
    ap.add_argument("--views", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sh-degree", type=int, default=None, help="default: the model's")
    a = ap.parse_args()
    w = data_workload(a.data, a.views)
    xp = _backend.array_module(None)
    g = ns.Gaussians(**{k: xp.asarray(v) for k, v in w.start.items()})
    degree = g.sh_degree() if a.sh_degree is None else a.sh_degree
    cameras = [v.camera for v in w.data.train]
    print(f"{w.name}: {len(g):,} Gaussians, SH degree {degree}, {cameras[0].width}x{cameras[0].height}")
    importance_scores(g, cameras[:2], degree, False, 1 / 255)  # compiles
    synced(xp)
    whole = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        importance_scores(g, cameras, degree, False, 1 / 255)
        synced(xp)
        whole.append(1e3 * (time.perf_counter() - t0) / len(cameras))
    stages = {"project": [], "bin": [], "contributions": [], "masks": []}
    skip = xp.zeros((len(g), (len(cameras) + 7) // 8), np.uint8)
    total = xp.zeros(len(g), np.float64)
    for v, cam in enumerate(cameras):
        t0 = time.perf_counter()
        p = ns.project(g, cam, sh_degree=degree, antialias=False, check=False)
        synced(xp)
        t1 = time.perf_counter()
        b = ns.bin_tiles(p)
        synced(xp)
        t2 = time.perf_counter()
        _, weight = ns.contributions(p, b, colour=False)
        synced(xp)
        t3 = time.perf_counter()
        total += weight
        set_view_bit(skip, v, weight < 1 / 255, xp)
        synced(xp)
        t4 = time.perf_counter()
        for name, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            stages[name].append(1e3 * dt)
    print(f"the pass: {statistics.median(whole):.3f} ms a view (runs {', '.join(f'{x:.3f}' for x in whole)}), "
          f"{len(cameras)} views")
    print("stages, synced (median ms a view): " + ", ".join(f"{k} {statistics.median(x):.3f}"
                                                          for k, x in stages.items()))


if __name__ == "__main__":
    main()
