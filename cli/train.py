"""``train`` and ``demo``: the configuration from the options, a pipeline for the ranks at hand, the run."""
import os

from .args import TRANSPORTS, add_data_options, count, fraction, load_data, mpi_comm, positive, write_metrics

HOLD_OUT_EVERY = 8  # with --eval, every 8th image (sorted by name) is a test view, as Inria's llffhold


def config_from_args(a):
    from engine.trainer import TrainConfig
    cfg = TrainConfig()
    for k in ("iterations", "strategy", "cap_max", "max_gaussians", "absgrad", "random_background", "antialias",
              "visible_adam", "snapshot_every", "seed", "sh_degree", "densify_until", "loss", "n_random_init",
              "s3im_repeats", "lambda_s3im", "grad_threshold", "batch_lr_exponent", "tensorboard"):
        v = getattr(a, k, None)
        if v is not None:
            setattr(cfg, k, v)
    if getattr(a, "white_background", False):
        cfg.background = (1.0, 1.0, 1.0)
    return cfg


def train_model(dataset, a, cfg):
    from engine.trainer import SNAPSHOT
    from pathlib import Path
    comm = mpi_comm(batched=getattr(a, "batch_size", None) is not None)
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
    comm = mpi_comm(batched=a.batch_size is not None)
    if comm is None:
        return run_training(a)
    from comm import abort_on_error
    with abort_on_error(comm):  # one rank failing stops them all, with its message
        try:
            return run_training(a)
        except (ValueError, OSError) as e:  # bad input: the message, not a traceback
            if os.environ.get("NUMBASPLAT_DEBUG"):
                raise
            raise SystemExit(f"error: {e}")


def run_training(a):
    cfg = config_from_args(a)
    dataset = load_data(a, cfg.background, HOLD_OUT_EVERY if a.eval else None)
    t = train_model(dataset, a, cfg)
    from engine.outputs import split_dir
    if a.eval or dataset.test:
        summary = t.evaluate(save_dir=split_dir(a.out, "test", t.step) if a.eval else None)
        if summary is not None:  # rank 0 of a distributed run
            write_metrics(summary, a.out)


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
    t = train_model(dataset, a, cfg)
    write_metrics(t.evaluate(), a.out)


def add_commands(sub):
    t = sub.add_parser("train", help="train on a capture")
    add_data_options(t)
    t.add_argument("--iters", dest="iterations", type=count(1), default=None)
    t.add_argument("--eval", action="store_true", help="evaluate on the test split and save renders")
    t.add_argument("--resume", action="store_true", help="continue from OUT/snapshot.h5")
    t.add_argument("--init-ply", default=None, help="start from the Gaussians of a PLY file (3DGS layout)")
    t.add_argument("--init-points", dest="n_random_init", type=count(1), default=None,
                   help="random points to start from when the capture has no SfM points (default 100000)")
    t.add_argument("--strategy", choices=["default", "mcmc"], default=None)
    t.add_argument("--loss", choices=["global", "tile"], default=None,
                   help="global: L1 + windowed SSIM; tile: L1 + S3IM per tile, fused on GPUs (ByteSplat)")
    t.add_argument("--s3im-repeats", type=count(1), default=None,
                   help="with --loss tile: arrangements of each tile's pixels into S3IM windows, the first "
                        "spatial and the others random (default 10, as published)")
    t.add_argument("--lambda-s3im", type=fraction, default=None,
                   help="with --loss tile: the weight l of (1 - l) L1 + l (1 - S3IM) (default 0.5 where "
                        "the images have alpha, objects on a plain background such as Blender scenes; else 0.2)")
    t.add_argument("--cap-max", type=count(1), default=None, help="Gaussian cap of the mcmc strategy")
    t.add_argument("--max-gaussians", type=count(0), default=None, help="memory guard: stop growing at N Gaussians")
    t.add_argument("--densify-until", type=count(0), default=None)
    t.add_argument("--absgrad", action="store_true", default=None)
    t.add_argument("--grad-threshold", type=positive, default=None,
                   help="default strategy: densify Gaussians whose mean screen-space gradient reaches this "
                        "(default 2e-4)")
    t.add_argument("--random-background", action="store_true", default=None)
    t.add_argument("--antialias", action="store_true", default=None)
    t.add_argument("--visible-adam", action="store_true", default=None)
    t.add_argument("--snapshot-every", type=count(0), default=None)
    t.add_argument("--sh-degree", type=int, choices=range(4), default=None)
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--quiet", action="store_true")
    t.add_argument("--tensorboard", action="store_true", default=None, help="also log as TensorBoard events in OUT")
    t.add_argument("--batch-size", type=count(1), default=None,
                   help="views per step (default: the number of MPI ranks; given without mpirun, the batched "
                        "pipeline runs in one process)")
    t.add_argument("--batch-lr-exponent", type=fraction, default=None,
                   help="at batch B the learning rates are scaled by B ** this (default 0.5, as Grendel does; "
                        "Adam's betas are raised to the power B)")
    t.add_argument("--grad-comm", choices=["sparse", "dense"], default="sparse",
                   help="backward exchange under MPI: zero-eliding (ByteSplat) or dense")
    t.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="how GPU buffers cross ranks under MPI: auto picks a CUDA-aware MPI, else NCCL when "
                        "every rank has its own GPU, else copies through host memory")
    t.set_defaults(fn=cmd_train)
    d = sub.add_parser("demo", help="train the built-in scene (also: no arguments)")
    d.add_argument("--iters", dest="iterations", type=count(1), default=None)
    d.add_argument("--out", default=None)
    d.set_defaults(fn=cmd_demo)
