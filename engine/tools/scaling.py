"""``run.py scaling``: training throughput and the phases of its step, on one rank or many
(mpiexec); on one rank also the bytes a step would move over P ranks, a cost model of the
speed-up built from them, and the device memory per Gaussian.

What it trains on (a ``Workload``): a benchmark scene (``run.py bench --make``: Gaussians
and one camera, no photos), of which ``views`` cameras shifted sideways are rendered as targets
(every rank renders the same ones); or a dataset folder with its ground-truth Gaussians
(``run.py synth`` writes the city so), trained on its first ``views`` training views, whose
images alone are read.  Training starts from the Gaussians with their colours perturbed, so the
loss and gradients are real, and with densification off, so every rank count does the same work.

One rank runs the single-GPU pipeline, or with ``pipeline="gaussian-exchange"`` the batched one
on one rank (to see what its plan and exchanges cost where nothing crosses ranks); P ranks run
the Gaussian-exchange one (batch P views): ``engine.pipelines.make_trainer``'s choice for the
ranks.  The bytes come from engine/pipelines/traffic.py.  Images per second come from the timed steps, which
do not sync inside; a few more steps are then synced at their phase boundaries for the phase
table (``trainer.PHASES``, the same names at every P).  Unlike the captures at hand, the
scenes can be as large as the GPUs hold (the benchmark scenes, the large city): what the scaling
table needs.
"""
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

import numbasplat as ns
from numbasplat import backend as _backend
from data.bench_scene import load_scene
from numbasplat.bench import peak_device_bytes
from numbasplat.loss import psnr_of_mse

from engine.pipelines import PipelineOptions, make_trainer
from engine.pipelines.traffic import PIXEL_TILE_BYTES, off_diagonal, pixel_traffic, rank_bytes, step_traffic, view_utilisation
from engine.recipe.trainer import PHASES
from . import timeline as timeline_module

# NCCL's effective NVLink 4 bandwidth (H100, H200), GB/s per GPU and direction: the 450 GB/s line
# rate less about 20% protocol overhead, as NCCL's maintainers give it (NVIDIA/nccl-tests issue
# 212). BENCHMARKS.md holds exchange times, not bandwidths, to use instead.
NVLINK_GBS = 370.0
INFINIBAND_GBS = 25.0  # a 200 Gb/s InfiniBand link (HDR), GB/s per direction: the line rate (clusters)
# NCCL's time for its smallest messages between NVLink GPUs (sendrecv_perf on 4 H800s, NVIDIA/nccl
# issue 1984), seconds: the cost model's default time a collective round costs beyond its bytes.
NVLINK_LATENCY_S = 4e-6
H200_BYTES = 141e9  # an H200's memory


@dataclass
class Workload:
    """What to train on: a ``data.Dataset``, the Gaussians' arrays to start from, and its name;
    ``settings``: ``TrainConfig`` fields the model was trained with (its background)."""
    data: object
    start: dict
    name: str
    settings: dict = field(default_factory=dict)


def synthetic_capture(g, cam, views, backend=None):
    """A ``data.Dataset`` of ``views`` renders of ``g``: the camera moved sideways by up to 5% of
    the scene's median depth (so the views overlap like a capture's neighbours)."""
    from data import Dataset, View
    xp = _backend.array_module(backend)
    dev = ns.Gaussians(**{k: xp.asarray(a) for k, a in g.arrays().items()})
    depth = float(np.median((g.means @ cam.viewmat[:3, :3].T + cam.viewmat[:3, 3])[:, 2]))
    train = []
    for i in range(views):
        vm = cam.viewmat.copy()
        a = 2 * np.pi * i / max(views, 1)
        vm[:2, 3] += 0.05 * depth * np.array([np.cos(a), np.sin(a)]) * (i > 0)
        c = ns.Camera(vm, cam.fx, cam.fy, cam.cx, cam.cy, cam.width, cam.height)
        image = np.clip(_backend.to_host(ns.render(dev, c, backend=backend).image), 0, 1)
        train.append(View(f"view{i:03d}", np.ascontiguousarray(image, np.float32), c))
    return Dataset(train=train, test=[], scene_scale=depth, source="benchmark scene", fmt="synthetic")


def perturbed(arrays, seed=0):
    """Copies of the Gaussians' ``arrays`` with their base colour perturbed: where training starts."""
    arrays = {k: np.array(a) for k, a in arrays.items()}
    arrays["sh"][:, 0] += np.random.default_rng(seed).normal(0, 0.3, arrays["sh"][:, 0].shape).astype(np.float32)
    return arrays


SCENE_VIEWS = 8   # renders of a benchmark scene to train on, unless told
TEST_EVERY = 8    # a dataset's held-out views: every 8th, as run.py synth and train --eval hold them out


def scene_workload(scene, views=None, backend=None):
    """A benchmark scene (a path, or (Gaussians, camera)) and ``views`` renders of it (None:
    ``SCENE_VIEWS``)."""
    g, cam = load_scene(scene) if isinstance(scene, str) else scene
    views = views or SCENE_VIEWS
    return Workload(synthetic_capture(g, cam, views, backend), perturbed(g.arrays()),
                    f"benchmark scene, {views} views")


GROUND_TRUTH = "ground_truth.ply"  # the Gaussians of a generated dataset (data/synthetic_city.py)


def data_workload(folder, views=None):
    """The dataset in ``folder`` at its full resolution, its first ``views`` training views (None:
    all; the test views are held out as ``TEST_EVERY`` says), and its ground-truth Gaussians.
    ValueError naming what is missing."""
    from data import load_dataset
    from data.ply import load_ply
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"--data {folder}: no such folder")
    ply = folder / GROUND_TRUTH
    if not ply.is_file():
        raise ValueError(f"--data {folder} has no {GROUND_TRUTH}: the Gaussians that training starts from "
                         "(run.py synth writes one)")
    data = load_dataset(folder, test_every=TEST_EVERY, max_width=None, train_views=views)
    return Workload(data, perturbed(load_ply(ply)), f"{folder}, {len(data.train)} training views")


def model_workload(trainer, views=None):
    """A trained model as it stands (``trainer``'s, after ``cli.evaluate.trained_model``) on its
    capture's first ``views`` training views (None: all): how fast its steps are, pruned or not."""
    d = trainer.data
    data = replace(d, train=d.train[:views] if views else d.train, test=[])
    g = trainer.model.gaussians
    start = {k: _backend.to_host(a) for k, a in g.arrays().items()}
    return Workload(data, start, f"the model of {trainer.out}, {len(data.train)} training views",
                    {"background": trainer.cfg.background})


def run(workload, iters=30, warmup=5, comm=None, grad_comm="sparse", transport="auto", backend=None,
        model_ranks=(), link_gbs=NVLINK_GBS, link_latency_s=NVLINK_LATENCY_S, balanced=True, loss="global",
        timeline=0, timeline_trace=None, offload=None, out=print):
    """Train ``workload`` (or a benchmark scene's path) and report: images per second, the phase
    table per rank, and on one rank the peak device memory and, for each of ``model_ranks``, the
    bytes a step of the Gaussian-exchange pipeline would move over that many ranks and the step
    time the cost model (``predict_step``, a link of ``link_gbs`` and ``link_latency_s`` a round)
    gives for them.  ``comm``: the ranks (None: the
    single-GPU pipeline; ``COMM_SELF``: the batched one on one rank).  ``balanced``: the modelled
    renderers' tile ranges balance the batch's intersections (else even).  Returns the report's
    numbers (rank 0's; the others return None).  Each timed step starts and ends synced (its
    median is the step's time); then ``iters`` steps run back to back, as in training, where the
    host queues a step while the device still works on the last (their mean: the throughput).
    ``loss``: the training loss (``tile``: the fused kernel on GPUs).  ``timeline``: that many more
    steps (one rank) under CUPTI (``engine.tools.timeline``): kernels, device busy and idle time, and
    host waits per step; the trace kept at ``timeline_trace``.  ``offload``: the model out of core,
    ``PipelineOptions``' fields (offload, offload_dir, host_memory, gpu_memory); on one rank the report then
    says where the device's bytes per working-set Gaussian go and the largest model that each tier holds
    (``offload_report``)."""
    from engine.recipe.trainer import TrainConfig
    if not isinstance(workload, Workload):
        workload = scene_workload(workload, backend=backend)
    size = comm.Get_size() if comm is not None else 1
    rank = comm.Get_rank() if comm is not None else 0
    if model_ranks and size > 1:
        raise ValueError("--model-ranks models P ranks from a run on one rank: run it without mpiexec")
    say = out if rank == 0 else (lambda *a, **k: None)
    if timeline:
        timeline_module.check_available(backend)
    start = workload.start
    n = len(start["means"])
    degree = ns.Gaussians(**start).sh_degree()
    cfg = TrainConfig(iterations=10**9, sh_degree=degree, sh_increase_every=1, densify_until=0, snapshot_every=0,
                      loss=loss, **workload.settings)
    with tempfile.TemporaryDirectory() as tmp:
        options = PipelineOptions(grad_comm=grad_comm, transport=transport, **(offload or {}))
        t = make_trainer(workload.data, tmp, cfg, options, comm, backend, log=print if comm is None else say)
        t.start_from({"params": start})
        _release_cached_blocks(t.backend)  # what making the capture left: the peak is then training's
        steps, losses, peak, back_to_back, phases = _time_steps(t, comm, warmup, iters)
        traced = None
        if timeline:
            traced = timeline_module.summarize(timeline_module.record(t.train_step, timeline, timeline_trace))
        per_rank = comm.gather(phases, root=0) if comm is not None else [phases]
        if rank != 0:
            return None
        report = _report(workload, t, n, size, iters, steps, losses, back_to_back, per_rank, traced, say)
        if size == 1:
            med, medians = report["step"], report["phases"]
            report.update(_model_report(t, med, medians[0], peak, model_ranks, grad_comm, (link_gbs, link_latency_s),
                                         balanced, say))
    return report


def _report(workload, t, n, size, iters, steps, losses, back_to_back, per_rank, traced, say):
    """Say the timings of ``run`` (``t``: its trainer of ``n`` Gaussians over ``size`` ranks; ``steps``,
    ``losses``, ``back_to_back``: ``_time_steps``'s; ``per_rank``: each rank's phase stats; ``traced``:
    the timeline's summary, or None) and -> the report's numbers."""
    cam = workload.data.train[0].camera
    med = statistics.median(steps)
    say(f"scaling: {workload.name}; {n} Gaussians, {cam.width}x{cam.height}, {size} rank(s), "
        f"{t.batch} view(s) per step, {type(t).__name__}, {iters} timed steps; "
        f"loss {float(losses[0]):.4f} -> {float(losses[-1]):.4f}")
    medians = [phase_medians(ph) for ph in per_rank]
    for line in phase_table(medians, len(per_rank[0])):
        say(line)
    say(f"step {1e3 * med:.2f} ms, {t.batch / med:.1f} images/s; back to back (no sync between steps, as "
        f"training runs) {1e3 * back_to_back:.2f} ms, {t.batch / back_to_back:.1f} images/s")
    report = {"step": med, "images_per_s": t.batch / med, "phases": medians, "gaussians": n,
              "back_to_back_step": back_to_back}
    if traced:
        for line in timeline_module.report_lines(traced):
            say(line)
        report["timeline"] = traced
    return report


def _time_steps(t, comm, warmup, iters):
    """The timings of trainer ``t``'s steps (``comm``: its ranks, None for one process): after ``warmup``
    steps, ``iters`` steps each started and ended synced (their times and losses), the peak device
    memory, the mean of ``iters`` steps back to back (the host queues the next step while the device
    works, as in training), and the phase times (``stats``) of up to 10 steps synced at their phases'
    boundaries.  -> (step times, losses, peak bytes, back-to-back step time, phase stats per step)."""
    t.time_phases = False  # throughput: the host runs ahead of the device, as in training
    steps, losses = [], []
    for it in range(warmup + iters):
        _sync(t, comm)
        t0 = time.perf_counter()
        loss, _ = t.train_step()
        _sync(t, comm)
        if it >= warmup:
            steps.append(time.perf_counter() - t0)
            losses.append(loss)  # read after the timing: reading a LazyLoss syncs
    peak = peak_device_bytes()
    _sync(t, comm)
    t0 = time.perf_counter()
    for _ in range(iters):
        t.train_step()
    _sync(t, comm)
    back_to_back = (time.perf_counter() - t0) / iters
    phases = []
    t.time_phases = True  # then the phases, on steps synced at their boundaries
    for _ in range(min(iters, 10)):
        t.train_step()
        phases.append(t.stats)
    t.time_phases = False
    return steps, losses, peak, back_to_back, phases


def _model_report(t, step, phases, peak, model_ranks, grad_comm, link, balanced, say):
    """The one-rank part of the report: memory per Gaussian and the largest scenes; the bytes per
    step and the cost model for each of ``model_ranks`` over ``link`` (GB/s, seconds a round)."""
    link_gbs, latency = link
    report = {}
    if t.store.out_of_core:
        report.update(offload_report(t, say, peak))
        return report
    model_bytes = t.model.nbytes() + sum(int(a.nbytes) for a in t.strategy_state.values())
    target_bytes = t.targets.nbytes
    n = len(t.model)
    if peak:
        owner, render = model_bytes / n, max(peak - target_bytes - model_bytes, 0) / n
        say(f"peak device memory {peak / 2**30:.2f} GiB: {(peak - target_bytes) / n:.0f} B per Gaussian besides the "
            f"{target_bytes / 2**30:.2f} GiB of training images (owner state {owner:.0f} B, the step's buffers "
            f"{render:.0f} B)")
        fits = {p: largest_scene(owner, render, H200_BYTES, p) for p in (1, *model_ranks)}
        say(f"largest scene on {H200_BYTES / 1e9:.0f} GB GPUs (H200): "
            + ", ".join(f"P = {p}: {g / 1e6:.0f}M Gaussians" for p, g in fits.items()))
        report.update(peak_bytes=peak, owner_bytes=owner, render_bytes=render, largest=fits)
    else:
        say("peak device memory: not measured (no GPU)")
    if not model_ranks:
        return report
    g = t.model.gaussians
    train = t.data.train
    traffic, predicted = {}, {}
    for p in model_ranks:
        views = [i % len(train) for i in range(p)]  # the batch: one view per rank
        traffic[p] = step_traffic(g, [train[i].camera for i in views], [t.targets[i] for i in views], p,
                                  t.sh_degree_now(), t.cfg.background, t.cfg.lambda_dssim, balanced, t.backend)
        predicted[p] = predict_step(phases, step, traffic[p], grad_comm, link_gbs * 1e9, latency)
    for line in traffic_table(traffic, balanced):
        say(line)
    cams = [c.camera for c in train[:max(model_ranks)]]
    pixel = {p: pixel_traffic(g, cams, p, t.sh_degree_now(), t.backend, saturation=True) for p in model_ranks}
    for line in pixel_traffic_table(pixel, traffic, len(cams)):
        say(line)
    every = [c.camera for c in train]
    consolidation = {p: view_utilisation(g, every, p) for p in model_ranks}
    for line in utilisation_table(consolidation):
        say(line)
    for line in model_table(predicted, step, t.batch, link, grad_comm, has_exchange_phases(phases)):
        say(line)
    for line in exchange_model_table(pixel, traffic, phases, step, t.batch,
                                     {"NVLink": link_gbs, "IB 200Gb": INFINIBAND_GBS}):
        say(line)
    report.update(traffic=traffic, predicted=predicted, pixel=pixel, consolidation=consolidation)
    return report


BILLION = 10**9  # the scene ``offload_report`` sizes on paper (TideGS's scale)


def offload_report(t, say, measured=0, paper=BILLION):
    """Trainer ``t``'s model out of core (one rank): where the device's bytes per working-set Gaussian go
    (``working_set_bytes``, at the intersections per Gaussian of its last working set in its view), then
    for this machine and the caps, the bytes per Gaussian of each tier (``tier_bytes``) and the largest
    model it holds: the device's budget over the index (with one block's slot beside it: chunked views
    train any view) and the largest working set beside this model's index, host memory (physical) over
    its bytes, the free disk at --offload-dir (else the temporary folder's) over its; each tier's bytes for
    a scene of ``paper`` Gaussians at SH degree 3; and where Adam runs on the device, what two options would
    make of a working-set Gaussian (``not_built``: Adam's moments in host memory, as CLM, which
    ``--offload-adam host`` runs; in bfloat16, not built).  ``measured``: the device's
    measured peak (0: none), said
    beside what the itemised bytes make of the last step (the pool, its working set's buffers, the index,
    the images and the view's per-pixel buffers).  -> the numbers."""
    from engine.stores.offload import RowLayout
    from engine.stores.offload.store import INTERSECTIONS_PER_GAUSSIAN, tier_bytes
    store, n, degree = t.store, len(t.model), t.sh_degree_now()
    held = round(store.layout.sh_bases ** 0.5) - 1  # the SH degree the rows hold
    k, tiles = INTERSECTIONS_PER_GAUSSIAN, 0
    model = store.last_working_set()
    if model is not None:  # in the last step's view
        camera = t.data.train[t._progress_view[1]].camera
        counts = ns.project(model.gaussians, camera, sh_degree=degree, backend=t.backend, check=False).counts
        k, tiles = float(counts.sum()) / max(len(model), 1), int(np.prod(camera.tiles))
    items, peak = store.working_set_bytes(k, tiles)
    say(f"device bytes per working-set Gaussian at SH degree {held}, {k:.2f} tile intersections each "
        f"(the last view's): {peak:.0f} B at the step's peak")
    for what, size in items.items():
        say(f"  {what}: {size:.0f} B")
    moments = 2 * 4 * store.layout.width  # (float32 m and v)
    options = {}
    if store.adam == "device":
        options = {"moments in host memory": peak - moments, "moments in bfloat16": peak - moments // 2}
        say(f"  with --offload-adam host: Adam's moments in host memory, Adam run there on the working set (CLM): "
            f"{options['moments in host memory']:.0f} B, and {moments} B a working-set Gaussian moved each step (its "
            f"gradients out, its parameters back); not built: moments in bfloat16 (not exact): "
            f"{options['moments in bfloat16']:.0f} B")
    else:
        say(f"  Adam on the host (--offload-adam host): its moments in host memory, {moments} B a working-set "
            f"Gaussian moved each step (its gradients out, its parameters back)")
    if measured:
        say(f"peak device memory {measured / 2**30:.2f} GiB measured; the items make "
            f"{store.step_device_bytes(k, tiles) / 2**30:.2f} GiB of the last step (its pool, its working set at "
            f"{peak:.0f} B a Gaussian less its pool rows, the index, the images, the view's buffers)")
    tiers, largest = _largest_models(store, n, k, say)
    sh3 = RowLayout(16, {name: np.zeros(0, dtype) for name, dtype in store.layout.statistics.items()})
    on_paper = tier_bytes(sh3, k, store.adam)
    gib = paper / 2**30
    say(f"on paper, {paper / 1e9:g}B Gaussians at SH degree 3: device {on_paper.index * gib:,.1f} GiB for the "
        f"index and {on_paper.working_set:.0f} B per working-set Gaussian; host mode {on_paper.host * gib:,.0f} GiB "
        f"({on_paper.host_growing * gib:,.0f} GiB while it grows) and the index {on_paper.host_index * gib:,.0f} GiB; "
        f"disk {on_paper.disk * gib:,.0f} GiB")
    return {"working_set_bytes": items, "working_set_peak_bytes": peak, "intersections_per_gaussian": k,
            "not_built": options,
            "tier_bytes": tiers._asdict(), "largest": largest, "on_paper": on_paper._asdict()}


def _largest_models(store, n, k, say):
    """``offload_report``'s largest models here: each tier's bytes per Gaussian (``tier_bytes``, at ``k``
    intersections a Gaussian) and the largest model that the device's budget, host memory and the free
    disk hold, said (``n``: the model's Gaussians now).  -> (the tiers' bytes, {tier: Gaussians})."""
    import os
    import shutil
    from engine.stores.offload.store import tier_bytes
    tiers = tier_bytes(store.layout, k, store.adam)
    budget = store.device_budget
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    folder = store.offload_dir if store.mode == "disk" else tempfile.gettempdir()
    free_disk = shutil.disk_usage(folder).free
    largest = {"host": ram // (tiers.host + tiers.host_index),
               "host growing": ram // (tiers.host_growing + tiers.host_index),
               "disk": min(free_disk // tiers.disk, ram // tiers.host_index)}
    say(f"largest models here ({n:,} Gaussians now, --offload {store.mode}):")
    if budget is None:
        say(f"  device: no cap (CPU backend); {tiers.working_set:.0f} B per working-set Gaussian, {tiers.index} B per "
            "model Gaussian (the index)")
    else:
        largest["device"] = max(0, budget - store.block_rows * tiers.working_set) // tiers.index
        largest["working set"] = int(max(0, budget - tiers.index * n) // tiers.working_set)
        say(f"  device ({budget / 2**30:.1f} GiB for the blocks and the index): {tiers.index} B per model Gaussian "
            f"(the index): {largest['device'] / 1e6:,.0f}M Gaussians; beside this model's index a working set of "
            f"{largest['working set'] / 1e6:,.1f}M Gaussians at {tiers.working_set:.0f} B each (larger views train in "
            "chunks)")
    say(f"  host mode ({ram / 2**30:.0f} GiB): {tiers.host} B per Gaussian, the table ({tiers.host_growing} B while "
        f"the model grows), and {tiers.host_index} B of the index: {largest['host'] / 1e6:,.0f}M Gaussians "
        f"({largest['host growing'] / 1e6:,.0f}M growing)")
    say(f"  disk mode ({free_disk / 2**30:.0f} GiB free at {folder}): {tiers.disk} B per Gaussian on the disk and "
        f"{tiers.host_index} B of the index in host memory: {largest['disk'] / 1e6:,.0f}M Gaussians")
    return tiers, largest


def _release_cached_blocks(backend):
    """Hand CuPy's cached free blocks back to the device (nothing to do elsewhere)."""
    if _backend.on_gpu(backend):
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()


def _sync(t, comm):
    """Wait for the GPU (and the other ranks): step times are then whole steps."""
    _backend.synchronize(t.backend)
    if comm is not None:
        comm.Barrier()


# ---------------------------------------------------------------------------------- the phases

def phase_medians(steps):
    """{phase: (median seconds, median seconds of the host's part)} over steps' ``stats``, in
    ``PHASES`` order."""
    names = [k for k in PHASES if steps and k in steps[0]["times"]]
    return {k: (statistics.median(s["times"][k] for s in steps), statistics.median(s["host"][k] for s in steps))
            for k in names}


def phase_table(per_rank, steps):
    """The lines of the phase table: a row per phase, a column per rank (``phase_medians`` each)."""
    def row(name, cells):
        return f"  {name:18s}" + "".join(f"{c:>22s}" for c in cells)

    def cell(seconds, host):
        return f"{1e3 * seconds:.2f} ({1e3 * host:.2f})"
    lines = [f"phases, ms (in brackets the host's part), median of {steps} steps synced at their boundaries:",
             row("phase", [f"rank {r} (median ms)" for r in range(len(per_rank))])]
    for k in PHASES:
        if any(k in m for m in per_rank):
            lines.append(row(k, [cell(*m[k]) if k in m else "-" for m in per_rank]))
    lines.append(row("sum", [cell(*np.sum(list(m.values()), axis=0)) if m else "-" for m in per_rank]))
    return lines


# ---------------------------------------------------------------------------------- the bytes tables

def pixel_traffic_table(pixel, traffic, views):
    """The lines comparing the pixel-level pipeline's bytes (``pixel``: {P: ``PixelTraffic`` over ``views``
    views}) with the Gaussian-level one's, per image."""
    mb = 1e6
    lines = ["pixel-level exchange, MB crossing ranks per image (one view a step; the Gaussian-level "
             "pipeline's batch of P views divided by P), and the shares of the partial tiles that the spatial "
             "reduction leaves unsent and, of those sent, that saturation reduction skips; order PSNR: the "
             "boxes' partial images composed in box order against the single render (dB):",
             f"  {'P':>3s} {'pixel fwd':>10s} {'pixel bwd':>10s} {'gauss fwd':>10s} {'gauss bwd sparse':>17s} "
             f"{'unsent %':>9s} {'saturated %':>12s} {'order PSNR':>11s}"]
    for p, counts in pixel.items():
        t = traffic[p]
        sent = off_diagonal(counts.forward).sum()
        fwd = sent * PIXEL_TILE_BYTES / views / mb
        bwd = off_diagonal(counts.backward).sum() * PIXEL_TILE_BYTES / views / mb
        unsent = 100.0 * (1 - sent / max(off_diagonal(counts.full).sum(), 1))
        saturated = ("-" if counts.saturated is None else
                     f"{100.0 * off_diagonal(counts.saturated).sum() / max(sent, 1):.1f}")
        order = "-" if counts.order_mse is None else f"{psnr_of_mse(counts.order_mse):.2f}"
        lines.append(f"  {p:3d} {fwd:10.2f} {bwd:10.2f} {off_diagonal(t.forward_bytes()).sum() / t.views / mb:10.2f} "
                     f"{off_diagonal(t.backward_bytes('sparse')).sum() / t.views / mb:17.2f} {unsent:9.1f} "
                     f"{saturated:>12s} {order:>11s}")
    return lines


def utilisation_table(consolidation):
    """The lines of view consolidation's utilisation ({P: ``view_utilisation``})."""
    lines = ["pixel-level exchange, view consolidation over the training views: utilisation U = active ranks / P "
             "a step, one view a step against the buckets",
             f"  {'P':>3s} {'views':>6s} {'steps':>6s} {'U before':>9s} {'U after':>8s}"]
    for p, u in consolidation.items():
        lines.append(f"  {p:3d} {u['views']:6d} {u['steps']:6d} {u['utilisation_before']:9.2f} "
                     f"{u['utilisation_after']:8.2f}")
    return lines


def traffic_table(traffic, balanced):
    """The lines of the bytes table: a row per rank count."""
    mb = 1e6

    def most_and_all(m):
        return f"{rank_bytes(m).max() / mb:9.2f} {off_diagonal(m).sum() / mb:9.2f}"
    pair = f"{'rank max':>9s} {'all':>9s}"
    lines = [f"bytes per step if a batch of P views is split over P ranks ({'balanced' if balanced else 'even'} "
             "tile ranges), MB crossing ranks: a rank's most (the more of sent and received) and all ranks':",
             f"  {'P':>3s} {'records':>12s} {'forward':>19s} {'backward dense':>19s} {'backward sparse':>19s} "
             f"{'kept %':>7s} {'halo (global loss)':>19s}",
             f"  {'':3s} {'crossing':>12s} {pair} {pair} {pair} {'':7s} {pair}"]
    for p, t in traffic.items():
        cross = off_diagonal(t.records).sum()
        kept = 100.0 * t.kept.sum() / max(t.records.sum(), 1)
        lines.append(f"  {p:3d} {cross:12d} {most_and_all(t.forward_bytes())} "
                     f"{most_and_all(t.backward_bytes('dense'))} {most_and_all(t.backward_bytes('sparse'))} "
                     f"{kept:7.1f} {most_and_all(t.halo_bytes())}")
    return lines


# ---------------------------------------------------------------------------------- the cost model

SCALES = {"project": "view_rows", "plan": "view_rows", "owner": "view_rows", "optimizer": "rows",
          "render": "isect_received", "loss": "pixels", "backward": "isect_own"}
"""How each phase's work grows (a key of ``Traffic.shares``).  The exchanges and the ranks' sum
cost the link's time and, where one rank of the exchange pipeline measured them, their host work
(``EXCHANGE_SCALES``)."""


EXCHANGE_SCALES = {"forward_exchange": "view_rows", "backward_exchange": "view_rows", "halo_exchange": "each",
                   "reduce": "each"}
"""The Gaussian-exchange pipeline's own phases, as one rank of it measures them (``run.py scaling
--pipeline gaussian-exchange``, where nothing crosses ranks): their host work (packing, encoding and
decoding the records and gradients, the collectives' calls) grows with the records a rank packs, the
halo's and the ranks' sum's stays ("each": one rank's)."""

ROUNDS = 5
"""The collective rounds a step of the Gaussian exchange waits on: the plan's counts, the records, the
halo, the gradients and the ranks' sum (``engine/pipelines/gaussian_exchange.py``)."""


def has_exchange_phases(phases):
    """Whether ``phases`` came from the Gaussian-exchange pipeline (its own phases measured)."""
    return any(k in phases for k in EXCHANGE_SCALES)


def predict_step(phases, step, traffic, grad_comm, link_bytes_per_s, latency_s=0.0):
    """The cost model: the predicted seconds of a step of the Gaussian-exchange pipeline over
    ``traffic.ranks`` ranks, from what one rank measured (``phases``: {phase: (median seconds,
    host part)} of synced steps; ``step``: the median seconds of a step synced one at a time) and
    the step's ``Traffic``.

    Assumptions.  A phase's time grows with its work (``SCALES``): owner phases with the
    records they project (their rows, for every view of the batch), Adam with the rows, the
    render with the intersections binned, the backward with those rasterized, the loss with the
    pixels.  Ranks work in parallel and the slowest sets the step.  A rank's messages cross one
    link of ``link_bytes_per_s`` each way, one after the other (no overlap with computing), and
    each of the step's ``ROUNDS`` collectives costs ``latency_s`` (a round between two ranks) for each
    of its log2(P) stages (recursive doubling, as collectives of small messages run) more.

    Where ``phases`` are the Gaussian-exchange pipeline's on one rank (``has_exchange_phases``), its
    own phases' host work is added as ``EXCHANGE_SCALES`` grows it, and the step is the sum of its
    phases as synced: each exchange waits for the device (the send counts, the buffers), so the host
    cannot queue the next phases while the device works.  Measured on the single-GPU pipeline
    instead, that host work is left out, and synced phases that add up to more than the step (the
    syncs cost the host's overlap with the device) are scaled down to it: one rank's prediction is
    then the measured step.  What the step takes beyond its phases stays as measured on one rank.

    Returns seconds per step, and its parts: per rank the work and the link's time; the
    fixed rest."""
    exchange = has_exchange_phases(phases)
    scales = {**SCALES, **EXCHANGE_SCALES} if exchange else SCALES
    work, fixed = scaled_work(phases, step, scales, traffic.shares(), fit=not exchange)
    link = traffic.link_bytes(grad_comm) / link_bytes_per_s + ROUNDS * latency_s * np.log2(traffic.ranks)
    return {"step": float((work + link).max() + fixed), "work": work, "link": link, "fixed": fixed}


def scaled_work(phases, step, scales, shares, fit=True):
    """Each rank's seconds of the phases named in ``scales`` (phase -> a key of ``shares``, per rank
    its part of one rank's work), and the step's fixed rest: the measured ``step`` less its phases
    (none where they add up to more).  ``fit``: synced ``phases`` that add up to more than the step
    are scaled down to it first (the host's overlap with the device, which the syncs cost)."""
    scaled = sum(phases[k][0] for k in scales if k in phases)
    factor = min(1.0, step / scaled) if fit and scaled > 0 else 1.0
    work = factor * sum(phases[k][0] * shares[scales[k]] for k in scales if k in phases)
    return work, max(step - factor * scaled, 0.0)


PIXEL_SCALES = {"project": "rows", "owner": "rows", "optimizer": "rows", "render": "isect", "backward": "isect",
                "loss": "pixels"}
"""How each phase of one rank rendering one view grows in the pixel-level pipeline (a key of
``pixel_shares``): a rank projects, updates and renders its box's Gaussians, and composes its
range of the view's tiles (composition and the loss)."""


def pixel_shares(counts):
    """Per rank, its part of the work of one rank rendering one view (``PIXEL_SCALES``)."""
    return {"rows": counts.rows / max(counts.rows.sum(), 1), "isect": counts.isect / max(counts.isect.sum(), 1),
            "pixels": counts.composed / max(counts.composed.sum(), 1)}


def predict_pixel_step(phases, step, counts, link_bytes_per_s):
    """The cost model of the pixel-level pipeline (one view a step, every rank taking part: no
    consolidation, which the city's views leave at about 1) from one rank's measured ``phases`` and
    ``step`` (as ``predict_step``) and ``counts`` (``PixelTraffic``): each phase scaled by the rank's
    share of its work (``PIXEL_SCALES``), plus the link's time for the rank's partial tiles (the more
    of sent and received, forward less what saturation skips, and back), one after the other; the
    step's rest beyond its phases fixed as measured.  It leaves out the pipeline's own host work (its
    plans, the allgathers of covered tiles, composition's launches), which the measured 2-rank runs
    show to be most of its step on one shared GPU.  -> as ``predict_step``: seconds per view."""
    work, fixed = scaled_work(phases, step, PIXEL_SCALES, pixel_shares(counts))
    forward = counts.forward - (counts.saturated if counts.saturated is not None else 0)
    tiles = off_diagonal(forward + counts.backward) / max(counts.views, 1)
    link = rank_bytes(tiles * PIXEL_TILE_BYTES) / link_bytes_per_s
    return {"step": float((work + link).max() + fixed), "work": work, "link": link, "fixed": fixed}


def exchange_model_table(pixel, traffic, phases, step, views, links):
    """The lines comparing both exchanges' modelled images/s for each link of ``links`` ({name: GB/s}):
    the Gaussian-level pipeline's batch of P views a step (sparse gradients), the pixel-level one's one
    view a step (``predict_pixel_step``)."""
    own = [k for k in phases if k == "plan" or k in EXCHANGE_SCALES]  # the exchange pipeline's own phases
    compute = {k: v for k, v in phases.items() if k not in own}
    step = max(step - sum(phases[k][0] for k in own), 0.0)  # as the single pipeline would step
    lines = ["cost model, images/s of the Gaussian-level (sparse) against the pixel-level exchange "
             f"(measured on 1 rank: {1e3 * step:.2f} ms, {views / step:.1f} images/s; host work of each "
             "pipeline beyond one rank's left out):",
             f"  {'P':>3s} " + " ".join(f"{name + ' gauss':>16s} {name + ' pixel':>16s}" for name in links)]
    for p, counts in pixel.items():
        cells = []
        for gbs in links.values():
            g = predict_step(compute, step, traffic[p], "sparse", gbs * 1e9)["step"]
            x = predict_pixel_step(compute, step, counts, gbs * 1e9)["step"]
            cells.append(f"{p / g:16.1f} {1 / x:16.1f}")
        lines.append(f"  {p:3d} " + " ".join(cells))
    return lines


def model_table(predicted, step, views, link, grad_comm, host_work):
    """The lines of the cost model's table: a row per rank count beside the measured one (``link``: GB/s
    and seconds a round; ``host_work``: whether the pipeline's own host work is in, ``has_exchange_phases``)."""
    gbs, latency = link
    lines = [f"cost model (predict_step; link {gbs:g} GB/s per GPU and direction, {1e6 * latency:g} us a round, "
             f"{grad_comm} gradients): measured on 1 rank {1e3 * step:.2f} ms, {views / step:.1f} images/s; "
             + ("the exchange pipeline's host work in" if host_work else
                "the exchange pipeline's host work left out (measure with --pipeline gaussian-exchange)"),
             f"  {'P':>3s} {'ms/step':>9s} {'work ms':>9s} {'link ms':>9s} {'fixed ms':>9s} {'images/s':>9s} "
             f"{'speed-up':>9s}"]
    for p, m in predicted.items():
        rate = p / m["step"]
        lines.append(f"  {p:3d} {1e3 * m['step']:9.2f} {1e3 * m['work'].max():9.2f} {1e3 * m['link'].max():9.2f} "
                     f"{1e3 * m['fixed']:9.2f} {rate:9.1f} {rate * step / views:8.2f}x")
    return lines


def largest_scene(owner_bytes, render_bytes, device_bytes, ranks):
    """The most Gaussians that ``ranks`` devices of ``device_bytes`` each can train, from the bytes
    per Gaussian of one rank: its owner state (``owner_bytes``: parameters, gradients, Adam's
    moments, the strategy's statistics), of which each rank holds a P-th; and a step's buffers
    (``render_bytes``: projected records, their gradients, binning, images), which do not
    shrink with P, since a rank projects its shard for every view of a batch of P views and
    renders a P-th of their tiles.  The training images are not counted."""
    return int(device_bytes // (owner_bytes / ranks + render_bytes))
