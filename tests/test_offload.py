"""engine/offload.py: out-of-core training with the model in host memory equals in-memory training
with visible-only Adam (across densification and a snapshot/resume), and its blocks cull views
conservatively."""
from dataclasses import replace

import numpy as np
import pytest

from engine.demo import make_dataset
from engine.offload import BlockIndex, OffloadTrainer, morton_codes
from engine.single_gpu import SingleGPUTrainer
from engine.trainer import SNAPSHOT
from numbasplat.optim import GROUPS
from test_trainer import fast_refine, small_config

import numbasplat as ns


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


@pytest.mark.parametrize("scene", ["demo", "clusters"])
def test_offloaded_training_equals_in_memory_training_with_visible_adam(dataset, tmp_path, scene):
    """The demo (every view sees everything; densification from random points) and two clusters
    that the views see one at a time (the working set is half the model): equal parameters and
    moments after 40 steps with densification, the offloaded run stopped at 23 and resumed."""
    from scenes import cluster_capture
    data, start = (dataset, None) if scene == "demo" else cluster_capture(per_cluster=60, views=8)
    cfg = lambda: small_config(iterations=40, visible_adam=True, sh_degree=0)  # noqa: E731

    def trainer(kind, folder):
        t = fast_refine(SingleGPUTrainer(data, tmp_path / folder, cfg(), backend="cpu") if kind == "memory" else
                        OffloadTrainer(data, tmp_path / folder, cfg(), backend="cpu", block_rows=16))
        if start is not None:
            t.start_from({"params": start})
        return t
    memory = trainer("memory", "memory")
    memory.train(progress=False)
    first = trainer("host", "host")
    first.train(progress=False, until=23)
    resumed = trainer("host", "host")
    resumed.load_snapshot(tmp_path / "host" / SNAPSHOT)
    resumed.train(progress=False)
    a, b = memory.model.host_arrays(), resumed.model.host_arrays()
    assert len(memory.model) != (400 if start is None else 120), "densification did not run"
    if scene == "clusters":
        assert resumed.stats["resident_gaussians"] < 0.8 * len(resumed.model)  # the working set: about one cluster
    for g in GROUPS:
        np.testing.assert_allclose(b[g], a[g], rtol=1e-6, atol=1e-7, err_msg=g)
    np.testing.assert_allclose(resumed.model.host_arrays("v")["means"], memory.model.host_arrays("v")["means"],
                               rtol=1e-6, atol=1e-12)


def test_offload_refuses_what_it_cannot_do(dataset, tmp_path):
    for change, message in ((dict(visible_adam=False), "needs --visible-adam"),
                            (dict(visible_adam=True, strategy="mcmc"), "default strategy"),
                            (dict(visible_adam=True, loss="tile"), "--loss global")):
        with pytest.raises(ValueError, match=message):
            OffloadTrainer(dataset, tmp_path, small_config(**change), backend="cpu")


def test_train_offload_host_writes_a_model_that_resumes_in_memory(tmp_path):
    """``train --offload host`` turns on visible-only Adam, writes the usual outputs (snapshot, PLY,
    metrics from views rendered from their working sets), and its snapshot resumes in memory."""
    import json
    import cli
    from test_trainer import write_blender_capture
    cap, out = tmp_path / "capture", tmp_path / "out"
    write_blender_capture(cap, make_dataset(size=32, n_views=10, backend="cpu"))
    args = ["train", "--data", str(cap), "--white-background", "--out", str(out), "--quiet", "--sh-degree", "1",
            "--init-points", "300", "--eval"]
    assert cli.main([*args, "--iters", "12", "--offload", "host"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["iterations"] == 12 and np.isfinite(metrics["psnr"]) and metrics["gaussians"] == 300
    recorded = json.loads((out / "cfg.json").read_text())
    assert recorded["visible_adam"] is True and recorded["offload"] == "host"
    assert cli.main([*args, "--iters", "16", "--resume"]) == 0  # in memory now
    assert json.loads((out / "metrics.json").read_text())["iterations"] == 16


@pytest.mark.parametrize("scene", ["lego", "fern"])
def test_offload_equals_in_memory_on_the_captures(scene, tmp_path):
    """200 steps of lego and fern (at 1/16 and 1/64 of their sizes, fern from an eighth of its points:
    for the CPU), densifying every 50: offloaded and
    in-memory training with visible-only Adam end equal within 1e-6."""
    from conftest import shared_dir
    from data import load_dataset
    root = shared_dir() / "data" / scene
    if scene == "lego":
        data = load_dataset(root, resolution=16, test_every=0)
    else:  # every 8th of its SfM points to start from
        data = load_dataset(root, images="images_8", resolution=8, test_every=0)
        data = replace(data, points=data.points[::8], colors=data.colors[::8])
    cfg = lambda: small_config(iterations=200, visible_adam=True, sh_degree=1, n_random_init=1000,  # noqa: E731
                               densify_from=50, densify_every=50, log_every=100,
                               background=(1.0, 1.0, 1.0) if scene == "lego" else (0.0, 0.0, 0.0))
    memory = SingleGPUTrainer(data, tmp_path / "memory", cfg(), backend="cpu")
    memory.train(progress=False)
    host = OffloadTrainer(data, tmp_path / "host", cfg(), backend="cpu", block_rows=256)
    host.train(progress=False)
    a, b = memory.model.host_arrays(), host.model.host_arrays()
    assert len(a["means"]) != (1000 if scene == "lego" else len(data.points)), "densification did not run"
    for g in GROUPS:
        np.testing.assert_allclose(b[g], a[g], rtol=1e-6, atol=1e-7, err_msg=g)
