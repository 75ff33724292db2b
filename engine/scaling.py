"""``run.py scaling``: training throughput on a benchmark scene, on one rank or many (mpiexec).

A benchmark scene (``shared/bench/scene_gen.py``) is Gaussians and one camera,
with no photos, so this makes a capture of it: ``views`` cameras shifted
sideways from the scene's one, with targets rendered from the scene itself
(every rank renders the same ones).  Training starts from the scene with its
colours perturbed, so the loss and gradients are real, and with densification
off, so every rank count does the same work.  One rank runs the single-GPU
pipeline, P ranks the Gaussian-exchange one (batch P views); both report images per
second over the timed steps; the Gaussian-exchange one then times each rank's phases on a few
more steps, synced at the phase boundaries (which costs throughput, so not on the timed ones).
Unlike the 7k captures at hand, the scenes can be as large as the GPUs hold
(1M, 6M Gaussians at 1297x840, 1920x1080): what the scaling table needs.
"""
import statistics
import tempfile
import time

import numpy as np

import numbasplat as ns
from numbasplat import backend as _backend
from numbasplat.bench import load_scene


def synthetic_capture(g, cam, views, backend=None):
    """A ``data.Dataset`` of ``views`` renders of ``g``: the camera moved sideways by up to 5% of
    the scene's median depth (so the views overlap like a capture's neighbours)."""
    from data import Dataset, View
    xp = _backend.array_module(backend)
    dev = ns.Gaussians(**{k: xp.asarray(a) for k, a in g.arrays().items()})
    depth = float(np.median((g.means @ cam.viewmat[:3, :3].T + cam.viewmat[:3, 3])[:, 2]))
    train = []
    for i in range(views):
        vm = cam.viewmat.copy()
        a = 2 * np.pi * i / max(views, 1)
        vm[:2, 3] += 0.05 * depth * np.array([np.cos(a), np.sin(a)]) * (i > 0)
        c = ns.Camera(vm, cam.fx, cam.fy, cam.cx, cam.cy, cam.width, cam.height)
        image = np.clip(_backend.to_host(ns.render(dev, c, backend=backend).image), 0, 1)
        train.append(View(f"view{i:03d}", np.ascontiguousarray(image, np.float32), c))
    return Dataset(train=train, test=[], scene_scale=depth, source="benchmark scene", fmt="synthetic")


def perturbed(g, seed=0):
    """The scene's arrays with its base colour perturbed: where training starts."""
    arrays = {k: np.array(a) for k, a in g.arrays().items()}
    arrays["sh"][:, 0] += np.random.default_rng(seed).normal(0, 0.3, arrays["sh"][:, 0].shape).astype(np.float32)
    return arrays


def run(scene, views=8, iters=30, warmup=5, comm=None, grad_comm="sparse", transport="auto", backend=None,
        out=print):
    from engine.trainer import TrainConfig
    g, cam = load_scene(scene) if isinstance(scene, str) else scene
    size = comm.Get_size() if comm is not None else 1
    rank = comm.Get_rank() if comm is not None else 0
    say = out if rank == 0 else (lambda *a, **k: None)
    data = synthetic_capture(g, cam, views, backend)
    cfg = TrainConfig(iterations=10**9, sh_degree=g.sh_degree(), sh_increase_every=1, densify_until=0,
                      snapshot_every=0)
    with tempfile.TemporaryDirectory() as tmp:
        if comm is None:
            from engine.single_gpu import SingleGPUTrainer
            t = SingleGPUTrainer(data, tmp, cfg, backend)
        else:
            from engine.gaussian_exchange import GaussianExchangeTrainer
            t = GaussianExchangeTrainer(data, tmp, cfg, comm, grad_comm=grad_comm, backend=backend,
                                        transport=transport, log=say)
            t.time_phases = False  # throughput: the host runs ahead of the device, as in training
        t.start_from({"params": perturbed(g)})
        steps, losses = [], []
        for it in range(warmup + iters):
            _sync(t, comm)
            t0 = time.perf_counter()
            loss, _ = t.train_step()
            _sync(t, comm)
            if it >= warmup:
                steps.append(time.perf_counter() - t0)
                losses.append(loss)  # read after the timing: reading a LazyLoss syncs
        phases = []
        t.time_phases = True  # then the phases, on steps synced at their boundaries
        for it in range(min(iters, 10) if comm is not None else 0):
            t.train_step()
            phases.append(dict(t.stats["times"]))
    images = size  # views per step: the batch is one view per rank
    med = statistics.median(steps)
    say(f"scaling: {len(g)} Gaussians, {cam.width}x{cam.height}, {size} rank(s), {images} view(s) per step, "
        f"{iters} timed steps; loss {float(losses[0]):.4f} -> {float(losses[-1]):.4f}")
    per_rank = comm.gather(phases, root=0) if comm is not None else [phases]
    if rank == 0 and per_rank[0] and per_rank[0][0]:
        for r, ph in enumerate(per_rank):
            say(f"  rank {r} (median ms): " + " ".join(
                f"{k} {1e3 * statistics.median(p[k] for p in ph):.2f}" for k in ph[0]))
    say(f"step {1e3 * med:.2f} ms, {images / med:.1f} images/s")
    return images / med


def _sync(t, comm):
    """Wait for the GPU (and the other ranks): step times are then whole steps."""
    _backend.synchronize(t.backend)
    if comm is not None:
        comm.Barrier()
