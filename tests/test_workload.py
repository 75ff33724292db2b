"""BlitzGS's workload switches (engine/recipe/workload.py, issue 27) on the CPU backend: the importance pass
against a brute-force float64 compositing, culled and LOD-gated views against the full render,
the densification weights and view masks through refinements, the schedule, a run with every
switch on (and with auto's choice of views) that resumes as if never stopped, the views' visible
shares that auto chooses by, the warm-up that compiles the pass's kernels, and the switches' checks."""
import json

import numpy as np
import pytest

import numbasplat as ns
from engine.recipe.model import GaussianModel
from engine.pipelines.single_gpu import SingleGPUTrainer
from engine.recipe.strategy import IMPORTANCE_WEIGHT, LOD_SPARE, VIEW_SKIP, Context, DefaultStrategy
from engine.recipe.trainer import SNAPSHOT, TrainConfig
from engine.recipe.workload import (LodReach, Workload, densify_weights, importance_scores, opacity_resets, scoring_steps,
                             set_view_bit, view_bit)
from tests.scenes import edge_case_scene, look_at_camera
from tests.test_contributions import reference_contributions
from test_trainer import fast_refine, small_config


@pytest.fixture(scope="module")
def dataset():
    from engine.tools.demo import make_dataset
    return make_dataset(size=32, n_views=12, backend="cpu")


def shifted_camera(dx, W=40, H=30):
    """``look_at_camera`` moved sideways by ``dx``: another view of the same scene."""
    cam = look_at_camera(W=W, H=H)
    cam.viewmat[0, 3] = -dx
    return cam


def unit_colour(p):
    """The projection's records with colour (1, 0, 0): the reference's contribution is then T alpha."""
    proj = p.proj.copy()
    proj[:, ns.rendering.go.RED:ns.rendering.go.BLUE + 1] = (1.0, 0.0, 0.0)
    return ns.Projection(p.camera, p.cam, proj, p.radii, p.counts, p.sh_degree, p.antialias)


def test_importance_pass_matches_brute_force_compositing():
    """Each Gaussian's sum of T alpha over the pixels of each view, from every pixel composited in
    float64 (tests/test_contributions.py's reference), and the views' masks from those sums."""
    g = edge_case_scene(n=30, seed=4, dtype=np.float32)
    cams = [shifted_camera(dx) for dx in (0.0, 0.6, -1.2)]
    below = 0.05
    total, skip = importance_scores(g, cams, sh_degree=3, antialias=False, mask_below=below, backend="cpu")
    expected = np.zeros(len(g))
    for v, cam in enumerate(cams):
        _, per_view = reference_contributions(unit_colour(ns.project(g, cam, backend="cpu")))
        expected += per_view
        np.testing.assert_array_equal(view_bit(skip, v, np), per_view < below - 1e-6 * np.maximum(per_view, 1))
    np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-7)
    assert total.dtype == np.float64 and skip.shape == (len(g), 1) and skip.dtype == np.uint8
    assert total[0] == 0 and total[3] == 0  # behind the camera; under the alpha threshold
    assert (total > 1.0).sum() > 10         # most of them cover pixels
    # the colour-weighted pass (pruning's) differs: the colour is left out
    p = ns.project(g, cams[0], backend="cpu")
    weighted = ns.contributions(p, ns.bin_tiles(p, backend="cpu"), backend="cpu")[1]
    unweighted = ns.contributions(p, ns.bin_tiles(p, backend="cpu"), backend="cpu", colour=False)[1]
    assert not np.allclose(weighted, unweighted)


def test_view_bits_follow_packbits_order():
    rng = np.random.default_rng(0)
    bits = rng.random((13, 19)) < 0.4
    packed = np.zeros((13, 3), np.uint8)
    for v in range(19):
        set_view_bit(packed, v, bits[:, v], np)
    np.testing.assert_array_equal(packed, np.packbits(bits, axis=1))
    for v in range(19):
        np.testing.assert_array_equal(view_bit(packed, v, np), bits[:, v])


def masked_workload(**switches):
    cfg = TrainConfig(**{"importance_every": 100, "view_masks": "on", **switches})
    return Workload(cfg, n_views=3)


def culled(g, cam, workload, state, view=0):
    """(the projection of ``g`` in ``cam``, the same with ``workload``'s culling)."""
    full = ns.project(g, cam, backend="cpu")
    p = ns.project(g, cam, backend="cpu")
    return full, workload.cull(p, g, state, view, "cpu")


def render_projection(p):
    return ns.rasterize(p, ns.bin_tiles(p, backend="cpu"), np.ones(3, np.float32), "cpu").image


def test_a_view_that_skips_nothing_renders_and_differentiates_exactly_as_the_full_model():
    g = edge_case_scene(n=30, seed=1, dtype=np.float32)
    cam = look_at_camera()
    state = {VIEW_SKIP: np.zeros((len(g), 1), np.uint8)}  # no mask bit set, no LOD gate
    full, p = culled(g, cam, masked_workload(), state)
    for k in ("proj", "radii", "counts"):
        np.testing.assert_array_equal(getattr(p, k), getattr(full, k), err_msg=k)
    assert (full.counts > 0).sum() > 10


def test_a_masked_view_renders_within_tolerance_and_its_skipped_rows_get_no_gradient():
    """The view's mask from an importance pass: what it skips adds under ``below`` to the view, so
    the render moves by little; the skipped rows are not drawn and their gradients are zero."""
    g = edge_case_scene(n=40, seed=3, dtype=np.float32)
    cam = look_at_camera()
    below = 0.5
    _, skip = importance_scores(g, [cam], sh_degree=3, antialias=False, mask_below=below, backend="cpu")
    full, p = culled(g, cam, masked_workload(view_mask_below=below), {VIEW_SKIP: skip})
    skipped = np.flatnonzero(view_bit(skip, 0, np))
    drawn = np.flatnonzero(p.counts > 0)
    assert len(skipped) >= 5 and 0 in skipped and 3 in skipped, skipped  # behind, transparent, and faint ones
    np.testing.assert_array_equal(drawn, np.setdiff1d(np.flatnonzero(full.counts > 0), skipped))
    np.testing.assert_array_equal(p.radii, full.radii)  # (in view: the densification statistics count it)
    assert (full.counts[skipped] > 0).sum() >= 3  # some were drawn before the mask hid them
    diff = np.abs(render_projection(p) - render_projection(full)).max()
    assert 0 < diff <= 2 * below, diff  # removing one changes a pixel by at most 2 x its weight there
    grad = np.ones((len(g), ns.rendering.go.GRAD_FIELDS), np.float32)
    out = ns.Gaussians(**{k: np.full_like(a, 7.0) for k, a in g.arrays().items()})
    ns.project_backward(g, p, grad, out, accumulate=False, backend="cpu")
    for k in g.FIELDS:
        assert not getattr(out, k)[skipped].any(), k
        assert getattr(out, k)[drawn].any(), k


def screen_statistics(g, p, cam):
    """The default strategy's statistics of one view (sums, seen, max_radius) after a backward of
    its render against a grey target."""
    b = ns.bin_tiles(p, backend="cpu")
    r = ns.rasterize(p, b, np.ones(3, np.float32), "cpu")
    grad = ns.rasterize_backward(p, b, r, r.image - np.float32(0.5), backend="cpu")
    stats = DefaultStrategy.fresh_statistics(np, len(g))
    ns.rendering.screen_gradient_stats(p, grad, 1.0, (ns.rendering.go.U, ns.rendering.go.V), stats["grad"],
                                       stats["count"], stats["max_radius"], backend="cpu")
    return stats


def test_densification_counts_a_masked_view_and_not_a_gated_one():
    """A view's mask hides rows that add next to nothing to it: the mean gradient that densifies
    them still counts the view (with no gradient), as a run without masks counts it, so that the
    masks do not raise it.  The LOD gate's rows are not counted (as a Gaussian out of view)."""
    g = edge_case_scene(n=40, seed=3, dtype=np.float32)
    cam = look_at_camera()
    _, skip = importance_scores(g, [cam], sh_degree=3, antialias=False, mask_below=0.5, backend="cpu")
    full, p = culled(g, cam, masked_workload(view_mask_below=0.5), {VIEW_SKIP: skip})
    hidden = (full.counts > 0) & (p.counts == 0)
    assert hidden.sum() >= 3
    whole, masked = screen_statistics(g, full, cam), screen_statistics(g, p, cam)
    np.testing.assert_array_equal(masked["count"], whole["count"])
    np.testing.assert_array_equal(masked["max_radius"], whole["max_radius"])
    assert not masked["grad"][hidden].any() and whole["grad"][hidden].any()
    gated_g = edge_case_scene(n=30, seed=5, dtype=np.float32)
    gated_g.scales[20:30] = np.log(0.002)
    full, p = culled(gated_g, shifted_camera(0.3), Workload(TrainConfig(lod_min_px=0.5), 1), {})
    gated = (full.counts > 0) & (p.counts == 0)
    assert gated.sum() >= 3 and not p.radii[gated].any()
    stats = screen_statistics(gated_g, p, shifted_camera(0.3))
    assert not stats["count"][gated].any() and (stats["count"][p.counts > 0] == 1).all()


def footprint_reference(g, cam):
    """The LOD footprint in float64: 3 sigma of the largest axis, in pixels, at the distance."""
    centre = -cam.viewmat[:3, :3].T.astype(np.float64) @ cam.viewmat[:3, 3]
    distance = np.linalg.norm(g.means.astype(np.float64) - centre, axis=1)
    return 3 * np.exp(g.scales.astype(np.float64).max(1)) * max(cam.fx, cam.fy) / distance


def test_lod_gate_skips_the_fine_gaussians_and_the_render_moves_by_their_share():
    """Tiny faint Gaussians far away: their footprint is under a pixel, the gate hides exactly
    them, and the render differs by at most their opacity."""
    g = edge_case_scene(n=30, seed=5, dtype=np.float32)
    tiny = np.arange(20, 30)
    g.scales[tiny] = np.log(0.002)
    g.opacities[tiny] = np.log(0.04 / 0.96)
    cam = shifted_camera(0.3)  # the camera centre off the origin
    foot = footprint_reference(g, cam)
    assert foot[tiny].max() < 0.5 < foot[:20].min()
    full, p = culled(g, cam, Workload(TrainConfig(lod_min_px=0.5), 1), {})
    assert (full.counts[tiny] > 0).sum() >= 3 and not p.counts[tiny].any()
    np.testing.assert_array_equal(p.counts[:20], full.counts[:20])
    diff = np.abs(render_projection(p) - render_projection(full)).max()
    assert 0 < diff <= 2 * 0.04, diff
    # the gate's edge: just under a Gaussian's footprint keeps it, just over hides it
    k = int(np.flatnonzero(full.counts[:20] > 0)[0])
    for factor, hidden in ((0.999, False), (1.001, True)):
        _, p = culled(g, cam, Workload(TrainConfig(lod_min_px=float(foot[k]) * factor), 1), {})
        assert (p.counts[k] == 0) == hidden, (factor, foot[k])
    # the rows the pass spares (LOD_SPARE) stay drawn; the masks still hide theirs
    spare = np.zeros(len(g), np.uint8)
    spare[tiny[::2]] = 1
    _, p = culled(g, cam, Workload(TrainConfig(lod_min_px=0.5), 1), {LOD_SPARE: spare})
    np.testing.assert_array_equal(p.counts, np.where(np.isin(np.arange(len(g)), tiny[1::2]), 0, full.counts))
    bits = np.zeros((len(g), 8), bool)
    bits[tiny[0], 0] = True
    _, p = culled(g, cam, masked_workload(lod_min_px=0.5), {LOD_SPARE: spare, VIEW_SKIP: np.packbits(bits, axis=1)})
    assert p.counts[tiny[0]] == 0 and (p.counts[tiny[2::2]] == full.counts[tiny[2::2]]).all()
    with pytest.raises(ValueError, match="spare"):
        ns.cull(ns.project(g, cam, backend="cpu"), g, None, 0, 0.5, "cpu", spare=spare[:-1])


def test_the_pass_tells_what_the_lod_gate_keeps_from_training():
    """``LodReach`` against the float64 footprints and the brute-force compositing: the share of the
    views' T alpha on Gaussians the gate hides where they are drawn, and the Gaussians hidden from
    every view that draws them; the pass's renders themselves do not change."""
    g = edge_case_scene(n=30, seed=5, dtype=np.float32)
    g.scales[20:30] = np.log(0.002)  # fine ones: hidden from every view
    cams = [shifted_camera(dx) for dx in (0.3, -0.5)]
    feet = [footprint_reference(g, cam) for cam in cams]
    sizes = np.sort(np.concatenate([f[:20] for f in feet]))
    min_px = float(sizes[19] + sizes[20]) / 2  # between the scene's footprints: some rows hidden, some drawn
    assert sizes[20] - sizes[19] > 1e-4 * sizes[20]
    lod = LodReach(len(g), min_px, np)
    total, skip = importance_scores(g, cams, 3, False, 0.05, backend="cpu", lod=lod)
    np.testing.assert_array_equal(total, importance_scores(g, cams, 3, False, 0.05, backend="cpu")[0])
    hidden = weight = 0.0
    drawn, trained = np.zeros(len(g), bool), np.zeros(len(g), bool)
    for cam, foot in zip(cams, feet):
        p = ns.project(g, cam, backend="cpu")
        _, per_view = reference_contributions(unit_colour(p))
        gated = (p.counts > 0) & (foot < min_px)
        hidden, weight = hidden + per_view[gated].sum(), weight + per_view.sum()
        drawn |= p.counts > 0
        trained |= (p.counts > 0) & ~gated
    report = lod.report()
    assert 0 < report["lod_hidden_weight"] < 1 and 10 <= report["lod_untrained"] < (drawn).sum()
    np.testing.assert_allclose(report["lod_hidden_weight"], hidden / weight, rtol=1e-5)
    assert report["lod_untrained"] == (drawn & ~trained).sum()
    keep = np.arange(len(g)) >= 25
    assert lod.report(keep)["lod_untrained"] == (drawn & ~trained)[keep].sum()


def test_cull_reads_the_views_bit_and_checks_its_mask():
    """Bit 11 of a two-byte mask hides exactly its rows; a mask of the wrong rows or bytes is refused."""
    g = edge_case_scene(n=30, seed=6, dtype=np.float32)
    cam = look_at_camera()
    bits = np.random.default_rng(1).random((len(g), 16)) < 0.5
    full = ns.project(g, cam, backend="cpu")
    p = ns.cull(ns.project(g, cam, backend="cpu"), g, np.packbits(bits, axis=1), 11, backend="cpu")
    np.testing.assert_array_equal(p.counts, np.where(bits[:, 11], 0, full.counts))
    with pytest.raises(ValueError, match="no bit 16"):
        ns.cull(full, g, np.packbits(bits, axis=1), 16, backend="cpu")
    with pytest.raises(ValueError, match=r"shape \(29, 2\)"):
        ns.cull(full, g, np.packbits(bits[:29], axis=1), 0, backend="cpu")
    empty = ns.Gaussians(*(np.zeros(s, np.float32) for s in ((0, 3), (0, 3), (0, 4), (0,), (0, 1, 3))))
    assert len(ns.cull(ns.project(empty, cam, backend="cpu"), empty, None, 0, 2.0, "cpu").counts) == 0


def test_densify_weights_rule():
    w = densify_weights(np.array([0.0, 1.0, 2.0, 4.0, 8.0, 16.0]), np)
    np.testing.assert_allclose(w, [0.0, 0.25, 0.5, 1.0, 1.0, 1.0])  # the median of the positive ones: 4
    np.testing.assert_array_equal(densify_weights(np.zeros(3), np), np.ones(3))


def test_weights_bias_densification_and_refinements_carry_weights_and_masks():
    """Four Gaussians over the gradient threshold: one small (clones), one large (splits), one
    small of weight 0.1 (its weighted gradient falls under the threshold: kept, not cloned), one
    transparent (pruned).  New rows take their parent's weight and mask."""
    n = 4
    arrays = {"means": np.zeros((n, 3), np.float32), "scales": np.log(np.full((n, 3), 0.001, np.float32)),
              "quats": np.tile(np.float32([1, 0, 0, 0]), (n, 1)), "opacities": np.full(n, 2.0, np.float32),
              "sh": np.zeros((n, 1, 3), np.float32)}
    arrays["scales"][1] = np.log(0.5)
    arrays["opacities"][3] = -10.0
    model = GaussianModel(arrays, "cpu")
    s = DefaultStrategy(grad_threshold=1.0, refine_start=0, refine_every=1, reset=False)
    state = {"grad": np.full(n, 2.0, np.float32), "count": np.ones(n, np.int32),
             "max_radius": np.zeros(n, np.float32), IMPORTANCE_WEIGHT: np.float32([1.0, 0.9, 0.1, 1.0]),
             VIEW_SKIP: np.uint8([[1], [2], [4], [8]])}
    done = s.after_optimizer(model, state, 1, Context(1.0, np.random.default_rng(0)))
    assert (done["cloned"], done["split"], done["pruned"]) == (1, 1, 1), done
    # kept 0 and 2, then 0's clone, then 1's two children
    np.testing.assert_allclose(state[IMPORTANCE_WEIGHT], [1.0, 0.1, 1.0, 0.9, 0.9])
    np.testing.assert_array_equal(state[VIEW_SKIP][:, 0], [1, 4, 1, 2, 2])
    assert len(model) == 5 and len(state["grad"]) == 5


def test_an_opacity_reset_drops_the_view_masks_and_keeps_the_weights():
    """After a reset every Gaussian is translucent and what hid behind others shows: the masks go
    (views skip nothing until the next pass), the densification weights stay."""
    n = 3
    arrays = {"means": np.zeros((n, 3), np.float32), "scales": np.log(np.full((n, 3), 0.01, np.float32)),
              "quats": np.tile(np.float32([1, 0, 0, 0]), (n, 1)), "opacities": np.full(n, 2.0, np.float32),
              "sh": np.zeros((n, 1, 3), np.float32)}
    model = GaussianModel(arrays, "cpu")
    s = DefaultStrategy(refine_start=0, refine_every=1000, reset_every=10)
    state = {"grad": np.zeros(n, np.float32), "count": np.zeros(n, np.int32), "max_radius": np.zeros(n, np.float32),
             IMPORTANCE_WEIGHT: np.float32([1.0, 0.5, 0.2]), VIEW_SKIP: np.uint8([[1], [2], [4]])}
    ctx = Context(1.0, np.random.default_rng(0))
    assert s.after_optimizer(model, state, 9, ctx) == {} and VIEW_SKIP in state  # no reset yet: kept
    done = s.after_optimizer(model, state, 10, ctx)
    assert done.get("opacity_reset") and VIEW_SKIP not in state, done
    np.testing.assert_allclose(state[IMPORTANCE_WEIGHT], [1.0, 0.5, 0.2])
    g = edge_case_scene(n=20, seed=2, dtype=np.float32)
    full, p = culled(g, look_at_camera(), masked_workload(), {})  # a view with no mask skips nothing
    np.testing.assert_array_equal(p.counts, full.counts)


def test_scoring_steps():
    assert scoring_steps(30_000, 3000) == list(range(3000, 30_000, 3000))
    assert scoring_steps(7000, 3000) == [3000, 6000]
    assert scoring_steps(7000, 5000) == [5000, 6300]   # and once at 90%: no pass in the last 15%
    assert scoring_steps(100, 0) == []
    # a pass right after an opacity reset waits for the opacities to come back
    waits = [(3000, 3500), (6000, 6500)]
    assert scoring_steps(7000, 3000, waits) == [3500, 6500]
    assert scoring_steps(6200, 3000, waits) == [3500, 5580]  # 6000's moved past the end: the 90% pass instead
    s = DefaultStrategy(refine_start=500, refine_stop=15_000, reset_every=3000)
    assert opacity_resets(s, 30_000) == [(r, r + 500) for r in (3000, 6000, 9000, 12000)]
    assert opacity_resets(s, 7000) == [(3000, 3500), (6000, 6500)]
    s.reset_at_start = True
    assert opacity_resets(s, 3000) == [(500, 1000)]
    assert opacity_resets(DefaultStrategy(reset=False), 7000) == []


def test_workload_switches_are_checked():
    with pytest.raises(ValueError, match="--view-masks on needs"):
        Workload(TrainConfig(view_masks="on"), 3)
    with pytest.raises(ValueError, match="--importance-prune needs"):
        Workload(TrainConfig(importance_prune=0.1), 3)
    with pytest.raises(ValueError, match="--strategy default"):
        Workload(TrainConfig(importance_every=10, strategy="mcmc"), 3)
    with pytest.raises(ValueError, match="--view-masks must be"):
        Workload(TrainConfig(view_masks="yes"), 3)
    with pytest.raises(ValueError, match="--view-masks auto needs"):
        Workload(TrainConfig(view_masks="auto"), 3)
    with pytest.raises(ValueError, match="--lod-views must be"):
        Workload(TrainConfig(lod_views="some"), 3)
    for switches in (dict(lod_views="auto", lod_min_px=0.5), dict(lod_views="auto", importance_every=10)):
        with pytest.raises(ValueError, match="--lod-views auto needs"):
            Workload(TrainConfig(**switches), 3)
    assert not Workload(TrainConfig(), 3).on


def test_pipelines_without_culling_refuse_the_switches(dataset, tmp_path):
    from engine.pipelines.single_gpu import OffloadTrainer
    with pytest.raises(ValueError, match="not supported by OffloadTrainer"):
        OffloadTrainer(dataset, tmp_path, small_config(lod_min_px=1.0, visible_adam=True), backend="cpu")


BLITZ = dict(importance_every=12, importance_prune=0.01, view_masks="on", lod_min_px=0.6, view_mask_below=0.3)
# the masks and the gate on the views under a share between the demo views' (0.34-0.41 at the first pass)
BLITZ_AUTO = {**BLITZ, "view_masks": "auto", "lod_views": "auto", "cull_share_below": 0.38}


@pytest.mark.parametrize("switches", [BLITZ, BLITZ_AUTO], ids=["on", "auto"])
def test_every_switch_trains_logs_and_resumes_as_if_never_stopped(dataset, tmp_path, switches):
    """Passes at 12, 24 and 36 of 40 (pruning, weights, masks), the LOD gate every step (auto: on the
    views that the last pass found under the share); a run stopped at 20 and resumed from its
    snapshot (masks, weights and the views' shares in it) ends as the whole run."""
    cfg = lambda: small_config(**switches)  # noqa: E731
    whole = fast_refine(SingleGPUTrainer(dataset, tmp_path / "a", cfg(), backend="cpu")).train(progress=False)
    records = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    passes = [r for r in records if "importance_pass" in r]
    assert [r["step"] for r in passes] == [12, 24, 36], passes  # (the resets at 5 and 25 wait 4 steps)
    assert all(r["importance_pass"]["seconds"] > 0 for r in passes)
    assert any(r["importance_pass"]["pruned"] > 0 for r in passes)
    assert passes[-1]["gaussians"] == passes[-1]["importance_pass"]["gaussians"]
    # the Gaussians drawn per view since the last log, under the model's size then (a refinement at
    # the log's step may have shrunk it since)
    active = [(r["drawn_per_view"], max(before["gaussians"], r["gaussians"]))
              for before, r in zip(records, records[1:]) if r["step"] > 12 and "drawn_per_view" in r]
    assert active and all(drawn < size for drawn, size in active), active
    assert whole.evaluate(views=dataset.train[:2], lpips=False)["importance_seconds"] > 0
    first = fast_refine(SingleGPUTrainer(dataset, tmp_path / "b", cfg(), backend="cpu"))
    first.train(progress=False, until=20)  # the masks of the pass at 12 in the snapshot; the resumed run
    assert VIEW_SKIP in first.strategy_state  # then drops them at the reset at 25 and makes new ones at 36
    resumed = fast_refine(SingleGPUTrainer(dataset, tmp_path / "b", cfg(), backend="cpu"))
    resumed.load_snapshot(tmp_path / "b" / SNAPSHOT)
    np.testing.assert_array_equal(resumed.strategy_state[VIEW_SKIP], first.strategy_state[VIEW_SKIP])
    resumed.train(progress=False)
    a, b = whole.model.host_arrays(), resumed.model.host_arrays()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_the_pass_spares_what_the_lod_gate_would_keep_from_every_view(dataset, tmp_path):
    """After a pass the state's ``LOD_SPARE`` marks the rows the pass found hidden from every view
    drawing them (its ``lod_untrained``), those views draw them, and a snapshot keeps the marks."""
    cfg = small_config(importance_every=12, lod_min_px=6.0)  # coarse: a fifth of the rows are under it everywhere
    t = fast_refine(SingleGPUTrainer(dataset, tmp_path / "a", cfg, backend="cpu"))
    t.train(progress=False, until=12)
    record = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()][-1]
    spare = t.strategy_state[LOD_SPARE]
    assert spare.dtype == np.uint8 and spare.shape == (len(t.model),)
    assert int(spare.sum()) == record["importance_pass"]["lod_untrained"] > 0
    g = t.model.gaussians
    drawn = np.zeros(len(g), bool)
    for v, view in enumerate(dataset.train):
        full, p = culled(g, view.camera, t.workload, t.strategy_state, v)
        drawn |= full.counts > 0
        np.testing.assert_array_equal(p.counts[spare == 1], full.counts[spare == 1])
        bare, _ = culled(g, view.camera, t.workload, {}, v)  # without the marks the gate hides them
        assert not t.workload.cull(bare, g, {}, v, "cpu").counts[spare == 1].any()
    assert drawn[spare == 1].all()
    t.save_snapshot()
    resumed = SingleGPUTrainer(dataset, tmp_path / "a", cfg, backend="cpu")
    resumed.load_snapshot(tmp_path / "a" / SNAPSHOT)
    np.testing.assert_array_equal(resumed.strategy_state[LOD_SPARE], spare)


def test_cli_flags_and_their_defaults():
    import argparse
    from cli.train import config_from_args, train_parser
    p = train_parser()
    a = p.parse_args(["--importance-every", "3000", "--importance-prune", "1e-4", "--view-masks", "on",
                      "--lod-min-px", "0.5", "--shard", "parity"])
    cfg = config_from_args(a)
    assert (cfg.importance_every, cfg.importance_prune, cfg.view_masks, cfg.lod_min_px) == (3000, 1e-4, "on", 0.5)
    assert a.shard == "parity"
    d = config_from_args(p.parse_args([]))
    assert (d.importance_every, d.importance_prune, d.view_masks, d.lod_min_px) == (0, 0.0, "off", 0.0)
    assert (d.lod_views, d.cull_share_below) == ("all", 0.3)
    auto = config_from_args(p.parse_args(["--view-masks", "auto", "--lod-views", "auto", "--cull-share-below", "0.2"]))
    assert (auto.view_masks, auto.lod_views, auto.cull_share_below) == ("auto", "auto", 0.2)
    assert p.parse_args([]).shard == "contiguous"
    for bad in (["--view-masks", "yes"], ["--shard", "odd"], ["--importance-prune", "2"], ["--lod-min-px", "-1"],
                ["--lod-views", "some"], ["--cull-share-below", "1.5"]):
        with pytest.raises(argparse.ArgumentError):
            p.parse_args(bad)


def test_the_pass_counts_the_gaussians_each_view_draws():
    """``importance_scores(drawn=)``: each view's count of the rows its projection draws (the visible
    share's numerator), and the scores and masks as without it."""
    g = edge_case_scene(n=30, seed=4, dtype=np.float32)
    cams = [shifted_camera(dx) for dx in (0.0, 0.6, -1.2, 4.0)]
    drawn = np.full(len(cams), -1, np.int64)
    total, skip = importance_scores(g, cams, 3, False, 0.05, backend="cpu", drawn=drawn)
    expected = [int((ns.project(g, cam, backend="cpu").counts > 0).sum()) for cam in cams]
    assert drawn.tolist() == expected and len(set(expected)) > 1, expected
    plain_total, plain_skip = importance_scores(g, cams, 3, False, 0.05, backend="cpu")
    np.testing.assert_array_equal(total, plain_total)
    np.testing.assert_array_equal(skip, plain_skip)


def auto_workload(shares, **switches):
    """A ``Workload`` of three views whose last pass measured ``shares`` (None: no pass yet)."""
    cfg = TrainConfig(**{"importance_every": 100, "lod_min_px": 0.5, "cull_share_below": 0.5, **switches})
    w = Workload(cfg, n_views=3)
    w.visible_share = None if shares is None else np.array(shares)
    return w


def test_auto_culls_only_the_views_that_see_a_small_share():
    """``--view-masks auto`` and ``--lod-views auto``: a view under ``cull_share_below`` applies its
    mask and the gate, one at or over it neither, and before any pass none does; each auto alone
    leaves the other switch as it is."""
    both = dict(view_masks="auto", lod_views="auto")
    shares = [0.2, 0.7, 0.5]
    assert [auto_workload(shares, **both).cuts(v) for v in range(3)] == [(True, 0.5), (False, 0.0), (False, 0.0)]
    assert [auto_workload(None, **both).cuts(v) for v in range(3)] == [(False, 0.0)] * 3
    assert auto_workload(shares, view_masks="auto").cuts(1) == (False, 0.5)       # the gate on every view
    assert auto_workload(shares, view_masks="on", lod_views="auto").cuts(1) == (True, 0.0)
    assert auto_workload(shares, view_masks="on").cuts(1) == (True, 0.5)          # no auto: as before
    # the culled projections: the mask hides its rows from the view under the share, not from the other
    g = edge_case_scene(n=40, seed=3, dtype=np.float32)
    cam = look_at_camera()
    _, skip = importance_scores(g, [cam, cam, cam], sh_degree=3, antialias=False, mask_below=0.5, backend="cpu")
    w = auto_workload(shares, view_masks="auto", view_mask_below=0.5, lod_min_px=0.0)  # (the masks alone)
    full, small = culled(g, cam, w, {VIEW_SKIP: skip}, view=0)
    _, large = culled(g, cam, w, {VIEW_SKIP: skip}, view=1)
    np.testing.assert_array_equal(large.counts, full.counts)
    np.testing.assert_array_equal(small.counts, np.where(view_bit(skip, 0, np), 0, full.counts))
    assert (small.counts < full.counts).sum() >= 3


def test_a_pass_measures_the_visible_shares_that_auto_chooses_by(dataset, tmp_path):
    """A run's pass (no pruning: the rows stay as they were) stores each training view's share of the
    Gaussians its projection draws, logs their median and the views under ``cull_share_below``, and
    a snapshot keeps the shares for a resumed run; the run warmed the pass's kernels first."""
    cfg = small_config(importance_every=12, view_masks="auto", lod_min_px=0.6, lod_views="auto",
                       cull_share_below=0.38)  # (between the demo views' shares: some views culled, some not)
    t = fast_refine(SingleGPUTrainer(dataset, tmp_path / "a", cfg, backend="cpu"))
    t.train(progress=False, until=12)
    g = t.model.gaussians
    shares = np.array([(ns.project(g, v.camera, backend="cpu").counts > 0).mean() for v in dataset.train])
    np.testing.assert_allclose(t.workload.visible_share, shares, rtol=1e-12)
    record = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()][-1]
    assert 0 < record["importance_pass"]["cut_views"] == (shares < 0.38).sum() < len(shares)
    assert record["importance_pass"]["visible_share"] == pytest.approx(np.median(shares))
    assert [t.workload.cuts_view(v) for v in range(len(shares))] == (shares < 0.38).tolist()
    assert t.workload.warmup_seconds > 0
    t.save_snapshot()
    resumed = SingleGPUTrainer(dataset, tmp_path / "a", cfg, backend="cpu")
    resumed.load_snapshot(tmp_path / "a" / SNAPSHOT)
    np.testing.assert_array_equal(resumed.workload.visible_share, t.workload.visible_share)


def test_the_warm_up_runs_the_pass_where_one_is_due_and_changes_nothing(dataset, tmp_path):
    """``Workload.warm``: where a pass comes in the run it times one on a few rows, and leaves the
    model and the strategy's state as they were; a second call, or a run with no pass to come, does
    nothing."""
    t = SingleGPUTrainer(dataset, tmp_path / "a", small_config(**BLITZ), backend="cpu")
    t.init_model()
    before = t.model.host_arrays()
    state = {k: np.array(a) for k, a in t.strategy_state.items()}
    t.workload.warm(t)
    seconds = t.workload.warmup_seconds
    assert seconds > 0 and t.workload.passes == 0 and t.workload.visible_share is None
    for k, a in t.model.host_arrays().items():
        np.testing.assert_array_equal(a, before[k], err_msg=k)
    assert t.strategy_state.keys() == state.keys()
    for k, a in state.items():
        np.testing.assert_array_equal(t.strategy_state[k], a, err_msg=k)
    t.workload.warm(t)
    assert t.workload.warmup_seconds == seconds
    late = SingleGPUTrainer(dataset, tmp_path / "b", small_config(**BLITZ), backend="cpu")
    late.init_model()
    late.step = 36  # (as a run resumed at its last pass: the passes come at 12, 24 and 36 of 40)
    late.workload.warm(late)
    assert late.workload.warmup_seconds == 0
