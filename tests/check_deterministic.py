"""``--deterministic`` on a GPU: the same training twice gives the same model, to the bit.

Trains one scene from the same seed several times, densifying (from step 200, every 100) and
resetting the opacities once (at 600) within the run, and hashes each run's 3DGS PLY (sha256):

* deterministic, step graphs on (training's default), twice: the hashes must be equal;
* deterministic, step graphs off: the same hash again (the graphs replay the same kernels);
* the default (float atomics in the raster backward), twice: expected to differ, shown only.

Prints each run's milliseconds per step (timed after a warm-up of ``--warmup`` steps, which also
compiles the kernels), its Gaussians and its last view's intersections (the deterministic backward
takes 384 bytes of scratch per intersection).  Exits 1 if the deterministic hashes differ.
Not collected by pytest (a GPU check, as tests/check_cuda_*.py).

    python tests/check_deterministic.py                                  # the built-in demo scene
    python tests/check_deterministic.py --data ../shared/data/lego --resolution 4
"""
import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.tools.outputs import write_model_outputs  # noqa: E402
from engine.pipelines.single_gpu import SingleGPUTrainer  # noqa: E402
from engine.recipe.trainer import TrainConfig  # noqa: E402
from numbasplat import backend as _backend  # noqa: E402


def load(args):
    if args.data is None:
        from engine.tools.demo import make_dataset
        return make_dataset(size=args.size, n_views=40), "the built-in demo scene"
    from data import load_dataset
    return (load_dataset(args.data, images=args.images, background=(1.0, 1.0, 1.0), resolution=args.resolution),
            f"{args.data} at --resolution {args.resolution}")


def train(dataset, out, args, deterministic, graphs):
    """-> (the PLY's sha256, ms per step after the warm-up, Gaussians, the most intersections of a view
    at its last binning)."""
    cfg = TrainConfig(iterations=args.steps, deterministic=deterministic, step_graphs="on" if graphs else "off",
                      densify_from=200, densify_every=100, opacity_reset_every=600, background=(1.0, 1.0, 1.0),
                      snapshot_every=0, log_every=100, seed=args.seed)
    t = SingleGPUTrainer(dataset, out, cfg, log=lambda *a, **k: None)
    t.init_model()
    t.train(progress=False, until=args.warmup)
    _backend.synchronize()
    start = time.perf_counter()
    t.train(progress=False)
    _backend.synchronize()
    ms = 1e3 * (time.perf_counter() - start) / (args.steps - args.warmup)
    ply = write_model_outputs(t)
    isect = max(total for total, _ in t._room.last.values()) if t._room is not None and t._room.last else None
    return hashlib.sha256(Path(ply).read_bytes()).hexdigest(), ms, len(t.model), isect


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="a capture (default: the built-in demo scene)")
    p.add_argument("--images", default=None)
    p.add_argument("--resolution", type=int, default=4)
    p.add_argument("--size", type=int, default=256, help="the demo scene's image size")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not _backend.on_gpu():
        print("no GPU: this check is for a real GPU (the simulator's is tests/check_deterministic_raster.py)")
        return 0
    dataset, what = load(args)
    print(f"{what}: {len(dataset.train)} training views of {dataset.train[0].camera.width}x"
          f"{dataset.train[0].camera.height}, {args.steps} steps (densifying from 200, an opacity reset at 600), "
          f"seed {args.seed}")
    runs = [("deterministic", True, True), ("deterministic again", True, True),
            ("deterministic, no step graphs", True, False), ("default", False, True), ("default again", False, True)]
    hashes = {}
    with tempfile.TemporaryDirectory(prefix="numbasplat-deterministic-") as tmp:
        for i, (name, deterministic, graphs) in enumerate(runs):
            digest, ms, n, isect = train(dataset, Path(tmp) / str(i), args, deterministic, graphs)
            hashes[name] = digest
            print(f"  {name:30s} sha256 {digest[:16]}  {ms:7.2f} ms/step  {n} Gaussians  "
                  f"up to {isect} intersections a view")
    det = [hashes[k] for k in hashes if k.startswith("deterministic")]
    same = len(set(det)) == 1
    print(f"deterministic runs: {'the same PLY (sha256 equal)' if same else 'DIFFERENT PLYs'}; "
          f"default runs: {'the same PLY' if hashes['default'] == hashes['default again'] else 'different PLYs'} "
          f"(expected to differ: float atomics); deterministic vs default: "
          f"{'the same' if hashes['default'] == det[0] else 'different'}")
    print("deterministic check passed" if same else "FAILED: the deterministic runs differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
