"""``--deterministic``: the raster backward's fixed-order sums (under the CUDA simulator: against
the CPU backend and the default backward, the same bits at every call, no float atomics), and on
the CPU the flag's way in (the config, the CLI, the rendering API, step graphs, the benchmark) and
the options it refuses, each combination one error naming it."""
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import cli
import numbasplat as ns
from conftest import simulator_test
from engine.pipelines.single_gpu import SingleGPUTrainer
from engine.pipelines.step_graphs import StepGraphs
from engine.pipelines import PipelineOptions, check
from engine.recipe.trainer import TrainConfig
from test_cli_train import capture  # noqa: F401 (a fixture)
from test_trainer import dataset, small_config  # noqa: F401 (a fixture)

test_deterministic_backward_in_simulator = simulator_test(
    Path(__file__).with_name("check_deterministic_raster.py"), "all deterministic checks passed", timeout=900)


def test_the_flag_reaches_the_config_and_cfg_json(capture, tmp_path):  # noqa: F811
    """``run.py train --deterministic`` trains (a few steps on the CPU) and OUT/cfg.json keeps it, so
    that the file repeats a deterministic run; it is off by default."""
    assert TrainConfig().deterministic is False
    out = tmp_path / "run"
    assert cli.main(["train", "--quiet", "--data", str(capture), "--out", str(out), "--iters", "3",
                     "--init-points", "100", "--sh-degree", "0", "--deterministic"]) == 0
    assert json.loads((out / "cfg.json").read_text())["deterministic"] is True


REFUSED = [
    (["--loss", "tile"], "--loss tile (its fused kernel adds gradients with atomics)"),
    (["--prune", "contribution"], "--prune contribution (its contribution totals are added with atomics)"),
    (["--importance-every", "50"], "--importance-every 50 (its contribution totals are added with atomics)"),
    (["--offload", "host"], "the OffloadTrainer pipeline (--offload, or MPI ranks and --exchange: only one process "
                            "holding the whole model is deterministic)"),
]


@pytest.mark.parametrize("flags, words", REFUSED, ids=[r[0][0] for r in REFUSED])
def test_each_refused_combination_is_one_error_naming_the_flag(capture, tmp_path, capsys, flags, words):  # noqa: F811
    assert cli.main(["train", "--data", str(capture), "--out", str(tmp_path), "--deterministic", *flags]) == 1
    assert capsys.readouterr().err == f"error: --deterministic cannot be combined with {words}\n"


def test_the_refusals_come_together_and_name_the_ranked_pipelines():
    """Every conflict in one message; the MPI ranks' pipelines are refused by name."""
    from engine.pipelines.gaussian_exchange import GaussianExchangeTrainer
    from engine.pipelines.pixel_exchange import PixelExchangeTrainer
    cfg = TrainConfig(deterministic=True, loss="tile", prune="hardware")
    for pipeline in (GaussianExchangeTrainer, PixelExchangeTrainer):
        with pytest.raises(ValueError) as e:
            check(cfg, PipelineOptions(), pipeline=pipeline)
        assert str(e.value) == ("--deterministic cannot be combined with --loss tile (its fused kernel adds "
                                "gradients with atomics); --prune hardware (its contribution totals are added "
                                f"with atomics); the {pipeline.__name__} pipeline (--offload, or MPI ranks and "
                                "--exchange: only one process holding the whole model is deterministic)")
    check(TrainConfig(deterministic=True, lod_min_px=1.0, strategy="mcmc"), PipelineOptions(),
          pipeline=SingleGPUTrainer)  # what it takes: no error


def test_deterministic_backward_needs_a_deterministic_binning():
    from tests.scenes import edge_case_scene, look_at_camera
    g, cam = edge_case_scene(n=20, seed=1, dtype=np.float32), look_at_camera(W=24, H=20)
    f = ns.render(g, cam, backend="cpu")
    d_img = np.ones((20, 24, 3), np.float32)
    with pytest.raises(ValueError, match=r"bin_tiles\(deterministic=True\)"):
        ns.render_backward(g, f, d_img, backend="cpu", deterministic=True)
    fixed = ns.render(g, cam, backend="cpu", deterministic=True)
    b = fixed.binning
    # the kept arrays: each Gaussian's emitted intersections are contiguous, and perm sorts them into ids
    order, ends, counts = b.order, b.ends, fixed.projection.counts
    emitted = np.repeat(order, counts[order])
    np.testing.assert_array_equal(emitted[b.perm], b.ids)
    np.testing.assert_array_equal(ends, np.cumsum(counts[order]))
    # the CPU backend's sums are in a fixed order already: the same bits either way
    for want, got in zip(ns.render_backward(g, f, d_img, backend="cpu"),
                         ns.render_backward(g, fixed, d_img, backend="cpu", deterministic=True)):
        for a, c in zip(*(x.arrays().values() if hasattr(x, "arrays") else [x] for x in (want, got))):
            np.testing.assert_array_equal(a, c)
    assert ns.bin_tiles(f.projection, backend="cpu").perm is None  # nothing kept without it


def _trained(dataset, path, graphs, **settings):
    t = SingleGPUTrainer(dataset, path, small_config(iterations=44, **settings), backend="cpu")
    t.strategy.refine_start, t.strategy.refine_every, t.strategy.reset_every = 4, 20, 25
    t.binning_room = True
    if graphs:
        t._graphs = StepGraphs(simulate=True)
    t.init_model()
    t.train(progress=False, until=40)  # (15 steps between the reset and the next refinement: views come again)
    return t


def test_deterministic_training_with_step_graphs(dataset, tmp_path):  # noqa: F811
    """With --deterministic, steps replayed from their captures (binning into room, densifying, an
    opacity reset) train as steps run as usual, and on the CPU as without the flag: to the bit."""
    graphed = _trained(dataset, tmp_path / "graphs", True, deterministic=True)
    plain = _trained(dataset, tmp_path / "plain", False, deterministic=True)
    default = _trained(dataset, tmp_path / "default", False)
    assert graphed._graphs.replays > 0 and len(plain.model) != 400  # (densified)
    for other in (plain, default):
        for k, a in other.model.gaussians.arrays().items():
            np.testing.assert_array_equal(graphed.model.gaussians.arrays()[k], a, err_msg=k)


def test_bench_takes_the_flag(tmp_path, capsys):
    """``run.py bench --deterministic`` times the step as training runs it; not with the tile loss."""
    from numbasplat import bench
    from test_bench import scene_arrays
    path = tmp_path / "scene.npz"
    np.savez(path, **scene_arrays())
    import cli
    args = cli.parser().parse_args(["bench", "--scene", str(path), "--iters", "1", "--warmup", "0", "--deterministic"])
    from cli.bench import cmd_bench
    cmd_bench(args)
    assert ", deterministic, 1 iterations" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--deterministic cannot be combined with --loss tile"):
        cmd_bench(SimpleNamespace(**{**vars(args), "loss": "tile"}))
    with pytest.raises(ValueError, match="--deterministic cannot be combined with --loss tile"):
        bench.run(str(path), iters=1, warmup=0, loss="tile", deterministic=True, backend="cpu")


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="simulator has no compiler")
def test_the_gpu_kernels_of_the_fixed_order_add_no_float_with_an_atomic(monkeypatch):
    """The simulator runs its own variant of the warp sums (no shuffles): the real kernels' PTX for
    sm_90 shows that with --deterministic nothing is added into a float by an atomic, where the
    default backward does (so the pattern is live)."""
    from test_cuda_launch import _ptx_available
    if not _ptx_available():
        pytest.skip("no NVVM (install numba-cuda[cu12])")
    from numba import cuda as numba_cuda
    from numba.cuda import dispatcher
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: SimpleNamespace(compute_capability=(9, 0)))
    from numbasplat.cuda import raster

    def float_atomics(k):
        ptx, _ = numba_cuda.compile_ptx(k.fn, k.sig, cc=(9, 0), fastmath=k.fastmath)
        return re.findall(r"\b(?:atom|red)\.[\w.]*\.f(?:16|32|64)\b", ptx)
    assert float_atomics(raster._raster_backward_kernel)
    assert float_atomics(raster._raster_backward_fixed_kernel) == []
    assert float_atomics(raster._slot_sum_kernel) == []
