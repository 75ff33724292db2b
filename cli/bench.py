"""``bench``, ``scaling`` and ``info``: how fast, on how many ranks, on what."""
import os
import sys

from .args import TRANSPORTS, count, mpi_comm


def cmd_bench(a):
    from numbasplat import bench
    if not os.path.isfile(a.scene):
        raise SystemExit(f"error: benchmark scene not found: {a.scene} "
                         "(make one with shared/bench/scene_gen.py)")
    bench.run(a.scene, iters=a.iters, warmup=a.warmup, sh_degree=a.sh_degree, profile=a.profile, loss=a.loss,
              fuse=not a.no_fuse)


def cmd_scaling(a):
    if not os.path.isfile(a.scene):
        raise SystemExit(f"error: benchmark scene not found: {a.scene} (make one with shared/bench/scene_gen.py)")
    from engine import scaling
    comm = mpi_comm()
    if comm is None:
        return scaling.run(a.scene, views=a.views, iters=a.iters, warmup=a.warmup)
    from comm import abort_on_error
    from engine.distributed import select_device
    with abort_on_error(comm):
        select_device(comm)
        scaling.run(a.scene, views=a.views, iters=a.iters, warmup=a.warmup, comm=comm, grad_comm=a.grad_comm,
                    transport=a.transport)


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


def add_commands(sub):
    b = sub.add_parser("bench", help="time full training steps on a benchmark scene (.npz)")
    b.add_argument("--scene", required=True, help=".npz written by shared/bench/scene_gen.py")
    b.add_argument("--iters", type=count(1), default=20)
    b.add_argument("--warmup", type=count(0), default=3)
    b.add_argument("--sh-degree", type=int, choices=range(4), default=None)
    b.add_argument("--profile", action="store_true", help="also print the host-side Python profile")
    b.add_argument("--loss", choices=["global", "tile"], default="global")
    b.add_argument("--no-fuse", action="store_true", help="with --loss tile: the unfused kernels only")
    b.set_defaults(fn=cmd_bench)
    c = sub.add_parser("scaling", help="training images/s on a benchmark scene, one rank or many (mpiexec)")
    c.add_argument("--scene", required=True, help=".npz written by shared/bench/scene_gen.py")
    c.add_argument("--views", type=count(1), default=8, help="views of the scene to train on")
    c.add_argument("--iters", type=count(1), default=30, help="timed steps")
    c.add_argument("--warmup", type=count(0), default=5)
    c.add_argument("--grad-comm", choices=["sparse", "dense"], default="sparse")
    c.add_argument("--transport", choices=TRANSPORTS, default="auto")
    c.set_defaults(fn=cmd_scaling)
    i = sub.add_parser("info", help="print the backend, GPU, MPI and versions")
    i.set_defaults(fn=cmd_info)
