"""Adam fused into the projection backward (``rendering.project_backward_adam``) updates as the
projection backward then ``Adam.update`` does: the kernels on the CPU backend to the bit, the
single-GPU trainer with ``--fuse-adam`` on and off to the bit, and the CUDA kernels within float
rounding under the simulator (tests/check_cuda_raster.py ``compare_fused_adam``)."""
import numpy as np
import pytest

import numbasplat as ns
from engine.pipelines.single_gpu import SingleGPUTrainer
from numbasplat.optim import GROUPS, Adam, FlatParams, column_lrs
from numbasplat.rendering import project_backward_adam
from conftest import simulator_test
from scenes import edge_case_scene, look_at_camera
from test_trainer import dataset, small_config  # noqa: F401 (a fixture)

LR = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3, "sh_rest": 1e-4}


def _model(stored, n=60):
    """Adam over ``edge_case_scene``'s Gaussians (rotations not the identity, uneven scales, one behind
    the camera, one below the alpha threshold), float32, on the CPU backend, its moments as if it had
    trained before (so that a Gaussian not drawn moves where Adam updates it)."""
    params = FlatParams.from_gaussians(edge_case_scene(n=n, seed=5, dtype=np.float32, degree=stored))
    rng = np.random.default_rng(1)
    m = (1e-3 * rng.normal(size=params.size)).astype(np.float32)
    return Adam(params, backend="cpu", m=m, v=(m * m + 1e-7).astype(np.float32))


def _step(adam, cam, degree, d_img, fused, visible=False, skip=None):
    """One step of ``adam``'s model on ``cam``: render, backward of the image gradient ``d_img``, then
    the projection backward and Adam, fused or one after the other.  -> the projection."""
    adam.set_step(column_lrs(LR, adam.params.sh_bases))
    g = adam.params.gaussians()
    f = ns.render(g, cam, sh_degree=degree, backend="cpu")
    rec = ns.rasterize_backward(f.projection, f.binning, f.render, d_img, backend="cpu")
    if fused:
        project_backward_adam(f.projection, rec, adam, visible=visible, skip=skip, backend="cpu")
    else:
        grads = adam.params.like(np.zeros(adam.params.size, np.float32))
        ns.project_backward(g, f.projection, rec, grads.gaussians(), accumulate=False, backend="cpu")
        adam.update(grads.data, f.projection.counts > 0 if visible else None, skip)
    return f.projection


@pytest.mark.parametrize("stored, degree", [(3, 3), (3, 1), (1, 1)])
@pytest.mark.parametrize("visible", [False, True])
def test_fused_kernels_update_as_projection_backward_then_adam(stored, degree, visible):
    """4 steps on a 40x28 image (each model rendering its own state), per-group rates and the higher SH
    bands' own: parameters and both moments the same bits, and moved (every group); with ``visible``
    the Gaussians not drawn keep their state."""
    cam = look_at_camera(W=40, H=28)
    apart, fused = _model(stored), _model(stored)
    rng = np.random.default_rng(stored + degree)
    for _ in range(4):
        before = apart.params.data.copy()
        d_img = rng.normal(size=(cam.height, cam.width, 3)).astype(np.float32)
        _step(apart, cam, degree, d_img, False, visible)
        p = _step(fused, cam, degree, d_img, True, visible)
        for key, a, b in (("params", apart.params.data, fused.params.data), ("m", apart.m, fused.m),
                          ("v", apart.v, fused.v)):
            np.testing.assert_array_equal(b, a, err_msg=key)
    moved = apart.params.like(apart.params.data != before)  # (by the last step)
    hidden = p.counts == 0
    assert hidden.any() and (~hidden).any()
    for group in GROUPS:
        rows = moved.view(group).reshape(len(hidden), -1).any(axis=1)
        assert rows[~hidden].all(), group
        assert not rows[hidden].any() if visible else rows[hidden].all(), group


def test_a_skipped_step_leaves_the_state():
    """The skip flag set: parameters and moments as they were (after a step that set the moments)."""
    cam = look_at_camera(W=40, H=28)
    adam = _model(3)
    d_img = np.random.default_rng(0).normal(size=(cam.height, cam.width, 3)).astype(np.float32)
    _step(adam, cam, 3, d_img, True)
    before = [a.copy() for a in (adam.params.data, adam.m, adam.v)]
    _step(adam, cam, 3, d_img, True, skip=np.ones(1, np.int32))
    for a, b in zip(before, (adam.params.data, adam.m, adam.v)):
        np.testing.assert_array_equal(b, a)


def test_the_moments_must_be_flat_buffers():
    from numbasplat.optim import RowsAdam
    adam = _model(1, n=8)
    rows = RowsAdam(adam.params, backend="cpu", table=np.zeros((8, 3 * 23), np.float32), rows=np.arange(8),
                    columns=[0, 23, 46])
    rows.set_step(column_lrs(LR, 4))
    p = ns.project(adam.params.gaussians(), look_at_camera(W=16, H=12), backend="cpu")
    with pytest.raises(ValueError, match="not flat buffers"):
        project_backward_adam(p, np.zeros((8, 12), np.float32), rows, backend="cpu")


def _trained(dataset, path, fuse, steps=30, **settings):
    """``steps`` steps of the single-GPU trainer (SH up to degree 3, a band every 6 steps; densifying
    from step 4 every 10, an opacity reset at 20), ``--fuse-adam`` ``fuse``."""
    t = SingleGPUTrainer(dataset, path, small_config(iterations=steps, sh_degree=3, sh_increase_every=6,
                                                     fuse_adam=fuse, **settings), backend="cpu")
    t.strategy.refine_start, t.strategy.refine_every, t.strategy.reset_every = 4, 10, 20
    t.init_model()
    fused_steps = []
    step = t.train_step
    t.train_step = lambda: (fused_steps.append(t.fuses_adam()), step())[1]
    t.train(progress=False)
    return t, fused_steps


@pytest.mark.parametrize("settings", [{}, {"visible_adam": True}, {"opacity_reg": 0.01, "regularise_from": 15}],
                         ids=["default", "visible_adam", "regularised_from_15"])
def test_training_with_fused_adam_is_training_without(dataset, tmp_path, settings):
    """The same model, moments and statistics to the bit after 30 steps (densifying, an opacity reset, SH
    degrees 0 to 3); fused at every step but those where the regularisers act, which keep the separate
    Adam; the fused steps leave the gradient buffer unwritten."""
    apart, never = _trained(dataset, tmp_path / "apart", "off", **settings)
    fused, steps = _trained(dataset, tmp_path / "fused", "on", **settings)
    assert not any(never)
    assert steps == [not settings or step < settings.get("regularise_from", 30) for step in range(30)]
    assert len(fused.model) != 400, "densification did not run"
    for which in ("params", "m", "v"):
        a, b = apart.model.host_arrays(which), fused.model.host_arrays(which)
        for g in GROUPS:
            np.testing.assert_array_equal(b[g], a[g], err_msg=f"{which} {g}")
    for k, a in apart.strategy_state.items():
        np.testing.assert_array_equal(fused.strategy_state[k], a, err_msg=k)
    assert bool(np.any(apart.model.grads.data != 0)) and (bool(np.any(fused.model.grads.data != 0))
                                                          == ("regularise_from" in settings))


def test_fused_adam_only_where_exact(dataset, tmp_path):
    """Off with ``--fuse-adam off``, on an aggregate device (a split placement), out of core, and at
    steps where a regulariser acts."""
    from numbasplat.placement import Placement
    t = SingleGPUTrainer(dataset, tmp_path / "a", small_config(opacity_reg=0.01, regularise_from=10), backend="cpu")
    t.init_model()
    assert not t.fuses_adam()  # (off by default)
    t.cfg.fuse_adam = "on"
    assert t.fuses_adam()
    t.step = 10
    assert not t.fuses_adam()
    t.step = 0
    t.cfg.fuse_adam = "off"
    assert not t.fuses_adam()
    t.cfg.fuse_adam = "on"
    t.placement = Placement(2, "cpu")
    assert not t.fuses_adam()


test_fused_cuda_kernels_match_the_separate_adam_in_simulator = simulator_test("""
    import sys
    from tests.check_cuda_raster import main_fused_adam
    sys.exit(main_fused_adam())
    """, "all fused Adam checks passed", timeout=900)


def test_bench_times_the_fused_step_and_the_separate_one():
    """``run.py bench`` times the step as training runs it by default (Adam after the projection backward)
    and then with Adam fused into it;
    each alone, the same loss after the same steps (the fused step trains as the other); a split step
    (``virtual_devices``) keeps the separate Adam, and refuses the fused one."""
    from numbasplat import bench
    g = edge_case_scene(n=80, seed=2, dtype=np.float32, degree=3)
    cam = look_at_camera(W=40, H=28)
    lines = []
    med = bench.run((g, cam), iters=1, warmup=1, backend="cpu", out=lines.append)
    assert any(line.startswith("  adam") for line in lines) and "adam" in med
    fused = [line for line in lines if line.startswith("Adam fused into project_bwd")]
    apart = [line for line in lines if line.startswith("Adam after project_bwd")]
    assert len(fused) == len(apart) == 1 and apart[0].endswith("<- training's") and "adam" in apart[0]
    assert "project_bwd+adam" in fused[0]
    said = {}
    for fuse_adam in (True, False):
        lines = []
        bench.run((g, cam), iters=2, warmup=1, backend="cpu", fuse_adam=fuse_adam, compare_adam=False,
                  out=lines.append)
        assert not any(line.startswith("Adam ") for line in lines)
        said[fuse_adam] = lines[0].split("loss value ")[1]
    assert said[True] == said[False]
    lines = []
    bench.run((g, cam), iters=1, warmup=0, backend="cpu", virtual_devices=2, out=lines.append)
    assert any(line.startswith("  adam") for line in lines) and not any(line.startswith("Adam ") for line in lines)
    with pytest.raises(ValueError, match="fuse_adam"):
        bench.run((g, cam), iters=1, backend="cpu", virtual_devices=2, fuse_adam=True)
