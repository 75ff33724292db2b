"""Run by tests/test_pixel_exchange.py under mpiexec: K steps of the pixel-level pipeline on the
slab capture (boxes separated in depth), no densification; the final parameters, in the order one
rank holds them, to OUT/final.npz."""
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from comm import abort_on_error  # noqa: E402
from engine.pipelines.pixel_exchange import OffloadedPixelExchangeTrainer, PixelExchangeTrainer  # noqa: E402
from engine.recipe.trainer import MEANS_LR, TrainConfig  # noqa: E402
from scenes import cluster_capture, slab_capture  # noqa: E402

out = Path(sys.argv[1])
comm = MPI.COMM_WORLD
with abort_on_error(comm):
    opaque = "opaque" in sys.argv  # a hiding top slab, 3 epochs of 4 views: saturation reduction at work
    clusters = "clusters" in sys.argv  # two clusters, each view sees one: consolidation at work
    if opaque:
        data, start = slab_capture(n_slabs=2, per_slab=150, views=4, size=48, opaque_top=True, distance=0.5)
    else:
        data, start = cluster_capture() if clusters else slab_capture()
    densify = "densify" in sys.argv  # refinements at steps 4, 8 (grown, migrated, the tree rebuilt if unbalanced)
    cfg = TrainConfig(iterations=12 if opaque or clusters else 8, sh_degree=0, n_random_init=1, snapshot_every=0,
                      log_every=4, background=(1.0, 1.0, 1.0), densify_from=3 if densify else 10**6, densify_every=4,
                      grad_threshold=1e-5, visible_adam=clusters or "visible" in sys.argv)
    if "wander" in sys.argv:  # means learning rates 3000x: Gaussians cross into other boxes and migrate
        cfg.lr_means, cfg.lr_means_final = 3000 * MEANS_LR, 3000 * cfg.lr_means_final
    pipeline, caps = PixelExchangeTrainer, {}
    if "offload" in sys.argv:  # each rank's Gaussians out of core, in blocks of 8 rows
        pipeline, caps = OffloadedPixelExchangeTrainer, {"mode": "host", "block_rows": 8}
    import engine.pipelines.pixel_exchange
    if "wander" in sys.argv:  # the Gaussians that left their box migrate every image (the default: every 100)
        engine.pipelines.pixel_exchange.SETTLE_EVERY = 1
    if "settle2" in sys.argv:  # they migrate every 2 images (with a step in flight: the pipeline empties there)
        engine.pipelines.pixel_exchange.SETTLE_EVERY = 2
    if "ahead1" in sys.argv:  # a step rendered ahead
        caps["render_ahead"] = 1
    t = pipeline(data, out, cfg, comm, backend="cpu", saturation="saturation-off" not in sys.argv,
                 consolidation="consolidation-off" not in sys.argv, batch_size=2 if "batch2" in sys.argv else None,
                 **caps)
    t.start_from({"params": start})
    migrated, in_flight, at = [], [], []  # the Gaussians each migration moved (over all ranks); the steps in flight
    migrate = t._migrate                  # then; the image it came after

    def counted_migrate(model, state):
        in_flight.append(len(t._in_flight))
        at.append(t.step)
        moved = migrate(model, state)  # (the new shard, its state, the Gaussians moved)
        migrated.append(moved[2])
        return moved
    t._migrate = counted_migrate
    if "rebalance" in sys.argv:  # every Gaussian moved into rank 0's box: they migrate, then the tree is rebuilt
        before = t.gathered()
        means = t.model.group("means")
        means[:, 2] = np.remainder(means[:, 2] + 0.1, 1.5) - 0.1  # every slab dropped onto the lowest (box 0)
        shifted = t.gathered()
        for g in ("means", "opacities", "sh"):  # moments and statistics that name their row: they must travel with it
            t.model.group(g, "m")[...] = t.model.group(g) + 1
            t.model.group(g, "v")[...] = t.model.group(g) + 2
        t.strategy_state = {"grad": t.model.group("means")[:, 0] + 3, "count": np.arange(len(t.model), dtype=np.int32)}
        model, state, events = t._rebalance(t.model, t.strategy_state)
        t.store.hold(model, state)
        counts = comm.allgather(len(t.model))
        after = t.gathered()
        travelled = all(np.array_equal(t.model.group(g, w), t.model.group(g) + k)
                        for g in ("means", "opacities", "sh") for w, k in (("m", 1), ("v", 2)))
        travelled &= np.array_equal(t.strategy_state["grad"], t.model.group("means")[:, 0] + 3)
        travelled = all(comm.allgather(travelled and t.strategy_state["count"].dtype == np.int32))
        if comm.Get_rank() == 0:
            same = all(np.array_equal(np.sort(after[k], axis=0), np.sort(shifted[k], axis=0)) for k in after)
            print("rebalance", events, "counts", counts, "same rows", same, "moments travelled", travelled)
        sys.exit(0)
    order = np.argsort(t.partition.owner(start["means"]), kind="stable")  # the rows as the ranks hold them
    losses = []
    while t.step < cfg.iterations:
        loss, _ = t.train_step()
        losses.append(float(loss))
        if opaque:
            skipped = comm.allgather(t.stats["tiles_saturated"])
            if comm.Get_rank() == 0:
                print("step", t.step, "saturated", skipped, "loss", losses[-1])
    if comm.Get_rank() == 0 and clusters:
        print("steps", len(losses), "utilisation", {k: v for k, v in t.stats.items() if k.startswith("utilisation")})
    params = t.gathered()
    if comm.Get_rank() == 0 and densify:  # (grown: the rows as the ranks hold them)
        np.savez(out / "final.npz", losses=np.array(losses), **params)
        print("gaussians", len(params["means"]), "migrations", len(migrated), "in flight", sum(in_flight),
              "migrated", sum(migrated), "at", at)
    elif comm.Get_rank() == 0:
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        np.savez(out / "final.npz", losses=np.array(losses), **{k: a[back] for k, a in params.items()})
        print("gaussians", len(params["means"]), "boxes", [int(x) for x in np.bincount(t.partition.owner(start["means"]))])
