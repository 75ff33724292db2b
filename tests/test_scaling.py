"""engine/tools/scaling.py, the measuring tools of issue 22 on one rank: the dataset workload (only the
training views used are read), the phase table of both pipelines at P = 1, the bytes a step
would move over P ranks (engine/pipelines/traffic.py) against a brute-force count, the cost model's edge and monotonic
behaviour, and the memory model.  CPU backend, tiny scenes."""
import os

import numpy as np
import pytest

import numbasplat as ns
from data import synthetic_city as sc
from engine.tools import scaling
from engine.pipelines import traffic
from engine.pipelines.distributed import balanced_bounds, even_bounds
from engine.recipe.trainer import PHASES
from numbasplat.loss import l1_ssim_loss
from numbasplat.math import geometry as geo
from numbasplat.math import gaussian_ops as go
from numbasplat.math.tiles import TILE

SINGLE_PHASES = {"project", "render", "loss", "backward", "owner", "optimizer", "refine"}


@pytest.fixture(scope="module")
def city(tmp_path_factory):
    """A tiny city: ten views, of which 0 and 8 are held out."""
    out = tmp_path_factory.mktemp("city") / "tiny"
    sc.generate(out, preset="small", gaussians=20_000, views=10, resolution="64x36", seed=3, progress=False,
                backend="cpu")
    return out


def test_data_workload_reads_only_the_training_views_it_uses(city, monkeypatch):
    from data import colmap, load_dataset
    read = []
    real = colmap.load_image
    monkeypatch.setattr(colmap, "load_image", lambda path, *a, **k: read.append(path.name) or real(path, *a, **k))
    w = scaling.data_workload(city, views=3)
    first = ["00001_street.png", "00002_street.png", "00003_street.png"]  # 00000 is a test view
    assert sorted(read) == first and [v.name for v in w.data.train] == first and w.data.test == []
    assert (w.data.train[0].width, w.data.train[0].height) == (64, 36)
    everything = load_dataset(city, test_every=8)
    assert [v.name for v in everything.train[:3]] == first
    np.testing.assert_array_equal(w.data.train[2].image, everything.train[2].image)
    assert len(scaling.data_workload(city).data.train) == 8
    from data.ply import load_ply
    truth = load_ply(city / "ground_truth.ply")
    np.testing.assert_array_equal(w.start["means"], truth["means"])
    assert not np.array_equal(w.start["sh"][:, 0], truth["sh"][:, 0])  # the colours start perturbed


def test_data_workload_names_what_is_missing(tmp_path, city):
    with pytest.raises(ValueError, match="no such folder"):
        scaling.data_workload(tmp_path / "none")
    (tmp_path / "x").mkdir()
    with pytest.raises(ValueError, match="has no ground_truth.ply"):
        scaling.data_workload(tmp_path / "x")


def test_both_pipelines_report_their_phases_at_one_rank(city):
    from mpi4py import MPI
    w = scaling.data_workload(city, views=2)
    lines = []
    single = scaling.run(w, iters=2, warmup=1, out=lines.append, backend="cpu")
    assert set(single["phases"][0]) == SINGLE_PHASES and single["images_per_s"] > 0
    text = "\n".join(lines)
    assert "SingleGPUTrainer" in text and "rank 0 (median ms)" in text and "rank 1" not in text
    assert text.index("loss ") < text.index("images/s") and "peak device memory: not measured" in text
    batched = scaling.run(w, iters=2, warmup=1, comm=MPI.COMM_SELF, out=lines.append, backend="cpu")
    assert list(batched["phases"][0]) == list(PHASES)  # every phase, in order
    for m in (single, batched):
        assert all(0 <= host <= total for total, host in m["phases"][0].values())


def tiny_scene(n=400, W=64, H=48, seed=1):
    """Gaussians of all sizes in front of a camera, and three views of them a little apart."""
    rng = np.random.default_rng(seed)
    f = 0.9 * W
    z = 2.0 + 4.0 * rng.random(n)
    means = np.stack([(rng.random(n) - 0.5) * W / f * z, (rng.random(n) - 0.5) * H / f * z, z], 1)
    sh = rng.normal(0, 0.2, (n, 4, 3))
    scales = np.log(rng.uniform(0.5, 8.0, (n, 3)) * z[:, None] / f)
    g = ns.Gaussians(means.astype(np.float32), scales.astype(np.float32), rng.normal(size=(n, 4)).astype(np.float32),
                     rng.normal(0, 1.5, n).astype(np.float32), sh.astype(np.float32))
    cams = []
    for b in range(3):
        vm = np.eye(4)
        vm[:2, 3] = 0.3 * b, -0.2 * b
        cams.append(ns.Camera(vm, f, f, W / 2, H / 2, W, H))
    targets = [rng.random((H, W, 3)).astype(np.float32) for _ in cams]
    return g, cams, targets


def brute_force_records(g, cams, bounds, P):
    """[owner, renderer] records by looking at every Gaussian: the renderers whose tile ranges meet
    the row-major span of its tile rectangle in its view."""
    owners = even_bounds(len(g), P)
    records = np.zeros((P, P), np.int64)
    for b, cam in enumerate(cams):
        tx, ty = cam.tiles
        p = ns.project(g, cam, sh_degree=1, backend="cpu")
        for n in np.flatnonzero(p.counts > 0):
            u, v, ca, cb, cc, opac = (np.float32(x) for x in p.proj[n, :6])
            ext, cov_a, cov_c = go.footprint(u, v, ca, cb, cc, opac)
            tx0, tx1, ty0, ty1 = geo.tile_rect(u, v, cov_a, cov_c, ext, TILE, tx, ty)
            first, last = b * tx * ty + ty0 * tx + tx0, b * tx * ty + ty1 * tx + tx1
            s = np.searchsorted(owners, n, side="right") - 1
            for d in range(P):
                if bounds[d] < bounds[d + 1] and bounds[d] <= last and bounds[d + 1] > first:
                    records[s, d] += 1
    return records


def brute_force_halo(bounds, tiles_x, n_tiles):
    """[source, destination] tiles: those of the source within one tile row and one tile of any of
    the destination's tiles, in the same view."""
    P = len(bounds) - 1
    halo = np.zeros((P, P), np.int64)
    for s in range(P):
        for d in range(P):
            mine = np.arange(bounds[d], bounds[d + 1])
            for t in range(bounds[s], bounds[s + 1]):
                near = (np.abs(mine - t) <= tiles_x + 1) & (mine // n_tiles == t // n_tiles)
                halo[s, d] += s != d and near.any()
    return halo


@pytest.mark.parametrize("P,views,balanced", [(1, 1, True), (2, 2, False), (3, 2, False), (3, 2, True),
                                               (2, 3, True)])
def test_bytes_per_step_against_a_brute_force_count(P, views, balanced):
    g, cams, targets = tiny_scene()
    cams, targets = cams[:views], targets[:views]
    t = traffic.step_traffic(g, cams, targets, P, 1, (0, 0, 0), 0.2, balanced, "cpu")
    tx, ty = cams[0].tiles
    n_tiles = tx * ty
    frames = [ns.render(g, c, sh_degree=1, backend="cpu") for c in cams]
    cost = np.concatenate([np.diff(f.binning.ranges, axis=1)[:, 0] for f in frames])
    bounds = balanced_bounds(cost, P) if balanced else even_bounds(views * n_tiles, P)
    records = brute_force_records(g, cams, bounds, P)
    np.testing.assert_array_equal(t.records, records)
    halo = brute_force_halo(bounds, tx, n_tiles)
    np.testing.assert_array_equal(t.halo_tiles - np.diag(np.diag(t.halo_tiles)), halo)
    assert halo.sum() > 0 or P % views == 0  # ranks that cut a view trade its tiles
    # bytes: records of eleven floats forward, twelve back (dense); nothing that stays on a rank
    off = records - np.diag(np.diag(records))
    np.testing.assert_array_equal(t.crossing("dense"), off * 44 + off.T * 48 + halo * TILE * TILE * 12)
    np.testing.assert_array_equal(t.link_bytes("dense"), np.maximum(t.crossing("dense").sum(0),
                                                                    t.crossing("dense").sum(1)))
    # the sparse exchange keeps the rows whose gradient from the renderer's tiles is not zero
    assert (t.kept <= t.records).all()
    rows, kept = t.records.T, t.kept.T  # [renderer, owner]: a bitmap bit a row, a word of bases per 256 rows
    np.testing.assert_array_equal(t.backward_bytes("sparse"), 4 * (-(-rows // 32) + -(-rows // 256) + 12 * kept))
    nonzero = 0
    for f, target in zip(frames, targets):
        _, d_image = l1_ssim_loss(f.image, target, 0.2, backend="cpu")
        grad = ns.rasterize_backward(f.projection, f.binning, f.render, d_image, backend="cpu")
        nonzero += int((grad != 0).any(axis=1).sum())
    assert t.kept.sum() == nonzero if P == 1 else t.kept.sum() >= nonzero
    # the work: the owners' rows, the intersections binned and rasterized, the tiles
    assert t.rows.sum() == len(g) and t.tiles.sum() == views * n_tiles and t.isect_own.sum() == cost.sum()
    assert (t.isect_received >= t.isect_own).all() and t.isect_received.sum() >= cost.sum()


def ideal_traffic(P, n=1000, tiles=100, isect=5000.0, link_bytes=0):
    """A ``Traffic`` of P ranks whose work is split evenly (records that never cross but ``link_bytes``)."""
    records = np.full((P, P), link_bytes // traffic.RECORD_BYTES if P > 1 else 0)
    return traffic.Traffic(ranks=P, views=P, gaussians=n, view_tiles=tiles, view_isect=isect,
                           records=records, kept=records, halo_tiles=np.zeros((P, P), np.int64),
                           rows=np.diff(even_bounds(n, P)), isect_received=np.full(P, isect),
                           isect_own=np.full(P, isect), tiles=np.full(P, tiles))


PHASE_TIMES = {"project": (0.002, 0.001), "render": (0.004, 0.001), "loss": (0.001, 0.0005),
               "backward": (0.003, 0.001), "owner": (0.002, 0.001), "optimizer": (0.002, 0.0015)}


@pytest.mark.parametrize("step", [0.020, 0.010])  # more than the phases add up to, and less
def test_cost_model_predicts_the_measured_step_on_one_rank(step):
    g, cams, targets = tiny_scene()
    for t in (traffic.step_traffic(g, cams[:1], targets[:1], 1, 1, (0, 0, 0), 0.2, True, "cpu"), ideal_traffic(1)):
        m = scaling.predict_step(PHASE_TIMES, step, t, "sparse", 1e9)
        assert m["step"] == pytest.approx(step) and m["fixed"] >= 0 and m["link"].max() == 0
    assert scaling.predict_step({}, step, ideal_traffic(1), "dense", 1e9)["step"] == pytest.approx(step)


def test_cost_model_with_even_work_and_the_link():
    step = 0.020
    times = [scaling.predict_step(PHASE_TIMES, step, ideal_traffic(P), "dense", 1e9)["step"] for P in (1, 2, 4, 8)]
    # every rank does one view's work but Adam on a P-th of the rows; the fixed rest stays
    optimizer = PHASE_TIMES["optimizer"][0]
    assert times == pytest.approx([step - optimizer * (1 - 1 / P) for P in (1, 2, 4, 8)])
    rates = [P / s for P, s in zip((1, 2, 4, 8), times)]
    assert rates == sorted(rates)
    # bytes cost time: the less bandwidth, the slower; without bytes the link takes nothing
    busy = ideal_traffic(4, link_bytes=44_000_000)
    slow, fast = (scaling.predict_step(PHASE_TIMES, step, busy, "dense", bw)["step"] for bw in (1e9, 1e11))
    assert slow > fast > times[2]
    assert slow - times[2] == pytest.approx(busy.link_bytes("dense").max() / 1e9)


EXCHANGE_PHASE_TIMES = {**PHASE_TIMES, "plan": (0.001, 0.001), "forward_exchange": (0.002, 0.0015),
                        "halo_exchange": (0.0005, 0.0005), "backward_exchange": (0.003, 0.002), "reduce": (0.0004, 0.0004)}


@pytest.mark.parametrize("step", [0.030, 0.010])  # more than the phases add up to, and less
def test_cost_model_adds_the_exchange_pipelines_host_work_and_round_latency(step):
    phases = EXCHANGE_PHASE_TIMES
    total = sum(t for t, _ in phases.values())
    assert scaling.has_exchange_phases(phases) and not scaling.has_exchange_phases(PHASE_TIMES)
    # one rank of the exchange pipeline: its synced phases, not fitted into the step (each exchange syncs)
    one = scaling.predict_step(phases, step, ideal_traffic(1), "sparse", 1e9, latency_s=1e-3)
    assert one["step"] == pytest.approx(max(step, total)) and one["link"].max() == 0  # no round crosses ranks
    latency = 2e-4
    for P in (2, 4):
        m = scaling.predict_step(phases, step, ideal_traffic(P), "dense", 1e9, latency_s=latency)
        # every rank: a view's projection, plan, records and gradients packed (P views of a P-th of the
        # rows), its tiles; Adam a P-th; the halo and the sum as one rank's; each round's latency
        per_view = {"project", "plan", "owner", "forward_exchange", "backward_exchange", "render", "loss",
                    "backward", "halo_exchange", "reduce"}
        expect = sum(phases[k][0] for k in per_view) + phases["optimizer"][0] / P
        np.testing.assert_allclose(m["work"], expect)
        rounds = scaling.ROUNDS * latency * {2: 1, 4: 2}[P]  # a collective of P ranks: log2 P stages
        np.testing.assert_allclose(m["link"], rounds)
        assert m["step"] == pytest.approx(expect + rounds + max(step - total, 0.0))
    # measured on the single pipeline, the exchange pipeline's host work and the rounds' latency stay out
    # of the comparison table, as the pixel pipeline's do
    lines = scaling.exchange_model_table({2: even_pixel_counts(2)}, {2: ideal_traffic(2)}, phases, step, 1,
                                         {"NVLink": 370.0})
    own = sum(t for k, (t, _) in phases.items() if k not in PHASE_TIMES)
    single = scaling.predict_step(PHASE_TIMES, step - own, ideal_traffic(2), "sparse", 370e9)["step"]
    pixel = scaling.predict_pixel_step(PHASE_TIMES, step - own, even_pixel_counts(2), 370e9)["step"]
    assert lines[-1].split() == ["2", f"{2 / single:.1f}", f"{1 / pixel:.1f}"]


def even_pixel_counts(P, views=2, tiles=100, isect=5000, sent_tiles=0):
    """A ``PixelTraffic`` of P ranks whose work is split evenly, each sending every other ``sent_tiles``
    partial tiles a view forward (and as many gradients back)."""
    off = np.full((P, P), sent_tiles * views) - np.diag(np.full(P, sent_tiles * views))
    return traffic.PixelTraffic(forward=off, backward=off, full=off, saturated=None, rows=np.full(P, 1000),
                                isect=np.full(P, isect * views // P), composed=np.full(P, tiles * views // P),
                                views=views, order_mse=None)


@pytest.mark.parametrize("step", [0.020, 0.010])
def test_pixel_cost_model_splits_each_phase_by_its_work_and_adds_the_link(step):
    one = scaling.predict_pixel_step(PHASE_TIMES, step, even_pixel_counts(1), 1e9)
    assert one["step"] == pytest.approx(step) and one["link"].max() == 0  # one rank: the measured step
    scaled = sum(t for t, _ in PHASE_TIMES.values())
    fixed = step - min(1.0, step / scaled) * scaled
    for P in (2, 4, 8):  # every phase a P-th on every rank; the rest fixed
        m = scaling.predict_pixel_step(PHASE_TIMES, step, even_pixel_counts(P), 1e9)
        assert m["step"] == pytest.approx(fixed + (step - fixed) / P)
        busy = scaling.predict_pixel_step(PHASE_TIMES, step, even_pixel_counts(P, sent_tiles=10), 1e9)
        # a rank sends 10 tiles to each of the P - 1 others and gets as many gradients back
        sent = 2 * 10 * (P - 1) * traffic.PIXEL_TILE_BYTES
        assert busy["step"] - m["step"] == pytest.approx(sent / 1e9)
    # a rank with all the intersections renders all the view: the step is no shorter for its render
    skewed = even_pixel_counts(2)._replace(isect=np.array([10000, 0]))
    m = scaling.predict_pixel_step(PHASE_TIMES, step, skewed, 1e9)
    fit = min(1.0, step / scaled)
    assert m["work"][0] == pytest.approx(fit * (PHASE_TIMES["render"][0] + PHASE_TIMES["backward"][0]
                                                + (scaled - PHASE_TIMES["render"][0] - PHASE_TIMES["backward"][0]) / 2))


def test_largest_scene_grows_with_the_ranks_up_to_the_step_buffers():
    owner, render, device = 200.0, 100.0, 30e9
    fits = [scaling.largest_scene(owner, render, device, P) for P in (1, 2, 4, 8)]
    assert fits[0] == int(device // (owner + render)) and fits == sorted(fits)
    assert fits[-1] < device / render


def test_phase_table_has_a_column_per_rank_and_a_dash_where_a_rank_lacks_a_phase():
    lines = scaling.phase_table([{"project": (0.001, 0.0005)}, {"project": (0.002, 0.001), "plan": (0.003, 0.0)}],
                                5)
    assert "rank 1 (median ms)" in lines[1]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert rows["project"] == ["1.00", "(0.50)", "2.00", "(1.00)"] and rows["plan"] == ["-", "3.00", "(0.00)"]
    assert rows["sum"] == ["1.00", "(0.50)", "5.00", "(1.00)"]


def wall_capture(size=40):
    """An opaque wall of large Gaussians 6 in front of a patch of small ones, seen through the wall
    by two cameras: the kd-tree's cut falls between them (depth is the longest extent), and the
    wall leaves the patch's tiles in the dark.  -> (the Gaussians' arrays, the cameras)."""
    from engine.tools.camera_path import look_at
    rng = np.random.default_rng(3)
    x, y = np.meshgrid(np.linspace(-2.5, 2.5, 21), np.linspace(-2.5, 2.5, 21))
    wall = np.column_stack([x.ravel(), y.ravel(), np.full(x.size, 6.0)])
    patch = np.column_stack([rng.uniform(-1, 1, (60, 2)), rng.uniform(-0.2, 0.2, 60)])
    means = np.concatenate([wall, patch]).astype(np.float32)
    n, k = len(means), len(wall)
    scales = np.log(np.where(np.arange(n)[:, None] < k, 0.25, 0.1) * np.ones((n, 3))).astype(np.float32)
    opacities = np.where(np.arange(n) < k, 8.0, 0.0).astype(np.float32)
    quats = np.tile(np.float32([1, 0, 0, 0]), (n, 1))
    start = {"means": means, "scales": scales, "quats": quats, "opacities": opacities,
             "sh": rng.normal(0, 0.5, (n, 1, 3)).astype(np.float32)}
    cams = [ns.Camera(look_at((0.3 * i, 0.2, 9.0), (0.0, 0.0, 0.0), up=(0, 1, 0)), 0.9 * size, 0.9 * size,
                      size / 2, size / 2, size, size) for i in range(2)]
    return start, cams


def cloud_capture(size=40):
    """A cube of large, half-transparent Gaussians seen by the wall's cameras: the kd-tree's cut
    runs through it, so Gaussians of the two boxes interleave along the rays and composing the
    boxes in order is not the single render's blend order.  -> (the arrays, the cameras)."""
    start, cams = wall_capture(size)
    rng = np.random.default_rng(4)
    n = 120
    start = {"means": rng.uniform(-1, 1, (n, 3)).astype(np.float32),
             "scales": np.full((n, 3), np.log(0.35), np.float32), "quats": np.tile(np.float32([1, 0, 0, 0]), (n, 1)),
             "opacities": np.zeros(n, np.float32), "sh": rng.normal(0, 0.5, (n, 1, 3)).astype(np.float32)}
    return start, cams


@pytest.mark.parametrize("scene,P", [("slabs", 2), ("slabs", 3), ("wall", 2), ("cloud", 2)])
def test_pixel_bytes_against_a_brute_force_count(scene, P):
    """The pixel-level pipeline's tiles per step: those of each box's partial image that are not
    nothing (colour 0, transmittance 1), counted per composer's range with its halo (forward)
    and without (backward); and of the forward ones those whose every pixel the boxes in front leave
    under SATURATED of the light (saturation reduction); and the partial images composed in box order
    against the single render."""
    import numbasplat as ns
    from numbasplat.compose import compose
    from engine.pipelines.distributed import even_bounds
    from engine.pipelines.gaussian_exchange import halo_ranges
    from engine.tools.camera_path import centres
    from engine.pipelines.partition import SpatialPartition
    from engine.pipelines.pixel_exchange import SATURATED
    from numbasplat.rendering import image_tiles
    from scenes import slab_capture
    if scene == "slabs":
        data, start = slab_capture(n_slabs=3, per_slab=20, views=2, size=40)
        cams = [v.camera for v in data.train]
    else:
        start, cams = (wall_capture if scene == "wall" else cloud_capture)()
    g = ns.Gaussians(**start)
    counts = traffic.pixel_traffic(g, cams, P, 0, "cpu", saturation=True)
    forward, backward, full, saturated = counts[:4]
    part = SpatialPartition.build(start["means"], P)
    owner = part.owner(start["means"])
    want_f, want_b, want_full, want_s = (np.zeros((P, P), np.int64) for _ in range(4))
    want_isect, want_composed = np.zeros(P, np.int64), np.zeros(P, np.int64)
    squared, pixels, black = 0.0, 0, np.zeros(3, np.float32)
    for cam in cams:
        layers = []
        tx, ty = cam.tiles
        n = tx * ty
        bounds = even_bounds(n, P)
        want_composed += np.diff(bounds)
        _, _, need_lo, need_hi = halo_ranges(bounds, tx, n)
        reach = np.ones((cam.height, cam.width))  # the light reaching each box, front to back
        for r in part.front_to_back(centres([cam])[0]):
            box = ns.Gaussians(*(a[owner == r] for a in start.values()))
            f = ns.render(box, cam, background=black, backend="cpu")
            layers.append(f)
            partial = np.concatenate([f.image, f.render.trans[..., None]], axis=2)
            something = (np.abs(image_tiles(partial, 0, n).reshape(n, -1, 4) - [0, 0, 0, 1]) > 0).any(axis=(1, 2))
            dark = image_tiles(reach[..., None], 0, n).reshape(n, -1).max(axis=1) < SATURATED
            reach = reach * f.render.trans
            want_isect[r] += f.binning.n_isect
            for d in range(P):
                want_f[r, d] += something[need_lo[d]:need_hi[d]].sum()
                want_b[r, d] += something[bounds[d]:bounds[d + 1]].sum()
                want_full[r, d] += need_hi[d] - need_lo[d]
                want_s[r, d] += (something & dark)[need_lo[d]:need_hi[d]].sum()
        composite, _ = compose(np.stack([f.image for f in layers]), np.stack([f.render.trans for f in layers]), black)
        single = ns.render(g, cam, background=black, backend="cpu").image
        squared += float(((composite - single) ** 2).sum())
        pixels += composite.size
    np.testing.assert_array_equal(forward, want_f)
    np.testing.assert_array_equal(backward, want_b)
    np.testing.assert_array_equal(full, want_full)
    np.testing.assert_array_equal(saturated, want_s)
    # the work the cost model scales by: each box's Gaussians, its partial renders' intersections, the tiles composed
    np.testing.assert_array_equal(counts.rows, np.bincount(owner, minlength=P))
    np.testing.assert_array_equal(counts.isect, want_isect)
    np.testing.assert_array_equal(counts.composed, want_composed)
    assert counts.views == len(cams)
    assert (forward <= full).all() and forward.sum() > 0 and (saturated.sum() > 0) == (scene == "wall")
    assert counts.order_mse == pytest.approx(squared / pixels, rel=1e-6, abs=1e-15)
    assert (counts.order_mse > 1e-6) == (scene == "cloud")  # only the cloud's boxes interleave along the rays
    assert traffic.pixel_traffic(g, cams, P, 0, "cpu").saturated is None  # (not rendered unless asked)


def test_scaling_out_of_core_reports_the_working_set_bytes_and_each_tiers_largest_model(city):
    """``run(offload=...)``: the out-of-core trainer, then where the device's bytes per working-set Gaussian
    go (``working_set_bytes`` at the last view's intersections, its items adding up to the peak) and, under
    the --gpu-memory cap, the largest model the device's index allows and the working set beside it, host
    memory's and the disk's, and a billion Gaussians at SH degree 3 on paper."""
    from engine.stores.offload.store import VIEW_BYTES_PER_PIXEL, DeviceCache, working_set_bytes
    w = scaling.data_workload(city, views=2)
    lines = []
    report = scaling.run(w, iters=1, warmup=1, out=lines.append, backend="cpu",
                         offload=dict(offload="host", gpu_memory=64 * 2**20))
    text = "\n".join(lines)
    assert "OffloadTrainer" in text and "device bytes per working-set Gaussian at SH degree" in text
    assert "on paper, 1B Gaussians at SH degree 3" in text
    k = report["intersections_per_gaussian"]
    assert k > 0
    items, peak = report["working_set_bytes"], report["working_set_peak_bytes"]
    assert report["not_built"] == {"moments in host memory": peak - 2 * 4 * 23, "moments in bfloat16": peak - 4 * 23}
    binning, scratch, backward = list(items.values())[4:]
    assert peak == sum(list(items.values())[:4]) + max(binning + scratch, backward)
    budget = 64 * 2**20 - VIEW_BYTES_PER_PIXEL * 64 * 36  # (and the training images on the device: none here)
    largest = report["largest"]
    assert largest["working set"] == int((budget - DeviceCache.INDEX_BYTES * 20_000) // peak)
    assert 0 < largest["working set"] < largest["device"] < budget // DeviceCache.INDEX_BYTES
    tiers = report["tier_bytes"]
    assert tiers["host"] == tiers["disk"] == 4 * (3 * 23 + 3)  # (SH degree 1: 23 parameters; 3 statistics)
    assert tiers["host_growing"] == tiers["host"] * 9 // 4
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert largest["host growing"] < largest["host"] <= ram // (tiers["host"] + tiers["host_index"])
    assert report["on_paper"]["working_set"] == \
        working_set_bytes(*_sh3_layout_and(k))[1]


def _sh3_layout_and(k):
    """(the rows' layout at SH degree 3 with the default strategy's statistics, ``k``)."""
    from engine.recipe.strategy import DefaultStrategy
    from engine.stores.offload import RowLayout
    return RowLayout(16, DefaultStrategy.fresh_statistics(np, 0)), k
