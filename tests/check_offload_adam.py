"""Adam on the host (``--offload-adam host``) against Adam on the device, out of core on a GPU (issue 60).

Not collected by pytest (a GPU check, as tests/check_*.py); tests/test_offload.py checks on the CPU backend
that the two train the same model to the bit.  Two parts:

* the update: two out-of-core trainers (``--offload host``) of eight clusters of ``--cluster-gaussians`` each
  at the corners of a cube, each seen alone by two views (``octant_capture``), their pools of ``--slots``
  blocks of 4096 rows (fewer than the blocks: they move straight between the page-locked table and the pool,
  the moments' columns left behind where Adam runs on the host), one with each Adam, take ``--updates``
  updates of the same views' working sets with the same random gradients and visible masks; their
  parameters and both moments must agree within ``--tolerance`` (each group's largest difference over its largest value; the device's kernel
  divides and takes square roots fast, within 1e-6 of the CPU's).  Exits 1 past it.
* training: ``--steps`` steps of ``--data`` with each Adam (densifying from step 50, every 50; ``--gpu-memory``
  caps the device, 0: 80% of the free memory), the images/s of the steps after ``--warmup``, the Gaussians
  and the largest differences of the parameters and moments (the raster backward's float atomics make two
  GPU runs differ beyond rounding, so these are printed, not checked).

    python tests/check_offload_adam.py --data .data/lego --resolution 4
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli.args import byte_size  # noqa: E402
from engine.pipelines.single_gpu import OffloadTrainer  # noqa: E402
from engine.recipe.trainer import TrainConfig  # noqa: E402
from numbasplat import backend as _backend  # noqa: E402
from numbasplat.optim import GROUPS  # noqa: E402

ADAMS = ("device", "host")


def trainers(data, out, args, gpu_memory=0, slots=None, **settings):
    """An out-of-core trainer on the GPU for each Adam, one seed and config; ``slots``: its pool's blocks (else
    the cap's)."""
    made = {}
    for adam in ADAMS:
        cfg = TrainConfig(iterations=args.steps, sh_degree=3, sh_increase_every=100, visible_adam=True,
                          view_order="trajectory", snapshot_every=0, log_every=10**9, background=(1.0, 1.0, 1.0),
                          seed=args.seed, **settings)
        made[adam] = OffloadTrainer(data, Path(out) / adam, cfg, backend=args.backend, gpu_memory=gpu_memory,
                                    offload_adam=adam)
        if slots is not None:
            made[adam].store._slots = lambda n: slots
    return made


def differences(a, b):
    """{"params" | "m" | "v": (largest absolute difference, the largest over a group of its largest difference
    over its largest value)} of two models' states; None where their sizes differ."""
    out = {}
    for w in ("params", "m", "v"):
        absolute = relative = 0.0
        for g in GROUPS:
            x, y = np.asarray(a[w][g], np.float64), np.asarray(b[w][g], np.float64)
            if x.shape != y.shape:
                return None
            d = float(np.abs(x - y).max(initial=0))
            absolute = max(absolute, d)
            relative = max(relative, d / max(float(np.abs(x).max(initial=0)), 1e-30))
        out[w] = (absolute, relative)
    return out


def octant_capture(per_cluster, size, seed, backend):
    """Eight clusters of rotated, unevenly scaled Gaussians at the corners of a cube (each an octant's: the
    blocks' Morton order never mixes them), each seen alone by two views from inside the cube.  -> (a
    ``data.Dataset``, the start's arrays, SH degree 3)."""
    import numbasplat as ns
    from data import Dataset, View
    from engine.tools.camera_path import look_at
    rng = np.random.default_rng(seed)
    corners = 5.0 * np.array([(x, y, z) for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], np.float64)
    n = 8 * per_cluster
    means = np.repeat(corners, per_cluster, 0) + rng.uniform(-0.7, 0.7, (n, 3))
    truth = ns.Gaussians(means.astype(np.float32), np.log(rng.uniform(0.03, 0.09, (n, 3))).astype(np.float32),
                         rng.normal(size=(n, 4)).astype(np.float32), rng.uniform(-1.5, 0.5, n).astype(np.float32),
                         rng.normal(0, 0.3, (n, 16, 3)).astype(np.float32))
    on_backend = ns.Gaussians(**{k: _backend.asarray(a, backend) for k, a in truth.arrays().items()})
    train = []
    for k, c in enumerate(corners):
        for j in range(2):
            eye = c * (1 - 2.5 / np.linalg.norm(c)) + 0.2 * rng.normal(size=3)
            cam = ns.Camera(look_at(eye, c, up=(0, 0, 1)), 0.9 * size, 0.9 * size, size / 2, size / 2, size, size)
            image = ns.render(on_backend, cam, background=np.ones(3, np.float32), backend=backend).image
            image = np.clip(_backend.to_host(image), 0, 1)
            train.append(View(f"view{2 * k + j:02d}", np.ascontiguousarray(image, np.float32), cam))
    start = {k: np.array(a) for k, a in truth.arrays().items()}
    start["sh"] += rng.normal(0, 0.1, start["sh"].shape).astype(np.float32)
    return Dataset(train=train, test=[], scene_scale=8.0, source="octants", fmt="synthetic"), start


def update_check(args):
    """The two Adams on the same working sets, gradients and masks: -> the largest relative difference of
    the parameters and moments."""
    xp = _backend.array_module(args.backend)
    data, start = octant_capture(args.cluster_gaussians, 64, args.seed, args.backend)
    rng = np.random.default_rng(args.seed)
    made = trainers(data, tempfile.mkdtemp(), args, slots=args.slots, densify_until=0)
    for t in made.values():
        t.start_from({"params": start})
    for k in range(args.updates):
        i = (5 * k) % len(data.train)  # (the clusters in turn: the pool's blocks leave and come back)
        sizes = {}
        for adam, t in made.items():
            model, state = t.store.checkout([i])
            if getattr(model, "chunked", False):
                raise SystemExit(f"view {i} sees more than --slots {args.slots} blocks: give more")
            sizes[adam] = len(model)
            if adam == "device":  # (the same draws for both)
                grads = (rng.normal(size=model.params.size) * 1e-3).astype(np.float32)
                visible = rng.random(len(model)) < 0.8
            if len(model) != sizes["device"]:
                raise SystemExit(f"update {k}: view {i}'s working sets differ ({sizes}): the boxes culled apart")
            lr, cols = t.learning_rates()
            model.adam.set_step(cols)
            model.adam.update(xp.asarray(grads), xp.asarray(visible))
            t.store.checkin(model, state, lr)
    states = {adam: t.store.whole()[0].state() for adam, t in made.items()}
    d = differences(states["device"], states["host"])
    for w, (absolute, relative) in d.items():
        print(f"update check, {args.updates} updates of {len(made['host'].model):,} Gaussians: {w} largest "
              f"difference {absolute:.3g} (relative {relative:.3g})")
    for adam, t in made.items():
        c = t.store.cache
        print(f"  Adam on the {adam}: pool {c.slots} of {t.store.index.blocks} blocks, {c.pool.shape[1]} columns a "
              f"row, {c.misses} blocks moved in, {c.moved_bytes / 2**20:.1f} MiB moved")
    return max(relative for _, relative in d.values())


def training(data, args):
    """``--steps`` steps of each Adam: images/s after ``--warmup``, Gaussians, the largest differences."""
    made = trainers(data, tempfile.mkdtemp(), args, args.gpu_memory, densify_from=50, densify_every=50,
                    densify_until=max(args.steps - 50, 51))
    rates = {}
    for adam, t in made.items():
        t.train(progress=False, until=args.warmup)
        _backend.synchronize(args.backend)
        start = time.perf_counter()
        while t.step < args.steps:
            t.train_step()
        _backend.synchronize(args.backend)
        rates[adam] = (args.steps - args.warmup) / (time.perf_counter() - start)
        print(f"training, Adam on the {adam}: {rates[adam]:.1f} images/s over steps {args.warmup}..{args.steps}, "
              f"{len(t.model):,} Gaussians, pool {t.store.cache.slots} of {t.store.index.blocks} blocks, "
              f"{t.store.chunked_steps} steps in chunks", flush=True)
    d = differences(*(t.store.whole()[0].state() for t in made.values()))
    if d is None:
        print("training: the two runs densified to different sizes (GPU atomics)")
    else:
        print("training: largest differences (GPU atomics, not checked): " +
              ", ".join(f"{w} {a:.3g} (relative {r:.3g})" for w, (a, r) in d.items()))
    print(f"host Adam at {rates['host'] / rates['device']:.2f}x the device Adam's images/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / ".data" / "lego"))
    ap.add_argument("--resolution", type=int, default=4)
    ap.add_argument("--gpu-memory", type=byte_size, default=0)
    ap.add_argument("--cluster-gaussians", type=int, default=8192)
    ap.add_argument("--slots", type=int, default=6)
    ap.add_argument("--updates", type=int, default=40)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=1e-5, help="the update's largest relative difference")
    ap.add_argument("--backend", default="cuda", help="cuda; cpu runs the check's code where there is no GPU")
    args = ap.parse_args()
    if args.backend == "cuda" and not _backend.on_gpu("cuda"):
        raise SystemExit("a GPU check: no GPU here (tests/test_offload.py checks the CPU backend)")
    from data import load_dataset
    worst = update_check(args)
    training(load_dataset(args.data, background=(1.0, 1.0, 1.0), resolution=args.resolution), args)
    print(f"update check: largest relative difference {worst:.3g} (tolerance {args.tolerance:g})")
    return 1 if worst > args.tolerance else 0


if __name__ == "__main__":
    sys.exit(main())
