"""Where the importance pass's time goes (issue 27: the pass must stay under 5% of a run).

Loads a generated dataset's ground-truth Gaussians (``run.py synth`` writes ground_truth.ply), or a
trained model of a capture (``--ply``), and times, over its first V training views: the pass's first
call on two views (where its kernels are not compiled yet, their compilation), the whole pass as
training runs it (``engine.recipe.workload.importance_scores``, nothing synced between views), then
once more with the device synced between its stages (projection, binning, the contributions kernel,
the masks' bookkeeping; ``trainer.PhaseClock``), mean milliseconds a view, in brackets the host's part.

    python scripts/pass_profile.py --data city [--views 64] [--repeats 3]
    python scripts/pass_profile.py --data .data/helmet --images images_4 --ply OUT/point_cloud/iteration_30000/point_cloud.ply --lod-min-px 0.5

``--prune-table`` prints instead the share of the Gaussians that ``--importance-prune T`` would prune
at several T, under three normalisations of the importance: by the largest (the pass's), by the
median of those that contribute, and by one view's pixels (a Gaussian's blending weight summed over
the views, in views' worth of pixels): which one prunes alike across captures (issue 62).
"""
import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numbasplat as ns  # noqa: E402
from numbasplat import backend as _backend  # noqa: E402
from engine.tools.scaling import data_workload  # noqa: E402
from engine.recipe.trainer import PhaseClock  # noqa: E402
from engine.recipe.workload import LodReach, importance_scores  # noqa: E402

MASK_BELOW = 1 / 255  # the pass's default (--view-mask-below)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a dataset folder (with ground_truth.ply unless --ply)")
    ap.add_argument("--ply", help="the Gaussians to score instead of the ground truth (a trained model's PLY)")
    ap.add_argument("--images", help="the capture's image folder (as train --images)")
    ap.add_argument("--lod-min-px", type=float, default=0.0, help="tell what this LOD gate hides, as a run's pass does")
    ap.add_argument("--views", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sh-degree", type=int, default=None, help="default: the model's")
    ap.add_argument("--prune-table", action="store_true", help="what each pruning threshold would prune (no timing)")
    a = ap.parse_args()
    if a.ply:
        from data import load_dataset
        from data.ply import load_ply
        from engine.tools.scaling import TEST_EVERY
        data, start = load_dataset(a.data, images=a.images, test_every=TEST_EVERY, train_views=a.views), load_ply(a.ply)
        name = f"{a.ply} on {len(data.train)} training views of {a.data}"
    else:
        w = data_workload(a.data, a.views)
        data, start, name = w.data, w.start, w.name
    xp = _backend.array_module(None)
    g = ns.Gaussians(**{k: xp.asarray(v) for k, v in start.items()})
    degree = g.sh_degree() if a.sh_degree is None else a.sh_degree
    cameras = [v.camera for v in data.train]
    print(f"{name}: {len(g):,} Gaussians, SH degree {degree}, {cameras[0].width}x{cameras[0].height}")

    if a.prune_table:
        prune_table(g, cameras, degree, xp)
        return

    def score(views, clock=None):
        lod = LodReach(len(g), a.lod_min_px, xp) if a.lod_min_px > 0 else None
        importance_scores(g, views, degree, False, MASK_BELOW, clock=clock, lod=lod)
    first = PhaseClock(None, True)
    score(cameras[:2])
    first.end("first")
    print(f"first call, 2 views: {first.times['first']:.2f} s (the kernels' compilation where not cached)")
    whole = []
    for _ in range(a.repeats):
        clock = PhaseClock(None, True)
        score(cameras)
        clock.end("pass")
        whole.append(1e3 * clock.times["pass"] / len(cameras))
    clock = PhaseClock(None, True)
    score(cameras, clock)
    print(f"the pass: {statistics.median(whole):.3f} ms a view (runs {', '.join(f'{x:.3f}' for x in whole)}), "
          f"{len(cameras)} views")
    print("stages, synced (mean ms a view): " + ", ".join(
        f"{k} {1e3 * t / len(cameras):.3f} ({1e3 * clock.host[k] / len(cameras):.3f})" for k, t in clock.times.items()))


def prune_table(g, cameras, degree, xp):
    """The shares pruned under each threshold and normalisation (``--prune-table``)."""
    importance = _backend.to_host(importance_scores(g, cameras, degree, False, MASK_BELOW)[0]).astype(float)
    contributing = importance[importance > 0]
    pixels = cameras[0].width * cameras[0].height
    scales = {"largest": importance.max(), "median": float(np.median(contributing)) if len(contributing) else 1.0,
              "pixels": pixels}
    print(f"importance: largest {importance.max():.4g} ({importance.max() / pixels:.3g} views' pixels), median of the "
          f"contributing {scales['median']:.4g}, none {np.mean(importance == 0):.3f} of the Gaussians")
    for name, scale in scales.items():
        print(f"by the {name}: " + ", ".join(f"{t:g} {np.mean(importance / scale < t):.3f}"
                                              for t in (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2)))


if __name__ == "__main__":
    main()
