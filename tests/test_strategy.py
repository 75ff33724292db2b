"""Densification strategies: what DefaultStrategy and MCMCStrategy do to a model, with their state apart."""
import numpy as np

from engine.recipe.model import GaussianModel, init_from_points
from engine.recipe.strategy import Context, DefaultStrategy, MCMCStrategy


def model_of(opacity_logits, scales):
    n = len(opacity_logits)
    arrays = init_from_points(np.random.default_rng(0).normal(size=(n, 3)), np.full((n, 3), 0.5), 1)
    arrays["opacities"] = np.asarray(opacity_logits, np.float32)
    arrays["scales"] = np.log(np.asarray(scales, np.float32))[:, None].repeat(3, 1)
    return GaussianModel(arrays, "cpu")


def test_default_strategy_clones_splits_and_prunes():
    #            small+hot  big+hot  transparent  quiet
    model = model_of([2.0, 2.0, -8.0, 2.0], [0.001, 0.5, 0.01, 0.01])
    model.group("means", "m")[...] = 7.0
    s = DefaultStrategy()
    state = s.initialize_state()
    s._fresh(state, np, 4)
    state["grad"][:] = [1e-3, 1e-3, 1e-3, 1e-5]
    state["count"][:] = 1
    before = model.host_arrays()
    done = s.after_optimizer(model, state, 600, Context(scene_scale=1.0, rng=np.random.default_rng(0)))
    assert done == {"cloned": 1, "split": 1, "pruned": 1, "gaussians": 5}
    after = model.host_arrays()
    # kept rows first (small, quiet), then the clone, then two children of the big one
    np.testing.assert_array_equal(after["means"][:2], before["means"][[0, 3]])
    np.testing.assert_array_equal(after["means"][2], before["means"][0])
    np.testing.assert_allclose(after["scales"][3:], np.log(0.5 / 1.6), rtol=1e-6)
    assert not np.allclose(after["means"][3], after["means"][4])
    m = model.host_arrays("m")["means"]
    assert (m[:2] == 7.0).all() and (m[2:] == 0).all()


def test_screen_size_prune_after_the_first_reset_unless_off():
    """A Gaussian whose radius reached max_screen_size pixels goes after the first opacity reset
    (3DGS), never with 0 (gsplat 1.5.3's default); none goes before the reset."""
    for limit, step, kept in ((20.0, 3100, 1), (0.0, 3100, 2), (20.0, 2900, 2)):
        model = model_of([2.0, 2.0], [0.01, 0.01])
        s = DefaultStrategy(max_screen_size=limit)
        state = s.initialize_state()
        s._fresh(state, np, 2)
        state["max_radius"][:] = [25.0, 5.0]
        s.after_optimizer(model, state, step, Context(scene_scale=1.0, rng=np.random.default_rng(0)))
        assert len(model) == kept, (limit, step)


def test_opacity_reset_and_memory_guard():
    model = model_of([3.0, 3.0, 3.0], [0.001, 0.001, 0.001])
    s = DefaultStrategy()
    state = s.initialize_state()
    s._fresh(state, np, 3)
    state["grad"][:] = 1e-3
    state["count"][:] = 1
    done = s.after_optimizer(model, state, 3000, Context(1.0, np.random.default_rng(0), max_gaussians=4))
    assert len(model) == 4 and done["cloned"] == 1 and done["opacity_reset"]
    assert np.allclose(1 / (1 + np.exp(-model.host_arrays()["opacities"])), 0.01, atol=1e-6)
    still = model_of([3.0, 3.0, 3.0], [0.001, 0.001, 0.001])  # reset=False (gsplat 1.5.3): opacities stay
    s = DefaultStrategy(reset=False)
    state = s.initialize_state()
    s._fresh(state, np, 3)
    done = s.after_optimizer(still, state, 3000, Context(1.0, np.random.default_rng(0)))
    assert "opacity_reset" not in done and (still.host_arrays()["opacities"] == 3.0).all()


def test_mcmc_relocates_dead_and_grows_to_cap():
    model = model_of([2.0] * 18 + [-9.0, -9.0], [0.05] * 20)
    s = MCMCStrategy(cap_max=21)
    done = s.after_optimizer(model, s.initialize_state(), 600, Context(1.0, np.random.default_rng(0)))
    assert done["relocated"] == 2 and done["added"] == 1 and len(model) == 21
    o = 1 / (1 + np.exp(-model.host_arrays()["opacities"]))
    assert (o > s.min_opacity).all()


def test_mcmc_perturbs_the_means_after_every_step():
    """MCMC's noise on the means comes with its ``after_optimizer`` hook (any step, not only
    refinement steps), scaled by the step's learning rate and gated off for opaque Gaussians."""
    def means_after(lr_means):
        model = model_of([-9.0, 0.0], [0.05, 0.05])
        before = model.host_arrays()["means"].copy()  # host_arrays may be views on the CPU
        done = MCMCStrategy().after_optimizer(model, {}, 7, Context(1.0, np.random.default_rng(0), lr_means=lr_means))
        assert done == {}
        return before, model.host_arrays()["means"]
    before, after = means_after(1e-3)
    assert not np.allclose(after[0], before[0]) and np.allclose(after[1], before[1], atol=1e-6)
    np.testing.assert_array_equal(*means_after(0.0))


def test_the_memory_guard_measures_the_device_only_when_a_refinement_asks():
    """``Context.free_bytes`` may be a function (the trainer's driver call): a step that does not
    refine never calls it; a refinement caps its growth at 0.8 of what it reports."""
    from engine.recipe.strategy import BYTES_PER_GAUSSIAN, growth_allowed

    def never():
        raise AssertionError("measured the device on a step without a refinement")
    model = model_of([2.0, 2.0], [0.001, 0.5])
    s = DefaultStrategy()
    state = s.initialize_state()
    s._fresh(state, np, 2)
    assert s.after_optimizer(model, state, 550, Context(1.0, np.random.default_rng(0), free_bytes=never)) == {}
    ctx = Context(1.0, np.random.default_rng(0), free_bytes=lambda: 100 * BYTES_PER_GAUSSIAN)
    assert ctx.free_device_bytes() == 100 * BYTES_PER_GAUSSIAN
    assert growth_allowed(0, 1000, ctx) == 80 and growth_allowed(0, 10, ctx) == 10


def test_regularisers_gradients_match_finite_differences_over_the_whole_model():
    """opacity_reg * mean(sigmoid(o)) + scale_reg * mean(exp(s)) in float64: the hand-written
    gradients against central differences, including saturated opacities and tiny and huge scales;
    a shard's rows (``total``: the whole model's count) get the whole model's gradients; the default
    strategy has them off (None), MCMC on at gsplat's 0.01."""
    logits = np.array([-12.0, -1.0, 0.0, 2.5, 15.0])
    scales = np.array([1e-4, 0.01, 0.3, 2.0, 40.0])
    model = model_of(logits, scales)
    reg = DefaultStrategy(opacity_reg=0.3, scale_reg=0.7)
    grads = reg.loss_gradients(model, {}, 0)
    n = len(logits)

    def opacity_term(o):  # one Gaussian's share of the loss (the others' shares do not depend on it)
        return 0.3 / n / (1 + np.exp(-o))

    def scale_term(x):  # one Gaussian's one axis
        return 0.7 / (3 * n) * np.exp(x)

    s64 = np.log(scales.astype(np.float32)).astype(np.float64)
    for i in range(n):
        h = 1e-5
        fd = (opacity_term(logits[i] + h) - opacity_term(logits[i] - h)) / (2 * h)
        np.testing.assert_allclose(grads["opacities"][i], fd, rtol=1e-5, atol=1e-12)
        fd = (scale_term(s64[i] + h) - scale_term(s64[i] - h)) / (2 * h)
        np.testing.assert_allclose(grads["scales"][i], fd, rtol=1e-5)
    shard = reg.loss_gradients(model, {}, 0, total=4 * n)  # these rows as a quarter of a 4n-Gaussian model
    for k in grads:
        np.testing.assert_allclose(shard[k], grads[k] / 4, rtol=1e-6)
    assert DefaultStrategy().loss_gradients(model, {}, 0) is None
    only = DefaultStrategy(scale_reg=0.7).loss_gradients(model, {}, 0)
    assert set(only) == {"scales"}
    assert (MCMCStrategy().opacity_reg, MCMCStrategy().scale_reg) == (0.01, 0.01)


def test_regularisers_from_a_step_take_over_from_the_opacity_resets():
    """With ``regularise_from`` the regularisers give nothing before that step and their gradients from
    it; the default strategy's opacity resets happen before it only (both at once collapse a model),
    and the importance pass's windows after resets (``opacity_resets``) follow the same rule."""
    from engine.recipe.workload import opacity_resets
    model = model_of([0.5, -1.0, 2.0], [0.01, 0.2, 0.05])
    s = DefaultStrategy(opacity_reg=0.01, scale_reg=0.01, regularise_from=7000)
    assert s.loss_gradients(model, {}, 6999) is None and not s.regularises_at(6999)
    late = s.loss_gradients(model, {}, 7000)
    assert s.regularises_at(7000)
    now = DefaultStrategy(opacity_reg=0.01, scale_reg=0.01).loss_gradients(model, {}, 0)
    for k in now:
        np.testing.assert_array_equal(late[k], now[k])
    ctx = Context(1.0, np.random.default_rng(0))
    resets = [step for step in range(500, 15_001, 500) if s.resets_at(step, ctx)]
    assert resets == [3000, 6000]
    assert [w[0] for w in opacity_resets(s, 30_000)] == [3000, 6000]
    assert [w[0] for w in opacity_resets(DefaultStrategy(), 30_000)] == [3000, 6000, 9000, 12000]
    always = DefaultStrategy(opacity_reg=0.01)  # from step 0: no resets at all
    assert not any(always.resets_at(step, ctx) for step in range(500, 15_001, 500))
    assert DefaultStrategy(regularise_from=7000).resets_at(9000, ctx)  # no regulariser: the resets as ever
    state = s.initialize_state()
    s._fresh(state, np, 3)
    done = s.after_optimizer(model, state, 9000, ctx)  # (prunes the Gaussian larger than max_world_size)
    assert "opacity_reset" not in done and (model.host_arrays()["opacities"] >= -1.0).all()


def _rotation_of(q):
    """The renderer's rotation matrix of the wxyz quaternion ``q`` (numbasplat.math.geometry)."""
    from numbasplat.math.geometry import quat_to_rotmat
    return np.array(quat_to_rotmat(*(np.asarray(q, np.float64) / np.linalg.norm(q)))).reshape(3, 3)


# 120 degrees about (1, 1, 1): its own inverse differs from it (x -> y, where the inverse takes x -> z)
SKEW_QUAT = np.array([0.5, 0.5, 0.5, 0.5])


def test_split_children_lie_along_the_parents_rotated_long_axis():
    """A split draws its children from the parent's own Gaussian: with uneven scales (long along its
    local x) and a rotation that is not its own inverse, the children's offsets lie along R e_x in the
    renderer's convention (a split rotating them by R^T, or not at all, puts them elsewhere)."""
    n = 64
    model = model_of([2.0] * n, [0.5] * n)
    g = model.gaussians
    g.scales[...] = np.log(np.array([0.5, 0.002, 0.001], np.float32))
    g.quats[...] = SKEW_QUAT.astype(np.float32)
    g.means[...] = np.random.default_rng(1).normal(size=(n, 3)).astype(np.float32)
    parents = model.host_arrays()["means"].copy()
    s = DefaultStrategy()
    state = s.initialize_state()
    s._fresh(state, np, n)
    state["grad"][:], state["count"][:] = 1e-3, 1
    done = s.after_optimizer(model, state, 600, Context(scene_scale=1.0, rng=np.random.default_rng(0)))
    assert done["split"] == n and len(model) == 2 * n
    offsets = model.host_arrays()["means"] - np.repeat(parents, 2, axis=0)
    axis = _rotation_of(SKEW_QUAT) @ np.array([1.0, 0.0, 0.0])
    along = offsets @ axis
    across = np.linalg.norm(offsets - along[:, None] * axis, axis=1)
    assert np.std(along) > 0.2 and across.max() < 0.02, (np.std(along), across.max())
    np.testing.assert_allclose(model.host_arrays()["scales"], np.log(np.array([0.5, 0.002, 0.001]) / 1.6)[None].repeat(2 * n, 0), rtol=1e-5)


def test_mcmc_noise_follows_each_gaussians_rotated_covariance():
    """MCMC's noise on a transparent Gaussian's mean is shaped by its covariance R S^2 R^T: with the
    scales uneven and a skew rotation, the steps lie along R e_x."""
    n = 64
    model = model_of([-9.0] * n, [0.5] * n)
    g = model.gaussians
    g.scales[...] = np.log(np.array([0.5, 0.002, 0.001], np.float32))
    g.quats[...] = SKEW_QUAT.astype(np.float32)
    before = model.host_arrays()["means"].copy()
    MCMCStrategy().after_optimizer(model, {}, 7, Context(1.0, np.random.default_rng(0), lr_means=1e-5))
    steps = model.host_arrays()["means"] - before
    axis = _rotation_of(SKEW_QUAT) @ np.array([1.0, 0.0, 0.0])
    along = steps @ axis
    across = np.linalg.norm(steps - along[:, None] * axis, axis=1)
    assert np.std(along) > 0 and across.max() < 1e-3 * np.abs(along).max()


def test_mcmc_relocation_keeps_the_rendered_mass_for_sources_drawn_many_times():
    """Eq. 9's new opacity and scale against a 60-digit evaluation of the published double sum,
    for sources drawn up to 500 times and opacities up to 1 - 1e-6: the float32 double sum
    overflowed from about 130 draws and gave NaN scales (a mouse run diverged at 13.6k steps)."""
    import math
    from decimal import Decimal, getcontext
    getcontext().prec = 60

    def exact(o, n):
        o = Decimal(float(o))
        o_new = 1 - (1 - o) ** (Decimal(1) / n)
        c = sum(Decimal(math.comb(i - 1, k)) * (-1) ** k / Decimal(k + 1).sqrt() * o_new ** (k + 1)
                for i in range(1, n + 1) for k in range(i))
        return float(o_new), float((o / c).ln())

    opacity = np.array([0.006, 0.3, 0.9, 0.999, 1 - 1e-6], np.float32)
    for n in (1, 2, 7, 51, 200, 500):
        o_new, s_new = MCMCStrategy()._relocation(np, opacity, np.zeros((5, 3), np.float32), np.full(5, n, np.float32))
        want = np.array([exact(o, n) for o in opacity])
        assert np.isfinite(s_new).all() and o_new.dtype == np.float32 and s_new.dtype == np.float32
        np.testing.assert_allclose(o_new, want[:, 0], rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(s_new[:, 0], want[:, 1], atol=1e-5)
