"""engine/stores/offload.py: out-of-core training with the model in host memory or on disk equals in-memory
training with visible-only Adam and the same view order (across densification and a snapshot/resume,
with the device's cache and the host's capped so that blocks move), its blocks cull views
conservatively, its caches move only what is missing, and bad input stops it with one message."""
import errno
import json
import os
import re
from dataclasses import replace

import numpy as np
import pytest

from engine.tools.demo import make_dataset
from engine.pipelines.single_gpu import OffloadTrainer
from engine.stores.offload import (BlockIndex, BoxesInFlight, DeviceCache, DiskBlocks, HostBlocks, RowLayout,
                                   format_bytes)
from engine.pipelines.partition import REACH, morton_codes
from numbasplat.optim import adam_step_bound
from engine.pipelines.single_gpu import SingleGPUTrainer
from engine.pipelines.step_graphs import StepGraphs
from engine.recipe.strategy import DefaultStrategy
from engine.recipe.trainer import SNAPSHOT
from numbasplat.optim import GROUPS
from numbasplat.rows import reach_boxes
from conftest import REPO_ROOT, run_sim
from tests.scenes import reach_table
from test_trainer import fast_refine, small_config

import numbasplat as ns


def slot_bytes(sh_bases, block_rows=16, adam="device"):
    """Device bytes that the store budgets for a block slot of ``block_rows`` rows at ``sh_bases`` (the default
    strategy's statistics; Adam on the ``adam`` side): what the tests' caps are made of."""
    from engine.stores.offload.store import working_set_bytes
    layout = RowLayout(sh_bases, DefaultStrategy.fresh_statistics(np, 0))
    return int(np.ceil(block_rows * working_set_bytes(layout, adam=adam)[1]))


def view_bytes(data):
    """The device bytes that the store keeps for ``data``'s largest training view's per-pixel buffers (the caps
    count them)."""
    from engine.stores.offload.store import VIEW_BYTES_PER_PIXEL
    return VIEW_BYTES_PER_PIXEL * max(v.camera.width * v.camera.height for v in data.train)


@pytest.fixture(scope="module")
def dataset():
    return make_dataset(size=32, n_views=12, backend="cpu")


def test_morton_blocks_are_compact_and_their_boxes_cull_conservatively(dataset):
    rng = np.random.default_rng(0)
    means = rng.uniform(-2, 2, (3000, 3))
    codes = morton_codes(means)
    assert len(np.unique(codes)) > 2900
    index = BlockIndex(means, np.log(np.full((3000, 3), 0.05)), block_rows=100)
    assert index.blocks == 30 and (np.bincount(index.block) == 100).all()
    spans = [np.ptp(means[index.block == b], axis=0).max() for b in range(index.blocks)]
    assert np.median(spans) < 2.5  # a block is a small part of the 4-wide cube
    g = ns.Gaussians(means.astype(np.float32), np.log(np.full((3000, 3), 0.05, np.float32)),
                     np.tile(np.float32([1, 0, 0, 0]), (3000, 1)), np.full(3000, 2.0, np.float32),
                     np.zeros((3000, 1, 3), np.float32))
    for v in dataset.train[:4]:  # every Gaussian the view renders is in the blocks it keeps
        p = ns.project(g, v.camera, backend="cpu")
        kept = index.rows(index.visible(v.camera))
        assert set(np.flatnonzero(p.counts > 0)) <= set(kept.tolist())


def _pool_rows_case(rng, n):
    """Random rows' blocks and places, blocks' slots (-1 for 60%), and the expected pool rows."""
    blocks = n // 100 + 2
    block, position = rng.integers(0, blocks, n).astype(np.int32), rng.integers(0, 100, n).astype(np.int32)
    slot = np.where(rng.random(blocks) < 0.4, rng.integers(0, 50, blocks), -1).astype(np.int64)
    return block, position, slot, (slot[block] * 100 + position)[slot[block] >= 0]


def test_pool_rows_are_the_resident_blocks_rows_in_model_order():
    """The parallel scan against numpy, across its chunks' edges (65536 rows a chunk) and empty input;
    a wrong count is refused."""
    from numbasplat.cpu.rows import POOL_ROWS_CHUNK
    from numbasplat.rows import pool_rows
    rng = np.random.default_rng(5)
    for n in (0, 1, POOL_ROWS_CHUNK, POOL_ROWS_CHUNK + 1, 3 * POOL_ROWS_CHUNK + 17):
        block, position, slot, want = _pool_rows_case(rng, n)
        np.testing.assert_array_equal(pool_rows(block, position, slot, 100, len(want), "cpu"), want, err_msg=str(n))
    with pytest.raises(ValueError, match="count"):
        pool_rows(block, position, slot, 100, len(want) + 1, "cpu")


def test_boxes_read_a_step_late_still_hold_every_gaussian():
    """Between a step and the arrival of its boxes, culling uses the step's blocks' older boxes grown
    for one Adam step: they hold the rows moved by as much as a step can (centres by the bound times
    the means' rate, log-scales by the bound times the scales'), and the boxes that arrive are exact."""
    rng = np.random.default_rng(3)
    means = rng.normal(size=(3000, 3)).astype(np.float32)
    scales = rng.uniform(-5, -2, (3000, 3)).astype(np.float32)
    index = BlockIndex(means, scales, block_rows=256)
    boxes = BoxesInFlight(index)
    assert boxes.for_culling()[0] is index.lo  # nothing in flight: the index's own
    lr_means, lr_scales, bound = 2e-3, 5e-3, adam_step_bound()
    blocks = np.array([0, 3, 7])
    rows = index.rows(blocks)
    moved_means, moved_scales = means.copy(), scales.copy()
    moved_means[rows] += rng.choice([-1, 1], (len(rows), 3)) * np.float32(bound * lr_means * 0.999)
    moved_scales[rows] += np.float32(bound * lr_scales * 0.999)
    table = np.hstack([moved_means, moved_scales])[index.by_block]
    lo, hi = reach_boxes(table, index.starts[blocks], index.sizes[blocks], 0, 3, REACH, "cpu")
    boxes.add(blocks, lo, hi, lr_means, lr_scales)
    cull_lo, cull_hi = boxes.for_culling()
    assert boxes.for_culling()[0] is cull_lo  # computed once a step (disk mode culls twice)
    assert (cull_lo[blocks] <= lo).all() and (cull_hi[blocks] >= hi).all()
    assert not np.array_equal(cull_lo[blocks], index.lo[blocks])     # grown, the index's own untouched
    others = np.setdiff1d(np.arange(index.blocks), blocks)
    np.testing.assert_array_equal(cull_lo[others], index.lo[others])
    boxes.add(np.array([1]), index.lo[[1]], index.hi[[1]], lr_means, lr_scales)   # the next step's
    boxes.for_culling()  # the first step's boxes now written into the index
    np.testing.assert_array_equal(index.lo[blocks], lo)
    np.testing.assert_array_equal(index.hi[blocks], hi)
    assert len(boxes.pending) == 1
    boxes.settle()
    assert not boxes.pending


def test_boxes_owed_are_computed_only_where_read_from_the_pool_as_it_is_then():
    """Where every block is the working set the store owes its steps' boxes: none is computed at a step, nor
    where a step lands the boxes in flight (``settle(keep=1)``); culling and a full ``settle`` compute the last
    owed once, from the rows as they are then, and land them (the index's are older than one step's growth);
    owing other blocks computes the earlier ones first."""
    rng = np.random.default_rng(4)
    means = rng.normal(size=(2000, 3)).astype(np.float32)
    scales = rng.uniform(-5, -2, (2000, 3)).astype(np.float32)
    index = BlockIndex(means, scales, block_rows=256)
    boxes = BoxesInFlight(index)
    table = np.hstack([means, scales])[index.by_block]
    every = np.arange(index.blocks)
    computed = []

    def reach(blocks):
        def now():
            computed.append(blocks)
            return reach_boxes(table, index.starts[blocks], index.sizes[blocks], 0, 3, REACH, "cpu")
        return now

    for _ in range(3):  # three steps: nothing computed
        table[:, :3] += np.float32(0.01)
        boxes.owe(every, reach(every), 1e-3, 1e-3)
        boxes.settle(keep=1)
    assert computed == [] and not boxes.pending
    lo, hi = boxes.for_culling()  # (the index's boxes are three steps old: the owed ones land at once)
    assert len(computed) == 1 and not boxes.pending
    exact = reach_boxes(table, index.starts, index.sizes, 0, 3, REACH, "cpu")
    np.testing.assert_array_equal(lo, exact[0])  # the rows as they were when read: the third step's
    np.testing.assert_array_equal(hi, exact[1])
    assert lo is index.lo
    boxes.owe(every, reach(every), 1e-3, 1e-3)
    boxes.owe(np.array([1, 2]), reach(np.array([1, 2])), 1e-3, 1e-3)  # other blocks: the earlier ones computed
    assert len(computed) == 2 and computed[1] is every
    boxes.settle()
    assert len(computed) == 3 and not boxes.pending


def test_reach_boxes_hold_every_rows_reach_and_nothing_more():
    table, starts, sizes = reach_table()
    lo, hi = reach_boxes(table, starts, sizes, 2, 7, 4.0, "cpu")
    assert lo.dtype == hi.dtype == np.float32
    for b, (a, n) in enumerate(zip(starts, sizes)):
        rows = table[a:a + n].astype(np.float64)
        reach = 4.0 * np.exp(rows[:, 7:10].max(axis=1))[:, None]
        want_lo = (rows[:, 2:5] - reach).min(axis=0) if n else np.full(3, np.inf)
        want_hi = (rows[:, 2:5] + reach).max(axis=0) if n else np.full(3, -np.inf)
        np.testing.assert_allclose(lo[b], want_lo, rtol=1e-6)   # (float32)
        np.testing.assert_allclose(hi[b], want_hi, rtol=1e-6)
    assert np.isinf(lo[2]).all() and np.isinf(hi[2]).all()


def offload_config(**kw):
    """The tests' run: visible-only Adam and the tour along the cameras (what offloading defaults to),
    in memory as offloaded."""
    return small_config(**{"visible_adam": True, "view_order": "trajectory", **kw})


@pytest.mark.parametrize("scene,mode,staged,slots", [("demo", "host", None, 26), ("clusters", "host", None, 26),
                                                     ("clusters", "disk", None, 26), ("clusters", "disk", True, 26),
                                                     ("clusters", "disk", None, 21)])
def test_offloaded_training_equals_in_memory_training_with_visible_adam(dataset, tmp_path, scene, mode, staged, slots,
                                                                         monkeypatch):
    """The demo (every view sees everything; densification from random points) and two clusters
    that the views see one at a time (the working set is half the model): equal parameters and
    moments after 40 steps with densification, the offloaded run stopped at 23 and resumed.  On the
    clusters the device holds about 25 of the blocks (8, 39 at the end), and in disk mode host memory
    a quarter of the model: blocks leave both and come back (``staged``: through the staging buffers,
    as on a GPU, here of two blocks each).  Where it holds 20, the device lacks blocks at the later refinements,
    which disk mode then makes block by block from the blocks' files."""
    monkeypatch.setattr(DeviceCache, "staged", staged)
    monkeypatch.setattr(DeviceCache, "STAGING_BLOCKS", 2)
    from scenes import cluster_capture
    data, start = (dataset, None) if scene == "demo" else cluster_capture(per_cluster=60, views=8)
    cfg = lambda: offload_config(iterations=40, sh_degree=0)  # noqa: E731
    caps = {} if scene == "demo" else {"gpu_memory": slots * slot_bytes(1) + view_bytes(data)}  # slots of 16 rows, sh
    # degree 0 (the index takes part of one)
    if mode == "disk":
        caps.update(offload_dir=tmp_path / "blocks", host_memory=120 * 45 * 4 // 4)

    def trainer(kind, folder):
        t = fast_refine(SingleGPUTrainer(data, tmp_path / folder, cfg(), backend="cpu") if kind == "memory" else
                        OffloadTrainer(data, tmp_path / folder, cfg(), backend="cpu", block_rows=16, mode=mode,
                                       **caps))
        if start is not None:
            t.start_from({"params": start})
        return t
    memory = trainer("memory", "memory")
    memory.train(progress=False)
    first = trainer("offload", "offload")
    first.train(progress=False, until=23)
    resumed = trainer("offload", "offload")
    resumed.load_snapshot(tmp_path / "offload" / SNAPSHOT)
    resumed.train(progress=False)
    model = resumed.store.whole()[0]  # (with its moments: ``whole_model`` renders, and may be the working set's)
    a, b = memory.model.host_arrays(), model.host_arrays()
    assert len(memory.model) != (400 if start is None else 120), "densification did not run"
    if scene == "clusters":
        assert resumed.stats["resident_gaussians"] < 0.8 * len(model)  # the working set: about one cluster
        assert resumed.store.cache.misses > (resumed.store.index.blocks if slots == 26 else 0)  # blocks left the
        # device and came back (in 20 slots, views larger than the pool train in chunks at the end)
    assert (resumed.store.cache.staging is not None) == bool(staged)
    if mode == "disk":
        assert first.store.host.read_bytes > 0 and resumed.store.host.read_bytes > 0  # blocks came back from the disk
        assert (getattr(resumed.store, "refine_peak_bytes", None) is not None) == (slots < 26)  # (block by block)
    else:  # the blocks written back went into the one table, which the whole model was gathered from
        whole = resumed.store.host.whole
        assert whole is not None and all(np.shares_memory(t, whole) for t in resumed.store.host.tables.values())
    for g in GROUPS:
        np.testing.assert_allclose(b[g], a[g], rtol=1e-6, atol=1e-7, err_msg=g)
    np.testing.assert_allclose(model.host_arrays("v")["means"], memory.model.host_arrays("v")["means"],
                               rtol=1e-6, atol=1e-12)
    log = [json.loads(line) for line in (tmp_path / "offload" / "log.jsonl").read_text().splitlines()]
    assert {"resident_gaussians", "cached_gaussians", "moved_bytes", "cache_hit_rate", "wait_s"} <= set(log[-1])
    assert 0 <= log[-1]["cache_hit_rate"] <= 1 and log[-1]["moved_bytes"] > 0


@pytest.mark.parametrize("mode,staged,slots", [("host", None, 20), ("disk", None, 20), ("disk", True, 20),
                                              ("host", None, 12), ("disk", None, 12)])
def test_adam_on_the_host_trains_as_adam_on_the_device_in_blocks_and_chunks(tmp_path, mode, staged, slots,
                                                                            monkeypatch):
    """``--offload-adam host``: the moments in the host's tier alone, the pool's rows the parameters and statistics,
    each working set's Adam run on the host's rows and its gradients written over its parameters on the device
    (every projection backward of the host's runs: a step's, or a chunk's).  200 steps of two clusters seen one
    at a time (rotated, unevenly scaled Gaussians, SH degree 1; 120 Gaussians, 469 after densifying at steps 50
    and 100, an opacity reset at 90, from step 120 the opacity and scale regularisers, which read the
    parameters), the device holding ``slots`` blocks of 16 rows: with 20 blocks leave and come back once there
    are 30; with 12 they do from step 50, and from step 100 the views outgrow the pool and train in chunks, the
    refinements made block by block.  In disk mode host memory holds a quarter of the start, ``staged``: the moves
    go through staging buffers of two blocks.  Stopped at step 75 and resumed, the parameters and both moments
    equal those of Adam on the device (the same slots, uninterrupted) within 1e-6."""
    import numbasplat.cpu as cpu_kernels
    from engine.stores.offload import OutOfCoreStore
    from scenes import cluster_capture
    monkeypatch.setattr(DeviceCache, "staged", staged)
    monkeypatch.setattr(DeviceCache, "STAGING_BLOCKS", 2)
    monkeypatch.setattr(OutOfCoreStore, "_slots", lambda self, n: slots)  # (both runs' pools alike)
    data, start = cluster_capture(per_cluster=60, views=8)
    rng = np.random.default_rng(1)
    start["sh"] = np.concatenate([start["sh"], rng.normal(0, 0.1, (120, 3, 3)).astype(np.float32)], axis=1)
    caps = {}
    if mode == "disk":
        caps.update(offload_dir=tmp_path / "blocks", host_memory=120 * 72 * 4 // 4)

    def trainer(adam, folder):
        t = OffloadTrainer(data, tmp_path / folder, offload_config(iterations=200, sh_degree=1, snapshot_every=0),
                           backend="cpu", block_rows=16, mode=mode, offload_adam=adam, **caps)
        s = t.strategy
        s.refine_start, s.refine_every, s.reset_every, s.refine_stop = 20, 50, 90, 150
        s.opacity_reg, s.scale_reg, s.regularise_from = 0.01, 0.01, 120
        t.start_from({"params": start})
        return t
    device = trainer("device", "device")
    device.train(progress=False)
    calls = {"project_backward": 0, "project_backward_over_params": 0}  # the host's runs' projection backwards

    def counted(name, kernel):
        def call(*args):
            calls[name] += 1
            return kernel(*args)
        return call
    for name in calls:
        monkeypatch.setattr(cpu_kernels, name, counted(name, getattr(cpu_kernels, name)))
    trainer("host", "host").train(progress=False, until=75)
    resumed = trainer("host", "host")
    resumed.load_snapshot(tmp_path / "host" / SNAPSHOT)
    resumed.train(progress=False)
    store = resumed.store
    assert store.cache.pool.shape[1] == store.layout.width + len(store.layout.statistics)  # (no moments there)
    assert calls["project_backward_over_params"] >= 200 and not calls["project_backward"]
    assert device.store.cache.pool.shape[1] == store.layout.columns_total
    assert len(resumed.model) == len(device.model) > 120, "densification did not run"
    assert store.cache.misses > (store.index.blocks if slots == 20 else 0)  # blocks left the device and came back
    assert (store.chunked_steps > 0) == (device.store.chunked_steps > 0) == (slots == 12)
    if mode == "disk":
        assert store.host.read_bytes > 0
    a, b = device.gather_state()[0], resumed.gather_state()[0]
    assert a["step"] == b["step"] == 200
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_allclose(b[w][g], a[w][g], rtol=1e-6, atol=1e-7 if w != "v" else 1e-12,
                                       err_msg=f"{w} {g}")
    assert all(np.abs(a["v"][g]).max() > 0 for g in GROUPS)  # (moments to compare)


def _gradients_over_the_parameters_case(backend):
    """A model whose gradients go over its parameters (``GaussianModel.grads_over_params``, as a working set's
    under ``--offload-adam host``): its projection backward on ``backend`` writes over the parameters, to the
    bit, the gradients that a model of the same parameters gets in a buffer of their own; adding to them is
    refused.  Rotated, unevenly scaled Gaussians (some behind the camera, off the image, culled) in a 40 x 30
    image, at the SH degree stored and below it, where the CUDA SH kernel's threads write other coefficients
    than they read (a missing barrier shows there); the larger case takes two of that kernel's blocks."""
    from engine.recipe.model import GaussianModel
    from numbasplat.backend import to_host
    from scenes import edge_case_scene, look_at_camera
    camera = look_at_camera(W=40, H=30)
    rng = np.random.default_rng(5)
    for n, degree in ((24, 3), (24, 1), (200, 2)):
        g = edge_case_scene(n=n, seed=n, dtype=np.float32)
        apart, over = (GaussianModel(g.arrays(), backend) for _ in range(2))
        over.grads_over_params = True
        over.release_grads()  # (the constructor made a buffer of their own)
        assert over.grads is over.params
        p = ns.project(apart.gaussians, camera, sh_degree=degree, backend=backend)
        b = ns.bin_tiles(p, backend=backend)
        r = ns.rasterize(p, b, None, backend)
        d_image = apart.xp.asarray(rng.normal(size=r.image.shape).astype(r.image.dtype))
        grad = ns.rasterize_backward(p, b, r, d_image, backend=backend)
        for model in (apart, over):
            ns.project_backward(model.gaussians, p, grad, model.grad_gaussians, accumulate=False, backend=backend)
        want = to_host(apart.grads.data)
        assert np.abs(want).max() > 0 and not np.array_equal(want, to_host(apart.params.data))
        np.testing.assert_array_equal(to_host(over.params.data), want, err_msg=f"{n} Gaussians, degree {degree}")
        with pytest.raises(ValueError, match="cannot be added"):
            ns.project_backward(over.gaussians, p, grad, over.grad_gaussians, accumulate=True, backend=backend)


def test_gradients_written_over_the_parameters_are_those_of_a_buffer_of_their_own():
    """``_gradients_over_the_parameters_case`` on the CPU kernels."""
    _gradients_over_the_parameters_case("cpu")


@pytest.mark.sim
@pytest.mark.timeout(900)
def test_gradients_written_over_the_parameters_are_those_of_a_buffer_of_their_own_in_simulator():
    """``_gradients_over_the_parameters_case`` on the CUDA kernels, simulated: the parameters go into the
    kernels uncopied, so a thread that wrote a gradient before another read its parameter would show."""
    run_sim("""
        from test_offload import _gradients_over_the_parameters_case
        _gradients_over_the_parameters_case("cuda")
        print("gradients over the parameters ok")
    """, timeout=900, env={"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])})


def test_an_unknown_offload_adam_is_named(dataset, tmp_path, capsys):
    """``--offload-adam`` takes device or host; any other value stops with one message naming the flag (on the
    command line, in a config file, to the pipeline), and so does the flag without ``--offload``."""
    import cli
    from engine.pipelines import PipelineOptions, check
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--data", "d", "--offload", "host", "--offload-adam", "gpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: argument --offload-adam: invalid choice: 'gpu'"), err
    (tmp_path / "run.json").write_text(json.dumps({"data": "d", "out": "o", "offload": "host", "offload_adam": "gpu"}))
    assert cli.main(["train", "--config", str(tmp_path / "run.json")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "offload_adam" in err and "invalid choice" in err, err
    with pytest.raises(ValueError, match=r"^--offload-adam gpu: unknown \(device or host\)$"):
        OffloadTrainer(dataset, tmp_path, offload_config(), backend="cpu", offload_adam="gpu")
    with pytest.raises(ValueError, match=r"^--offload-adam cpu: unknown \(device or host\)$"):
        check(offload_config(), PipelineOptions(offload="host", offload_adam="cpu"))
    with pytest.raises(ValueError, match=r"^--offload-adam is for --offload host or disk$"):
        check(offload_config(), PipelineOptions(offload_adam="host"))


@pytest.mark.parametrize("mode,adam", [("host", "device"), ("disk", "device"), ("host", "host")])
def test_an_offloaded_shard_trains_as_the_shard_in_memory(tmp_path, mode, adam):
    """The Gaussian-exchange pipeline with its shard out of core (one rank, batches of 2 views): on
    two clusters seen one at a time, under a device cap that holds 30 blocks of 16 rows (blocks leave
    and come back), stopped at step 24 and resumed, the parameters and moments equal the pipeline's
    in memory with visible-only Adam (the rows that either view of a batch saw), Adam run on the device
    or (``adam`` host, ``--offload-adam host``) on the host.  Under mpiexec: tests/test_gaussian_exchange.py."""
    from mpi4py import MPI
    from engine.pipelines.gaussian_exchange import GaussianExchangeTrainer, OffloadedGaussianExchangeTrainer
    from scenes import cluster_capture
    data, start = cluster_capture(per_cluster=60, views=8)
    caps = {"gpu_memory": 30 * slot_bytes(1, adam=adam) + view_bytes(data)}
    if mode == "disk":
        caps.update(offload_dir=tmp_path / "blocks", host_memory=120 * 45 * 4 // 4)

    def trainer(kind, folder):
        cfg = offload_config(iterations=40, sh_degree=0)
        if kind == "memory":
            t = GaussianExchangeTrainer(data, tmp_path / folder, cfg, MPI.COMM_SELF, batch_size=2, backend="cpu")
        else:
            t = OffloadedGaussianExchangeTrainer(data, tmp_path / folder, cfg, MPI.COMM_SELF, batch_size=2,
                                                 backend="cpu", block_rows=16, mode=mode, offload_adam=adam, **caps)
        t = fast_refine(t)
        t.start_from({"params": start})
        return t
    memory = trainer("memory", "memory")
    memory.train(progress=False)
    trainer("offload", "offload").train(progress=False, until=24)
    resumed = trainer("offload", "offload")
    resumed.load_snapshot(tmp_path / "offload" / SNAPSHOT)
    resumed.train(progress=False)
    assert len(memory.model) != 120, "densification did not run"
    assert resumed.stats["resident_gaussians"] < 0.8 * resumed.total  # the working set: about one cluster
    assert resumed.store.cache.misses > resumed.store.index.blocks  # blocks left the device and came back
    a, b = memory.model.state(), resumed.gather_state()[0]
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_allclose(b[w][g], a[w][g], rtol=1e-6, atol=1e-7 if w != "v" else 1e-12,
                                       err_msg=f"{w} {g}")
    assert a["step"] == b["step"]


def test_offload_refuses_what_it_cannot_do(dataset, tmp_path):
    for change, message in ((dict(visible_adam=False), "needs --visible-adam"),
                            (dict(visible_adam=True, strategy="mcmc"), "default strategy"),
                            (dict(visible_adam=True, loss="tile"), "--loss global")):
        with pytest.raises(ValueError, match=message):
            OffloadTrainer(dataset, tmp_path, small_config(**change), backend="cpu")
    cfg = small_config(visible_adam=True)
    for kw, message in ((dict(mode="disk", host_memory=10**6), "needs --offload-dir"),
                        (dict(mode="disk", offload_dir=tmp_path), "needs --host-memory"),
                        (dict(mode="host", host_memory=10**6), "are for --offload disk")):
        with pytest.raises(ValueError, match=message):
            OffloadTrainer(dataset, tmp_path, cfg, backend="cpu", **kw)


def test_byte_sizes_parse_with_units():
    import argparse
    from cli.args import byte_size
    assert byte_size("24GiB") == 24 * 2**30 and byte_size("512MiB") == 512 * 2**20
    assert byte_size("1.5GB") == 1_500_000_000 and byte_size("1000") == 1000 and byte_size("64 kib") == 65536
    for bad in ("", "12XB", "GiB", "-1GiB", "1e9"):
        with pytest.raises(argparse.ArgumentTypeError, match="size in bytes"):
            byte_size(bad)


def test_trajectory_order_tours_the_cameras_deterministically(dataset):
    """Each epoch visits every view once, consecutive views nearer than in a random order, the same
    for a seed and varied between epochs."""
    from engine.recipe.view_order import camera_poses, epoch_order
    cameras = [v.camera for v in dataset.train]
    positions, _ = camera_poses(cameras)
    tours = [epoch_order("trajectory", cameras, np.random.default_rng(7)) for _ in range(2)]
    assert tours[0] == tours[1]
    rng = np.random.default_rng(7)
    epochs = [epoch_order("trajectory", cameras, rng) for _ in range(6)]
    assert all(sorted(e) == list(range(len(cameras))) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # nearby tours, not one

    def hop(order):
        return np.mean(np.linalg.norm(np.diff(positions[order], axis=0), axis=1))
    random_hops = np.mean([hop(np.random.default_rng(s).permutation(len(cameras))) for s in range(20)])
    assert max(hop(e) for e in epochs) < 0.8 * random_hops
    t = SingleGPUTrainer(dataset, "/tmp/unused-order", small_config(view_order="trajectory"), backend="cpu")
    visited = [t.next_view() for _ in range(len(cameras))]
    assert visited == epoch_order("trajectory", cameras, np.random.default_rng(0))  # the tour in its order
    with pytest.raises(ValueError, match="--view-order"):
        SingleGPUTrainer(dataset, "/tmp/unused-order", small_config(view_order="spiral"), backend="cpu")


@pytest.mark.parametrize("staged", [False, True])
def test_device_cache_moves_only_missing_blocks_least_recently_used_out_first(staged, monkeypatch):
    """The pool's moves, gathered or (``staged``) a block at a time through the page-locked staging buffers,
    here of one block each: a move of two blocks takes both buffers."""
    monkeypatch.setattr(DeviceCache, "staged", staged)
    monkeypatch.setattr(DeviceCache, "STAGING_BLOCKS", 1)
    means = np.random.default_rng(0).uniform(-1, 1, (64, 3))
    index = BlockIndex(means, np.full((64, 3), -3.0), block_rows=16)
    layout = RowLayout(1, {"count": np.zeros(0, np.int32)})
    host = HostBlocks()
    host.reset({b: np.full((16, layout.columns_total), b, np.float32) for b in range(4)})
    cache = DeviceCache(np, layout, 16, 2, index)
    assert (cache.staging is not None) == staged
    block_bytes = 16 * layout.row_bytes
    cache.fetch([0, 1], index, host)
    assert (cache.misses, cache.hits, cache.moved_bytes) == (2, 0, 2 * block_bytes)
    cache.fetch([1], index, host)
    assert (cache.misses, cache.hits, cache.moved_bytes) == (2, 1, 2 * block_bytes)  # resident: nothing moves
    cache.pool[cache.slot[1] * 16:(cache.slot[1] + 1) * 16] = 7.0
    cache.changed([1])
    cache.fetch([2], index, host)  # 0 is the least recently used: out, unchanged, so not written back
    assert cache.slot[0] == -1 and cache.slot[1] >= 0 and cache.moved_bytes == 3 * block_bytes
    cache.fetch([3, 0], index, host)  # 1 (changed) and 2 out: 1 written back
    assert cache.slot[1] == -1 and (host.get(1) == 7.0).all() and cache.moved_bytes == 6 * block_bytes
    assert (cache.pool[cache.slot[0] * 16] == 0).all() and (cache.pool[cache.slot[3] * 16] == 3).all()
    rows = index.rows([3, 0])  # the working set's pool rows: in model order, each at its slot and place
    np.testing.assert_array_equal(cache.rows([3, 0], len(rows)),
                                  cache.slot[index.block[rows]] * 16 + index.position[rows])


def test_staging_ring_moves_rows_through_its_buffers_in_batches_and_refuses_a_move_too_large():
    """``StagingRing`` (the CPU's plain arrays): moves of 4, 6, 3, 10 and 1 rows through two buffers of 10 rows
    go in four batches (4 + 6, 3, 10, 1), each buffer in turn, both ways; a move of 11 rows is refused."""
    from numbasplat.device import StagingRing
    rng = np.random.default_rng(0)
    ring = StagingRing(10, 3)
    tables = [rng.normal(size=(k, 3)).astype(np.float32) for k in (4, 6, 3, 10, 1)]
    starts = [0, 5, 12, 20, 35]
    table = np.zeros((40, 3), np.float32)
    ring.upload(tables, table, starts)
    for t, start in zip(tables, starts):
        np.testing.assert_array_equal(table[start:start + len(t)], t)
    assert ring.next == 0  # (four batches through two buffers)
    back = [np.array(rows) for rows in ring.download(table, starts, [len(t) for t in tables])]
    for a, b in zip(back, tables):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ring.buffers[1][:1], tables[4])  # (the last batch's buffer)
    with pytest.raises(ValueError, match="a move of 11 rows exceeds the buffers' 10"):
        ring.upload([np.zeros((11, 3), np.float32)], table, [0])


@pytest.mark.parametrize("moves", ["gathered", "staged", "direct"])
def test_prefetch_moves_the_next_blocks_beside_this_steps_and_fetch_counts_them_once(moves, monkeypatch):
    """The next step's blocks come in ahead (misses then, not hits at the step), never into the
    slots of this step's blocks; a changed block they push out goes back first (into the host's one
    table where the moves are direct); what does not fit is left for the step's own fetch.  The moves
    gathered, through the staging buffers (of one block each), or direct."""
    monkeypatch.setattr(DeviceCache, "staged", moves == "staged")
    monkeypatch.setattr(DeviceCache, "STAGING_BLOCKS", 1)
    direct = moves == "direct"
    means = np.random.default_rng(0).uniform(-1, 1, (80, 3))
    index = BlockIndex(means, np.full((80, 3), -3.0), block_rows=16)
    layout = RowLayout(1, {"count": np.zeros(0, np.int32)})
    whole = np.repeat(np.arange(5, dtype=np.float32), 16)[:, None] * np.ones(layout.columns_total, np.float32)
    host = HostBlocks()
    host.reset({b: whole[16 * b:16 * b + 16] for b in range(5)}, whole=whole)
    cache = DeviceCache(np, layout, 16, 3, index, direct=whole if direct else None)
    cache.fetch([0, 1], index, host)
    cache.pool[cache.slot[1] * 16:(cache.slot[1] + 1) * 16] = 7.0
    cache.changed([1])
    cache.prefetch([2, 3], [0], index, host)  # a free slot, and 1's (0 is this step's)
    assert cache.slot[0] >= 0 and cache.slot[1] == -1 and cache.slot[2] >= 0 and cache.slot[3] >= 0
    assert (host.get(1) == 7.0).all() and (whole[16:32] == 7.0).all()
    assert (cache.misses, cache.hits) == (4, 0)
    cache.fetch([2, 3], index, host)  # came in ahead: neither a hit nor a second miss
    assert (cache.misses, cache.hits) == (4, 0)
    for b in (2, 3):
        assert (cache.pool[cache.slot[b] * 16:(cache.slot[b] + 1) * 16] == b).all()
    cache.prefetch([4, 1, 0], [2, 3], index, host)  # no room beside this step's blocks and the next's
    assert cache.slot[4] == -1 and cache.slot[1] == -1 and cache.misses == 4
    cache.fetch([3, 4], index, host)  # the step's own fetch moves what the guess did not
    assert cache.slot[4] >= 0 and (cache.misses, cache.hits) == (5, 1)
    assert (cache.pool[cache.slot[4] * 16:(cache.slot[4] + 1) * 16] == 4).all()


@pytest.mark.parametrize("moves", ["gathered", "staged", "direct"])
def test_a_pool_without_moments_moves_the_parameters_and_statistics_and_keeps_the_hosts_moments(moves, monkeypatch):
    """``--offload-adam host``'s pool (``RowLayout.without_moments``): blocks come in as their rows' parameters and
    statistics alone, gathered, through the staging buffers (of one block each) or direct from the host's one
    table; a changed block goes back into those columns of its host rows, whose moments stay as they were; a
    pool that holds every block takes those columns of the whole table."""
    monkeypatch.setattr(DeviceCache, "staged", moves == "staged")
    monkeypatch.setattr(DeviceCache, "STAGING_BLOCKS", 1)
    index = BlockIndex(np.random.default_rng(0).uniform(-1, 1, (80, 3)), np.full((80, 3), -3.0), block_rows=16)
    layout = RowLayout(1, {"count": np.zeros(0, np.int32), "grad": np.zeros(0, np.float32)})
    pool_layout = layout.without_moments()
    w, s = layout.width, len(layout.statistics)
    assert (pool_layout.columns_total, layout.columns_total) == (w + s, 3 * w + s)
    kept = np.r_[0:w + s]  # the host row's columns that the pool holds: its first
    whole = np.arange(80 * layout.columns_total, dtype=np.float32).reshape(80, -1)
    before = whole.copy()
    host = HostBlocks()
    host.reset({b: whole[16 * b:16 * b + 16] for b in range(5)}, whole=whole)
    cache = DeviceCache(np, layout, 16, 3, index, direct=whole if moves == "direct" else None, pool_layout=pool_layout)
    assert cache.pool.shape == (48, w + s) and (cache.staging is not None) == (moves == "staged")
    cache.fetch([0, 1], index, host)
    for b in (0, 1):
        np.testing.assert_array_equal(cache.pool[cache.slot[b] * 16:(cache.slot[b] + 1) * 16],
                                      before[16 * b:16 * b + 16][:, kept])
    assert cache.moved_bytes == 2 * 16 * pool_layout.row_bytes
    cache.pool[cache.slot[1] * 16:(cache.slot[1] + 1) * 16] = -1.0
    cache.changed([1])
    cache.fetch([2, 3, 4], index, host)  # 0 and 1 out: 1 written back
    expected = before.copy()
    expected[16:32, kept] = -1.0
    np.testing.assert_array_equal(whole, expected)  # (its moments, the columns after, as they were)
    for b in (2, 3, 4):
        np.testing.assert_array_equal(cache.pool[cache.slot[b] * 16:(cache.slot[b] + 1) * 16],
                                      expected[16 * b:16 * b + 16][:, kept])
    every = DeviceCache(np, layout, 16, 5, index, pool_layout=pool_layout)
    every.hold_all(whole)
    np.testing.assert_array_equal(every.pool, expected[:, kept])


def test_blocks_coming_back_do_not_keep_the_arrays_they_came_in_alive(tmp_path):
    """A step writes many blocks back as one array; a block kept as a view of it would keep all of
    it alive beside the blocks (host memory growing step by step past the model's size, past
    --host-memory in disk mode).  Host mode copies into the block's table in place, which stays a view
    of the one table the whole model is gathered from; disk mode keeps arrays of their own."""
    import gc
    import weakref
    whole = np.zeros((4 * 8, 5), np.float32)
    host = HostBlocks()
    host.reset({b: whole[8 * b:8 * b + 8] for b in range(4)}, whole=whole)
    batch = np.arange(16 * 5, dtype=np.float32).reshape(16, 5)  # blocks 1 and 3 back from the device
    gone = weakref.ref(batch)
    host.put(1, batch[:8])
    host.put(3, batch[8:])
    disk = DiskBlocks(tmp_path / "d", capacity=10 * 8 * 5 * 4)
    disk.reset({b: whole[8 * b:8 * b + 8] for b in range(4)})
    disk.put(2, batch[8:])
    del batch
    gc.collect()
    assert gone() is None
    assert host.whole is whole and np.shares_memory(host.get(3), whole)
    np.testing.assert_array_equal(whole[8:16].ravel(), np.arange(40))
    np.testing.assert_array_equal(whole[24:32].ravel(), np.arange(40, 80))
    assert all(t.base is None for t in disk.cache.values())  # (reset's views of ``whole`` copied too)
    np.testing.assert_array_equal(disk.get(2).ravel(), np.arange(40, 80))
    host.put(0, np.ones((3, 5), np.float32))  # a block of another size: its own array, and no whole table
    assert host.whole is None
    disk.close()


def test_disk_blocks_cache_within_the_cap_and_read_ahead(tmp_path):
    """Host memory holds at most the cap (three quarters the cache, a quarter the read-ahead); a block
    read ahead serves the next read; one changed since it was read ahead is not served stale.  (The
    writes behind drained before the read ahead: a block being written is served from memory.)"""
    tables = {b: np.full((10, 5), b, np.float32) for b in range(6)}  # 200 bytes each
    store = DiskBlocks(tmp_path / "d", capacity=4 * 200 + 100)  # cache 675 bytes: 3 blocks
    store.reset(tables)
    store.flush()
    assert store.cached_bytes <= 675 and store.written_bytes >= 3 * 200  # the others went to disk
    for b in range(6):
        assert (store.get(b) == b).all()
        assert store.cached_bytes <= 675
    store.put(0, np.full((10, 5), 9, np.float32))
    for b in (3, 4, 5, 1):
        store.get(b)  # 0 out: written back
    assert 0 not in store.cache
    store.flush()
    reads = store.read_bytes
    store.prefetch([0])
    store._wait()
    assert store.staged and store.read_bytes == reads + 200
    assert (store.get(0) == 9).all() and store.read_bytes == reads + 200  # served from the read-ahead
    store.prefetch([2])
    store._wait()
    store.put(2, np.full((10, 5), 5, np.float32))  # changed after it was read ahead
    assert (store.get(2) == 5).all()
    folder = store.folder
    store.close()
    assert not os.path.exists(folder)


@pytest.mark.parametrize("scene", ["lego", "fern"])
def test_offload_equals_in_memory_on_the_captures(scene, tmp_path):
    """200 steps of lego and fern (at 1/16 and 1/64 of their sizes, fern from an eighth of its points:
    for the CPU), densifying every 50: offloaded to host memory, offloaded to disk (host memory two
    blocks of 256 rows and the read-ahead, the model many; stopped at step 120 and resumed) and
    in-memory training with visible-only Adam end equal within 1e-6."""
    from conftest import shared_dir
    from data import load_dataset
    root = shared_dir() / "data" / scene
    if scene == "lego":
        data = load_dataset(root, resolution=25, test_every=0)  # 25 px wide: lego at 1/16
    else:  # every 8th of its SfM points to start from
        data = load_dataset(root, images="images_8", resolution=8, test_every=0)
        data = replace(data, points=data.points[::8], colors=data.colors[::8])
    cfg = lambda: offload_config(iterations=200, sh_degree=1, n_random_init=1000,  # noqa: E731
                                 densify_from=50, densify_every=50, log_every=100, snapshot_every=120,
                                 lr_means_steps=30_000,  # the means still moving: the model outgrows the cap
                                 background=(1.0, 1.0, 1.0) if scene == "lego" else (0.0, 0.0, 0.0))
    memory = SingleGPUTrainer(data, tmp_path / "memory", cfg(), backend="cpu")
    memory.train(progress=False)
    host = OffloadTrainer(data, tmp_path / "host", cfg(), backend="cpu", block_rows=256)
    host.train(progress=False)
    row_bytes = RowLayout(4, DefaultStrategy.fresh_statistics(np, 0)).row_bytes
    start_rows = 1000 if scene == "lego" else len(data.points)
    disk = dict(mode="disk", offload_dir=tmp_path / "blocks", host_memory=2 * 256 * row_bytes * 4 // 3)  # 2 blocks
    first = OffloadTrainer(data, tmp_path / "disk", cfg(), backend="cpu", block_rows=256, **disk)
    first.train(progress=False, until=120)
    resumed = OffloadTrainer(data, tmp_path / "disk", cfg(), backend="cpu", block_rows=256, **disk)
    resumed.load_snapshot(tmp_path / "disk" / SNAPSHOT)
    resumed.train(progress=False)
    a, b, c = memory.model.host_arrays(), host.whole_model().host_arrays(), resumed.whole_model().host_arrays()
    assert len(a["means"]) != start_rows, "densification did not run"
    assert first.store.host.read_bytes > 0 and resumed.store.host.read_bytes > 0  # blocks came back from the disk
    assert len(a["means"]) * row_bytes > resumed.store.host.capacity  # the model does not fit the cap
    for g in GROUPS:
        np.testing.assert_allclose(b[g], a[g], rtol=1e-6, atol=1e-7, err_msg=g)
        np.testing.assert_allclose(c[g], b[g], rtol=1e-6, atol=1e-7, err_msg=g)


def snapshot_bytes(folder):
    return (folder / SNAPSHOT).read_bytes()


def trained_until(data, out, step, **kw):
    """An offloaded run stopped at ``step`` with its snapshot, and a trainer resumed from it (``kw``)."""
    OffloadTrainer(data, out, offload_config(iterations=40), backend="cpu", block_rows=16).train(
        progress=False, until=step)
    t = OffloadTrainer(data, out, offload_config(iterations=40), backend="cpu", block_rows=16, **kw)
    t.load_snapshot(out / SNAPSHOT)
    return t


def test_auto_view_order_tours_only_while_the_device_holds_under_half_the_blocks(dataset, tmp_path):
    """--view-order auto: random (3DGS) while the device's pool holds at least half the blocks, a tour
    when not; random in memory."""
    roomy = OffloadTrainer(dataset, tmp_path / "a", offload_config(view_order="auto"), backend="cpu", block_rows=16)
    roomy.init_model()
    assert roomy.store.index.blocks == 25 and roomy.epoch_view_order() == "random"
    tight = OffloadTrainer(dataset, tmp_path / "b", offload_config(view_order="auto"), backend="cpu", block_rows=16,
                           gpu_memory=10 * slot_bytes(4) + 16 * 400 + view_bytes(dataset))  # 10 slots, and the index
    tight.init_model()
    assert tight.store.cache.slots == 10 and tight.epoch_view_order() == "trajectory"
    most = OffloadTrainer(dataset, tmp_path / "d", offload_config(view_order="auto"), backend="cpu", block_rows=16,
                          gpu_memory=15 * slot_bytes(4) + 16 * 400 + view_bytes(dataset))  # 15 slots of 25: random
    most.init_model()
    assert most.store.cache.slots == 15 and most.epoch_view_order() == "random"
    assert SingleGPUTrainer(dataset, tmp_path / "c", small_config(), backend="cpu").epoch_view_order() == "random"


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_a_parameter_group_read_from_the_host_table_is_the_whole_models(tmp_path, monkeypatch, mode):
    """What the pixel exchange's boxes need of an out-of-core shard (its means and scales) comes from
    the host's tier without gathering the model (its one table; in disk mode its blocks one at a time, host
    memory a cache of three of them), the device's changed blocks written back first: equal to the gathered
    model's, while blocks move."""
    from scenes import cluster_capture
    data, start = cluster_capture(per_cluster=60, views=8)
    disk = {} if mode == "host" else dict(mode="disk", offload_dir=tmp_path / "blocks", host_memory=5 * 8 * 45 * 4)
    t = OffloadTrainer(data, tmp_path / "out", offload_config(sh_degree=0), backend="cpu", block_rows=8,
                       gpu_memory=13 * slot_bytes(1, 8) + 16 * 120 + view_bytes(data), **disk)  # 13 slots of 15 blocks
    t.start_from({"params": start})
    for _ in range(5):
        t.train_step()
    assert t.store.cache.slots < t.store.index.blocks and t.store.cache.dirty.any()
    with monkeypatch.context() as patched:
        forbid_gathering(patched)
        means, scales = t.store.group("means"), t.store.group("scales")
    g = t.store.whole()[0].gaussians
    np.testing.assert_array_equal(means, g.means)
    np.testing.assert_array_equal(scales, g.scales)
    assert not np.array_equal(means, start["means"])  # (it trained)


def test_the_part_of_a_model_a_frustum_holds_renders_as_the_whole(dataset):
    """Evaluation under MPI with the model out of core renders, on the device, only the Gaussians whose
    reach the view can see (the whole model stays in host memory): the image equals the whole
    model's, and the Gaussians far off to the side and behind the camera are left out."""
    import numbasplat as ns
    from engine.tools.demo import ground_truth
    from engine.stores.offload import frustum_part
    from engine.tools.outputs import render_image
    g = ground_truth()
    camera = dataset.train[0].camera
    eye = -camera.viewmat[:3, :3].T @ camera.viewmat[:3, 3]
    away = np.float32(eye + 40 * (eye - g.means.mean(0)))  # far behind the camera
    extra = ns.Gaussians(np.repeat(away[None], 7, 0) + np.arange(7, dtype=np.float32)[:, None], g.scales[:7],
                         g.quats[:7], g.opacities[:7], g.sh[:7])
    whole = ns.Gaussians(**{k: np.concatenate([a, getattr(extra, k)]) for k, a in g.arrays().items()})
    part = frustum_part(whole, camera)
    assert len(part.means) <= len(g.means) < len(whole.means)
    np.testing.assert_array_equal(render_image(part, camera, backend="cpu"), render_image(whole, camera, backend="cpu"))


@pytest.mark.parametrize("adam", ["device", "host"])
@pytest.mark.parametrize("mode", ["host", "disk"])
def test_a_view_larger_than_the_device_trains_in_chunks_as_the_whole_working_set(dataset, tmp_path, mode, adam,
                                                                                 monkeypatch):
    """A cap of 3 block slots (48 rows) for views that see all 25 blocks (400 Gaussians, then more, and
    the index more of the cap): each view is trained in depth-ordered chunks of at most 48 rows, rendered front to back with the
    pixels' state carried and back-propagated back to front, each chunk's rows stepped by Adam (on the device, or
    ``adam`` host: on the host's rows, ``--offload-adam host``) and checked in; after steps with densification and
    an opacity reset the model equals the run whose device holds every block (the unchunked out-of-core step).  The
    last chunk rendered stays in the pool for its backward, which runs first: 2K - 1 checkouts a step of K chunks.
    The chunks' rows move between the host and the device 20 rows at a time, their boxes computed a few blocks at
    a time (host memory holds a slice, not a chunk)."""
    import engine.stores.offload.store as store_module
    from engine.stores.offload.chunked import ChunkedView
    monkeypatch.setattr(store_module, "HOLD_SLICE_ROWS", 20)
    chunks, checkouts = [], []
    depth_chunks, checkout = ChunkedView.depth_chunks, ChunkedView.checkout
    monkeypatch.setattr(ChunkedView, "depth_chunks", lambda self, *a: chunks.append(len(depth_chunks(self, *a)))
                        or self.chunks)
    monkeypatch.setattr(ChunkedView, "checkout", lambda self, k: checkouts.append(k) or checkout(self, k))
    cfg = lambda: offload_config(iterations=30, sh_degree=1)  # noqa: E731
    roomy = fast_refine(OffloadTrainer(dataset, tmp_path / "roomy", cfg(), backend="cpu", block_rows=16))
    tight = fast_refine(OffloadTrainer(dataset, tmp_path / "tight", cfg(), backend="cpu", block_rows=16,
                                       gpu_memory=3 * slot_bytes(4, adam=adam) + 16 * 400 + view_bytes(dataset),  # 3
                                       # slots, the index
                                       offload_adam=adam,
                                       **({} if mode == "host" else dict(mode="disk", offload_dir=tmp_path / "d",
                                                                         host_memory=8 * 16 * 72 * 4))))
    roomy.train(progress=False)
    tight.train(progress=False)
    assert roomy.store.chunked_steps == 0 and tight.store.chunked_steps == 30
    assert tight.stats["resident_gaussians"] == 16 * tight.store.cache.slots <= 48  # (the index grew with the model)
    assert min(chunks) >= 2 and len(chunks) == 30 and len(checkouts) == sum(2 * k - 1 for k in chunks)
    a, b = roomy.store.whole()[0], tight.store.whole()[0]
    assert len(a) == len(b) != 400, "densification did not run"
    for w in ("params", "m", "v"):
        x, y = a.host_arrays(w), b.host_arrays(w)
        for g in GROUPS:
            np.testing.assert_allclose(y[g], x[g], rtol=1e-5, atol=1e-7, err_msg=f"{w} {g}")
    assert a.adam.step_count == b.adam.step_count == 30


def test_the_device_budget_follows_the_binnings_intersections(dataset, tmp_path):
    """A cap whose pool holds every block at the intersections per Gaussian assumed at first: once binnings
    show ten times as many (a model grown from a few large Gaussians, as a capture's SfM points), the budget's
    working rows shrink below the pool's, a view whose rows no longer fit trains in chunks of at most those
    rows (the step's device bytes at the binnings' intersections within the cap, as they were not before),
    and the pool that a refinement makes anew holds fewer slots.  The run's own binnings are recorded, each
    exact (a step's and every chunk's)."""
    from engine.stores.offload.store import INTERSECTIONS_PER_GAUSSIAN, INTERSECTIONS_SPARE
    cap = 25 * slot_bytes(4) + 16 * 400 + view_bytes(dataset)  # every block at the assumed intersections
    t = trained_until(dataset, tmp_path / "out", 10, gpu_memory=cap)
    t.train(progress=False, until=12)
    store = t.store
    store.checkout([0])
    assert store.cache.slots == 25 and store.chunked_steps == 0 and store._working_rows() >= 400
    seen = list(store._binned)
    assert len(seen) == 2 and all(0 < k < INTERSECTIONS_PER_GAUSSIAN for k in seen)  # (the 2 steps since the resume)
    k = 10 * INTERSECTIONS_PER_GAUSSIAN
    store.binned(400, 400 * k / INTERSECTIONS_SPARE)
    assert store.intersections_per_gaussian() == k
    rows = store._working_rows()
    assert 16 <= rows < 400
    before = store.step_device_bytes(k)  # (the last step's whole working set, at the new intersections)
    assert before > store.device_budget + 16 * 400 + store.images_bytes + view_bytes(dataset)
    view = store.checkout([1])[0]
    assert getattr(view, "chunked", False) and store.chunked_steps == 1 and view.count == rows
    assert store.step_device_bytes(k) <= cap
    chunks = view.depth_chunks(dataset.train[1].camera)
    assert len(chunks) > 1 and max(len(c) for c in chunks) <= rows
    store._install(store.whole()[0], {})  # (a refinement's re-cut: the pool made at the binnings' intersections)
    slots = store.cache.slots
    assert 1 <= slots < 25 and slots == (store.device_budget - 16 * 400) // store._slot_bytes()
    assert store._working_rows() >= 16 * slots


def _clusters_start():
    """-> (two clusters seen one at a time, 8 views; their start at SH degree 1: rotated, unevenly scaled)."""
    from scenes import cluster_capture
    data, start = cluster_capture(per_cluster=60, views=8)
    start["sh"] = np.concatenate([start["sh"], np.random.default_rng(1).normal(0, 0.1, (120, 3, 3)).astype(np.float32)],
                                 axis=1)  # (SH degree 1)
    return data, start


def _clusters_binned(tmp_path, folder, adam, roomed, room=None, iterations=40, slots=20, graphs=False):
    """An out-of-core run of two clusters seen one at a time (rotated, unevenly scaled Gaussians), its device pool
    holding ``slots`` blocks of 16 rows (20: blocks leave and come back once it densifies past them; None: every
    block), each view's working set binned into room (``roomed``; ``room``: a ``BinningRoom`` of the test's) or
    exactly; ``graphs``: with step graphs (simulated: a replay calls the captured step)."""
    data, start = _clusters_start()
    t = fast_refine(OffloadTrainer(data, tmp_path / folder, offload_config(iterations=iterations, sh_degree=1),
                                   backend="cpu", block_rows=16, offload_adam=adam))
    if slots is not None:
        t.store._slots = lambda n: slots
    if graphs:
        t._graphs = StepGraphs(simulate=True)
    t.binning_room = roomed
    t.start_from({"params": start})
    if room is not None:
        t._room = room
    return t


@pytest.mark.parametrize("adam", ["device", "host"])
def test_where_the_device_holds_every_block_each_step_trains_them_all_without_gathering_them_again(
        tmp_path, monkeypatch, adam):
    """Two clusters that the views see one at a time, densifying, the device holding every block (no cap): each
    step's working set is every block, whichever cluster its view sees, gathered from the pool at the start and
    after each refinement only (not at each change of cluster), and the run equals in-memory training (with Adam on the host
    too, whose moments stay on the host).  Where the pool holds under every block, a step's working set is the
    blocks its view sees (about one cluster)."""
    data, start = _clusters_start()
    gathers, cuts, boxes, stored = [], [], [], []  # working sets gathered, refinements, boxes made, statistics stored
    made, reach, store = RowLayout.model, DeviceCache.boxes, RowLayout.store_statistics
    monkeypatch.setattr(RowLayout, "store_statistics", lambda self, *a: stored.append(1) or store(self, *a))
    monkeypatch.setattr(RowLayout, "model", lambda self, *a, **k: ("in_place" in k and gathers.append(1))
                        or made(self, *a, **k))  # (a working set's gather from the pool)
    monkeypatch.setattr(DeviceCache, "boxes", lambda self, *a: boxes.append(1) or reach(self, *a))

    def run(folder, kind, slots=None):
        cfg = offload_config(iterations=40, sh_degree=1)
        t = fast_refine(SingleGPUTrainer(data, tmp_path / folder, cfg, backend="cpu") if kind == "memory" else
                        OffloadTrainer(data, tmp_path / folder, cfg, backend="cpu", block_rows=16, offload_adam=adam))
        if slots is not None:
            t.store._slots = lambda n: slots
        t.start_from({"params": start})
        working = []  # each step's (working set, model) Gaussians
        if kind != "memory":
            refine, checkout = t.store.refine, t.store.checkout
            t.store.refine = lambda *a: cuts.append(1) or refine(*a)

            def checked_out(*a):
                out = checkout(*a)
                working.append((t.store._in_pool.count, len(t.store.index)))
                return out
            t.store.checkout = checked_out
        t.train(progress=False)
        return t, working

    memory, _ = run("memory", "memory")
    del gathers[:], cuts[:]
    every, working = run("every", "offload")
    assert all(resident == n for resident, n in working), [w for w in working if w[0] != w[1]]  # (every block)
    assert len(every.store.index) > 120 and len(cuts) >= 3, "densification did not run"
    assert len(gathers) <= len(cuts) + 1, (len(gathers), len(cuts))  # one at the start and after each refinement
    assert len(boxes) <= len(cuts) + 1, (len(boxes), len(cuts))  # (owed: computed where read, at a refinement)
    assert len(stored) <= 2 * len(cuts) + 2, (len(stored), len(cuts))  # (owed too: stored where the pool is read)
    a, b = memory.gather_state()[0], every.gather_state()[0]
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_allclose(b[w][g], a[w][g], rtol=1e-6, atol=1e-7, err_msg=f"{w} {g}")
    del boxes[:]
    some, working = run("some", "offload", slots=20)
    assert any(resident < 0.8 * n for resident, n in working), working  # (the blocks a view sees)
    culled = sum(resident < n for resident, n in working) - some.store.chunked_steps  # (a chunked step's: the host's)
    assert len(boxes) >= culled > 5  # (each such step's, for culling)


@pytest.mark.parametrize("adam", ["device", "host"])
def test_working_sets_binned_into_room_train_as_exact_binning(tmp_path, adam):
    """Out of core on a GPU each view's working set bins into room kept for the view (``BinningRoom``: no sync
    for its intersections' total): 40 steps densifying, blocks leaving the device and coming back, give the same
    parameters and moments to the bit as exact binning, with Adam on the device or on the host, and the device's
    budget follows the room each step took."""
    exact = _clusters_binned(tmp_path, "exact", adam, False)
    exact.train(progress=False)
    roomy = _clusters_binned(tmp_path, "room", adam, True)
    roomy.train(progress=False)
    assert roomy._room.overflows == 0 and len(roomy._room.last) == 8
    assert roomy.store.cache.misses > roomy.store.cache.slots  # (blocks left the device and came back)
    a, b = exact.gather_state()[0], roomy.gather_state()[0]
    assert len(b["params"]["means"]) > 120, "densification did not run"
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(b[w][g], a[w][g], err_msg=f"{w} {g}")
    assert max(roomy.store._binned) > max(exact.store._binned)  # (a room is more than the total it held)


@pytest.mark.parametrize("adam", ["device", "host"])
def test_out_of_core_steps_replayed_from_graphs_train_as_steps_run_as_usual(tmp_path, adam):
    """Where the working set is the whole model (every block resident) and Adam runs on the device, step graphs
    replay out-of-core steps: 40 steps densifying give the same parameters and moments to the bit as steps run as
    usual.  With Adam on the host (host work inside the step) or a pool of 6 blocks (under the start's 8: the working
    set changes with the view, or chunks), no step is replayed."""
    plain = _clusters_binned(tmp_path, "plain", adam, True, slots=None)
    plain.train(progress=False)
    graphed = _clusters_binned(tmp_path, "graphs", adam, True, slots=None, graphs=True)
    graphed.train(progress=False)
    assert (graphed._graphs.replays > 0) == (adam == "device"), graphed._graphs.replays
    if adam == "device":  # captured as often as in memory: once a view after each refinement (the working set's
        data, start = _clusters_start()  # buffers, its gradients' too, the same from step to step in between)
        memory = fast_refine(SingleGPUTrainer(data, tmp_path / "memory", offload_config(iterations=40, sh_degree=1),
                                              backend="cpu"))
        memory._graphs, memory.binning_room = StepGraphs(simulate=True), True
        memory.start_from({"params": start})
        memory.train(progress=False)
        assert (graphed._graphs.captures, graphed._graphs.replays) == (memory._graphs.captures,
                                                                         memory._graphs.replays)
    a, b = plain.gather_state()[0], graphed.gather_state()[0]
    assert len(b["params"]["means"]) > 120, "densification did not run"
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(b[w][g], a[w][g], err_msg=f"{w} {g}")
    capped = _clusters_binned(tmp_path, "capped", adam, True, slots=6, graphs=True)  # (the start's 8 blocks in 6)
    capped.train(progress=False)
    assert capped._graphs.replays == capped._graphs.captures == 0
    assert capped.store.chunked_steps + capped.store.cache.misses > 0  # (the pool held part of the model)


@pytest.mark.parametrize("adam", ["device", "host"])
def test_a_working_set_that_outgrows_its_room_leaves_the_model_and_its_moments_alone(tmp_path, adam):
    """After the first pass over the 8 views (binned exactly) every working set gets one slot: each step is
    skipped, the parameters, moments and densification statistics stay as they were (with Adam on the host the
    gradients written over the working set's parameters are replaced by the pool's), and the log counts them."""
    from test_single_gpu import _NoRoom
    t = _clusters_binned(tmp_path, "out", adam, True, room=_NoRoom(), iterations=8)
    t.strategy.refine_start = 100
    t.train(progress=False)
    before, count = t.gather_state()
    t.cfg.iterations = 12
    t.train(progress=False)
    after, again = t.gather_state()
    assert t.log_extra()["binning_overflows"] == 4
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(after[w][g], before[w][g], err_msg=f"{w} {g}")
    np.testing.assert_array_equal(again["count"], count["count"])


def test_a_device_cap_too_small_for_a_block_stops_with_the_size_it_needs(dataset, tmp_path):
    t = trained_until(dataset, tmp_path / "out", 10, gpu_memory=slot_bytes(4) + view_bytes(dataset))  # no slot beside the index
    before = snapshot_bytes(tmp_path / "out")
    view = view_bytes(dataset)
    have, need = (re.escape(format_bytes(b)) for b in (slot_bytes(4) + view, slot_bytes(4) + 16 * 400 + view))
    with pytest.raises(ValueError, match=fr"--gpu-memory {have} is too small for view view[0-9]+\.png: its "
                                         r"working set \(400 Gaussians in 25 blocks\), trained in depth-ordered "
                                         r"chunks, needs room for one block of 16 Gaussians beside the index, "
                                         fr"{need}; give --gpu-memory {need} or more"):
        t.train(progress=False)
    assert snapshot_bytes(tmp_path / "out") == before


def test_a_device_cap_too_small_for_the_index_stops_before_allocating_it(dataset, tmp_path):
    """A cap that the training images, the largest view's buffers and the block index already overfill (a large
    capture under a small ``--gpu-memory``) stops with the sizes and the cap that fits, not an allocator's error."""
    trained_until(dataset, tmp_path / "out", 10)
    before = snapshot_bytes(tmp_path / "out")
    view = view_bytes(dataset)
    have, need = (re.escape(format_bytes(b)) for b in (view + 64, view + 16 * 400 + slot_bytes(4)))
    with pytest.raises(ValueError, match=fr"--gpu-memory {have} is too small: the training images take 0 B of it "
                                         fr"\(--targets uint8 keeps them in a quarter\), the largest view's buffers "
                                         fr"{re.escape(format_bytes(view))}, the index of 400 Gaussians 6\.2 KiB and one "
                                         fr"block .*; give --gpu-memory {need} or more"):
        OffloadTrainer(dataset, tmp_path / "out", offload_config(iterations=40), backend="cpu", block_rows=16,
                       gpu_memory=view + 64).load_snapshot(tmp_path / "out" / SNAPSHOT)
    assert snapshot_bytes(tmp_path / "out") == before


def test_a_gpu_caps_headroom_stays_out_of_the_budget_and_the_cap_named_holds_the_need(dataset, tmp_path):
    """On a GPU ``GPU_HEADROOM`` of a ``--gpu-memory`` cap is kept for what the budget does not count (the
    allocator's split chunks); the cap that an error names (``_cap_for``) leaves exactly the bytes needed."""
    from engine.stores.offload.store import GPU_HEADROOM
    store = trained_until(dataset, tmp_path / "out", 10).store
    assert store._headroom() == (0.0, 0)  # the CPU backend: the cap is the budget
    store._headroom = lambda: GPU_HEADROOM
    for need in (1, 10**6, 3 * 10**9):
        store.gpu_memory = store._cap_for(need + store.images_bytes + store._view_bytes())
        assert need <= store._device_budget() <= need + 2
        assert store.gpu_memory - need > GPU_HEADROOM[0] * store.gpu_memory + GPU_HEADROOM[1] - 2


def test_a_store_without_chunked_views_refuses_a_view_too_large_with_the_size_it_needs(dataset, tmp_path):
    """A store whose pipeline trains no chunked views (an MPI rank's shard) refuses a view larger than its
    pool, naming the cap its whole working set needs."""
    t = trained_until(dataset, tmp_path / "out", 10, gpu_memory=2 * slot_bytes(4) + view_bytes(dataset))  # 2 slots (less the index: 1)
    t.store.chunked_views = False
    before = snapshot_bytes(tmp_path / "out")
    view = view_bytes(dataset)
    have, need = (re.escape(format_bytes(b)) for b in (2 * slot_bytes(4) + view, 25 * slot_bytes(4) + 16 * 400 + view))
    with pytest.raises(ValueError, match=fr"--gpu-memory {have} is too small for view view[0-9]+\.png: its "
                                         fr"working set \(400 Gaussians in 25 blocks\) needs {need}; give "
                                         fr"--gpu-memory {need} or more"):
        t.train(progress=False)
    assert snapshot_bytes(tmp_path / "out") == before


def test_a_host_cap_too_small_for_a_block_stops_with_the_size_it_needs(dataset, tmp_path):
    with pytest.raises(ValueError, match=r"--host-memory 1\.0 KiB is too small: a block of the model takes "
                                         r"4\.5 KiB.*give --host-memory 6\.0 KiB or more"):
        trained_until(dataset, tmp_path / "out", 10, mode="disk", offload_dir=tmp_path / "d", host_memory=1024)


def test_an_unwritable_offload_dir_is_named(dataset, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(OSError, match="--offload-dir .*file/blocks is not a writable folder"):
        OffloadTrainer(dataset, tmp_path / "out", offload_config(), backend="cpu", mode="disk",
                       offload_dir=tmp_path / "file" / "blocks", host_memory=10**6)


def test_a_full_disk_stops_training_with_the_last_snapshot_intact(dataset, tmp_path, monkeypatch):
    t = trained_until(dataset, tmp_path / "out", 10, mode="disk", offload_dir=tmp_path / "d",
                      host_memory=3 * 16 * 72 * 4)  # two blocks cached
    before = snapshot_bytes(tmp_path / "out")
    real_write = os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "d")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match=r"--offload-dir .*/d: cannot write a block of the model \(the disk is full\); "
                                      "training stopped, the last snapshot is kept"):
        t.train(progress=False)
    monkeypatch.undo()
    assert snapshot_bytes(tmp_path / "out") == before
    again = OffloadTrainer(dataset, tmp_path / "out", offload_config(iterations=40), backend="cpu", block_rows=16)
    assert again.load_snapshot(tmp_path / "out" / SNAPSHOT)["step"] == 10


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_train_offload_writes_a_model_that_resumes_in_memory(tmp_path, mode):
    """``train --offload host|disk`` turns on visible-only Adam, writes the usual outputs (snapshot, PLY,
    metrics from views rendered from their working sets), and its snapshot resumes in memory."""
    import cli
    from test_trainer import write_blender_capture
    cap, out = tmp_path / "capture", tmp_path / "out"
    write_blender_capture(cap, make_dataset(size=32, n_views=10, backend="cpu"))
    args = ["train", "--data", str(cap), "--white-background", "--out", str(out), "--quiet", "--sh-degree", "1",
            "--init-points", "300", "--eval"]
    extra = ["--offload-dir", str(tmp_path / "blocks"), "--host-memory", "0.2MiB"] if mode == "disk" else []
    assert cli.main([*args, "--iters", "12", "--offload", mode, "--gpu-memory", "1GiB", *extra]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["iterations"] == 12 and np.isfinite(metrics["psnr"]) and metrics["gaussians"] == 300
    recorded = json.loads((out / "cfg.json").read_text())
    assert recorded["visible_adam"] is True and recorded["offload"] == mode
    assert recorded["view_order"] == "auto" and recorded["gpu_memory"] == 2**30
    assert cli.main([*args, "--iters", "16", "--resume", "--offload", "none"]) == 0  # in memory now
    assert json.loads((out / "metrics.json").read_text())["iterations"] == 16
    if mode == "disk":
        assert os.listdir(tmp_path / "blocks") == []  # the blocks' files are gone with the run


def _random_model(n, sh_bases, seed):
    """A GaussianModel of ``n`` rows with random parameters, moments and step, and int/float statistics."""
    from engine.recipe.model import GaussianModel
    rng = np.random.default_rng(seed)
    state = {which: {g: rng.normal(size=(n, sh_bases, 3) if g == "sh" else (n,) if g == "opacities" else
                                   (n, {"means": 3, "scales": 3, "quats": 4}[g])).astype(np.float32)
                     for g in GROUPS} for which in ("params", "m", "v")}
    state["step"] = 17
    stats = {"grad": rng.random(n).astype(np.float32), "count": rng.integers(0, 1000, n).astype(np.int32)}
    return GaussianModel.from_state(state, "cpu"), stats


def _reference_table(layout, model, stats):
    """The row table written column group by column group, with numpy (what the kernels replace): the parameters,
    the statistics, m, v."""
    n, w, s = len(model), layout.width, len(layout.statistics)
    out = np.zeros((n, layout.columns_total), np.float32)
    for first, which in ((0, "params"), (w + s, "m"), (2 * w + s, "v")):
        for g, (a, b) in layout.columns.items():
            out[:, first + a:first + b] = model.group(g, which).reshape(n, b - a)
    for j, k in enumerate(layout.statistics):
        out[:, w + j] = stats[k]
    return out


@pytest.mark.parametrize("sh_bases", [1, 16])
def test_rows_move_between_the_table_and_a_model_in_one_kernel_each_way(sh_bases):
    """RowLayout's plan: a model's table equals the column-by-column one; rows picked from a pool
    (in any order, some twice) give the model of those rows; storing it back writes only them."""
    model, stats = _random_model(37, sh_bases, seed=sh_bases)
    layout = RowLayout(sh_bases, stats)
    table = layout.table(model, stats)
    np.testing.assert_array_equal(table, _reference_table(layout, model, stats))
    rows = np.array([5, 0, 36, 12, 12, 7], np.int64)
    picked, picked_stats = layout.model(table, 3, "cpu", rows=rows)
    assert len(picked) == 6 and picked.adam.step_count == 3
    for which in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(picked.group(g, which), model.group(g, which)[rows])
    assert picked_stats["count"].dtype == np.int32
    np.testing.assert_array_equal(picked_stats["count"], stats["count"][rows])
    pool = np.full((40, layout.columns_total), -1, np.float32)
    picked.adam.m[:] += 1  # trained in place: the store writes what the model holds now
    layout.store(picked, picked_stats, pool, np.array([39, 1, 2, 3, 4, 5], np.int64))
    expected = table[rows]
    w, s = layout.width, len(layout.statistics)
    expected[:, w + s:2 * w + s] += 1  # (m)
    np.testing.assert_array_equal(pool[[39, 1, 2, 3, 4, 5]], expected)
    assert (pool[[0] + list(range(6, 39))] == -1).all()
    picked.gather(np.arange(6))  # new buffers (as a refinement makes): stored from those
    layout.store(picked, picked_stats, pool, np.arange(6, 12))
    np.testing.assert_array_equal(pool[6:12], expected)


@pytest.mark.sim
@pytest.mark.timeout(600)
def test_cuda_row_moves_and_boxes_match_cpu_in_simulator():
    run_sim("""
        import numpy as np
        from engine.stores.offload import RowLayout
        from numbasplat.optim import GROUPS
        from test_offload import _random_model
        model, stats = _random_model(9, 4, seed=2)
        layout = RowLayout(4, stats)
        table = layout.table(model, stats)                       # CPU kernel
        rows = np.array([8, 1, 1, 4], np.int64)
        cpu, cpu_stats = layout.model(table, 5, "cpu", rows=rows)
        gpu, gpu_stats = layout.model(table, 5, "cuda", rows=rows)  # CUDA kernel, simulated
        for which in ("params", "m", "v"):
            for g in GROUPS:
                np.testing.assert_array_equal(gpu.group(g, which), cpu.group(g, which))
        np.testing.assert_array_equal(gpu_stats["count"], cpu_stats["count"])
        pool = np.zeros((6, layout.columns_total), np.float32)
        layout.store(gpu, gpu_stats, pool, np.array([5, 0, 2, 3], np.int64))
        np.testing.assert_array_equal(pool[[5, 0, 2, 3]], table[rows])
        gpu.gather(np.arange(4))  # new buffers: a kernel per buffer, into a view of the table's columns
        pool[:] = 0
        layout.store(gpu, gpu_stats, pool, np.array([5, 0, 2, 3], np.int64))
        np.testing.assert_array_equal(pool[[5, 0, 2, 3]], table[rows])
        from numbasplat.rows import pool_rows
        from test_offload import _pool_rows_case
        for n in (0, 1, 700):
            block, position, slot, want = _pool_rows_case(np.random.default_rng(n), n)
            got = pool_rows(block, position, slot, 100, len(want), "cuda")   # CUDA kernels and a scan
            np.testing.assert_array_equal(got, want)
        print("row moves ok")
    """, timeout=600, env={"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])})


@pytest.mark.sim
@pytest.mark.timeout(1500)
def test_offloaded_training_on_the_cuda_kernels_equals_in_memory_in_simulator(tmp_path):
    """The CUDA path end to end, simulated: offloaded training (the working set's rows by the pool-rows
    scan, moved by the row plans, boxes on the device) equals in-memory training with visible-only
    Adam after 16 steps and two densifications, both where the device holds every block (densified
    there, cut straight into a full pool) and under a cap that moves blocks (densified on the host), there
    also with Adam on the host (``--offload-adam host``: the new parameters scattered into the pool by the
    device's row plans)."""
    run_sim(f"""
        from pathlib import Path
        import numpy as np
        from engine.pipelines.single_gpu import OffloadTrainer
        from engine.pipelines.single_gpu import SingleGPUTrainer
        from engine.stores.offload.store import VIEW_BYTES_PER_PIXEL
        from numbasplat.optim import GROUPS
        from scenes import cluster_capture
        from test_trainer import fast_refine, small_config
        data, start = cluster_capture(per_cluster=20, views=4, size=16)

        def run(kind, **caps):
            cfg = small_config(iterations=16, sh_degree=0, visible_adam=True, view_order="trajectory")
            out = Path({str(tmp_path)!r}) / kind
            t = (SingleGPUTrainer(data, out, cfg, backend="cuda") if kind == "memory" else
                 OffloadTrainer(data, out, cfg, backend="cuda", block_rows=8, **caps))
            fast_refine(t).start_from({{"params": start}})
            t.train(progress=False)
            return t
        a = run("memory").model.host_arrays()
        assert len(a["means"]) > 40, "densification did not run"
        view = VIEW_BYTES_PER_PIXEL * max(v.camera.width * v.camera.height for v in data.train)
        for name, caps in (("full", {{}}), ("capped", {{"gpu_memory": 9 * {slot_bytes(1, 8)} + 16 * 200 + view}}),
                           ("capped-host", {{"gpu_memory": 9 * {slot_bytes(1, 8, "host")} + 16 * 200 + view,
                                            "offload_adam": "host"}})):
            t = run(name, **caps)
            assert (t.store.cache.misses > 0) == name.startswith("capped")
            b = t.whole_model().host_arrays()
            for g in GROUPS:
                np.testing.assert_allclose(b[g], a[g], rtol=1e-5, atol=1e-6, err_msg=name + " " + g)
        print("offloaded on the CUDA kernels ok")
    """, timeout=1500, env={"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])})



def test_a_step_through_the_memory_or_the_host_store_leaves_the_same_whole_model():
    """A store's calls (``engine.stores.memory``): the Gaussians a view trains checked out, stepped (Adam on the
    rows the view sees, their statistics counted), checked in; the whole model then equals the memory
    store's and the host store's (which checked out only the view's working set)."""
    from engine.recipe.model import GaussianModel
    from engine.stores.offload import OutOfCoreStore
    from engine.stores.memory import MemoryStore
    from numbasplat.optim import column_lrs
    from scenes import cluster_capture
    data, start = cluster_capture(per_cluster=60, views=8)
    lr = {"means": 1e-3, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}
    wholes, checked_out = [], []
    for store in (MemoryStore(), OutOfCoreStore("host", block_rows=16)):
        store.open(backend="cpu", views=data.train, images_bytes=0, betas=(0.9, 0.999),
                   fresh_statistics=DefaultStrategy.fresh_statistics)
        store.hold(GaussianModel.from_state({"params": start}, store.home),
                   DefaultStrategy.fresh_statistics(np, len(start["means"])))
        model, state = store.checkout([0], upcoming=[1])
        checked_out.append(len(model))
        p = ns.project(model.gaussians, data.train[0].camera, sh_degree=0, backend="cpu")
        seen = p.counts > 0
        model.grads.data[...] = 0.01
        model.adam.step(model.grads.data, column_lrs(lr, model.sh_bases), seen)
        state["count"][seen] += 1
        store.checkin(model, state, lr)
        wholes.append(store.whole())
        store.close()
    (a, a_state), (b, b_state) = wholes
    assert checked_out[1] <= checked_out[0] == len(a)  # the host store's: the blocks whose boxes the view sees
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(b.group(g, w), a.group(g, w), err_msg=f"{w} {g}")
    np.testing.assert_array_equal(b_state["count"], a_state["count"])
    assert a_state["count"].sum() > 0 and a.adam.step_count == b.adam.step_count == 1


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_a_pool_of_every_block_writes_the_host_tier_when_read_and_renders_its_working_set(tmp_path, mode):
    """A model held where the pool holds every block: the host's tier (host mode's table, disk mode's files) is
    written only when read (every block changed, the flush writing them), and equals the model then; after a step
    the model to render is the working set on the device (no gather), with the parameters Adam wrote; after the
    model is cut anew, not the old working set."""
    from engine.recipe.model import GaussianModel
    from engine.stores.offload import OutOfCoreStore
    from numbasplat.optim import column_lrs
    from scenes import cluster_capture
    data, start = cluster_capture(per_cluster=60, views=8)
    store = OutOfCoreStore(mode, block_rows=16, offload_dir=tmp_path / "blocks", host_memory=64 << 20)
    store.open(backend="cpu", views=data.train, images_bytes=0, betas=(0.9, 0.999),
               fresh_statistics=DefaultStrategy.fresh_statistics)
    held = GaussianModel.from_state({"params": start}, store.home)
    statistics = DefaultStrategy.fresh_statistics(np, len(start["means"]))
    statistics["count"][::3] = 2
    store.hold(held, statistics)
    assert store.cache.slots == store.index.blocks and store.cache.dirty.all()  # (nothing written to the host yet)
    assert store.host.written_bytes == 0 and not list((tmp_path / "blocks").rglob("*.f32"))
    store._flush()  # (as anything that reads the host's tier does first)
    assert not store.cache.dirty.any()
    np.testing.assert_array_equal(store._host_rows(np.arange(len(held))), store.layout.table(held, statistics))
    lr = {"means": 1e-3, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}
    model, state = store.checkout([0], upcoming=[1])
    assert len(model) == len(store.index)  # (every block: the working set is the whole model, in model order)
    model.grads.data[...] = 0.01
    model.adam.step(model.grads.data, column_lrs(lr, model.sh_bases), None)
    store.checkin(model, state, lr)
    rendered = store.rendered()
    assert rendered is model
    whole = store.whole()[0]
    for g in GROUPS:
        np.testing.assert_array_equal(whole.group(g), rendered.group(g), err_msg=g)
        assert not np.array_equal(whole.group(g), held.group(g)), g  # (the step's update, not the held model)
    store.hold(whole, DefaultStrategy.fresh_statistics(np, len(whole)))
    assert store.rendered() is not model  # (a model cut anew: the last working set is of the old index)
    store.close()


@pytest.mark.parametrize("change", [dict(loss="tile"), dict(appearance=True)])
def test_out_of_core_refuses_the_tile_loss_and_appearance_in_check(change):
    """The tile loss and the colour corrections are refused out of core in the one ``check``, with the
    flags named (whatever pipeline holds the store)."""
    from engine.pipelines.options import PipelineOptions, check
    for options in (PipelineOptions(offload="host"), PipelineOptions(offload="disk", offload_dir="d", host_memory=1)):
        with pytest.raises(ValueError, match=r"--offload (host|disk) trains with --loss global, without --appearance"):
            check(small_config(visible_adam=True, **change), options)


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_a_model_started_from_a_ply_is_cut_into_blocks_as_it_is_read(dataset, tmp_path, monkeypatch, mode):
    """``train --init-ply`` out of core: the PLY is read a slice of rows at a time (64 here) into the blocks' table,
    never as a whole model beside it (host memory at the start: the table, and under a tenth more), in disk mode
    into the blocks' files (host memory: the cache and under a tenth of the table), and the blocks
    hold its parameters (rotated, unevenly scaled Gaussians at SH degree 3), Adam's moments and the statistics
    zero, as a model made of the whole file would; a pool of two slots, as a GPU's that the blocks move to."""
    import tracemalloc
    import data.ply as ply
    import engine.stores.offload.store as store_module
    monkeypatch.setattr(store_module, "HOLD_SLICE_ROWS", 64)
    monkeypatch.setattr(ply, "PLY_READ_ROWS", 32)  # (the file's records read 32 at a time)
    monkeypatch.setattr(store_module.OutOfCoreStore, "_slots", lambda self, count: 2)  # (blocks move, as on a GPU)
    rng = np.random.default_rng(2)
    n = 20_000
    start = random_start(rng, n, sh_bases=16)
    ply.save_ply(tmp_path / "start.ply", ns.Gaussians(**start))
    row_bytes = RowLayout(16, DefaultStrategy.fresh_statistics(np, 0)).row_bytes
    disk = {} if mode == "host" else dict(mode="disk", offload_dir=tmp_path / "blocks", host_memory=4 * 512 * row_bytes)
    t = OffloadTrainer(dataset, tmp_path / "out", offload_config(sh_degree=3, iterations=4), backend="cpu",
                       block_rows=512, gpu_memory=2**30, **disk)
    read = ply.PlyGaussians(tmp_path / "start.ply")
    tracemalloc.start()
    try:
        t.start_from({"params": read})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    table_bytes = n * t.store.layout.row_bytes
    assert peak < (1.1 if mode == "host" else 0.1) * table_bytes + 64 * n + disk.get("host_memory", 0), \
        (peak, table_bytes)
    model, statistics = t.store.whole()
    for k, a in start.items():
        np.testing.assert_array_equal(getattr(model.gaussians, k), a, err_msg=k)
    assert not model.adam.m.any() and not model.adam.v.any() and model.adam.step_count == 0
    assert all(not a.any() for a in statistics.values())
    np.testing.assert_array_equal(t.store.index.block, BlockIndex(start["means"], start["scales"], 512).block)
    t.train(progress=False, until=2)  # (and it trains)


def held_out_of_core(start, statistics, block_rows, rng, folder=None, cached_blocks=3):
    """``start``'s parameters (random first moments) and ``statistics`` held by a store out of core (a device pool
    of two blocks, refinement block by block): in host mode, or with ``folder`` in disk mode there, its host
    memory a cache of ``cached_blocks`` blocks (and the room in transit, a third of that) -> (the store, a copy
    of its whole model, its statistics)."""
    from engine.recipe.model import GaussianModel
    from engine.stores.offload import OutOfCoreStore
    disk = {}
    if folder is not None:
        row_bytes = RowLayout(start["sh"].shape[1], DefaultStrategy.fresh_statistics(np, 0)).row_bytes
        disk = dict(mode="disk", offload_dir=folder, host_memory=int(np.ceil(cached_blocks * block_rows * row_bytes
                                                                               * 4 / 3)))
    store = OutOfCoreStore(block_rows=block_rows, gpu_memory=1, **disk)
    store.open(backend="cpu", views=[], images_bytes=0, betas=(0.9, 0.999),
               fresh_statistics=DefaultStrategy.fresh_statistics)
    store._slots = lambda count: 2
    store.refine_in_blocks = True
    model = GaussianModel.from_state({"params": start}, "cpu")
    model.adam.m[...] = rng.normal(size=model.adam.m.shape)
    store.hold(model, statistics)
    whole, state = store.whole()
    store._whole = None  # (not kept: disk mode's blocks are read back from their files)
    return store, GaussianModel.from_state(whole.state(), "cpu"), {k: np.array(a) for k, a in state.items()}


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_evaluation_out_of_core_renders_each_view_from_its_blocks_never_the_gathered_model(dataset, tmp_path,
                                                                                          monkeypatch, mode):
    """Where the device's pool does not hold every block, evaluation reads each view's blocks from the host's tier
    (host mode's one table; disk mode's files, its cache of three blocks left alone), never the model gathered in
    host memory: each view renders the Gaussians the gathered model's blocks in view hold, in model order, and its
    image equals the whole model's (rotated, unevenly scaled Gaussians at SH degree 3; the pool has two slots
    of many blocks).  A chunked view's depth pass reads the same rows' first columns alone: the same keys."""
    from engine.stores.offload import OutOfCoreModel
    from engine.tools.outputs import render_image
    from numbasplat.chunks import depth_keys
    rng = np.random.default_rng(5)
    n, block_rows = 600, 16
    start = random_start(rng, n, sh_bases=16, opacity=1.0)
    start["means"] *= np.float32(0.5)
    start["means"][n // 2:] *= np.float32(60)  # (a half all around, far: each view sees a part of it)
    statistics = DefaultStrategy.fresh_statistics(np, n)
    store, whole, _ = held_out_of_core(start, statistics, block_rows, rng,
                                       folder=tmp_path / "blocks" if mode == "disk" else None)
    with monkeypatch.context() as patched:
        forbid_gathering(patched)
        model = store.rendered()
        assert isinstance(model, OutOfCoreModel) and len(model) == n
        for v in dataset.train[:4]:
            part = store.part_in_view(model, v.camera)
            seen = store.index.rows(store.index.visible(v.camera))
            assert 0 < len(seen) < n
            for k, a in whole.gaussians.take(seen).arrays().items():
                np.testing.assert_array_equal(getattr(part, k), a, err_msg=k)
            np.testing.assert_allclose(render_image(part, v.camera, sh_degree=3, backend="cpu"),
                                       render_image(whole.gaussians, v.camera, sh_degree=3, backend="cpu"), atol=1e-6)
            # (a chunked view's depth pass: the keys of the rows' first columns alone equal the whole rows')
            np.testing.assert_array_equal(depth_keys(store.depth_rows(seen), v.camera, backend="cpu"),
                                          depth_keys(whole.gaussians.take(seen), v.camera, backend="cpu"))
    if mode == "disk":
        assert len(store.host.cache) <= 3


def random_start(rng, n, sh_bases=1, opacity=0.0):
    """``n`` rotated, unevenly scaled Gaussians' parameters, their opacities' logits about ``opacity``."""
    return {"means": rng.normal(size=(n, 3)).astype(np.float32),
            "scales": np.log(rng.uniform(0.002, 0.05, (n, 3))).astype(np.float32),
            "quats": rng.normal(size=(n, 4)).astype(np.float32),
            "opacities": rng.normal(opacity, 3, n).astype(np.float32),
            "sh": rng.normal(size=(n, sh_bases, 3)).astype(np.float32)}


def assert_blocks_hold_their_boxes(store):
    """Each block's box is the reach of its rows, as the host's tier holds them."""
    index, layout = store.index, store.layout
    table = np.concatenate([store.host.scan(b) for b in range(index.blocks)])
    lo, hi = reach_boxes(table, index.starts, index.sizes, layout.columns["means"][0], layout.columns["scales"][0],
                         REACH, backend="cpu")
    np.testing.assert_array_equal(index.lo, lo)
    np.testing.assert_array_equal(index.hi, hi)


@pytest.mark.parametrize("mode", ["host", "disk", "outgrown"])  # outgrown: a page-locked table of the model's size
@pytest.mark.parametrize("growth", [4.0, 0.6])  # x the gradients; below 1 more prunes (opacities lower)  # (the model grows: blocks split; it shrinks: the table shrinks)
def test_a_refinement_block_by_block_equals_the_whole_models(growth, mode, tmp_path):
    """Clones, splits and prunes made block by block (``OutOfCoreStore.refine``) on the host's table, or in disk
    mode from the blocks' files (a cache of three of the 25 blocks) to new ones, give the whole model's refinement,
    row for row in the same order (rotated, unevenly scaled Gaussians; the random draws of the splits by global
    row), with host memory beyond the table (or the cache) of a few blocks only; each new block's box is its
    rows' reach."""
    from engine.recipe.strategy import Context
    rng = np.random.default_rng(3)
    n, block_rows = 400, 16
    start = random_start(rng, n, opacity=0 if growth > 1 else -4)
    statistics = {"grad": (rng.uniform(0, growth * 4e-4, n)).astype(np.float32),
                  "count": rng.integers(0, 3, n).astype(np.int32), "max_radius": np.zeros(n, np.float32)}
    strategy = DefaultStrategy(refine_start=0, refine_every=10, percent_dense=0.02)
    store, whole, state = held_out_of_core(start, statistics, block_rows, rng,
                                           folder=tmp_path / "blocks" if mode == "disk" else None)
    if mode == "outgrown":  # (page-locked on a GPU: a table that takes the model's rows and no more)
        store._locked = outgrown = store.host.whole
        assert outgrown.shape[0] == n
    whole_ctx, ctx = Context(1.0, np.random.default_rng(7)), Context(1.0, np.random.default_rng(7))
    expected = strategy.after_optimizer(whole, state, 10, whole_ctx)
    read_before = store.host.read_bytes
    events = store.refine(strategy, 10, ctx)
    if mode == "outgrown":  # a larger table where the model grew past it, the same one where it shrank
        assert (store._locked is outgrown) == (growth < 1) and store.host.whole.base is store._locked
    assert events == expected and expected["cloned"] and expected["split"] and expected["pruned"]
    assert ctx.rng.integers(2**63) == whole_ctx.rng.integers(2**63)  # (the one key drawn, as the whole model draws it)
    if mode == "disk":  # the blocks were read back from their files, the new ones written to files of their own
        assert store.host.whole is None and store.host.read_bytes > read_before and not store.host.cache
        files = os.listdir(store.host.folder)
        assert sorted(files) == sorted(f"g{store.host.generation}-b{b}.f32" for b in range(store.index.blocks))
    assert (len(store.whole()[0]) > n) == (growth > 1)
    got, got_state = store.whole()
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(got.group(g, w), whole.group(g, w), err_msg=f"{w} {g}")
    assert all(not got_state[k].any() for k in got_state)
    assert store.index.sizes.max() <= block_rows and store.index.blocks >= len(got) / block_rows
    assert_blocks_hold_their_boxes(store)
    assert store.refine_peak_bytes < 8 * block_rows * 2 * store.layout.row_bytes * 4
    store.close()


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_an_opacity_reset_block_by_block_keeps_the_statistics_as_the_whole_models(mode, tmp_path):
    """A step that resets the opacities without refining, made block by block (``OutOfCoreStore.refine``; in disk
    mode from the blocks' files to new ones), keeps the densification statistics gathered so far, as the whole
    model's reset does (a refinement alone starts them afresh), and caps the opacities and their moments alike
    (rotated, unevenly scaled Gaussians)."""
    from engine.recipe.strategy import Context
    rng = np.random.default_rng(4)
    n, block_rows = 300, 16
    start = random_start(rng, n)
    statistics = {"grad": rng.uniform(0, 1e-3, n).astype(np.float32), "count": rng.integers(1, 5, n).astype(np.int32),
                  "max_radius": rng.uniform(0, 9, n).astype(np.float32)}
    strategy = DefaultStrategy(refine_start=0, refine_every=7, reset_every=10)
    store, whole, state = held_out_of_core(start, statistics, block_rows, rng,
                                           folder=tmp_path / "blocks" if mode == "disk" else None)
    ctx = Context(1.0, np.random.default_rng(7))
    assert strategy.resets_at(10, ctx) and not strategy.refines_at(10, ctx)
    expected = strategy.after_optimizer(whole, state, 10, ctx)
    assert store.refine(strategy, 10, Context(1.0, np.random.default_rng(7))) == expected == {"opacity_reset": True}
    got, got_state = store.whole()
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(got.group(g, w), whole.group(g, w), err_msg=f"{w} {g}")
    for k, a in statistics.items():
        np.testing.assert_array_equal(np.asarray(got_state[k]), a, err_msg=k)
    assert_blocks_hold_their_boxes(store)
    store.close()


def test_a_refinement_on_disk_holds_a_few_blocks_and_the_decisions_never_the_model(tmp_path, monkeypatch):
    """Disk mode refines block by block from the blocks' files to new ones, and saves after, without gathering
    the model: host memory beyond its cache (three of the 79 blocks) stays a few blocks and some bytes a Gaussian
    for the decisions and the new index, far under the model (20,000 Gaussians at SH degree 3, growing by clones
    and splits, some pruned); the refined model equals the whole model's refinement, as the saved arrays do."""
    import tracemalloc
    from engine.recipe.strategy import Context
    rng = np.random.default_rng(5)
    n, block_rows = 20_000, 256
    start = random_start(rng, n, sh_bases=16, opacity=-2)
    statistics = {"grad": rng.uniform(0, 4e-4, n).astype(np.float32), "count": rng.integers(0, 3, n).astype(np.int32),
                  "max_radius": np.zeros(n, np.float32)}
    strategy = DefaultStrategy(refine_start=0, refine_every=10, percent_dense=0.02)
    store, whole, state = held_out_of_core(start, statistics, block_rows, rng, folder=tmp_path / "blocks")
    expected = strategy.after_optimizer(whole, state, 10, Context(1.0, np.random.default_rng(7)))
    assert expected["cloned"] and expected["split"] and expected["pruned"]
    block_bytes, model_bytes = block_rows * store.layout.row_bytes, n * store.layout.row_bytes
    with monkeypatch.context() as patched:
        forbid_gathering(patched)
        tracemalloc.start()
        try:
            events = store.refine(strategy, 10, Context(1.0, np.random.default_rng(7)))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        saved, saved_statistics = store.saved_state()
        saved = {w: {g: a[:] for g, a in saved[w].items()} for w in ("params", "m", "v")}
        saved_statistics = {k: a[:] for k, a in saved_statistics.items()}
    assert events == expected and len(store.index) > n
    assert peak < 8 * block_bytes + 100 * len(store.index) < model_bytes / 3, (peak, block_bytes, model_bytes)
    got, got_state = store.whole()
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(got.group(g, w), whole.group(g, w), err_msg=f"{w} {g}")
            np.testing.assert_array_equal(saved[w][g], whole.host_arrays(w)[g], err_msg=f"saved {w} {g}")
    for k, a in got_state.items():
        np.testing.assert_array_equal(saved_statistics[k], a, err_msg=k)
    store.close()


def test_a_refinement_on_disk_that_fails_midway_leaves_the_blocks_before(tmp_path, monkeypatch):
    """The new blocks of a refinement on disk are files of the next generation, the blocks before let go only
    once every one is written: a refinement that fails midway (an error in the strategy) leaves the model as it
    was, and the next one is the whole model's; a full disk stops it with the one message naming the folder."""
    from engine.recipe.strategy import Context
    rng = np.random.default_rng(6)
    n, block_rows = 300, 16
    start = random_start(rng, n)
    statistics = {"grad": rng.uniform(0, 8e-4, n).astype(np.float32), "count": rng.integers(0, 3, n).astype(np.int32),
                  "max_radius": np.zeros(n, np.float32)}
    strategy = DefaultStrategy(refine_start=0, refine_every=10, percent_dense=0.02)
    store, whole, state = held_out_of_core(start, statistics, block_rows, rng, folder=tmp_path / "blocks")
    before = {w: {g: np.array(a) for g, a in whole.host_arrays(w).items()} for w in ("params", "m", "v")}
    refine_block = type(store)._refine_block
    calls = []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("the strategy failed")
        return refine_block(self, *args)
    with monkeypatch.context() as patched:
        patched.setattr(type(store), "_refine_block", failing)
        with pytest.raises(RuntimeError, match="the strategy failed"):
            store.refine(strategy, 10, Context(1.0, np.random.default_rng(7)))
    got, got_state = store.whole()
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(got.host_arrays(w)[g], before[w][g], err_msg=f"{w} {g}")
    for k, a in statistics.items():
        np.testing.assert_array_equal(got_state[k], a, err_msg=k)
    store._whole = None
    expected = strategy.after_optimizer(whole, state, 10, Context(1.0, np.random.default_rng(7)))
    assert store.refine(strategy, 10, Context(1.0, np.random.default_rng(7))) == expected and expected["split"]
    got = store.whole()[0]
    for w in ("params", "m", "v"):
        for g in GROUPS:
            np.testing.assert_array_equal(got.group(g, w), whole.group(g, w), err_msg=f"{w} {g}")
    store._whole = None
    real_write = os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(store.host.folder)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match=r"--offload-dir .*/blocks: cannot write a block of the model \(the disk is "
                                      r"full\); training stopped, the last snapshot is kept"):
        store.refine(strategy, 20, Context(1.0, np.random.default_rng(7)))
    monkeypatch.undo()
    store.close()


def test_rows_read_from_a_file_of_columns_are_the_tables_rows(tmp_path):
    """``FileRows`` (disk mode's saved arrays, read from a file of the model's columns in model order) gives what
    ``TableRows`` (host mode's, read from the one table) gives, for any slice of rows and indices into the rest."""
    from engine.stores.offload.layout import FileRows, TableRows
    rng = np.random.default_rng(8)
    table = rng.normal(size=(50, 12)).astype(np.float32)
    rows = rng.permutation(50)  # (model row i: table row rows[i])
    path = tmp_path / "columns.f32"
    with open(path, "wb") as f:
        f.write(b"\0" * 8)  # (an offset before them)
        f.write(np.ascontiguousarray(table[rows, 3:9]).tobytes())
        f.write(np.ascontiguousarray(np.round(table[rows, 9] * 100)).tobytes())  # (a count after them)
    in_table, in_file = (TableRows(table, rows, (3, 9), (2, 3)), FileRows(path, 8, 50, (3, 9), (2, 3)))
    assert in_file.shape == in_table.shape == (50, 2, 3) and in_file.nbytes == in_table.nbytes == 50 * 6 * 4
    for key in (slice(0, 10), slice(5, 50, 3), slice(None, None, -1), slice(40, 2, -7), slice(60, 70), slice(9, 3),
                (slice(3, 9), 1), (slice(None), slice(None), 2)):
        np.testing.assert_array_equal(in_file[key], in_table[key], err_msg=str(key))
    counts = FileRows(path, 8 + 4 * 50 * 6, 50, (9, 10), (), np.int32)  # (a statistic, float32 in the rows)
    np.testing.assert_array_equal(counts[:], np.round(table[rows, 9] * 100).astype(np.int32))
    assert counts[:].dtype == np.int32
    with pytest.raises(TypeError, match="FileRows reads slices of rows"):
        in_file[3]


def forbid_gathering(monkeypatch):
    """Gathering the whole model out of core (``OutOfCoreStore._gather_whole``) fails the test from now on."""
    from engine.stores.offload import OutOfCoreStore

    def gathered(self):
        raise AssertionError("the whole model was gathered in host memory")
    monkeypatch.setattr(OutOfCoreStore, "_gather_whole", gathered)


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_snapshots_and_the_ply_read_the_model_out_of_core_a_slice_of_rows_at_a_time(dataset, tmp_path, monkeypatch,
                                                                                      mode):
    """The snapshot and the PLY are written a slice of rows at a time (1024 here), never from a gathered copy
    of the model: in host mode from the host's one table, in disk mode from a file of the model's columns in
    model order made from the blocks' files (host memory a cache of three of the 40 blocks), once for both and
    let go at the next step.  The files equal those of the gathered model (a snapshot that resumes the same
    run), and the host's peak while writing them stays under a tenth of the model (20,000 Gaussians at SH
    degree 3, rotated and uneven, after steps that moved them)."""
    import tracemalloc
    import h5py
    import data.ply as ply
    import engine.tools.snapshot as snapshot
    from engine.tools.outputs import write_model_outputs
    monkeypatch.setattr(snapshot, "SNAPSHOT_CHUNK_ROWS", 1024)
    monkeypatch.setattr(ply, "PLY_CHUNK_ROWS", 1024)
    rng = np.random.default_rng(1)
    n, block_rows = 20_000, 512
    quats = rng.normal(size=(n, 4)).astype(np.float32)
    start = dict(means=rng.uniform(-1, 1, (n, 3)).astype(np.float32),
                 scales=np.log(rng.uniform(0.02, 0.1, (n, 3))).astype(np.float32), quats=quats,
                 opacities=rng.normal(0, 1, n).astype(np.float32), sh=rng.normal(0, 0.3, (n, 16, 3)).astype(np.float32))
    row_bytes = RowLayout(16, DefaultStrategy.fresh_statistics(np, 0)).row_bytes
    disk = {} if mode == "host" else dict(mode="disk", offload_dir=tmp_path / "blocks",
                                           host_memory=4 * block_rows * row_bytes)  # 3 blocks and one in transit
    cfg = lambda: offload_config(sh_degree=3, iterations=4, densify_from=10**6)  # noqa: E731
    t = OffloadTrainer(dataset, tmp_path / "out", cfg(), backend="cpu", block_rows=block_rows, **disk)
    t.start_from({"params": start})
    t.train(progress=False, until=3)
    model_bytes = n * row_bytes
    assert mode == "disk" or t.store.host.whole.nbytes == model_bytes
    with monkeypatch.context() as patched:
        forbid_gathering(patched)
        tracemalloc.start()
        try:
            t.save_snapshot(tmp_path / "lazy.h5")
            written = t.store.host.written_bytes
            ply_path = write_model_outputs(t)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < model_bytes / 10, (peak, model_bytes)
    if mode == "disk":  # the blocks came back from their files; the PLY read the file the snapshot had made
        assert t.store.host.read_bytes > model_bytes and t.store.host.written_bytes == written
        assert t.store.index.blocks == 40 and len(t.store.host.cache) <= 3
        in_model_order = t.store.host.ordered[1]
        assert os.path.getsize(in_model_order) == model_bytes
        host = t.store.host  # (every block in its file, or changed in the cache: written when it leaves)
        assert all(os.path.exists(host._path(b)) or b in host.dirty for b in range(40))
        assert len(os.listdir(host.folder)) == 1 + sum(os.path.exists(host._path(b)) for b in range(40))
    model, statistics = t.store.whole()  # the gathered model, as the snapshot wrote it before
    with h5py.File(tmp_path / "lazy.h5") as f:
        for which in ("params", "m", "v"):
            for g, a in model.host_arrays(which).items():
                np.testing.assert_array_equal(f[f"{'adam/' if which != 'params' else ''}{which}/{g}"][()], a)
        for k, a in statistics.items():
            np.testing.assert_array_equal(f[f"strategy/{k}"][()], a)
            assert f[f"strategy/{k}"].dtype == a.dtype
        assert f["adam/m/sh"].shape == (n, 16, 3) and f["params/opacities"].shape == (n,)
    ply.save_ply(tmp_path / "gathered.ply", model.gaussians)
    assert open(ply_path, "rb").read() == open(tmp_path / "gathered.ply", "rb").read()
    if mode == "disk":  # the next step lets the file go: the disk holds the blocks alone again
        t.train_step()
        assert not os.path.exists(in_model_order) and len(os.listdir(t.store.host.folder)) == 40
    resumed = OffloadTrainer(dataset, tmp_path / "again", cfg(), backend="cpu", block_rows=block_rows)
    resumed.load_snapshot(tmp_path / "lazy.h5")
    for g, a in resumed.whole_model().host_arrays("params").items():
        np.testing.assert_array_equal(a, model.host_arrays("params")[g])


@pytest.mark.parametrize("adam", ["device", "host"])
def test_the_working_set_bytes_are_what_a_step_allocates(dataset, tmp_path, adam):
    """``working_set_bytes`` at SH degree 3, item by item, against the arrays that a step on the CPU backend
    allocates for a working set of 20,000 Gaussians: the pool's rows, the working copy (parameters and
    statistics, no moments, no gradients until the backward), the projection, the rows and visible mask,
    the binning's peak as tracemalloc sees it (numpy's arrays; the tiles' ranges and a few objects besides),
    the backward's records, kept ids and the parameters' gradients, which the check-in lets go.  With Adam on
    the host (``--offload-adam host``) the pool's rows hold no moments, the backward writes the gradients over
    the working copy's parameters (no buffer of their own), and the update allocates host memory alone, and
    from its second step only the host rows' places: the parameters gathered from them, the gradients and the
    visible mask brought over land in page-locked buffers it keeps from step to step."""
    import tracemalloc
    from engine.stores.offload.store import working_set_bytes
    rng = np.random.default_rng(0)
    n = 20_000
    quats = rng.normal(size=(n, 4)).astype(np.float32)
    start = dict(means=rng.uniform(-1, 1, (n, 3)).astype(np.float32),
                 scales=np.log(rng.uniform(0.04, 0.12, (n, 3))).astype(np.float32),
                 quats=quats, opacities=np.zeros(n, np.float32), sh=rng.normal(0, 0.3, (n, 16, 3)).astype(np.float32))
    t = OffloadTrainer(dataset, tmp_path, offload_config(sh_degree=3), backend="cpu", block_rows=512,
                       offload_adam=adam)
    t.store._copies_whole_rows = lambda: False  # (the working set in place, as under a cap, where the budget counts:
    # without one, a steady working set trains on a copy of its whole rows where the device has room for it)
    t.start_from({"params": start})
    i = 1
    model, state = t.store.checkout([i])
    working = t.store._in_pool
    assert len(model) == working.count == n  # (every block in view)
    p = t.project_view(model, state, i, 3)
    tiles = int(np.prod(p.camera.tiles))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        b = ns.bin_tiles(p, backend="cpu")
        binning_peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    intersections = int(p.counts.sum())
    assert intersections > n  # (so that a byte per intersection shows)
    r = ns.rasterize(p, b, None, "cpu")
    grad = ns.rasterize_backward(p, b, r, np.ones_like(r.image), backend="cpu")
    assert model._grads is None  # (none yet: the binning's peak does without them)
    visible = t.owner_backward(model, state, [p], [grad])
    items, peak = t.store.working_set_bytes(intersections / n, tiles)
    assert (items, peak) == working_set_bytes(t.store.layout, intersections / n, tiles, adam)  # (the pipeline's)
    copies = sum(a.nbytes for a in state.values() if not np.shares_memory(a, model.params.data.base))
    allocated = [t.store.cache.pool.nbytes / len(t.store.cache.pool), (model.params.data.base.nbytes + copies) / n,
                 (p.proj.nbytes + p.radii.nbytes + p.counts.nbytes) / n,
                 (working.rows.nbytes + (p.counts > 0).nbytes) / n]
    assert list(items.values())[:4] == allocated
    assert model.adam.m.nbytes == model.adam.v.nbytes == 0  # the moments are the pool's alone
    assert model.params.data.base.nbytes == 4 * n * (model.params.size // n + len(t.store.layout.statistics))
    assert abs(binning_peak - (n * items["binning at its peak: depth order, intersections and their sort"]
                               + 8 * tiles)) < 4096  # (a byte a Gaussian: 20,000)
    binning, scratch, backward = list(items.values())[4:]
    over_params = np.shares_memory(model.grads.data, model.params.data)
    assert over_params == (adam == "host")
    assert backward * n == grad.nbytes + b.ids.nbytes + (0 if over_params else model.grads.data.nbytes)
    assert scratch == intersections / n * (2 + 2 + 8)  # (a GPU's sort: not allocated here)
    assert peak == sum(allocated) + max(binning + scratch, backward)
    pool_row = 720 if adam == "device" else 248  # (SH degree 3: 59 parameters, m and v or none, 3 statistics)
    assert list(items.values())[:2] == [pool_row, 252]  # (the working copy: 59 parameters, 3 statistics, one int32)
    assert model.grads.data.nbytes == 236 * n  # (with Adam on the host, the working copy's parameters' bytes)
    assert t.store.step_device_bytes(intersections / n, tiles) == \
        t.store.cache.pool.nbytes + n * (peak - pool_row) + DeviceCache.INDEX_BYTES * n + view_bytes(dataset)
    if adam == "host":  # the update's allocations (its second: the first compiles): on the host
        assert t.store.host.whole is not None  # (host mode's one table: its rows stepped in place, not gathered)
        model.adam.set_step(t.learning_rates()[1])
        model.adam.update(model.grads.data, visible)
        model.adam.set_step(t.learning_rates()[1])
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            model.adam.update(model.grads.data, visible)
            update_peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        assert abs(update_peak - n * 8) < 4096  # (the rows' places, int64)
    t.store.checkin(model, state, t.learning_rates()[0])
    assert model._grads is None  # (let go until the next backward)


def _held_bytes(store):
    """The bytes that a ``DiskBlocks`` holds: its cache and its blocks in transit (read ahead, being read, being
    written)."""
    with store.lock:
        return store.cached_bytes + store._in_transit()


@pytest.mark.parametrize("slow", [False, True])
def test_disk_blocks_writing_behind_serve_the_latest_rows_and_write_what_writing_at_once_does(tmp_path, slow):
    """A seeded mix of puts, gets (some changed in place and put back, as ``rows_out`` does), reads ahead and a
    re-cut on 20 blocks of several shapes under a cap of a few blocks, written behind and, the twin, at once:
    every get is the block's latest rows, the cache and the blocks in transit hold at most the cap, a re-cut
    leaves no file of the cut before, and once the writes drain the two wrote the same bytes and every block
    not changed since it left the cache has its latest rows in its file.  A slow writer makes the gets and
    puts reach blocks whose writes are in flight."""
    import time
    rng = np.random.default_rng(7)
    shapes = {b: (int(rng.integers(3, 12)), int(rng.integers(2, 7))) for b in range(20)}
    capacity = 5 * 11 * 6 * 4  # five of the largest blocks (264 bytes): a quarter of it in transit
    behind = DiskBlocks(tmp_path / "behind", capacity)
    at_once = DiskBlocks(tmp_path / "at_once", capacity, write_behind=False)
    stores = (behind, at_once)
    if slow:
        write = behind._write

        def slow_write(b, table, generation):
            time.sleep(0.003)
            write(b, table, generation)
        behind._write = slow_write

    def recut():
        tables = {b: rng.normal(size=s).astype(np.float32) for b, s in shapes.items()}
        for store in stores:
            store.reset({b: t.copy() for b, t in tables.items()})
            assert all(name.startswith(f"g{store.generation}-") for name in os.listdir(store.folder))
        return tables

    latest = recut()
    in_flight = 0  # gets of blocks being written
    for step in range(800):
        b, op = int(rng.integers(20)), rng.choice(["put", "get", "change", "prefetch"], p=[0.3, 0.3, 0.25, 0.15])
        if step == 400:
            latest = recut()
        elif op == "put":
            latest[b] = rng.normal(size=shapes[b]).astype(np.float32)
            for store in stores:
                store.put(b, latest[b].copy())
        elif op == "prefetch":
            ahead = rng.choice(20, size=4, replace=False)
            for store in stores:
                store.prefetch(ahead)
        else:
            with behind.lock:
                in_flight += b in behind.writing
            rows = rng.integers(shapes[b][0], size=2)
            value = np.float32(rng.normal())
            for store in stores:
                got = store.get(b)
                np.testing.assert_array_equal(got, latest[b])
                if op == "change":
                    got[rows] = value
                    store.put(b, got)
            if op == "change":
                latest[b] = latest[b].copy()
                latest[b][rows] = value
        for store in stores:
            assert _held_bytes(store) <= capacity
    behind.flush()
    assert behind.written_bytes == at_once.written_bytes > 0
    assert list(behind.cache) == list(at_once.cache) and behind.dirty == at_once.dirty and not behind.writing
    for store in stores:
        for b in sorted(set(range(20)) - store.dirty):
            np.testing.assert_array_equal(np.fromfile(store._path(b), np.float32).reshape(shapes[b]), latest[b])
    assert in_flight > 0 or not slow
    for store in stores:
        folder = store.folder
        store.close()
        assert not os.path.exists(folder)


@pytest.mark.parametrize("at", ["get", "put", "prefetch", "flush", "reset", "close"])
def test_a_write_behind_that_fails_stops_the_next_call_with_one_message(tmp_path, monkeypatch, at):
    """A write that fails on the writer thread (a full disk) is raised at the training thread's next call as
    the one line that a write at once gives (no traceback of the writer thread), again at every call but
    ``close``, which raises it only where no call did; the failed block's rows stay in memory."""
    import threading
    import traceback
    tables = {b: np.full((10, 5), b, np.float32) for b in range(8)}  # 200 bytes each
    store = DiskBlocks(tmp_path / "d", capacity=8 * 200)  # a cache of 6 blocks, 2 in transit
    real_write, gate = os.write, threading.Event()

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(store.folder):
            gate.wait(10)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", full)
    store.reset(tables)  # blocks 0 and 1 out of the cache: their writes wait at the gate
    assert sorted(store.writing) == [0, 1] and store.failure is None
    gate.set()
    with store.changed:
        assert store.changed.wait_for(lambda: store.writes_in_flight == 0, timeout=10)
    message = (r"^\[Errno 28\] --offload-dir .*/d: cannot write a block of the model \(the disk is full\); "
               r"training stopped, the last snapshot is kept$")
    calls = {"get": lambda: store.get(0), "put": lambda: store.put(3, tables[3]), "prefetch": lambda: store.prefetch([0]),
             "flush": store.flush, "reset": lambda: store.reset(tables), "close": store.close}
    with pytest.raises(OSError, match=message) as raised:
        calls[at]()
    e = raised.value
    assert e.errno == errno.ENOSPC and e.__cause__ is None and e.__suppress_context__
    assert "_write_in_flight" not in "".join(traceback.format_exception(e))  # (the training thread's call alone)
    if at != "close":
        with pytest.raises(OSError, match=message):
            store.get(5)
        assert (store.writing[0][1] == 0).all() and (store.writing[1][1] == 1).all()
    folder = store.folder
    store.close()  # (raised already: not again)
    assert not os.path.exists(folder)


def test_writes_behind_that_fall_behind_hold_the_training_thread_within_the_cap(tmp_path):
    """With the writer stalled: a read ahead skips the blocks being written, a get of one is served from memory
    (no read), and puts of changed blocks go on while the writes in flight fit the room in transit, then wait
    rather than hold more than the cap; the writer freed, they finish and every block reads back its latest."""
    import threading
    store = DiskBlocks(tmp_path / "d", capacity=16 * 200)  # a cache of 12 blocks of 200 bytes, 4 in transit
    latest = {b: np.full((10, 5), b, np.float32) for b in range(16)}
    store.reset(latest)
    store.flush()  # blocks 0 to 3 in their files, 4 to 15 cached (changed)
    write, gate = store._write, threading.Event()

    def stalled(*args):
        gate.wait(10)
        write(*args)
    store._write = stalled
    latest[0] = np.full((10, 5), 100, np.float32)
    store.put(0, latest[0])  # 4 out, its write stalled
    reads = store.read_bytes
    store.prefetch([4, 1])
    store._wait()
    assert list(store.staged) == [1] and store.read_bytes == reads + 200  # (4 is being written: not read)
    got = store.get(4)
    assert got is store.writing[4][1] and store.read_bytes == reads + 200  # 5 out, its write stalled too
    done, held = [], []

    def puts():
        for b in (2, 3, 12, 13):
            latest[b] = np.full((10, 5), 200 + b, np.float32)
            store.put(b, latest[b])
            done.append(b)
            held.append(_held_bytes(store))
    worker = threading.Thread(target=puts, daemon=True)
    worker.start()
    worker.join(0.5)
    assert worker.is_alive() and done == [2]  # 6 out (the room in transit full), then 7 out: it waits
    assert store.writes_in_flight == 4 and _held_bytes(store) <= store.capacity
    gate.set()
    worker.join(10)
    assert not worker.is_alive() and done == [2, 3, 12, 13] and max(held) <= store.capacity
    store.flush()
    for b in range(16):
        np.testing.assert_array_equal(store.get(b), latest[b])
    store.close()


def test_a_block_written_again_before_its_first_write_lands_is_served_its_latest_rows(tmp_path):
    """A block out of the cache changed, read back while its write is in flight, changed and out again: when
    the first write lands the block stays in memory (its file has the older rows until the second lands), and
    the writes land in order, the file then holding the latest rows."""
    import threading
    store = DiskBlocks(tmp_path / "d", capacity=8 * 200)  # a cache of 6 blocks of 200 bytes, 2 in transit
    store.reset({b: np.full((10, 5), b, np.float32) for b in range(10)})
    for b in (0, 1, 2, 3, 4, 5):
        store.get(b)  # (from their files)
    store.flush()  # every block in its file, the cache 0 to 5 unchanged
    write, permits = store._write, threading.Semaphore(0)

    def one_at_a_time(*args):
        assert permits.acquire(timeout=10)
        write(*args)
    store._write = one_at_a_time
    first, second = np.full((10, 5), 100, np.float32), np.full((10, 5), 200, np.float32)
    store.put(0, first.copy())
    for b in (6, 7, 8, 9, 1, 2):
        store.get(b)  # 1 to 5 out unchanged, then 0 changed: its first write in flight
    np.testing.assert_array_equal(store.get(0), first)  # (from memory: 6 out)
    store.put(0, second.copy())
    for b in (3, 4, 5, 6, 7, 8):
        store.get(b)  # 7, 8, 9, 1, 2 out unchanged, then 0 changed: its second write in flight
    assert store.writes_in_flight == 2 and store.writing[0][0] == store.version[0] == 3  # (reset's put the first)
    permits.release()
    with store.changed:
        assert store.changed.wait_for(lambda: store.writes_in_flight == 1, timeout=10)
    np.testing.assert_array_equal(np.fromfile(store._path(0), np.float32), first.ravel())
    reads = store.read_bytes
    np.testing.assert_array_equal(store.get(0), second)
    assert store.read_bytes == reads  # (not its file: the first write's rows)
    permits.release()
    store.flush()
    np.testing.assert_array_equal(np.fromfile(store._path(0), np.float32), second.ravel())
    store.close()


def test_a_file_is_never_written_while_it_is_read_ahead_and_a_torn_read_ahead_is_dropped(tmp_path):
    """A block read ahead, meanwhile read at once, changed and out of the cache: its write behind waits for the
    read ahead to end, which is then dropped (the block is being written).  Written at once, a read ahead of a
    file half written (a short read) is dropped too, not raised at the next call."""
    import threading
    store = DiskBlocks(tmp_path / "d", capacity=8 * 200)  # a cache of 6 blocks of 200 bytes, 2 in transit
    store.reset({b: np.full((10, 5), b, np.float32) for b in range(10)})
    for b in (0, 1, 2, 3, 4, 5):
        store.get(b)
    store.flush()  # every block in its file, the cache 0 to 5 unchanged
    read, go, reading = store._read, threading.Event(), threading.Event()

    def held_ahead(b, generation=None):
        if threading.current_thread().name.startswith("offload-prefetch"):
            reading.set()
            assert go.wait(10)
        return read(b, generation)
    store._read = held_ahead
    store.prefetch([6])
    assert reading.wait(10)  # the reader in block 6's file
    assert (store.get(6) == 6).all()
    changed = np.full((10, 5), 60, np.float32)
    store.put(6, changed.copy())
    for b in (7, 8, 9, 0, 1, 2):
        store.get(b)  # 0 to 5 out unchanged, then 6 changed: its write waits for the read
    written = store.written_bytes
    with store.changed:
        assert not store.changed.wait_for(lambda: store.writes_in_flight == 0, timeout=0.3)
    assert store.written_bytes == written and sorted(store.writing) == [6]
    go.set()
    store._wait()
    store.flush()
    assert not store.staged and store.written_bytes == written + 200
    np.testing.assert_array_equal(np.fromfile(store._path(6), np.float32), changed.ravel())
    np.testing.assert_array_equal(store.get(6), changed)
    store.close()

    at_once = DiskBlocks(tmp_path / "e", capacity=8 * 200, write_behind=False)
    at_once.reset({b: np.full((10, 5), b, np.float32) for b in range(10)})
    read = at_once._read

    def torn(b, generation=None):
        if threading.current_thread().name.startswith("offload-prefetch"):
            raise ValueError("cannot reshape array of size 0 into shape (10,5)")
        return read(b, generation)
    at_once._read = torn
    at_once.prefetch([0, 1])
    at_once._wait()
    assert not at_once.staged and (at_once.get(0) == 0).all()
    at_once.close()


def test_a_crashed_runs_block_folder_is_removed_at_the_next_start_and_no_other(tmp_path):
    """Disk mode's folder names its process and host; a later start in ``--offload-dir`` removes those of this
    host whose process has ended, and keeps a running one's, another host's and one that names none."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from engine.stores.offload.tiers import DiskBlocks

    host = socket.gethostname()
    ended = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                               text=True, check=True).stdout)
    names = {"crashed": f"{ended}@{host}-x1y2", "running": f"{os.getpid()}@{host}-x1y2",
             "elsewhere": f"{ended}@other-{host}-x1y2", "older": "x1y2", "crashed-file": f"{ended + 1}@{host}-z"}
    for key, name in names.items():
        path = tmp_path / (DiskBlocks.PREFIX + name)
        if key == "crashed-file":  # (a file of that name is not a folder: it stays)
            path.write_text("")
            continue
        path.mkdir()
        (path / "g0-b0.f32").write_bytes(b"\0" * 64)
    (tmp_path / "mine").mkdir()  # (not a block folder)
    blocks = DiskBlocks(tmp_path, 10**6)
    assert Path(blocks.folder).name.startswith(f"{DiskBlocks.PREFIX}{os.getpid()}@{host}-")
    assert blocks.removed_abandoned == [str(tmp_path / (DiskBlocks.PREFIX + names["crashed"]))]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(blocks.folder).name, "mine"] + [DiskBlocks.PREFIX + names[k]
                                              for k in ("running", "elsewhere", "older", "crashed-file")])
    blocks.close()
    assert not Path(blocks.folder).exists()
    again = DiskBlocks(tmp_path, 10**6)  # (the closed run's folder is gone; nothing else removed)
    assert again.removed_abandoned == []
    again.close()


def test_device_cache_evicts_as_a_least_recently_used_list_would(monkeypatch):
    """The pool's bookkeeping (arrays over the blocks) against a plain least-recently-used list over 300 random
    fetches, prefetches and changes of 30 blocks in 8 slots: the same blocks resident, the same written back in
    the same order, the same hits and misses."""
    from collections import OrderedDict
    rng = np.random.default_rng(3)
    n, slots = 30, 8
    index = BlockIndex(rng.uniform(-1, 1, (16 * n, 3)), np.full((16 * n, 3), -3.0), block_rows=16)
    layout = RowLayout(1, {"count": np.zeros(0, np.int32)})
    host = HostBlocks()
    host.reset({b: np.full((16, layout.columns_total), b, np.float32) for b in range(n)})
    written = []
    put = host.put
    monkeypatch.setattr(host, "put", lambda b, t: (written.append(b), put(b, t)))
    cache = DeviceCache(np, layout, 16, slots, index)
    lru, dirty, incoming, expected = OrderedDict(), set(), set(), []
    hits = misses = 0

    def move_in(missing, keep):
        out = max(0, len(missing) - (slots - len(lru)))
        leaving = [b for b in lru if b not in keep][:out]
        expected.extend(b for b in leaving if b in dirty)
        for b in leaving:
            dirty.discard(b)
            del lru[b]
        lru.update((b, None) for b in missing)

    for _ in range(300):
        blocks = [int(b) for b in rng.choice(n, rng.integers(1, slots + 1), replace=False)]
        if rng.random() < 0.6:
            cache.fetch(np.array(blocks), index, host)
            missing = [b for b in blocks if b not in lru]
            hits += sum(b not in incoming for b in blocks if b in lru)
            for b in blocks:
                if b in lru:
                    lru.move_to_end(b)
            incoming.clear()
            misses += len(missing)
            move_in(missing, set(blocks))
            if rng.random() < 0.5:
                cache.changed(blocks)
                dirty.update(blocks)
        else:
            busy = [b for b in lru if rng.random() < 0.3][:slots - len(blocks)]
            cache.prefetch(blocks, busy, index, host)
            keep = set(blocks) | set(busy)
            missing = [b for b in blocks if b not in lru][:slots - len(lru) + sum(b not in keep for b in lru)]
            misses += len(missing)
            incoming.update(missing)
            move_in(missing, keep)
        assert sorted(np.flatnonzero(cache.slot >= 0)) == sorted(lru) and written == expected
        assert (cache.hits, cache.misses) == (hits, misses)
    assert len(written) > 20 and hits > 100


def test_a_views_depth_chunks_are_those_a_stable_sort_of_its_keys_cuts():
    """``depth_chunk_places`` (a partition, no sort: a street view of a large city has tens of millions of keys)
    cuts the chunks that a stable argsort of the keys below +inf cuts, ties (many, here) by place."""
    from engine.stores.offload.chunked import depth_chunk_places
    rng = np.random.default_rng(5)
    for _ in range(400):
        n, size = int(rng.integers(0, 120)), int(rng.integers(1, 40))
        keys = rng.integers(0, int(rng.integers(1, 12)), n).astype(np.float32) * np.float32(0.37)
        keys[rng.random(n) < 0.2] = np.inf
        order, drawn = np.argsort(keys, kind="stable"), int(np.count_nonzero(keys < np.inf))
        expected = [np.sort(order[a:min(drawn, a + size)]) for a in range(0, drawn, size)]
        got = depth_chunk_places(keys, size)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)


def test_a_chunked_view_gone_non_finite_stops_with_one_message(dataset, tmp_path, monkeypatch):
    """A chunked view's rows are checked for non-finite parameters on the device as each chunk goes back (its
    parameters are not read back to the host for it), its own rows alone (the pool's other rows, NaN here, are
    not the chunk's); an SH coefficient of every Gaussian made NaN in the host's tier stops the next step with one
    message naming the view.  The rows move and are checked 20 at a time (a chunk's last slice is short)."""
    import engine.stores.offload.store as store_module
    monkeypatch.setattr(store_module, "HOLD_SLICE_ROWS", 20)
    cfg = offload_config(iterations=6, sh_degree=1)
    t = OffloadTrainer(dataset, tmp_path / "out", cfg, backend="cpu", block_rows=16,
                       gpu_memory=3 * slot_bytes(4) + 16 * 400 + view_bytes(dataset))  # (3 slots: every view chunked)
    t.train(progress=False, until=3)
    assert t.store.chunked_steps == 3
    store, rows = t.store, np.arange(5, 36)  # (a chunk shorter than the pool: the rows after it stale, NaN here)
    store.cache.pool[:] = np.nan
    model, statistics = store.rows_in(rows)
    store._chunk_nonfinite = []
    store.rows_out(rows, model, statistics)
    assert sum(int(k) for k in store._chunk_nonfinite) == 0
    t.store.host.whole[:, t.store.layout.columns["sh"][0] + 3] = np.nan  # (a degree-1 coefficient: not in depth keys)
    with pytest.raises(FloatingPointError, match=r"non-finite parameters of [0-9]+ of the [0-9]+ Gaussians of view "
                                                 r"view[0-9]+\.png, trained in chunks"):
        t.train(progress=False, until=4)


def test_the_host_tiers_row_copies_equal_numpys_and_refuse_what_reaches_past_a_table():
    """``copy_host_rows`` (the host tier's gathers and scatters, on every core): rows given or 0, 1, ... on either
    side, whole rows or column spans, equal NumPy's fancy indexing; rows or spans past a table stop with one
    message (the kernel itself does not check its bounds)."""
    from numbasplat.rows import copy_host_rows
    rng = np.random.default_rng(3)
    table = rng.normal(size=(50, 9)).astype(np.float32)
    rows = rng.permutation(50)[:20]
    spans = ((6, 0, 3), (0, 3, 2))
    out = np.zeros((20, 5), np.float32)
    copy_host_rows(table, rows, out, None, spans)
    np.testing.assert_array_equal(out, np.concatenate([table[rows, 6:9], table[rows, 0:2]], axis=1))
    back = np.zeros_like(table)
    copy_host_rows(out, None, back, rows, ((0, 6, 3), (3, 0, 2)))
    expected = np.zeros_like(table)
    expected[rows, 6:9], expected[rows, 0:2] = table[rows, 6:9], table[rows, 0:2]
    np.testing.assert_array_equal(back, expected)
    whole = np.zeros((20, 9), np.float32)
    copy_host_rows(table, rows, whole, rng.permutation(20))
    np.testing.assert_array_equal(np.sort(whole, axis=0), np.sort(table[rows], axis=0))
    with pytest.raises(ValueError, match="spans .* reach past the tables' 9 / 5 columns"):
        copy_host_rows(table, rows, out, None, ((5, 0, 5),))
    with pytest.raises(ValueError, match="src_rows reach past the table's 50 rows"):
        copy_host_rows(table, np.array([3, 50]), out, None, spans)
    with pytest.raises(ValueError, match="dst_rows reach past the table's 20 rows"):
        copy_host_rows(table, np.arange(2), out, np.array([0, 20]), spans)
