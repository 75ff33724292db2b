"""engine/pipelines/pixel_exchange.py, Splaxel's pixel-level pipeline: one rank equals the single-process
trainer exactly (with B views in flight, the batched pipeline's step); 2 and 4 ranks (boxes
separated in depth) equal one rank within 1e-5."""
import os
import subprocess
import sys

from dataclasses import replace

import numpy as np
import pytest

from conftest import REPO_ROOT, mpiexec_path

from engine.pipelines.pixel_exchange import PixelExchangeTrainer
from engine.pipelines.single_gpu import SingleGPUTrainer
from engine.recipe.trainer import TrainConfig
from scenes import slab_capture


def check(ranks, out, *flags, timeout=500):
    """tests/check_mpi_pixel.py on ``ranks`` CPU ranks -> (its output, its OUT/final.npz arrays or None)."""
    env = dict(os.environ, NUMBASPLAT_BACKEND="cpu", NUMBA_NUM_THREADS="1")
    r = subprocess.run([mpiexec_path(), "-n", str(ranks), sys.executable, str(REPO_ROOT / "tests" / "check_mpi_pixel.py"),
                        str(out), *flags], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    final = out / "final.npz"
    return r.stdout, dict(np.load(final)) if final.is_file() else None


def config():
    return TrainConfig(iterations=6, sh_degree=0, snapshot_every=0, log_every=3, background=(1.0, 1.0, 1.0),
                       densify_from=10**6)


def test_one_rank_equals_the_single_process_trainer(tmp_path):
    from mpi4py import MPI
    data, start = slab_capture(n_slabs=2, per_slab=30, views=3)
    runs = []
    for name, make in (("single", lambda: SingleGPUTrainer(data, tmp_path / "single", config(), backend="cpu")),
                       ("pixel", lambda: PixelExchangeTrainer(data, tmp_path / "pixel", config(), MPI.COMM_SELF,
                                                              backend="cpu"))):
        t = make()
        t.start_from({"params": start})
        t.train(progress=False)
        runs.append(t.model.host_arrays())
    for k, a in runs[0].items():
        np.testing.assert_array_equal(runs[1][k], a, err_msg=k)


def test_views_in_flight_at_one_rank_are_the_batched_pipelines_step(tmp_path):
    """``batch_size`` B at one rank: B views rendered, composed and back-propagated, one Adam step on
    their mean gradient with batched Adam's betas and learning rates, as the Gaussian-level pipeline's
    batch of B views in one process (``--batch-size B`` without mpirun) trains."""
    from mpi4py import MPI
    from engine.pipelines.gaussian_exchange import GaussianExchangeTrainer
    data, start = slab_capture(n_slabs=2, per_slab=30, views=3)
    runs = []
    for name, pipeline in (("gaussian", GaussianExchangeTrainer), ("pixel", PixelExchangeTrainer)):
        t = pipeline(data, tmp_path / name, config(), MPI.COMM_SELF, backend="cpu", batch_size=2)
        t.start_from({"params": start})
        t.train(progress=False)
        assert t.step == 6 and t.model.adam.step_count == 3
        runs.append(t.model.host_arrays())
    for k, a in runs[0].items():
        np.testing.assert_allclose(runs[1][k], a, rtol=1e-5, atol=1e-7, err_msg=k)
    assert not np.allclose(runs[1]["sh"], start["sh"])  # it trained


def _run_recording(tmp_path, name, ahead, cfg=None):
    """One rank's pixel pipeline with ``ahead`` steps rendered ahead on the slab capture -> (the trainer,
    [(the first image of each step started, the means it rendered)], [the means after 0, 1, ... images])."""
    from mpi4py import MPI
    data, start = slab_capture(n_slabs=2, per_slab=30, views=3)
    t = PixelExchangeTrainer(data, tmp_path / name, cfg or config(), MPI.COMM_SELF, backend="cpu",
                             render_ahead=ahead)
    t.start_from({"params": start})
    rendered, after = [], [start["means"].copy()]
    begin, finish = t._start_step, t._finish_step
    t._start_step = lambda first, clock: rendered.append((first, t.model.group("means").copy())) or begin(first, clock)
    t._finish_step = lambda flight, clock: (finish(flight, clock), after.append(t.model.group("means").copy()))[0]
    return t, rendered, after


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_a_step_rendered_ahead_renders_the_parameters_from_before_the_updates_in_front_of_it(tmp_path, ahead):
    """With K steps rendered ahead, the step that starts at image f renders the parameters as they were
    after image f - K (its gradient K steps stale); with none, those after image f."""
    t, rendered, after = _run_recording(tmp_path, f"k{ahead}", ahead)
    t.train(progress=False)
    assert t.step == 6 and [f for f, _ in rendered] == list(range(6)) and len(after) == 7
    for first, means in rendered:
        np.testing.assert_array_equal(means, after[max(first - ahead, 0)], err_msg=str(first))
        if ahead and first > ahead:
            assert not np.array_equal(means, after[first]), first  # (the updates it missed moved the means)
    assert not t._in_flight  # emptied at the end


def test_steps_rendered_ahead_where_the_pipeline_empties_every_step_train_as_none(tmp_path, monkeypatch):
    import engine.pipelines.pixel_exchange as px
    finals = []
    for ahead in (0, 1):
        t, _, _ = _run_recording(tmp_path, f"settled{ahead}", ahead)
        if ahead:
            monkeypatch.setattr(px, "SETTLE_EVERY", 1)
        t.train(progress=False)
        finals.append(t.model.host_arrays())
    for k, a in finals[0].items():
        np.testing.assert_array_equal(finals[1][k], a, err_msg=k)


def test_steps_rendered_ahead_resume_from_a_snapshot_as_the_whole_run(tmp_path):
    """The pipeline empties at a snapshot step: stopped there and resumed, a run with a step rendered
    ahead ends as the whole run.  A snapshot written mid-flight (a stop signal) drops the step in
    flight and puts its views and the RNG back, as a run without steps ahead holds them then."""
    from mpi4py import MPI
    from engine.tools.snapshot import read_snapshot
    cfg = replace(config(), snapshot_every=3)
    whole, started, _ = _run_recording(tmp_path, "whole", 1, cfg)
    whole.train(progress=False)
    assert [f for f, _ in started] == list(range(6))  # (none rendered ahead past the snapshot, to be dropped)
    first, _, _ = _run_recording(tmp_path, "parts", 1, cfg)
    first.train(progress=False, until=3)
    assert first.step == 3 and not first._in_flight
    second = PixelExchangeTrainer(first.data, tmp_path / "parts", cfg, MPI.COMM_SELF, backend="cpu", render_ahead=1)
    second.load_snapshot(tmp_path / "parts" / "snapshot.h5")
    second.train(progress=False)
    for k, a in whole.model.host_arrays().items():
        np.testing.assert_array_equal(second.model.host_arrays()[k], a, err_msg=k)
    held = {}
    for ahead in (0, 1):
        t, _, _ = _run_recording(tmp_path, f"mid{ahead}", ahead)
        while t.step < 2:
            t.train_step()
        assert len(t._in_flight) == ahead
        t.save_snapshot()
        assert not t._in_flight
        _, attrs = read_snapshot(str(tmp_path / f"mid{ahead}" / "snapshot.h5"))
        held[ahead] = (list(attrs["order"]), str(attrs["rng"]), t.rng.random())
    assert held[1] == held[0]


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks, flags", [(2, ()), (4, ()), (2, ("batch2",)), (2, ("ahead1",))])
def test_ranks_of_depth_separated_boxes_train_as_one(tmp_path, ranks, flags):
    """(With a batch of 2 buckets a step, or a step rendered ahead, the same at P ranks as at one.)"""
    finals = []
    for n in (1, ranks):
        text, final = check(n, tmp_path / f"p{n}", *flags)
        finals.append(final)
        if n > 1:  # every rank held a slab's worth
            boxes = eval(text.split("boxes")[1])
            assert len(boxes) == ranks and min(boxes) > 0, text
    ref, got = finals
    np.testing.assert_allclose(got.pop("losses"), ref.pop("losses"), rtol=1e-4)  # (float32 shares, summed)
    for k, a in ref.items():
        assert got[k].shape == a.shape, k
        assert np.linalg.norm(got[k] - a) / np.linalg.norm(a) <= 1e-5, k
    assert not np.allclose(ref["sh"], slab_capture()[1]["sh"])  # it trained


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ahead", [0, 1])
def test_train_exchange_pixel_densifies_rebalances_and_resumes_on_other_ranks(tmp_path, ahead):
    """``mpiexec -n 2 run.py train --exchange pixel`` with densification (the Gaussians migrate to
    their boxes' owners and the tree is rebuilt when one rank holds over 1.1x the mean), a
    snapshot and PLY of the whole model; resumed on one process it repartitions and goes on.  With
    a step rendered ahead (``--render-ahead 1``) the same."""
    import json
    from engine.tools.demo import make_dataset
    from test_trainer import write_blender_capture
    cap, out = tmp_path / "capture", tmp_path / "out"
    write_blender_capture(cap, make_dataset(size=32, n_views=10, backend="cpu"))
    args = [sys.executable, "run.py", "train", "--data", str(cap), "--white-background", "--out", str(out), "--quiet",
            "--sh-degree", "1", "--init-points", "400", "--densify-from", "4", "--densify-every", "8",
            "--grad-threshold", "1e-5", "--exchange", "pixel", "--saturation", "off", "--render-ahead", str(ahead)]
    env = dict(os.environ, NUMBASPLAT_BACKEND="cpu", NUMBA_NUM_THREADS="1")
    r = subprocess.run([mpiexec_path(), "-n", "2", *args, "--iters", "24"], capture_output=True, text=True,
                       timeout=500, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    grown = [rec for rec in log if rec.get("cloned", 0) + rec.get("split", 0) > 0]
    assert grown and grown[-1]["gaussians_total"] > 400, log
    assert sum(rec["migrated"] for rec in grown) > 0, grown  # children and moved centres changed boxes
    # every rank's phase times and its host's time in the collectives, per log record (issue 63)
    assert all(len(rec["rank_stats"]) == 2 and all(s["collective_ms"] > 0 and "times" in s for s in rec["rank_stats"])
               for rec in log), log[-1]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["gaussians"] == log[-1]["gaussians_total"] and np.isfinite(metrics["psnr"])
    recorded = json.loads((out / "cfg.json").read_text())
    assert recorded["batch_size"] == 1 and recorded["render_ahead"] == ahead
    r = subprocess.run([*args, "--iters", "28", "--resume"], capture_output=True, text=True, timeout=500, env=env,
                       cwd=REPO_ROOT)
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout + r.stderr
    assert json.loads((out / "metrics.json").read_text())["iterations"] == 28


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scene", [("clusters",), ("clusters", "batch2"), ("visible", "wander")])
def test_ranks_offloading_their_boxes_train_as_in_memory(tmp_path, scene):
    """``--offload host`` with ``--exchange pixel``: each rank's Gaussians out of core (blocks of 8
    rows), its views' working set on the device, with refinements (grown fourfold): two clusters seen
    one at a time (a rank in no view some steps; with two buckets a step, a rank in up to two views),
    and slabs whose Gaussians wander into the other box and migrate there every step (the means'
    rates 3000x): equal to the ranks in memory with visible-only Adam, bit for bit."""
    runs = [check(2, tmp_path / name, *scene, "densify", *flags)
            for name, flags in (("memory", ()), ("offload", ("offload",)))]
    (text, memory), (_, offload) = runs
    assert len(memory["means"]) > 200  # it refined (from 80 or 160 rows; about 320 after)
    if "wander" in scene:
        assert int(text.split("migrated")[1].split()[0]) > 50, text
    for k, a in memory.items():
        np.testing.assert_array_equal(offload[k], a, err_msg=k)


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ahead", [("ahead1",), ()])
def test_gaussians_migrate_only_every_settle_images_and_where_the_pipeline_is_empty(tmp_path, ahead):
    """2 ranks, slabs whose Gaussians wander into the other box, refinements at images 4 and 8 and
    migrations every 2 images (``SETTLE_EVERY``), with and without a step rendered ahead: the Gaussians
    migrate there and only there (never under a render in flight, whose rows they would move; not
    every step, whose collective and rebuilt buffers cost more than the step), and the model trains."""
    text, final = check(2, tmp_path, "visible", "wander", "densify", "settle2", *ahead)
    line = text.split("gaussians")[1]
    migrations, in_flight, moved = (int(line.split(k)[1].split()[0]) for k in ("migrations", "in flight", "migrated"))
    assert migrations >= 4 and in_flight == 0 and moved > 50, text  # at images 2, 4 (refined: again if rebuilt), 6, 8
    assert all(step % 2 == 0 for step in eval(line.split(" at ")[1])), text
    assert len(final["means"]) > 200 and all(np.isfinite(a).all() for a in final.values())


@pytest.mark.mpi
@pytest.mark.timeout(500)
def test_cli_exchange_pixel_offloads_each_ranks_gaussians(tmp_path):
    """``mpiexec -n 2 run.py train --exchange pixel --offload host --eval``: the out-of-core pipeline, its
    traffic in the log, a snapshot and a PLY of the whole model, its test views rendered from the model
    in host memory."""
    import json
    from engine.tools.demo import make_dataset
    from test_trainer import write_blender_capture
    cap, out = tmp_path / "capture", tmp_path / "out"
    write_blender_capture(cap, make_dataset(size=32, n_views=10, backend="cpu"))
    env = dict(os.environ, NUMBASPLAT_BACKEND="cpu", NUMBA_NUM_THREADS="1")
    r = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "run.py", "train", "--data", str(cap),
                        "--white-background", "--out", str(out), "--quiet", "--sh-degree", "1", "--init-points", "400",
                        "--densify-from", "4", "--densify-every", "8", "--grad-threshold", "1e-5", "--exchange",
                        "pixel", "--offload", "host", "--iters", "12", "--log-every", "4", "--eval"],
                       capture_output=True, text=True, timeout=450, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 12 and log[-1]["moved_bytes"] > 0 and "resident_gaussians" in log[-1]
    assert (out / "snapshot.h5").exists() and any(out.glob("point_cloud/*/point_cloud.ply"))
    metrics = json.loads((out / "metrics.json").read_text())  # (evaluated from the model in host memory)
    assert metrics["gaussians"] == log[-1]["gaussians_total"] and np.isfinite(metrics["psnr"])


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_gaussians_migrate_to_their_box_and_the_tree_is_rebuilt_when_unbalanced(tmp_path):
    """Every Gaussian moved into rank 0's box: they all migrate there, rank 0 then holds 3x the
    mean, the tree is rebuilt over the new centres and the rows spread evenly again, none lost; each
    Gaussian's Adam moments and strategy statistics travel with it (only the leaving rows are sent)."""
    text, _ = check(3, tmp_path, "rebalance", timeout=250)
    line = text.split("rebalance")[1]
    assert "'rebuilt': True" in line and "same rows True" in line and "moments travelled True" in line, text
    counts = eval(line.split("counts")[1].split("same")[0])
    assert sum(counts) == 160 and max(counts) <= 1.1 * 160 / 3, counts
    assert int(line.split("'migrated': ")[1].split("}")[0].split(",")[0]) > 160 * 2 // 3  # all but box 0's, then more


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_saturated_tiles_are_skipped_on_later_visits_at_the_loss_of_at_most_their_light(tmp_path):
    """An opaque top slab hides part of the bottom one: from the second epoch on, the back rank
    neither renders nor sends the tiles the front saturates; the losses stay those of the full
    composition to within the light skipped (SATURATED), and ``saturation=False`` skips none."""
    runs = {}
    for flags in (("opaque",), ("opaque", "saturation-off")):
        text, final = check(2, tmp_path / "-".join(flags), *flags)
        steps = [line.split() for line in text.splitlines() if line.startswith("step ")]
        runs[flags] = ([eval(" ".join(s[3:-2])) for s in steps], final["losses"])
    skipped, losses = runs[("opaque",)]
    none, full = runs[("opaque", "saturation-off")]
    assert all(sum(k) == 0 for k in skipped[:4])                    # the first epoch composes fully
    assert all(k[1] == 0 for k in skipped) and sum(k[0] for k in skipped[4:]) > 0  # the back rank (0) skips
    assert all(sum(k) == 0 for k in none)
    np.testing.assert_allclose(losses[:4], full[:4], rtol=1e-6)
    assert np.abs(losses - full).max() < 1e-3 * full.max(), (losses, full)


def test_saturation_marks_each_rank_behind_where_the_light_in_front_of_it_is_spent():
    """``Saturation.saturated`` on three ranks in the order 2, 0, 1 over a 2x2-tile view: the front
    rank is never marked; rank 0 where the front layer's light is spent, rank 1 where the product of the
    two layers in front of it is (each tile alone, and only where all its pixels are dark)."""
    from engine.pipelines.pixel_exchange import SATURATED, Saturation
    trans = np.ones((3, 32, 32), np.float32)  # the layers in the order's positions: front, middle, back
    trans[0, :16, :16] = 0.0                          # tile 0: the front layer spends it
    trans[0, :16, 16:] = trans[1, :16, 16:] = 0.5 * SATURATED ** 0.5  # tile 1: only the two in front together
    trans[0, 16:, :16] = 0.0
    trans[0, 31, 0] = 1.0                             # tile 2: one pixel lit: not saturated
    marks = Saturation.saturated(trans, [2, 0, 1], 0, 4, 3)
    np.testing.assert_array_equal(marks, [[True, False, False, False], [True, True, False, False],
                                          [False, False, False, False]])
    np.testing.assert_array_equal(Saturation.saturated(trans, [2, 0, 1], 1, 3, 3), marks[:, 1:3])


def test_consolidation_buckets_views_of_disjoint_ranks_in_order():
    from engine.pipelines.pixel_exchange import consolidate, utilisation
    parts = [frozenset(s) for s in ({0}, {1}, {0, 1}, {2}, {1, 2}, {0}, {3})]
    buckets = consolidate(parts)
    assert buckets == [[0, 1, 3, 6], [2], [4, 5]]  # first fit, in the views' order ({1, 2} meets both)
    for b in buckets:
        ranks = [r for k in b for r in parts[k]]
        assert len(ranks) == len(set(ranks))     # no rank twice in a bucket
    u = utilisation(parts, buckets, 4)
    assert u["utilisation_before"] == pytest.approx(9 / 7 / 4)
    assert u["utilisation_after"] == pytest.approx((4 + 2 + 3) / 3 / 4)


class _StubAllgather:
    """A stand-in communicator whose ``Allgather`` keeps the caller's buffer as ``rank``'s (in ``sent``)
    and answers with every rank's buffer kept so far (zeros for those not yet sent)."""

    def __init__(self, rank, size, sent):
        self.rank, self.size, self.sent = rank, size, sent

    def Get_size(self):
        return self.size

    def Allgather(self, send, recv):
        self.sent[self.rank] = send.copy()
        for r in range(self.size):
            recv[r] = self.sent.get(r, 0)


def test_covered_tiles_gathered_as_bits_are_every_ranks_tiles_of_the_views_it_takes_part_in():
    """``_allgather_covered``: three ranks, views of tile counts that are not whole bytes, a rank in some
    views only; each rank's {view: covered tiles} comes back as it was sent, for its views alone."""
    from types import SimpleNamespace
    from engine.pipelines.pixel_exchange import _allgather_covered
    plans = [SimpleNamespace(n_tiles=5, composers=[0, 2]), SimpleNamespace(n_tiles=12, composers=[1, 2]),
             SimpleNamespace(n_tiles=3, composers=[0, 1, 2])]
    rng = np.random.default_rng(1)
    mine = [{k: rng.random(p.n_tiles) < 0.5 for k, p in enumerate(plans) if r in p.composers} for r in range(3)]
    sent = {}
    for r in range(3):
        got = _allgather_covered(_StubAllgather(r, 3, sent), plans, mine[r])
    assert [sorted(d) for d in got] == [[0, 2], [1, 2], [0, 1, 2]]
    for r in range(3):
        for k, tiles in mine[r].items():
            np.testing.assert_array_equal(got[r][k], tiles, err_msg=f"rank {r} view {k}")


def test_a_rank_holding_part_of_the_sky_takes_part_only_in_the_views_that_see_its_gaussians():
    """Rank 0 holds one cluster and a sky far above both; rank 1 the other cluster.  One box over
    rank 0's Gaussians would span rank 1's cluster too (every view would count rank 0); its boxes of
    a few Gaussians each leave a view looking down at rank 1's cluster to rank 1 alone."""
    from engine.pipelines.pixel_exchange import participants, rank_boxes
    from scenes import cluster_capture
    data, start = cluster_capture(per_cluster=40, views=4)
    rng = np.random.default_rng(0)
    sky = np.column_stack([rng.uniform(-100, 100, (80, 2)), np.full(80, 100.0)]).astype(np.float32)
    left = start["means"][:, 0] < 0
    means = [np.concatenate([start["means"][left], sky]), start["means"][~left]]
    scales = [np.concatenate([start["scales"][left], np.zeros((80, 3), np.float32)]), start["scales"][~left]]
    cams = [v.camera for v in data.train]  # views 0 and 2 look at the right cluster, 1 and 3 at the left
    got = participants([rank_boxes(m, s, rows=8) for m, s in zip(means, scales)], cams)  # (the cluster: 5 boxes)
    assert got == [frozenset({1}), frozenset({0}), frozenset({1}), frozenset({0})]
    coarse = participants([rank_boxes(m, s, rows=10**6) for m, s in zip(means, scales)], cams)
    assert coarse[0] == frozenset({0, 1})  # (one box a rank: the sky's box spans the right cluster)


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_views_of_disjoint_boxes_train_side_by_side(tmp_path):
    """Two clusters, each view sees one: consolidation trains two views a step (utilisation 0.5 ->
    1.0, half the steps) and fits as well as one view a step."""
    runs = {}
    for flags in (("clusters",), ("clusters", "consolidation-off")):
        text, final = check(2, tmp_path / "-".join(flags), *flags)
        runs[flags] = (text, final["losses"])
    text, together = runs[("clusters",)]
    _, alone = runs[("clusters", "consolidation-off")]
    assert "steps 6 utilisation {'utilisation_before': 0.5, 'utilisation_after': 1.0}" in text, text
    assert len(alone) == 12 and len(together) == 6
    assert together[-2:].mean() < 1.25 * alone[-4:].mean() and together[-1] < together[0]


def test_pixel_exchange_refuses_what_it_does_not_do(tmp_path):
    from mpi4py import MPI
    data, _ = slab_capture(n_slabs=2, per_slab=4, views=1)
    for change, message in ((dict(loss="tile"), "--exchange pixel trains with --loss global"),
                            (dict(strategy="mcmc"), "densifies with the default strategy")):
        cfg = config()
        for k, v in change.items():
            setattr(cfg, k, v)
        with pytest.raises(ValueError, match=message):
            PixelExchangeTrainer(data, tmp_path, cfg, MPI.COMM_SELF, backend="cpu")
    with pytest.raises(ValueError, match="--render-ahead -1"):
        PixelExchangeTrainer(data, tmp_path, config(), MPI.COMM_SELF, backend="cpu", render_ahead=-1)
    from engine.pipelines import PipelineOptions, make_trainer
    offloading = PipelineOptions(exchange="pixel", offload="host", render_ahead=1)
    with pytest.raises(ValueError, match="--render-ahead with --offload host: each step loads its own working set"):
        make_trainer(data, tmp_path, config(), offloading, MPI.COMM_SELF)


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_exchange_auto_counts_both_exchanges_and_trains_with_the_smaller(tmp_path):
    """``--exchange auto``: rank 0's byte counts (engine/pipelines/traffic.py) agree with the two counters run
    directly, and ``mpiexec -n 2 run.py train --exchange auto`` says its choice and trains with it."""
    import numbasplat as ns
    from engine.tools.demo import make_dataset
    from engine.pipelines.traffic import PIXEL_TILE_BYTES, exchange_bytes, off_diagonal, pixel_traffic, step_traffic
    from engine.recipe.trainer import initial_arrays
    from test_trainer import write_blender_capture
    data = make_dataset(size=32, n_views=10, backend="cpu")
    cfg = config()
    sizes = exchange_bytes(data, cfg, 2, backend="cpu")
    g = ns.Gaussians(**initial_arrays(data, cfg, np.random.default_rng(cfg.seed)))
    views = [data.train[0], data.train[-1]]
    fwd, bwd, full, _ = pixel_traffic(g, [v.camera for v in views], 2, 0, backend="cpu")[:4]
    assert sizes["pixel"] == off_diagonal(fwd + bwd).sum() * PIXEL_TILE_BYTES / 2
    t = step_traffic(g, [v.camera for v in views], [v.image for v in views], 2, 0, np.ones(3), 0.2, backend="cpu")
    assert sizes["gaussian"] == t.crossing("sparse").sum() / 2 > 0
    cap = tmp_path / "cap"
    write_blender_capture(cap, data)
    env = dict(os.environ, NUMBASPLAT_BACKEND="cpu", NUMBA_NUM_THREADS="1")
    r = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "run.py", "train", "--data", str(cap),
                        "--white-background", "--out", str(tmp_path / "out"), "--quiet",
                        "--exchange", "auto", "--sh-degree", "0", "--iters", "12", "--densify-from", "2",
                        "--densify-every", "2", "--densify-until", "8", "--opacity-reset-every", "4"],
                       capture_output=True, text=True, timeout=500,
                       env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    said = [line for line in r.stdout.splitlines() if line.startswith("--exchange auto: ")]
    assert len(said) == 1, r.stdout
    again = [line.split() for line in r.stdout.splitlines() if line.startswith("--exchange auto at step ")]
    steps = [int(w[4][:-1]) for w in again]
    # before each opacity reset and where densification ends: 3, 7, 8 (a batch of two views may step one past)
    assert len(steps) == 3 and all(0 <= s - d <= 1 for s, d in zip(steps, (3, 7, 8))), r.stdout
    choices = {said[0].split()[2]} | {w[5] for w in again}
    assert choices <= {"pixel", "gaussian"}
    assert ("pixel exchange" in r.stdout) == ("pixel" in choices), r.stdout


def test_exchange_auto_decides_again_where_densification_phases_end():
    from engine.pipelines import exchange_decision_steps
    cfg = config()
    cfg.iterations, cfg.densify_until, cfg.opacity_reset_every = 30_000, 15_000, 3000
    assert exchange_decision_steps(cfg, 0) == [2999, 5999, 8999, 11999, 14999, 15000]
    assert exchange_decision_steps(cfg, 9000) == [11999, 14999, 15000]  # (a resumed run: those still ahead)
    cfg.iterations = 7000
    assert exchange_decision_steps(cfg, 0) == [2999, 5999]
    cfg.opacity_reset = False
    assert exchange_decision_steps(cfg, 0) == []


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_exchange_auto_hands_over_through_the_snapshot(tmp_path):
    """A chooser that flips the exchange at each decision step: the run switches pipelines there and
    ends exactly where the same legs trained by hand, each resumed from the last one's snapshot, end.
    (The Gaussian-level pipeline steps by a batch of two views, so it stops at 4 for 3 and 11 for 10.)"""
    env = dict(os.environ, NUMBASPLAT_BACKEND="cpu", NUMBA_NUM_THREADS="1")
    script = REPO_ROOT / "tests" / "check_mpi_exchange_auto.py"
    r = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(script), str(tmp_path)], capture_output=True,
                       text=True, timeout=500, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("decisions"))
    assert line.startswith("decisions [3, 7, 10] chosen [(4, 'pixel'), (7, 'gaussian'), (11, 'pixel')] "
                           "last pixel same True"), line
    # --polish-steps 4: the Gaussian-level exchange at one view a step from step 10, as by hand
    assert "polish ('gaussian', 1, 10) same True" in r.stdout, r.stdout
