"""Do P ranks train as one process does at the same batch?  (run under mpiexec, then --compare)

    mpiexec -n 1 python scripts/batch_equivalence.py OUT --data DATA --batch 4 --images 6800
    mpiexec -n 4 python scripts/batch_equivalence.py OUT --data DATA --batch 4 --images 6800
    python scripts/batch_equivalence.py OUT --compare 1 4

Each run saves the whole model's gradients after the first step (OUT/grads_p{P}.npz) and
prints the Gaussian total and the loss every ``--every`` images, so a difference that the
CPU tests' small scene cannot show (a GPU kernel, a large scene, densification) shows up
as the first step where the runs part.  ``--compare`` prints the relative gradient
difference per parameter group.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numbasplat.optim import GROUPS  # noqa: E402


def run(a):
    from mpi4py import MPI
    from comm import abort_on_error
    from data import load_dataset
    from engine.tools.demo import make_dataset
    from engine.pipelines.distributed import select_device
    from engine.pipelines.gaussian_exchange import GaussianExchangeTrainer
    from engine.recipe.trainer import TrainConfig
    comm = MPI.COMM_WORLD
    with abort_on_error(comm):
        select_device(comm)
        background = (1.0, 1.0, 1.0) if a.white_background or a.data is None else None
        ds = make_dataset(size=32, n_views=8) if a.data is None else load_dataset(a.data, images=a.image_dir,
                                                                                   background=background)
        cfg = TrainConfig(iterations=a.images, snapshot_every=0)
        if a.data is None:
            cfg.n_random_init, cfg.sh_degree = 300, 1
        if background:
            cfg.background = background
        t = GaussianExchangeTrainer(ds, a.out, cfg, comm, batch_size=a.batch)
        t.init_model()
        loss = float(t.train_step()[0])
        grads = t.gathered("grads", root_only=True)
        if comm.rank == 0:
            np.savez(Path(a.out) / f"grads_p{comm.size}.npz", **grads)
            print(f"P={comm.size} batch {t.batch}: step {t.step} loss {loss:.6f}", flush=True)
        while t.step < a.images:
            loss = float(t.train_step()[0])
            total = comm.allreduce(len(t.model))
            if comm.rank == 0 and t.step % a.every < t.batch:
                print(f"P={comm.size} image {t.step}: loss {loss:.5f}, {total} Gaussians", flush=True)


def compare(a):
    p, q = (np.load(Path(a.out) / f"grads_p{k}.npz") for k in a.compare)
    for g in GROUPS:
        x, y = p[g], q[g]
        scale = max(float(np.abs(x).max()), 1e-30)
        print(f"{g:10s} {x.shape} max |g| {scale:.3e}, max difference {np.abs(x - y).max() / scale:.2e} relative")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--data", help="a capture folder (default: the built-in scene, 32x32)")
    ap.add_argument("--image-dir", dest="image_dir", help="image folder inside it, e.g. images_8")
    ap.add_argument("--white-background", action="store_true")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--images", type=int, default=400, help="train this many images")
    ap.add_argument("--every", type=int, default=400, help="print every this many images")
    ap.add_argument("--compare", type=int, nargs=2, metavar=("P", "Q"), help="compare grads_pP with grads_pQ")
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.compare:
        compare(a)
    else:
        run(a)


if __name__ == "__main__":
    main()
