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
    bench.run(a.scene, iters=a.iters, warmup=a.warmup, sh_degree=a.sh_degree, profile=a.profile)


def cmd_info(a):
    import numba
    import numpy as np
    from numbasplat import _backend
    print(f"numbasplat backend: {_backend.BACKEND}{' (CUDA simulator)' if _backend.SIM else ''}")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, numba {numba.__version__}")
    try:
        from numba import cuda
        if cuda.is_available() and not _backend.SIM:
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


def main(argv=None):
    ap = argparse.ArgumentParser(prog="run.py", description="NumbaSplat: 3D Gaussian Splatting in Numba")
    sub = ap.add_subparsers(dest="cmd")
    b = sub.add_parser("bench", help="time full training steps on a benchmark scene (.npz)")
    b.add_argument("--scene", required=True, help=".npz written by shared/bench/scene_gen.py")
    b.add_argument("--iters", type=int, default=20)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--sh-degree", type=int, default=None)
    b.add_argument("--profile", action="store_true", help="also print the host-side Python profile")
    b.set_defaults(fn=cmd_bench)
    i = sub.add_parser("info", help="print the backend, GPU, MPI and versions")
    i.set_defaults(fn=cmd_info)
    a = ap.parse_args(argv)
    if a.cmd is None:
        ap.print_help()
        return 0
    a.fn(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
