"""``run.py bench``: per-stage timings of full training steps on a standard scene, and the standard
scenes themselves (``run.py bench --make 1M --out b1m.npz``: ``make_scene``).

Stages: projection, binning+sort, forward raster, L1+SSIM loss, raster
backward, projection backward, Adam.  On the GPU each stage is bracketed by
CUDA events with no synchronisation in between, so the step time includes all
Python-side overhead exactly as training sees it.
"""
import cProfile
import io
import pstats
import statistics
import time

import numpy as np

from . import backend as _backend
from .gaussians import Gaussians
from .loss import l1_ssim_loss
from .math import gaussian_ops as go
from .tile_loss import s3im_permutations
from .optim import Adam, FlatParams, column_lrs
from .rendering import (Camera, bin_tiles, project, project_backward, rasterize, rasterize_backward,
                        rasterize_tile_loss)

STAGES = ("project", "bin_sort", "raster_fwd", "loss", "raster_bwd", "project_bwd", "adam")
LR = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}


SCENE_KEYS = (*Gaussians.FIELDS, "viewmat", "K", "W", "H")
# The standard benchmark scenes (BENCHMARKS.md): Gaussians -> the camera's width and height.  Any other
# count gets the 1M scene's camera unless told otherwise.
STANDARD_SIZES = {1_000_000: (1297, 840), 6_000_000: (1920, 1080)}
DEFAULT_SIZE = STANDARD_SIZES[1_000_000]
MAKE_HINT = "make one with run.py bench --make 1M --out FILE.npz"


def make_scene(n, width, height, seed=0, sh_degree=3):
    """A synthetic benchmark scene: ``n`` random Gaussians in front of one pinhole camera, as the dict
    of arrays that ``load_scene`` reads from an .npz (``run.py bench --make`` writes one).

    The camera sits at the origin looking down +z (OpenCV axes), focal length 0.9 x ``width``.  Depths
    run from 2 to 20, uniform in their square root so that the near field is denser; x and y spread
    uniformly over 1.2 times the field of view at each depth.  Scales are log-normal in screen pixels
    (median 2.5 px, log-sigma 0.8) turned into world units at each Gaussian's depth, so that each
    covers a few to tens of pixels wherever it is, as in trained scenes.  Rotations are uniform (a
    normalised 4D normal, wxyz), opacity logits N(0, 1.5), SH coefficients N(0, 0.3) with the DC term
    N(0.3, 0.6).  Drawn in this order from ``default_rng(seed)``: seed 0 gives the scenes that
    BENCHMARKS.md's numbers were measured on.
    """
    rng = np.random.default_rng(seed)
    focal = 0.9 * width
    depth = 2.0 + 18.0 * rng.random(n) ** 2
    x = (rng.random(n) - 0.5) * 1.2 * width / focal * depth
    y = (rng.random(n) - 0.5) * 1.2 * height / focal * depth
    footprint_px = np.exp(rng.normal(np.log(2.5), 0.8, (n, 3)))
    quats = rng.normal(size=(n, 4))
    quats /= np.linalg.norm(quats, axis=1, keepdims=True)
    opacities = rng.normal(0.0, 1.5, n)
    sh = rng.normal(0.0, 0.3, (n, (sh_degree + 1) ** 2, 3)).astype(np.float32)
    sh[:, 0, :] = rng.normal(0.3, 0.6, (n, 3))
    return {
        "means": np.stack([x, y, depth], 1).astype(np.float32),
        "quats": quats.astype(np.float32),
        "scales": np.log(footprint_px * depth[:, None] / focal).astype(np.float32),
        "opacities": opacities.astype(np.float32),
        "sh": sh,
        "viewmat": np.eye(4, dtype=np.float32),
        "K": np.array([[focal, 0, width / 2], [0, focal, height / 2], [0, 0, 1]], np.float32),
        "W": width,
        "H": height,
    }


def load_scene(path):
    """Gaussians and camera from a benchmark scene file (``make_scene``'s arrays: ``run.py bench --make``).

    A file that is not such a scene ends the command with one line naming it and what is wrong
    (not a NumPy archive, missing arrays, damaged, or arrays that do not fit together), never
    NumPy's advice about pickles: scenes hold plain arrays, so nothing is unpickled.
    """
    import zipfile
    import zlib

    def fail(what):
        return SystemExit(f"error: {path} is not a benchmark scene: {what} ({MAKE_HINT})")

    try:
        z = np.load(path, allow_pickle=False)
    except EOFError:
        raise fail("an empty file") from None
    except zipfile.BadZipFile:
        raise fail("a damaged or truncated .npz archive") from None
    except ValueError:  # neither a zip (.npz) nor an .npy header: NumPy would only try it as a pickle
        raise fail("not a NumPy .npz archive") from None
    except OSError as e:
        raise SystemExit(f"error: cannot read benchmark scene {path}: {e.strerror or e}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise fail("a single .npy array, not an .npz archive of arrays")
    with z:
        missing = [k for k in SCENE_KEYS if k not in z.files]
        if missing:
            raise fail(f"it lacks the arrays {', '.join(missing)} (it holds: {', '.join(z.files) or 'none'})")
        arrays = {}
        for k in SCENE_KEYS:
            try:
                arrays[k] = z[k]
            except ValueError:  # allow_pickle=False refused an object array
                raise fail(f"{k} holds Python objects, not numbers") from None
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
                raise fail(f"{k} is damaged ({e})") from None
    try:
        g = Gaussians(*(arrays[k] for k in Gaussians.FIELDS))
        g.validate(np, check=False)
        g.sh_degree()
        cam = Camera.from_K(arrays["viewmat"], arrays["K"], int(arrays["W"]), int(arrays["H"]))
    except (ValueError, TypeError, IndexError) as e:
        raise fail(f"arrays that do not fit together ({e})") from None
    return g, cam


class _Clock:
    """Marks on the device timeline (CUDA events) or the host clock (CPU)."""

    def __init__(self, backend):
        self.gpu = _backend.on_gpu(backend)
        if self.gpu:
            import cupy
            self.cupy = cupy

    def mark(self):
        if self.gpu:
            e = self.cupy.cuda.Event()
            e.record()
            return e
        return time.perf_counter()

    def elapsed_ms(self, a, b):
        if self.gpu:
            b.synchronize()
            return self.cupy.cuda.get_elapsed_time(a, b)
        return (b - a) * 1e3


def traffic_bytes(n_isect, n_pixels, fused):
    """(read, write) bytes of raster + loss + raster backward, from the kernels' layout.

    Per intersection, unfused: its Gaussian id and whole projected record are
    read once per pass; fused: the id and the fields it caches once
    (``numbasplat.cuda.fused.RECORD_BYTES``).  Per pixel, unfused: forward writes colour,
    transmittance, depth, last index (24 B); the tile loss reads colour and
    target (24 B) and writes dL/dC (12 B); backward reads transmittance, last
    index, dL/dC and the zero alpha/depth gradients (28 B).  Fused: the target
    (12 B) is read, nothing per pixel is written.  Gradient atomics (~48 B per
    Gaussian and warp) are the same in both and left out.
    """
    if fused:
        return n_isect * _backend.kernels("cuda").fused.RECORD_BYTES + n_pixels * 12, 0
    return 2 * n_isect * (4 * go.PROJ_FIELDS + 4) + n_pixels * (24 + 28), n_pixels * (24 + 12)


def peak_device_bytes():
    if not _backend.on_gpu():
        return 0
    import cupy
    return cupy.get_default_memory_pool().total_bytes()


def run(scene, iters=20, warmup=3, backend=None, sh_degree=None, seed=0, profile=False, loss="global",
        fuse=True, deterministic=False, out=print):
    if deterministic and loss == "tile":
        raise ValueError("--deterministic cannot be combined with --loss tile (its fused kernel adds gradients "
                         "with atomics)")
    backend = backend or _backend.BACKEND
    xp = _backend.array_module(backend)
    kernels = _backend.kernels(backend)
    g_host, cam = load_scene(scene) if isinstance(scene, str) else scene
    flat = FlatParams.from_gaussians(g_host, xp)
    g = flat.gaussians()
    grads = flat.like(xp.zeros(flat.size, np.float32))
    gg = grads.gaussians()
    opt = Adam(flat, backend=backend)
    lrs = column_lrs(LR, flat.sh_bases)
    rng = np.random.default_rng(seed)
    target = xp.asarray(rng.random((cam.height, cam.width, 3), np.float32))
    clock = _Clock(backend)
    times = {s: [] for s in STAGES + ("step", "forward")}
    launches = []
    prof = cProfile.Profile() if profile else None
    for it in range(warmup + iters):
        if prof and it == warmup:
            prof.enable()
        n0 = kernels.launch_count()
        m = [clock.mark()]
        p = project(g, cam, sh_degree, backend=backend, check=False)
        m.append(clock.mark())
        b = bin_tiles(p, backend, deterministic=deterministic)
        m.append(clock.mark())
        if loss == "tile":
            perms = xp.asarray(s3im_permutations(rng, 10))
            loss_value, rec, _, fstats = rasterize_tile_loss(p, b, target, perms, 0.2, fuse=fuse, backend=backend,
                                                              lazy=True)
            m += [clock.mark()] * 3  # raster, loss and backward are one stage (reported as raster_fwd)
        else:
            r = rasterize(p, b, backend=backend)
            m.append(clock.mark())
            loss_value, d_img = l1_ssim_loss(r.image, target, backend=backend, lazy=True)  # as in training
            m.append(clock.mark())
            rec = rasterize_backward(p, b, r, d_img, backend=backend, deterministic=deterministic)
            m.append(clock.mark())
        project_backward(g, p, rec, gg, accumulate=False, backend=backend)
        m.append(clock.mark())
        opt.step(grads.data, lrs)
        m.append(clock.mark())
        if it >= warmup:
            for s, a, c in zip(STAGES, m, m[1:]):
                times[s].append(clock.elapsed_ms(a, c))
            times["step"].append(clock.elapsed_ms(m[0], m[-1]))
            times["forward"].append(clock.elapsed_ms(m[0], m[3]))
            launches.append(None if n0 is None else kernels.launch_count() - n0)
    if prof:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        out(buf.getvalue())
    med = {k: statistics.median(v) for k, v in times.items()}
    n = len(g_host)
    out(f"scene: {n} Gaussians, {cam.width}x{cam.height}, backend {backend}, loss {loss} "
        f"{'(fused where it fits)' if loss == 'tile' and fuse else ''}"
        f"{', deterministic' if deterministic else ''}, {iters} iterations (median ms), "
        f"intersections {b.n_isect}, loss value {float(loss_value):.4f}")
    for s in STAGES:
        if loss == "tile" and s in ("loss", "raster_bwd"):
            continue
        label = "raster+loss+bwd" if loss == "tile" and s == "raster_fwd" else s
        out(f"  {label:15s} {med[s]:8.3f}")
    if loss == "tile":
        out(f"fused tiles {fstats['fused_tiles']:.3f}, Gaussians on fused tiles {fstats['fused_gaussians']:.3f} "
            f"(budget {fstats['max_fused']} per tile)")
        for name, fused_path in (("unfused", False), ("fused", True)):
            rd, wr = traffic_bytes(b.n_isect, cam.width * cam.height, fused_path)
            out(f"modelled device traffic, {name}: read {rd / 2**20:.1f} MiB, write {wr / 2**20:.1f} MiB")
    if loss != "tile":
        out(f"  {'forward':15s} {med['forward']:8.3f}   (project + bin_sort + raster_fwd)")
    if launches[0] is not None:
        out(f"numba kernel launches per step: {statistics.median(launches):.0f}")
    peak = peak_device_bytes()
    if peak:
        out(f"peak device memory: {peak / 2**20:.1f} MiB ({peak / n:.0f} B per Gaussian)")
    out(f"step_ms={med['step']:.3f}")
    return med
