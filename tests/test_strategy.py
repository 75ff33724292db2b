"""Densification strategies: what DefaultStrategy and MCMCStrategy do to a model, with their state apart."""
import numpy as np

from engine.model import GaussianModel, init_from_points
from engine.strategy import Context, DefaultStrategy, MCMCStrategy


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
    from engine.strategy import BYTES_PER_GAUSSIAN, growth_allowed

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
    grads = reg.loss_gradients(model, {})
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
    shard = reg.loss_gradients(model, {}, total=4 * n)  # these rows as a quarter of a 4n-Gaussian model
    for k in grads:
        np.testing.assert_allclose(shard[k], grads[k] / 4, rtol=1e-6)
    assert DefaultStrategy().loss_gradients(model, {}) is None
    only = DefaultStrategy(scale_reg=0.7).loss_gradients(model, {})
    assert set(only) == {"scales"}
    assert (MCMCStrategy().opacity_reg, MCMCStrategy().scale_reg) == (0.01, 0.01)
