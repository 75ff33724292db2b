"""``run.py bench``: per-stage timings of full training steps on a standard scene (the scenes
themselves, and their files, are ``data.bench_scene``'s: ``run.py bench --make 1M --out b1m.npz``).

Stages: projection, binning+sort, forward raster, L1+SSIM loss, raster
backward, projection backward, Adam.  On the GPU each stage is bracketed by
CUDA events with no synchronisation in between, so the step time includes all
Python-side overhead exactly as training sees it.  Adam runs as training runs
it: fused into the projection backward (``rendering.project_backward_adam``)
where the step is not split; the step is then timed again with the other Adam,
for comparison.
"""
import cProfile
import io
import pstats
import statistics
import time

import numpy as np

from . import backend as _backend
from . import device
from .math import gaussian_ops as go
from .tile_loss import s3im_permutations
from .optim import Adam, FlatParams, column_lrs
from .placement import Placement
from .rendering import project_backward_adam, rasterize_tile_loss, room_slots

STAGES = ("project", "bin_sort", "raster_fwd", "loss", "raster_bwd", "project_bwd", "adam")
LR = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}

_ADAM_LABELS = {True: "project_bwd+adam", False: "project_bwd"}  # (the projection backward's stage, Adam fused or not)


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
        fuse=True, deterministic=False, out=print, virtual_devices=1, into_room=False, graphs=False,
        part_streams=None, fuse_adam=None, compare_adam=True):
    """Time ``iters`` training steps (after ``warmup``) on ``scene``, the (Gaussians, Camera) of a benchmark
    scene (``data.bench_scene.load_scene``), printing each stage's median through ``out``; -> the medians (ms).
    ``virtual_devices``: every stage split that many ways, as the aggregate device splits it
    (``numbasplat.placement``; 1: the plain calls), the parts each on a stream of their own or not
    (``part_streams``: ``Placement``'s; None: on a GPU).  ``into_room``: the steps after the first bin into
    room for the first one's totals (``bin_tiles(room=)``; a split's as ``Placement.slots`` gives them), without the exact
    binning's sync, as training does.  ``graphs`` (with ``into_room``): the timed steps replay a CUDA
    graph of one step, as training's step graphs do (``engine.pipelines.step_graphs``): the host's
    launches out of the time, only the whole step timed (on the CPU backend and in the simulator the
    step itself runs in the graph's place).  ``fuse_adam``: Adam's update inside the projection backward's
    kernels (``rendering.project_backward_adam``; the stage ``project_bwd`` then holds Adam's work and
    ``adam`` none), or the projection backward then Adam; None: as training runs it by default (``--fuse-adam off``:
    the projection backward then Adam).  ``compare_adam`` (a step not split): the steps timed again with
    the other Adam (from the model as the first timing left it), both steps' medians printed."""
    if graphs and not into_room:
        raise ValueError("bench graphs: a captured step bins into a fixed room (into_room)")
    if graphs and loss == "tile":
        raise ValueError("--graphs times --loss global (the tile loss's fused path reads its counts on the host)")
    if graphs:
        warmup = max(warmup, 2)  # (the first step compiles and makes the room, the second is captured after it)
    if deterministic and loss == "tile":
        raise ValueError("--deterministic cannot be combined with --loss tile (its fused kernel adds gradients "
                         "with atomics)")
    if virtual_devices > 1 and loss == "tile":
        raise ValueError("--virtual-devices times --loss global (the tile loss's fused kernel takes every tile)")
    placement = Placement(virtual_devices, backend, part_streams=part_streams)
    if fuse_adam and placement.split:
        raise ValueError("bench fuse_adam: a split step updates with Adam by rows, after the projection backward")
    fuse_adam = bool(fuse_adam)  # (None: training's default, off)
    backend = backend or _backend.BACKEND
    xp = _backend.array_module(backend)
    kernels = _backend.kernels(backend)
    g_host, cam = scene
    flat = FlatParams.from_gaussians(g_host, xp)
    g = flat.gaussians()
    grads = flat.like(xp.zeros(flat.size, np.float32))
    gg = grads.gaussians()
    opt = Adam(flat, backend=backend)
    lrs = column_lrs(LR, flat.sh_bases)
    rng = np.random.default_rng(seed)
    target = xp.asarray(rng.random((cam.height, cam.width, 3), np.float32))
    clock = _Clock(backend)
    room = None  # (``into_room``: the first binning's slots, which the scene keeps step after step)
    prof = cProfile.Profile() if profile else None

    def step(mark, fused):
        """One training step, ``mark()`` between its stages, Adam ``fused`` into the projection backward or
        after it.  -> (its loss, its binning)."""
        nonlocal room
        mark()
        p = placement.project(g, cam, sh_degree, check=False)
        mark()
        b = placement.bin_tiles(p, room=room, deterministic=deterministic)
        if into_room and room is None:  # (the room's margin, as training keeps, holds the totals as Adam moves)
            room = room_slots(placement.slots(b))
        mark()
        if loss == "tile":
            perms = xp.asarray(s3im_permutations(rng, 10))
            loss_value, rec, _, stats = rasterize_tile_loss(p, b, target, perms, 0.2, fuse=fuse, backend=backend,
                                                             lazy=True)
            fstats.update(stats)
            for _ in range(3):  # raster, loss and backward are one stage (reported as raster_fwd)
                mark()
        else:
            r = placement.rasterize(p, b)
            mark()
            loss_value, d_img = placement.image_loss(r.image, target, 0.2)  # as in training
            mark()
            rec = placement.rasterize_backward(p, b, r, d_img, deterministic=deterministic)
            mark()
        if fused:
            project_backward_adam(p, rec, opt, backend=backend)
            mark()
        else:
            placement.project_backward(g, p, rec, gg, accumulate=False)
            mark()
            placement.adam_update(opt, grads.data)
        mark()
        return loss_value, b

    def timed_steps(fused, profiled=False):
        """``warmup`` steps, then ``iters`` timed.  -> (each stage's times, the launches of each step, the
        last step's loss and binning)."""
        times = {s: [] for s in STAGES + ("step", "forward")}
        launches = []
        graph = scratch = None
        for it in range(warmup + iters):
            if profiled and it == warmup:
                prof.enable()
            n0 = kernels.launch_count()
            opt.set_step(lrs)
            m = []
            if graph is None:
                loss_value, b = step(lambda: m.append(clock.mark()), fused)
            else:  # the step graph, timed as a whole
                m.append(clock.mark())
                if scratch is not None:
                    graph.launch(scratch.stream)  # (its loss lands in the captured step's output array)
                else:
                    loss_value, b = graph()
                m.append(clock.mark())
            if graphs and graph is None and it >= 1:  # (past the step that compiled and made the room)
                placement.prepare_adam(opt)
                if _backend.on_gpu(backend):
                    scratch = device.GraphScratch()
                    graph, (loss_value, b) = device.capture_graph(lambda: step(lambda: None, fused), scratch)
                else:
                    graph = lambda: step(lambda: None, fused)  # noqa: E731 (the step itself in the graph's place)
            if it >= warmup:
                if len(m) > 2:
                    for s, a, c in zip(STAGES, m, m[1:]):
                        times[s].append(clock.elapsed_ms(a, c))
                    times["forward"].append(clock.elapsed_ms(m[0], m[3]))
                    launches.append(None if n0 is None else kernels.launch_count() - n0)  # (a replay launches none)
                times["step"].append(clock.elapsed_ms(m[0], m[-1]))
        if profiled:
            prof.disable()
        return times, launches, loss_value, b

    fstats = {}
    times, launches, loss_value, b = timed_steps(fuse_adam, prof is not None)
    other = None  # (``compare_adam``: the other Adam's medians)
    if compare_adam and not placement.split:
        other = {k: statistics.median(v) for k, v in timed_steps(not fuse_adam)[0].items() if v}
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        out(buf.getvalue())
    med = {k: statistics.median(v) for k, v in times.items() if v}  # (a graph's step: its stages not apart)
    n = len(g_host)
    out(f"scene: {n} Gaussians, {cam.width}x{cam.height}, backend {backend}, loss {loss} "
        f"{'(fused where it fits)' if loss == 'tile' and fuse else ''}"
        f"{', deterministic' if deterministic else ''}"
        f"{f', {virtual_devices} virtual devices' if virtual_devices > 1 else ''}"
        f"{', a stream each' if placement.streams is not None else ''}, {iters} iterations (median ms), "
        f"intersections {b.n_isect}, loss value {float(loss_value):.4f}")
    if graphs:
        out("  (each timed step a replay of one CUDA graph of the step, on the CPU the step itself: its stages "
            "not timed apart)")
    for s in STAGES:
        if (loss == "tile" and s in ("loss", "raster_bwd")) or s not in med or (fuse_adam and s == "adam"):
            continue
        label = "raster+loss+bwd" if loss == "tile" and s == "raster_fwd" else s
        out(f"  {_ADAM_LABELS[fuse_adam] if s == 'project_bwd' else label:16s} {med[s]:8.3f}")
    if loss == "tile":
        out(f"fused tiles {fstats['fused_tiles']:.3f}, Gaussians on fused tiles {fstats['fused_gaussians']:.3f} "
            f"(budget {fstats['max_fused']} per tile)")
        for name, fused_path in (("unfused", False), ("fused", True)):
            rd, wr = traffic_bytes(b.n_isect, cam.width * cam.height, fused_path)
            out(f"modelled device traffic, {name}: read {rd / 2**20:.1f} MiB, write {wr / 2**20:.1f} MiB")
    if loss != "tile" and "forward" in med:
        out(f"  {'forward':16s} {med['forward']:8.3f}   (project + bin_sort + raster_fwd)")
    if launches and launches[0] is not None:
        out(f"numba kernel launches per step: {statistics.median(launches):.0f}")
    if other is not None:
        for fused, stages in sorted(((fuse_adam, med), (not fuse_adam, other)), reverse=True):
            parts = ", ".join(f"{_ADAM_LABELS[fused] if s == 'project_bwd' else s} {stages[s]:.3f}"
                              for s in ("project_bwd", "adam")[:1 if fused else 2] if s in stages)
            out(f"Adam {'fused into project_bwd' if fused else 'after project_bwd':23s} step {stages['step']:8.3f}"
                + (f"  ({parts})" if parts else "") + ("  <- training's" if fused == fuse_adam else ""))
    peak = peak_device_bytes()
    if peak:
        out(f"peak device memory: {peak / 2**20:.1f} MiB ({peak / n:.0f} B per Gaussian)")
    out(f"step_ms={med['step']:.3f}")
    return med
