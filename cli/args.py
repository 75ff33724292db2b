"""What several commands share: argument types that name a bad value, the capture options, the
MPI communicator a command runs on, and the metrics file."""
import argparse
import json
import os
from pathlib import Path

TRANSPORTS = ["auto", "nccl", "cuda", "host"]  # comm.TRANSPORTS and "auto" (comm is imported late: mpi4py)


def count(low):
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


def number(text):
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def fraction(text):
    """argparse type: a number in [0, 1]."""
    value = number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def positive(text):
    """argparse type: a finite number above 0."""
    value = number(text)
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def add_data_options(p, need_out=True):
    """The options that name a capture and where a command writes."""
    p.add_argument("--data", required=True, help="capture folder (COLMAP, Blender or instant-ngp)")
    p.add_argument("--format", default="auto", choices=["auto", "colmap", "blender", "ngp"])
    p.add_argument("--images", default=None, help="image folder of a COLMAP capture, e.g. images_4")
    p.add_argument("--white-background", action="store_true", help="composite RGBA on white (Blender scenes)")
    p.add_argument("--out", required=need_out, help="output folder")


def load_data(a, background, test_every=None):
    """The capture ``--data`` names; a bad one ends the command with the loader's message."""
    from data import DataError, load_dataset
    try:
        return load_dataset(a.data, fmt=a.format, images=a.images, background=background, test_every=test_every)
    except DataError as e:
        raise SystemExit(f"error: {e}")


def write_metrics(summary, out_dir):
    """``OUT/metrics.json`` (atomically) and the line a user reads."""
    from data.atomic import atomic_path
    path = Path(out_dir) / "metrics.json"
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(summary, indent=1))
    if summary["psnr"] is not None:
        print(f"test PSNR {summary['psnr']:.2f} dB, SSIM {summary['ssim']:.4f} over {len(summary['views'])} views; "
              f"{summary['gaussians']} Gaussians; {summary['train_seconds']:.1f} s training; metrics in {path}")


def mpi_comm(batched=False):
    """COMM_WORLD when started by mpiexec/srun with several ranks; else COMM_SELF for
    ``batched`` training (--batch-size on one process: the batched pipeline, one rank), else None."""
    launched = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
    if not any(k in os.environ for k in launched) and not batched:
        return None
    from comm.libraries import MPIUnavailable, load_mpi
    try:
        MPI = load_mpi()
    except MPIUnavailable as e:
        raise SystemExit(f"error: {e}") from None
    if MPI.COMM_WORLD.Get_size() > 1:
        return MPI.COMM_WORLD
    return MPI.COMM_SELF if batched else None
