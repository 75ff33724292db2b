"""Run by tests/test_gaussian_exchange.py under mpiexec: a few batched steps, final parameters to OUT/final.npz
(other-iters, other-data: rank 1 is given another iteration count, or sees one view fewer; parity: index-parity
shards; blitz: BlitzGS's importance passes, view masks and LOD gate; visible: visible-only Adam; offload: each
rank's shard out of core; resume: stopped at image 16 and resumed from the snapshot)."""
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comm import abort_on_error  # noqa: E402
from engine.tools.demo import make_dataset  # noqa: E402
from engine.pipelines.gaussian_exchange import GaussianExchangeTrainer, OffloadedGaussianExchangeTrainer  # noqa: E402
from engine.recipe.pruning import train_then_prune  # noqa: E402
from engine.recipe import trainer  # noqa: E402
from engine.recipe.trainer import TrainConfig  # noqa: E402


def anisotropic_init(*args, **kwargs):
    """3DGS starts isotropic and unrotated, where the quaternion gradient is zero up to
    rounding and Adam (eps 1e-15) turns that rounding into full steps; from a generic
    start every gradient is real and runs with P ranks agree to rounding."""
    arrays = init_from_points(*args, **kwargs)
    rng = np.random.default_rng(7)
    arrays["scales"] = arrays["scales"] + rng.normal(0, 0.3, arrays["scales"].shape).astype(np.float32)
    arrays["quats"] = rng.normal(size=arrays["quats"].shape).astype(np.float32)
    return arrays


init_from_points = trainer.init_from_points
trainer.init_from_points = anisotropic_init

out, grad_comm = Path(sys.argv[1]), sys.argv[2]
comm = MPI.COMM_WORLD
with abort_on_error(comm):
    odd = comm.Get_rank() == 1  # the rank that the mismatch flags set apart
    ds = make_dataset(size=32, n_views=11 if odd and "other-data" in sys.argv else 12, backend="cpu")
    cfg = TrainConfig(iterations=32, sh_degree=1, sh_increase_every=8, n_random_init=300, snapshot_every=0,
                      log_every=4, background=(1.0, 1.0, 1.0))
    if odd and "other-iters" in sys.argv:  # as if one rank were given another --iters
        cfg.iterations = 36
    backend = "cuda" if "cuda" in sys.argv else "cpu"  # cuda: the simulator in CI
    if "tile" in sys.argv:  # tile-local L1 + S3IM: each renderer computes its tiles' share
        cfg.loss = "tile"
    if "cap" in sys.argv:  # --max-gaussians is the whole model's cap, whatever the rank count
        cfg.max_gaussians = 330
    if "prune" in sys.argv:  # ByteSplat's pruning at step 16 (one ranking on the root), fine-tuned within the 32
        cfg.densify_until, cfg.prune, cfg.smem_budget = 16, "hardware", 9268 + 36 * 5  # 5 Gaussians a tile
        cfg.prune_fine_tune, cfg.prune_round_fine_tune, cfg.prune_rounds = 4, 4, 2
    if "blitz" in sys.argv:  # passes at steps 12 and 28 (pruning, weights, masks); a LOD gate of 0.8 pixels
        cfg.importance_every, cfg.importance_prune, cfg.view_masks, cfg.lod_min_px = 12, 0.02, "on", 0.8
        cfg.view_mask_below = 0.5
    if "regs" in sys.argv:  # L1 regularisers on opacities and scales: means over the whole model, not a shard
        cfg.opacity_reg, cfg.scale_reg, cfg.regularise_from = 0.5, 0.5, 0  # (from step 0: this run is short)
    small = "small" in sys.argv  # one batch of two views, 100 Gaussians: what the simulator can afford
    if small:
        cfg.iterations, cfg.n_random_init = 2, 100
    batch = 1 if "b1" in sys.argv else 2 if small else 4  # b1: every view split across the ranks
    cfg.visible_adam = "visible" in sys.argv  # Adam on the rows that the batch's views saw
    pipeline, caps = GaussianExchangeTrainer, {}
    if "offload" in sys.argv:  # each rank's shard out of core, in blocks of 16 rows
        pipeline, caps = OffloadedGaussianExchangeTrainer, {"mode": "host", "block_rows": 16}

    def make_trainer():
        t = pipeline(ds, out, cfg, comm, batch_size=batch, grad_comm=grad_comm, backend=backend,
                     shard="parity" if "parity" in sys.argv else "contiguous", **caps)
        s = t.strategy
        s.refine_start, s.refine_every, s.reset_every, s.grad_threshold = 4, 8, 24, 1e-5
        s.reset_at_start = False  # a reset right after the first steps leaves rounding-level SH gradients to Adam
        if "no-densify" in sys.argv:
            s.refine_start = 10**9
        return t
    t = make_trainer()
    if "resume" in sys.argv:  # stopped at image 16 (its snapshot), then a new trainer goes on from it
        t.train(progress=False, until=16)
        t = make_trainer()
        t.load_snapshot(out / "snapshot.h5")
    report = train_then_prune(t, progress=False, log=lambda *a: None)
    params = t.gathered()
    if comm.Get_rank() == 0:
        np.savez(out / "final.npz", **params)
        print("gaussians", len(params["means"]), "stats", {k: v for k, v in t.stats.items() if k != "times"})
        if report:
            print("pruning", [(s["stage"], s["gaussians_before"], s["gaussians_after"]) for s in report["stages"]])
