"""Run by tests/test_viewer.py under mpiexec: train --viewer's hook over ranks (``LiveView``): rank 0 holds
the viewer (no server: a virtual client that moves every step), the ranks gather a thinned model for it
every SYNC steps, and a pause on rank 0 holds every rank.  Prints one line per rank for the test."""
import sys
import threading
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comm import abort_on_error  # noqa: E402
from engine.tools import viewer as V  # noqa: E402
from engine.tools.demo import make_dataset  # noqa: E402
from engine.pipelines.gaussian_exchange import GaussianExchangeTrainer  # noqa: E402
from engine.recipe.trainer import TrainConfig  # noqa: E402

out = Path(sys.argv[1])
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
with abort_on_error(comm):
    ds = make_dataset(size=32, n_views=12, backend="cpu")
    cfg = TrainConfig(iterations=24, sh_degree=1, n_random_init=300, snapshot_every=0, log_every=4,
                      background=(1.0, 1.0, 1.0))
    t = GaussianExchangeTrainer(ds, out, cfg, comm, backend="cpu", log=lambda *a: None)
    t.init_model()
    viewer = view = None
    if rank == 0:
        viewer = V.Viewer(V._placeholder(t.model.sh_bases, "cpu"), V.dataset_cameras(ds), (1.0, 1.0, 1.0),
                          backend="cpu", training=True)
        wxyz, position, fov, _ = V.pose_of_camera(ds.test[0].camera)
        view = viewer.add_client("virtual", V.VirtualView(wxyz, position, fov, 32, 32))
    hook = V.LiveView(viewer, budget=1.0, sync_every=4, max_gathered=100)
    t.step_hooks.append(hook)
    if rank == 0:
        t.step_hooks.append(lambda trainer, rec: view.move() or 0.0)
        gathered = []
        set_model = viewer.set_model
        viewer.set_model = lambda g, note=None: (gathered.append((trainer_step(), len(g), note)), set_model(g, note))
        trainer_step = lambda: t.step  # noqa: E731

        def pause_then_resume():   # pause at once; resume when it has held the loop for two seconds
            viewer.pause()
            while not hook.holding:
                time.sleep(0.01)
            time.sleep(2.0)
            viewer.resume()
        threading.Thread(target=pause_then_resume, daemon=True).start()
    start = time.perf_counter()
    t.train(progress=False)
    wall = time.perf_counter() - start
    total = comm.allreduce(len(t.model))
    if rank == 0:
        steps = sorted({s for s, _, _ in gathered})
        sizes = {n for _, n, _ in gathered}
        ours = V.to_8bit(V.render_frame(viewer.gaussians, ds.test[0].camera, background=(1.0, 1.0, 1.0)))
        view.move()
        viewer.render_pending()
        same = int(np.abs(view.frames[-1].astype(int) - ours.astype(int)).max())
        print(f"rank 0: gathered at steps {steps} sizes {sorted(sizes)} total {total} note {gathered[-1][2]!r} "
              f"frames {hook.frames} same {same} wall {wall:.1f} trained {t.train_seconds:.1f}", flush=True)
    else:
        print(f"rank {rank}: step {t.step} wall {wall:.1f}", flush=True)
