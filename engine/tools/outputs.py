"""What a run leaves for the tools of the 3DGS ecosystem, in the layout of Inria's reference code.

    OUT/point_cloud/iteration_N/point_cloud.ply   the model as a 3DGS PLY (viewers, other trainers)
    OUT/cameras.json                              the views, as Inria's camera_to_JSON writes them
    OUT/cfg_args                                  Inria's argument line: SIBR's viewer reads the capture's
                                                  path, the SH degree and the background from it
    OUT/<split>/ours_N/renders/00000.png          renders and their ground truth side by side, as
    OUT/<split>/ours_N/gt/00000.png               Inria's render.py writes them (its metrics.py pairs
                                                  them by name)
    OUT/events.out.tfevents.*                     with --tensorboard: the log's scalars (tensorboardX)

N is the iteration the model was trained to.  ``RUN_OUTPUTS`` lists these and the rest a run writes
in OUT (the snapshot, log.jsonl, cfg.json, metrics.json, plots): what ``train --overwrite`` removes.  This module also holds the optional pieces that
need an extra package: LPIPS (``metrics``), the TensorBoard writer (``tensorboard``) and mp4
video (``video``); a missing one is ``MissingExtra``, whose message names the extra.
"""
import argparse
import json
import math
import os
import re
from pathlib import Path

import numpy as np

from data.atomic import atomic_path

CAMERAS_JSON = "cameras.json"
CFG_ARGS = "cfg_args"
POINT_CLOUD = "point_cloud"
SNAPSHOT = "snapshot.h5"  # the trainer's snapshot in OUT (engine/recipe/trainer.py writes it)


# what runs write in OUT (globs; SNAPSHOT aside): a folder holding any of them holds a run
RUN_OUTPUTS = ("log.jsonl", "cfg.json", "metrics.json", CAMERAS_JSON, CFG_ARGS, POINT_CLOUD, "test/ours_*",
               "train/ours_*", "plots", "events.out.tfevents.*", "timeline*.json.gz")


def run_outputs(out):
    """The files and folders in ``out`` that a run wrote (``RUN_OUTPUTS`` and the snapshot), sorted."""
    return sorted({p for pattern in (SNAPSHOT, *RUN_OUTPUTS) for p in Path(out).glob(pattern)})


class MissingExtra(ImportError):
    """An optional package a requested feature needs is not installed; the message says which
    extra brings it."""


def install_hint(extra):
    return f"pip install -e '.[{extra}]'"


# ------------------------------------------------------------------ the Inria layout
def point_cloud_path(out, iteration):
    """OUT/point_cloud/iteration_N/point_cloud.ply."""
    return Path(out) / POINT_CLOUD / f"iteration_{iteration}" / "point_cloud.ply"


def latest_point_cloud(out):
    """The PLY of the highest iteration under OUT/point_cloud, or None."""
    found = [(int(m.group(1)), p / "point_cloud.ply") for p in (Path(out) / POINT_CLOUD).glob("iteration_*")
             if (m := re.fullmatch(r"iteration_(\d+)", p.name)) and (p / "point_cloud.ply").is_file()]
    return max(found)[1] if found else None


def iteration_of(ply_path):
    """N of a PLY at point_cloud/iteration_N/point_cloud.ply, else None."""
    m = re.fullmatch(r"iteration_(\d+)", Path(ply_path).parent.name)
    return int(m.group(1)) if m and Path(ply_path).parent.parent.name == POINT_CLOUD else None


def split_dir(out, split, iteration):
    """OUT/<split>/ours_N: where Inria's render.py puts a split's renders and ground truth."""
    return Path(out) / split / f"ours_{iteration}"


def camera_entry(index, name, camera):
    """One view as Inria's ``camera_to_JSON``: the camera's centre ("position"), its
    camera-to-world rotation (OpenCV axes, rows), its size and focal lengths in pixels.
    ``img_name`` is the image's name without folder or extension."""
    c2w = np.linalg.inv(camera.viewmat)
    return {"id": index, "img_name": Path(name).stem, "width": int(camera.width), "height": int(camera.height),
            "position": c2w[:3, 3].tolist(), "rotation": [row.tolist() for row in c2w[:3, :3]],
            "fy": float(camera.fy), "fx": float(camera.fx)}


def write_cameras_json(out, dataset):
    """OUT/cameras.json: the test views, then the training views, as Inria lists them."""
    views = list(dataset.test) + list(dataset.train)
    entries = [camera_entry(i, v.name, v.camera) for i, v in enumerate(views)]
    with atomic_path(Path(out) / CAMERAS_JSON) as tmp:
        Path(tmp).write_text(json.dumps(entries))


def read_cameras_json(path):
    """-> [(img_name, numbasplat.Camera)] of a cameras.json (ours or Inria's); its principal
    point is the image centre (the file has none).  ValueError naming the file if unusable."""
    from numbasplat.rendering import Camera
    try:
        entries = json.loads(Path(path).read_text())
        cameras = []
        for e in entries:
            rot, pos = np.asarray(e["rotation"], np.float64), np.asarray(e["position"], np.float64)
            viewmat = np.eye(4)
            viewmat[:3, :3] = rot.T
            viewmat[:3, 3] = -rot.T @ pos
            w, h = int(e["width"]), int(e["height"])
            cameras.append((str(e["img_name"]), Camera(viewmat, e["fx"], e["fy"], w / 2, h / 2, w, h)))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a cameras.json of 3DGS views ({type(e).__name__}: {e})") from None
    if not cameras:
        raise ValueError(f"{path}: holds no views")
    return cameras


def _as_path(source):
    """A capture's folder as an absolute path (Inria's too); a source that is no folder as it is."""
    return os.path.abspath(source) if os.path.isdir(str(source)) else str(source)


def inria_resolution(dataset):
    """The ``-r`` with which Inria's loader scales the capture's images to the size they trained at
    here: -1 for its default (no resolution, the 1600 px cap, as ours), else a factor 1, 2, 4 or 8
    where one gives the width of the first view, else that width (Inria reads other values as one)."""
    from data.images import DEFAULT_MAX_WIDTH
    d = dataset.downscale
    loaded = [v.provenance for v in dataset.views if v.provenance is not None]
    if d is None or not loaded or (d.resolution is None and d.max_width == DEFAULT_MAX_WIDTH):
        return -1
    file_width, width = loaded[0].file_size[0], loaded[0].scaled_size[0]
    return next((f for f in (1, 2, 4, 8) if round(file_width / f) == width), width)


def write_cfg_args(out, dataset, sh_degree, white_background):
    """OUT/cfg_args, the one line Inria's train.py writes (``str`` of its argparse Namespace).
    SIBR's viewer needs it: it reads ``source_path`` (the capture, to load its cameras and images;
    it falls back to OUT/cameras.json), ``sh_degree`` (how to read the PLY) and ``white_background``;
    Inria's render.py also ``images`` and ``resolution``: the folder and the size the views trained at."""
    args = argparse.Namespace(data_device="cuda", eval=bool(dataset.test), images=dataset.images or "images",
                              model_path=os.path.abspath(out), resolution=inria_resolution(dataset),
                              sh_degree=int(sh_degree),
                              source_path=_as_path(dataset.source),
                              white_background=bool(white_background))
    with atomic_path(Path(out) / CFG_ARGS) as tmp:
        Path(tmp).write_text(str(args))


def write_model_outputs(trainer):
    """The trained model in Inria's layout: OUT/point_cloud/iteration_N/point_cloud.ply,
    OUT/cameras.json and OUT/cfg_args, so that viewers (SIBR, SuperSplat, ...) open OUT.
    Collective (the whole model, gathered or read a slice of rows at a time); the root rank writes.  -> the PLY's path (root)."""
    from data.ply import save_ply
    g = trainer.saved_gaussians()
    if g is None:
        return None
    ply = point_cloud_path(trainer.out, trainer.step)
    save_ply(ply, g)
    write_cameras_json(trainer.out, trainer.data)
    degree = math.isqrt(g.sh.shape[1]) - 1
    write_cfg_args(trainer.out, trainer.data, degree, tuple(trainer.cfg.background) == (1.0, 1.0, 1.0))
    trainer.log(f"model: {ply} (3DGS PLY), with {CAMERAS_JSON} and {CFG_ARGS} beside it for viewers")
    return ply


# ------------------------------------------------------------------ images
def render_image(gaussians, camera, sh_degree=None, background=None, antialias=False, backend=None):
    """The model's image from ``camera``, clipped to [0, 1] (a device array on GPU backends)."""
    import numbasplat as ns
    from numbasplat import backend as _backend
    frame = ns.render(gaussians, camera, sh_degree=sh_degree, background=background, antialias=antialias,
                      backend=backend)
    return _backend.array_module(backend).clip(frame.image, 0.0, 1.0)


def save_png(path, img):
    """(H, W, 3) floats in [0, 1] as an 8-bit PNG, rounded as torchvision's save_image (Inria's)."""
    from PIL import Image
    from data.synthetic_city import to_8bit
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(to_8bit(np.asarray(img))).save(path)


# ------------------------------------------------------------------ LPIPS (the metrics extra)
_lpips_cache = {}


def lpips_metric(log=print):
    """LPIPS as Inria's metrics.py computes it (VGG features; images in [0, 1] passed as they are,
    not rescaled to [-1, 1], as its lpipsPyTorch does, so numbers compare with 3DGS papers'), as a
    function (render, ground truth) -> float; None when the ``lpips`` package is missing or its
    weights cannot be loaded (torchvision downloads the VGG backbone once), said in one ``log``
    line, once per process."""
    if "metric" not in _lpips_cache:
        metric, why = _load_lpips()
        _lpips_cache["metric"] = metric
        if why:
            log(f"LPIPS skipped: {why}")
    return _lpips_cache["metric"]


def silenced_stderr():
    """A context that discards what is written to stderr, through ``sys.stderr`` or below Python on
    file descriptor 2 (where a library that kept the original stream, or C code, writes)."""
    import contextlib
    import io
    import sys

    @contextlib.contextmanager
    def silenced():
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 2)
            with contextlib.redirect_stderr(io.StringIO()):
                yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
    return silenced()


def _first_line(exc):
    """An exception's message, its first line (or its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _load_lpips():
    """-> (metric or None, why not or None).

    An installed torch that does not load (a CUDA library it links missing: OSError, or an
    ImportError naming the library) is a reason to skip too, not a traceback in ``eval``."""
    try:
        import lpips
        import torch
    except ModuleNotFoundError as e:
        return None, f"{e.name or 'lpips'} is not installed ({install_hint('metrics')})"
    except Exception as e:  # noqa: BLE001 -- installed but broken: skip the metric, saying why
        return None, f"torch failed to load ({_first_line(e)})"
    import socket
    import warnings
    timeout = socket.getdefaulttimeout()
    try:
        socket.setdefaulttimeout(20)  # no network: fail, don't hang on the backbone's download
        # (torch.hub announces the download on stderr: the one line below says what became of it)
        with warnings.catch_warnings(), silenced_stderr():
            warnings.simplefilter("ignore")
            device = "cuda" if torch.cuda.is_available() else "cpu"
            net = lpips.LPIPS(net="vgg", verbose=False).to(device).eval()
    except Exception as e:  # noqa: BLE001 -- any failure to load optional weights means: skip the metric
        return None, f"its VGG weights could not be loaded ({_first_line(e)})"
    finally:
        socket.setdefaulttimeout(timeout)

    def metric(img, gt):
        from numbasplat import backend as _backend

        def tensor(a):
            a = np.ascontiguousarray(np.asarray(_backend.to_host(a), np.float32).transpose(2, 0, 1))
            return torch.from_numpy(a)[None].to(device)
        with torch.no_grad():
            return float(net(tensor(img), tensor(gt)).item())
    return metric, None


# ------------------------------------------------------------------ the training log's scalars
def log_scalars(rec, prev=None):
    """The curves of one record of log.jsonl: loss, training PSNR (the step's view; with
    ``--eval-every`` also the test views' and 5 training views'), the Gaussian
    count (of the whole model under MPI) and, given the previous record, seconds per step."""
    out = {"loss": rec.get("loss"), "psnr/train": rec.get("psnr"),
           "gaussians": rec.get("gaussians_total", rec.get("gaussians"))}
    if "test_psnr" in rec:
        out["psnr/test"] = rec["test_psnr"]
    if "train_psnr" in rec:
        out["psnr/train_views"] = rec["train_psnr"]
    if prev is not None and rec["step"] > prev["step"] and "time" in rec and "time" in prev:
        out["step_seconds"] = (rec["time"] - prev["time"]) / (rec["step"] - prev["step"])
    return {k: float(v) for k, v in out.items() if v is not None}


class TensorBoardLog:
    """The log's scalars as TensorBoard events in OUT (as Inria's train.py writes them), beside
    log.jsonl: ``tensorboard --logdir OUT``.  tensorboardX writes them (no torch needed)."""

    def __init__(self, out, purge_step=None):
        """``purge_step``: a resumed run's step; events logged past it before the crash are dropped,
        as log.jsonl's records are."""
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise MissingExtra(f"--tensorboard needs tensorboardX: {install_hint('tensorboard')}") from None
        self.writer = SummaryWriter(str(out), purge_step=purge_step or None)
        self.prev = None

    def write(self, rec):
        for tag, value in log_scalars(rec, self.prev).items():
            self.writer.add_scalar(tag, value, rec["step"])
        self.writer.flush()  # log steps are rare: nothing is lost if the run is killed
        self.prev = rec

    def image(self, tag, img, step):
        """An (H, W, 3) render in [0, 1] as an image event (a scored view, as Inria's train.py logs)."""
        self.writer.add_image(tag, np.clip(np.asarray(img, np.float32), 0.0, 1.0), step, dataformats="HWC")
        self.writer.flush()

    def close(self):
        self.writer.close()


# ------------------------------------------------------------------ videos and frames
class VideoFrames:
    """Frames into an mp4 (H.264, yuv420p: plays everywhere) through imageio's bundled ffmpeg."""

    def __init__(self, path, fps):
        try:
            import imageio.v2 as imageio
            import imageio_ffmpeg
            imageio_ffmpeg.get_ffmpeg_exe()
        except (ImportError, RuntimeError) as e:
            raise MissingExtra(f"writing {path} needs imageio and imageio-ffmpeg ({e}): {install_hint('video')}, "
                               "or write PNG frames with --frames-dir DIR") from None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(path)
        self.writer = imageio.get_writer(str(path), fps=fps, codec="libx264", quality=8, macro_block_size=1,
                                         pixelformat="yuv420p")

    def add(self, img):
        from data.synthetic_city import to_8bit
        self.writer.append_data(to_8bit(np.asarray(img)))

    def close(self):
        self.writer.close()


class PngFrames:
    """Frames as DIR/00000.png, 00001.png, ..."""

    def __init__(self, folder):
        self.path = Path(folder)
        self.count = 0

    def add(self, img):
        save_png(self.path / f"{self.count:05d}.png", img)
        self.count += 1

    def close(self):
        pass
