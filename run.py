#!/usr/bin/env python3
"""NumbaSplat command line.  ``python run.py --help`` lists the commands."""
import argparse
import os
import sys

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")


def cmd_bench(a):
    from numbasplat import bench
    if not os.path.isfile(a.scene):
        raise SystemExit(f"error: benchmark scene not found: {a.scene} "
                         "(make one with shared/bench/scene_gen.py)")
    bench.run(a.scene, iters=a.iters, warmup=a.warmup, sh_degree=a.sh_degree, profile=a.profile, loss=a.loss,
              fuse=not a.no_fuse)


TRANSPORTS = ["auto", "nccl", "cuda", "host"]  # comm.TRANSPORTS and "auto" (comm is imported late: mpi4py)


def cmd_scaling(a):
    if not os.path.isfile(a.scene):
        raise SystemExit(f"error: benchmark scene not found: {a.scene} (make one with shared/bench/scene_gen.py)")
    from engine import scaling
    comm = _mpi_comm()
    if comm is None:
        return scaling.run(a.scene, views=a.views, iters=a.iters, warmup=a.warmup)
    from comm import abort_on_error
    from engine.distributed import select_device
    with abort_on_error(comm):
        select_device(comm)
        scaling.run(a.scene, views=a.views, iters=a.iters, warmup=a.warmup, comm=comm, grad_comm=a.grad_comm,
                    transport=a.transport)


def _config(a):
    from engine.trainer import TrainConfig
    cfg = TrainConfig()
    for k in ("iterations", "strategy", "cap_max", "max_gaussians", "absgrad", "random_background", "antialias",
              "visible_adam", "snapshot_every", "seed", "sh_degree", "densify_until", "loss", "n_random_init",
              "s3im_repeats", "lambda_s3im", "grad_threshold", "batch_lr_exponent"):
        v = getattr(a, k, None)
        if v is not None:
            setattr(cfg, k, v)
    if getattr(a, "white_background", False):
        cfg.background = (1.0, 1.0, 1.0)
    return cfg


def _load(a, background):
    from data import DataError, load_dataset
    try:
        return load_dataset(a.data, fmt=a.format, images=a.images, background=background)
    except DataError as e:
        raise SystemExit(f"error: {e}")


def _report(summary, out_dir):
    import json
    from pathlib import Path
    from data.atomic import atomic_path
    path = Path(out_dir) / "metrics.json"
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(summary, indent=1))
    if summary["psnr"] is not None:
        print(f"test PSNR {summary['psnr']:.2f} dB, SSIM {summary['ssim']:.4f} over {len(summary['views'])} views; "
              f"{summary['gaussians']} Gaussians; {summary['train_seconds']:.1f} s training; metrics in {path}")


def _mpi_comm(batched=False):
    """COMM_WORLD when started by mpiexec/srun with several ranks; else COMM_SELF for
    ``batched`` training (--batch-size on one process: the batched pipeline, one rank), else None."""
    launched = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
    if not any(k in os.environ for k in launched) and not batched:
        return None
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() > 1:
        return MPI.COMM_WORLD
    return MPI.COMM_SELF if batched else None


def _train(dataset, a, cfg):
    from engine.trainer import SNAPSHOT
    from pathlib import Path
    comm = _mpi_comm(batched=getattr(a, "batch_size", None) is not None)
    if comm is not None:
        from engine.distributed import select_device
        from engine.gaussian_exchange import GaussianExchangeTrainer
        select_device(comm)
        t = GaussianExchangeTrainer(dataset, a.out, cfg, comm, batch_size=getattr(a, "batch_size", None),
                                    grad_comm=getattr(a, "grad_comm", "sparse"),
                                    transport=getattr(a, "transport", "auto"))
    else:
        from engine.single_gpu import SingleGPUTrainer
        t = SingleGPUTrainer(dataset, a.out, cfg)
    if getattr(a, "init_ply", None):
        from data.ply import load_ply
        t.start_from({"params": load_ply(a.init_ply)})
        t.cfg.sh_degree = min(t.cfg.sh_degree, t.model.gaussians.sh_degree())
    if getattr(a, "resume", False):
        snap = Path(a.out) / SNAPSHOT
        if not snap.is_file():
            raise SystemExit(f"error: --resume but no snapshot at {snap}")
        t.load_snapshot(snap)
        t.cfg.iterations = cfg.iterations
        if comm is None or comm.Get_rank() == 0:
            print(f"resumed from {snap} at step {t.step}")
    try:
        t.train(progress=not getattr(a, "quiet", False) and (comm is None or comm.Get_rank() == 0))
    except KeyboardInterrupt:
        raise SystemExit(130)
    except FloatingPointError as e:
        raise SystemExit(f"error: {e}")
    except MemoryError as e:
        raise SystemExit(f"error: out of memory ({e}); try --max-gaussians N, a smaller --images folder "
                         "(e.g. images_4), or --densify-until with an earlier step")
    return t


def cmd_train(a):
    comm = _mpi_comm(batched=a.batch_size is not None)
    if comm is None:
        return _cmd_train(a)
    from comm import abort_on_error
    with abort_on_error(comm):  # one rank failing stops them all, with its message
        try:
            return _cmd_train(a)
        except (ValueError, OSError) as e:  # bad input: the message, not a traceback
            if os.environ.get("NUMBASPLAT_DEBUG"):
                raise
            raise SystemExit(f"error: {e}")


def _cmd_train(a):
    cfg = _config(a)
    dataset = _load(a, cfg.background)
    t = _train(dataset, a, cfg)
    if a.eval or dataset.test:
        summary = t.evaluate(save_dir=(a.out + "/test_renders") if a.eval else None)
        if summary is not None:  # rank 0 of a distributed run
            _report(summary, a.out)


def cmd_demo(a):
    """The default command: train the built-in procedural scene and print its test PSNR."""
    import tempfile
    from engine.demo import make_dataset
    from engine.trainer import TrainConfig
    print("NumbaSplat demo: rendering the built-in scene (the first run compiles kernels: about a minute)")
    dataset = make_dataset()
    cfg = TrainConfig(iterations=a.iterations or 2000, sh_degree=1, sh_increase_every=500, n_random_init=3000,
                      background=(1.0, 1.0, 1.0), snapshot_every=0, log_every=50)
    a.out = a.out or tempfile.mkdtemp(prefix="numbasplat-demo-")
    t = _train(dataset, a, cfg)
    _report(t.evaluate(), a.out)


def cmd_synth(a):
    """Write the procedural city dataset (data/synthetic_city.py) and say what it holds."""
    from data.synthetic_city import generate
    s = generate(a.out, preset=a.preset, gaussians=a.gaussians, views=a.views, resolution=a.res, seed=a.seed,
                 force=a.force, progress=not a.quiet)
    print(f"wrote {a.out}: {s['gaussians']} ground-truth Gaussians, {s['views']} views at {s['width']}x{s['height']} "
          f"({s['street_views']} street, {s['aerial_views']} aerial, {s['test_views']} held out), "
          f"{s['initial_points']} initial points; {sum(s['seconds'].values()):.1f} s")


def _trained(a):
    """A trainer holding the model of a training output folder (its snapshot) or of a PLY file."""
    from pathlib import Path
    from engine.single_gpu import SingleGPUTrainer
    from engine.trainer import SNAPSHOT
    cfg = _config(a)
    dataset = _load(a, cfg.background)
    t = SingleGPUTrainer(dataset, a.out, cfg)
    src = Path(a.model)
    if src.suffix == ".ply":
        from data.ply import load_ply
        try:
            t.start_from({"params": load_ply(src)})
        except ValueError as e:
            raise SystemExit(f"error: {e}")
        t.cfg.sh_degree = t.model.gaussians.sh_degree()
    else:
        snap = src / SNAPSHOT if src.is_dir() else src
        try:
            t.load_snapshot(snap, check_data=False)
        except (ValueError, OSError) as e:
            raise SystemExit(f"error: {e}")
    return t


def cmd_eval(a):
    t = _trained(a)
    _report(t.evaluate(save_dir=a.out + "/test_renders"), a.out)


def cmd_render(a):
    t = _trained(a)
    views = t.data.test if a.split == "test" else t.data.train
    t.evaluate(views, save_dir=a.out + f"/{a.split}_renders")
    print(f"wrote {len(views)} renders to {a.out}/{a.split}_renders")


def cmd_export(a):
    from pathlib import Path
    from data.ply import save_ply
    from engine.trainer import SNAPSHOT
    from engine.snapshot import read_snapshot
    from numbasplat.optim import GROUPS
    src = Path(a.model)
    snap = src / SNAPSHOT if src.is_dir() else src
    try:
        arrays, _ = read_snapshot(str(snap))
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    from types import SimpleNamespace
    save_ply(a.ply, SimpleNamespace(**{g: arrays[f"params/{g}"] for g in GROUPS}))
    print(f"wrote {a.ply}")


def cmd_info(a):
    import numba
    import numpy as np
    from numbasplat import backend as _backend
    print(f"numbasplat backend: {_backend.BACKEND}{' (CUDA simulator)' if _backend.SIM else ''}")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, numba {numba.__version__}")
    try:
        from numba import cuda
        if cuda.is_available() and _backend.on_gpu("cuda"):
            d = cuda.get_current_device()
            print(f"GPU: {d.name.decode() if isinstance(d.name, bytes) else d.name}, "
                  f"compute capability {d.compute_capability}")
        else:
            print("GPU: none")
    except Exception as e:  # no numba-cuda or driver
        print(f"GPU: none ({e.__class__.__name__})")
    try:
        from mpi4py import MPI
        print(f"MPI: {MPI.Get_library_version().splitlines()[0]}")
    except Exception as e:
        print(f"MPI: unavailable ({e})")


def _count(low):
    """argparse type: an integer of at least ``low`` (so a bad value is named, not silently used)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def _number(text):
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _fraction(text):
    """argparse type: a number in [0, 1]."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def _positive(text):
    """argparse type: a finite number above 0."""
    value = _number(text)
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def main(argv=None):
    ap = argparse.ArgumentParser(prog="run.py", description="NumbaSplat: 3D Gaussian Splatting in Numba")
    sub = ap.add_subparsers(dest="cmd")
    b = sub.add_parser("bench", help="time full training steps on a benchmark scene (.npz)")
    b.add_argument("--scene", required=True, help=".npz written by shared/bench/scene_gen.py")
    b.add_argument("--iters", type=_count(1), default=20)
    b.add_argument("--warmup", type=_count(0), default=3)
    b.add_argument("--sh-degree", type=int, choices=range(4), default=None)
    b.add_argument("--profile", action="store_true", help="also print the host-side Python profile")
    b.add_argument("--loss", choices=["global", "tile"], default="global")
    b.add_argument("--no-fuse", action="store_true", help="with --loss tile: the unfused kernels only")
    b.set_defaults(fn=cmd_bench)
    c = sub.add_parser("scaling", help="training images/s on a benchmark scene, one rank or many (mpiexec)")
    c.add_argument("--scene", required=True, help=".npz written by shared/bench/scene_gen.py")
    c.add_argument("--views", type=_count(1), default=8, help="views of the scene to train on")
    c.add_argument("--iters", type=_count(1), default=30, help="timed steps")
    c.add_argument("--warmup", type=_count(0), default=5)
    c.add_argument("--grad-comm", choices=["sparse", "dense"], default="sparse")
    c.add_argument("--transport", choices=TRANSPORTS, default="auto")
    c.set_defaults(fn=cmd_scaling)
    i = sub.add_parser("info", help="print the backend, GPU, MPI and versions")
    i.set_defaults(fn=cmd_info)

    def data_args(p, need_out=True):
        p.add_argument("--data", required=True, help="capture folder (COLMAP, Blender or instant-ngp)")
        p.add_argument("--format", default="auto", choices=["auto", "colmap", "blender", "ngp"])
        p.add_argument("--images", default=None, help="image folder of a COLMAP capture, e.g. images_4")
        p.add_argument("--white-background", action="store_true", help="composite RGBA on white (Blender scenes)")
        p.add_argument("--out", required=need_out, help="output folder")

    t = sub.add_parser("train", help="train on a capture")
    data_args(t)
    t.add_argument("--iters", dest="iterations", type=_count(1), default=None)
    t.add_argument("--eval", action="store_true", help="evaluate on the test split and save renders")
    t.add_argument("--resume", action="store_true", help="continue from OUT/snapshot.h5")
    t.add_argument("--init-ply", default=None, help="start from the Gaussians of a PLY file (3DGS layout)")
    t.add_argument("--init-points", dest="n_random_init", type=_count(1), default=None,
                   help="random points to start from when the capture has no SfM points (default 100000)")
    t.add_argument("--strategy", choices=["default", "mcmc"], default=None)
    t.add_argument("--loss", choices=["global", "tile"], default=None,
                   help="global: L1 + windowed SSIM; tile: L1 + S3IM per tile, fused on GPUs (ByteSplat)")
    t.add_argument("--s3im-repeats", type=_count(1), default=None,
                   help="with --loss tile: arrangements of each tile's pixels into S3IM windows, the first "
                        "spatial and the others random (default 10, as published)")
    t.add_argument("--lambda-s3im", type=_fraction, default=None,
                   help="with --loss tile: the weight l of (1 - l) L1 + l (1 - S3IM) (default 0.5 where "
                        "the images have alpha, objects on a plain background such as Blender scenes; else 0.2)")
    t.add_argument("--cap-max", type=_count(1), default=None, help="Gaussian cap of the mcmc strategy")
    t.add_argument("--max-gaussians", type=_count(0), default=None, help="memory guard: stop growing at N Gaussians")
    t.add_argument("--densify-until", type=_count(0), default=None)
    t.add_argument("--absgrad", action="store_true", default=None)
    t.add_argument("--grad-threshold", type=_positive, default=None,
                   help="default strategy: densify Gaussians whose mean screen-space gradient reaches this "
                        "(default 2e-4)")
    t.add_argument("--random-background", action="store_true", default=None)
    t.add_argument("--antialias", action="store_true", default=None)
    t.add_argument("--visible-adam", action="store_true", default=None)
    t.add_argument("--snapshot-every", type=_count(0), default=None)
    t.add_argument("--sh-degree", type=int, choices=range(4), default=None)
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--quiet", action="store_true")
    t.add_argument("--batch-size", type=_count(1), default=None,
                   help="views per step (default: the number of MPI ranks; given without mpirun, the batched "
                        "pipeline runs in one process)")
    t.add_argument("--batch-lr-exponent", type=_fraction, default=None,
                   help="at batch B the learning rates are scaled by B ** this (default 0.5, as Grendel does; "
                        "Adam's betas are raised to the power B)")
    t.add_argument("--grad-comm", choices=["sparse", "dense"], default="sparse",
                   help="backward exchange under MPI: zero-eliding (ByteSplat) or dense")
    t.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="how GPU buffers cross ranks under MPI: auto picks a CUDA-aware MPI, else NCCL when "
                        "every rank has its own GPU, else copies through host memory")
    t.set_defaults(fn=cmd_train)
    for name, fn, hlp in (("eval", cmd_eval, "evaluate a trained scene on the test split"),
                          ("render", cmd_render, "render views of a trained scene")):
        e = sub.add_parser(name, help=hlp)
        data_args(e)
        e.add_argument("--model", required=True, help="training output folder, snapshot .h5 or .ply")
        if name == "render":
            e.add_argument("--split", choices=["test", "train"], default="test")
        e.set_defaults(fn=fn)
    x = sub.add_parser("export", help="write the trained scene as a PLY file")
    x.add_argument("--model", required=True, help="training output folder or snapshot .h5")
    x.add_argument("--ply", required=True, help="output .ply path")
    x.set_defaults(fn=cmd_export)
    y = sub.add_parser("synth", help="write a procedural city (COLMAP text, ground-truth PLY) to train on")
    y.add_argument("--out", required=True, help="output folder (new or empty)")
    y.add_argument("--preset", default="small",
                   help="small or large: the city size, Gaussians, views and image size of PRESETS in "
                        "data/synthetic_city.py")
    y.add_argument("--gaussians", type=_count(1), default=None, help="ground-truth Gaussians (default: the preset's)")
    y.add_argument("--views", type=_count(1), default=None, help="views, every 8th held out (default: the preset's)")
    y.add_argument("--res", default=None, help="image size WxH (default: the preset's)")
    y.add_argument("--seed", type=_count(0), default=0)
    y.add_argument("--force", action="store_true", help="overwrite an earlier generation in --out")
    y.add_argument("--quiet", action="store_true", help="no progress bar")
    y.set_defaults(fn=cmd_synth)
    d = sub.add_parser("demo", help="train the built-in scene (also: no arguments)")
    d.add_argument("--iters", dest="iterations", type=_count(1), default=None)
    d.add_argument("--out", default=None)
    d.set_defaults(fn=cmd_demo)
    a = ap.parse_args(argv)
    if a.cmd is None:
        a = ap.parse_args(["demo"])
    try:
        a.fn(a)
    except (ValueError, OSError) as e:  # bad input: a message naming it, not a traceback
        if os.environ.get("NUMBASPLAT_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
