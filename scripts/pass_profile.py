"""Where the importance pass's time goes (issue 27: the pass must stay under 5% of a run).

Loads a generated dataset's ground-truth Gaussians (``run.py synth`` writes ground_truth.ply) and
times, over its first V training views: the whole pass as training runs it
(``engine.recipe.workload.importance_scores``, nothing synced between views), then once more with the
device synced between its stages (projection, binning, the contributions kernel, the masks'
bookkeeping; ``trainer.PhaseClock``), mean milliseconds a view, in brackets the host's part.

    python scripts/pass_profile.py --data city [--views 64] [--repeats 3]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numbasplat as ns  # noqa: E402
from numbasplat import backend as _backend  # noqa: E402
from engine.tools.scaling import data_workload  # noqa: E402
from engine.recipe.trainer import PhaseClock  # noqa: E402
from engine.recipe.workload import importance_scores  # noqa: E402

MASK_BELOW = 1 / 255  # the pass's default (--view-mask-below)


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
    importance_scores(g, cameras[:2], degree, False, MASK_BELOW)  # compiles
    whole = []
    for _ in range(a.repeats):
        clock = PhaseClock(None, True)
        importance_scores(g, cameras, degree, False, MASK_BELOW)
        clock.end("pass")
        whole.append(1e3 * clock.times["pass"] / len(cameras))
    clock = PhaseClock(None, True)
    importance_scores(g, cameras, degree, False, MASK_BELOW, clock=clock)
    print(f"the pass: {statistics.median(whole):.3f} ms a view (runs {', '.join(f'{x:.3f}' for x in whole)}), "
          f"{len(cameras)} views")
    print("stages, synced (mean ms a view): " + ", ".join(
        f"{k} {1e3 * t / len(cameras):.3f} ({1e3 * clock.host[k] / len(cameras):.3f})" for k, t in clock.times.items()))


if __name__ == "__main__":
    main()
