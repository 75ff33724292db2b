"""Densification strategies: objects that watch training and change the set of Gaussians.

A strategy is its settings (a dataclass); what it gathers while training is
a separate state dict that the trainer holds and passes to every hook, as
gsplat's strategies do.  So the snapshot stores the state, not the object,
and a pipeline that shards the Gaussians over ranks splits and gathers it:
every array of a state has one row per Gaussian, in the model's order.

The interface is small so that other schemes (ByteSplat's hardware-aware
pruning, BlitzGS's importance scores) can be added as further classes:

    initialize_state()                            a new state (its rows are made as the model's size is known)
    loss_gradients(model, state, total)           the regularisers' gradients (``Regularisers``), added before Adam
    after_backward(model, state, step, projection, grad, scale, skip)
                                                  see one view's screen-space gradients (x scale)
    after_optimizer(model, state, step, ctx)      after Adam: densify, prune, reset, perturb;
                                                  returns a dict of what it did
"""
import math
from dataclasses import dataclass

import numpy as np

from numbasplat import ABS_U, ABS_V, ALPHA_MIN, U, V
from numbasplat.backend import to_host
from numbasplat.rendering import screen_gradient_stats
from numbasplat.rows import row_normals

from .model import inverse_sigmoid


def _sigmoid(xp, x):
    return 1.0 / (1.0 + xp.exp(-x))


def _quat_rotate(xp, q, v):
    """Rotate vectors v (N,3) by unnormalised wxyz quaternions q (N,4)."""
    q = q / xp.linalg.norm(q, axis=1, keepdims=True)
    w, u = q[:, :1], q[:, 1:]
    t = 2.0 * xp.cross(u, v)
    return v + w * t + xp.cross(u, t)


@dataclass
class Context:
    """What a strategy may need beyond the model.

    Steps count images.  A batch advances them by B, so schedules fire when a
    multiple is crossed (``prev_step`` < k * every <= ``step``).  With the
    Gaussians sharded over ranks, this rank's rows are global rows
    ``offset + stride * (0 .. len(model) - 1)`` (contiguous shards: stride 1;
    index-parity shards: offset the rank, stride the rank count); random draws are
    functions of the global row (``normal``), so results do not depend on the sharding.
    """
    scene_scale: float
    rng: np.random.Generator
    max_gaussians: int = 0     # 0: no cap (besides the memory guard)
    free_bytes: object = 0     # device memory left (0: unknown), or a function measuring it (``free_device_bytes``)
    prev_step: int = None      # default: step - 1
    offset: int = 0
    lr_means: float = 0.0      # the means' learning rate of the Adam step just taken (MCMC's noise scales with it)
    stride: int = 1            # global row of local row j: offset + stride * j
    rows: object = None        # or the global rows of the local rows (an array): a part of the model held out of
    # core, refined block by block (``OutOfCoreStore.refine``) as the whole model is

    def crossed(self, step, every):
        prev = step - 1 if self.prev_step is None else self.prev_step
        return every > 0 and prev // every != step // every

    def reached(self, step, at):
        """Whether step ``at`` lies in (prev_step, step]."""
        prev = step - 1 if self.prev_step is None else self.prev_step
        return prev < at <= step

    def free_device_bytes(self):
        """The device memory left (0: unknown), measured when asked: a driver call, which a step
        that does not refine never makes."""
        return self.free_bytes() if callable(self.free_bytes) else self.free_bytes

    def normal(self, model, rows, shape):
        """Standard normal draws of ``shape`` for each of the local ``rows``, identical whatever the
        sharding: one key from ``rng`` (the same on every rank), each draw a function of the key and
        its global row (``row_normals``), drawn on the model's device."""
        key = int(self.rng.integers(2**63))
        if self.rows is not None:
            rows = model.xp.asarray(self.rows)[rows]
        draws = row_normals(key, rows, math.prod(shape), self.offset, self.stride, model.backend)
        return draws.reshape((len(draws),) + tuple(shape))


STATISTICS = ("grad", "count", "max_radius")  # the default strategy's statistics since its last refinement
IMPORTANCE_WEIGHT = "importance_weight"  # (N,) float32: BlitzGS's densification weight (engine/recipe/workload.py)
VIEW_SKIP = "view_skip"  # (N, ceil(views / 8)) uint8: bit v (np.packbits' order) set: view v skips the Gaussian
LOD_SPARE = "lod_spare"  # (N,) uint8: 1 where the LOD gate spares the Gaussian (no training view would train it)


def carry_rows(state, rows):
    """A state's arrays that outlive a refinement (all but ``STATISTICS``: the workload's weights
    and view masks), made to follow the model's new rows: new row k takes old row ``rows[k]``
    (a clone or a split child its parent's)."""
    for k in [k for k in state if k not in STATISTICS]:
        state[k] = state[k][rows]


BYTES_PER_GAUSSIAN = 1500     # parameters, gradients, Adam moments and per-step buffers


def growth_allowed(n_now, n_new, ctx):
    """The memory guard: stop growing near the cap or the device's capacity."""
    if ctx.max_gaussians and n_now + n_new > ctx.max_gaussians:
        return max(0, ctx.max_gaussians - n_now)
    free = ctx.free_device_bytes()
    if free and n_new * BYTES_PER_GAUSSIAN > 0.8 * free:
        return max(0, int(0.8 * free / BYTES_PER_GAUSSIAN))
    return n_new


@dataclass
class RefineSchedule:
    """When a strategy refines (densifies, prunes, relocates): every ``refine_every`` steps
    strictly between ``refine_start`` and ``refine_stop``."""
    refine_start: int = 500
    refine_stop: int = 15_000
    refine_every: int = 100

    def refines_at(self, step, ctx):
        return self.refine_start < step < self.refine_stop and ctx.crossed(step, self.refine_every)


@dataclass
class Regularisers:
    """L1 regularisers that push the Gaussians' opacities and scales down (3DGS as MCMC's; gsplat's
    ``opacity_reg`` and ``scale_reg``): opacity_reg * mean(sigmoid(o)) + scale_reg * mean(exp(s)),
    the means over the whole model's Gaussians (the scales' over their 3 axes too); 0 turns one off.
    They fight what a few training views let the model fit: floaters and overgrown Gaussians.
    They act from step ``regularise_from`` on: a 7k run is then the same without them, where a
    30k run overfits (BENCHMARKS.md, issue 57)."""
    opacity_reg: float = 0.0
    scale_reg: float = 0.0
    regularise_from: int = 0

    @property
    def regularising(self):
        """Whether either regulariser has a weight."""
        return bool(self.opacity_reg or self.scale_reg)

    def regularises_at(self, step):
        """Whether ``loss_gradients`` gives gradients at ``step``."""
        return self.regularising and step >= self.regularise_from

    def loss_gradients(self, model, state, step, total=None):
        """Their gradients for ``model``'s rows at ``step`` (``total``: the whole model's Gaussians, where
        ``model`` is a rank's shard or a working set; default its own), or None where they do not act."""
        if not self.regularises_at(step):
            return None
        xp = model.xp
        g = model.gaussians
        n = max(len(model) if total is None else total, 1)
        out = {}
        if self.opacity_reg:
            o = g.opacities  # sigmoid' = sigmoid(o) sigmoid(-o): 1 - sigmoid(o) loses its digits as o grows
            out["opacities"] = (self.opacity_reg / n) * _sigmoid(xp, o) * _sigmoid(xp, -o)
        if self.scale_reg:
            out["scales"] = (self.scale_reg / (3 * n)) * xp.exp(g.scales)
        return out


@dataclass
class DefaultStrategy(Regularisers, RefineSchedule):
    """Adaptive density control of the reference 3DGS implementation."""
    grad_threshold: float = 2e-4
    reset_every: int = 3000
    prune_opacity: float = 0.005
    percent_dense: float = 0.01
    max_screen_size: float = 0.0     # pixels, enforced after the first opacity reset (0: never)
    max_world_size: float = 0.1      # fraction of the scene scale
    absgrad: bool = False
    reset_at_start: bool = False     # also reset opacities at refine_start (3DGS does on white backgrounds)
    reset: bool = True               # reset opacities at all (the large-Gaussian prunes still wait for reset_every)

    @property
    def resets_until(self):
        """Opacity resets happen before this step: the end of densification, or where the regularisers
        begin.  Both at once collapse a model: a reset leaves opacities at 0.01, the regularisers push
        them under ``prune_opacity`` and the prunes take them (helmet lost 10 dB, BENCHMARKS.md)."""
        return min(self.refine_stop, self.regularise_from) if self.regularising else self.refine_stop

    def reset_steps(self, iterations):
        """The steps up to ``iterations`` whose crossing resets the opacities (``resets_at``'s rule), sorted."""
        if not self.reset:
            return []
        stop = min(self.resets_until, iterations)
        steps = list(range(self.reset_every, stop, self.reset_every))
        return sorted(steps + ([self.refine_start] if self.reset_at_start and self.refine_start < stop else []))

    def initialize_state(self):
        """The statistics since the last refinement, per Gaussian: the summed screen-space gradient
        norm ("grad"), the views that saw it ("count") and its largest radius in pixels ("max_radius");
        made (zero) at the first ``after_backward``, when the model's size is known.  The importance
        pass (engine/recipe/workload.py) adds ``IMPORTANCE_WEIGHT``, ``VIEW_SKIP`` and ``LOD_SPARE``, which
        refinements carry."""
        return {}

    @staticmethod
    def fresh_statistics(xp, n):
        """The statistics of ``n`` Gaussians that no view saw yet (zeros)."""
        return dict(grad=xp.zeros(n, np.float32), count=xp.zeros(n, np.int32), max_radius=xp.zeros(n, np.float32))

    @classmethod
    def _fresh(cls, state, xp, n):
        state.update(cls.fresh_statistics(xp, n))

    def after_backward(self, model, state, step, projection, grad, scale=1.0, skip=None):
        """Accumulate the norm of ``scale`` x the screen-space mean gradient, in NDC units as 3DGS does
        (``scale``: a batch's view sees its gradient, not its 1/B share of the batch loss); nothing
        where the (1,) device flag ``skip`` is set (the optimizer's ``skip``)."""
        xp = model.xp
        if "grad" not in state or len(state["grad"]) != len(model):
            self._fresh(state, xp, len(model))
        if step >= self.refine_stop:
            return
        cols = (ABS_U, ABS_V) if self.absgrad else (U, V)
        screen_gradient_stats(projection, grad, scale, cols, state["grad"], state["count"], state["max_radius"],
                              skip, model.backend)

    def resets_at(self, step, ctx):
        """Whether ``after_optimizer`` resets the opacities at ``step``."""
        at_start = self.reset_at_start and ctx.reached(step, self.refine_start)
        return self.reset and step < self.resets_until and (ctx.crossed(step, self.reset_every) or at_start)

    def acts_at(self, step, ctx):
        """Whether ``after_optimizer`` changes the model at ``step`` (refines or resets; at other steps it
        leaves model and state as they are, so that a pipeline holding the model out of core gathers it
        only then)."""
        return self.refines_at(step, ctx) or self.resets_at(step, ctx)

    def after_optimizer(self, model, state, step, ctx, decided=None):
        """``decided``: the refinement's decisions for ``model``'s rows, (prune mask, clone rows, split rows), where
        they were made for the whole model (``refinement``) and ``model`` is a part of it."""
        xp = model.xp
        done = {}
        if self.refines_at(step, ctx):
            done = self._refine(model, state, step, ctx, decided)
            self._fresh(state, xp, len(model))
        if self.resets_at(step, ctx):
            op = model.group("opacities")
            xp.minimum(op, inverse_sigmoid(0.01), out=op)
            model.reset_moments("opacities")
            done["opacity_reset"] = True
            # every Gaussian now translucent, those hidden behind others show: the views' masks
            # (engine/recipe/workload.py) hold no more, until the pass after the reset makes new ones
            state.pop(VIEW_SKIP, None)
        return done

    def candidates(self, model, state, step, ctx):
        """-> (mean gradients, prune mask, clone rows, split rows) of ``model``'s rows before the memory guard:
        decisions of each Gaussian alone, so that a part of the model makes those the whole would."""
        xp = model.xp
        g = model.gaussians
        grads = state["grad"] / xp.maximum(state["count"], 1)
        if IMPORTANCE_WEIGHT in state:  # BlitzGS: the mean gradient x the last importance pass's weight
            grads = grads * state[IMPORTANCE_WEIGHT]
        scale_max = xp.exp(g.scales.max(axis=1))
        opacity = _sigmoid(xp, g.opacities)
        prune = opacity < self.prune_opacity
        if step > self.reset_every:
            if self.max_screen_size > 0:
                prune |= state["max_radius"] > self.max_screen_size
            prune |= scale_max > self.max_world_size * ctx.scene_scale
        grow = (grads >= self.grad_threshold) & (opacity >= self.prune_opacity)
        small = scale_max <= self.percent_dense * ctx.scene_scale
        return grads, prune, xp.flatnonzero(grow & small), xp.flatnonzero(grow & ~small)

    @staticmethod
    def guard(xp, n_left, clone, split, clone_grads, split_grads, ctx):
        """The memory guard over the whole model: -> (clone, split) rows, the strongest first where it
        allows fewer than all (``n_left``: the Gaussians left after the prunes)."""
        budget = growth_allowed(n_left, len(clone) + len(split), ctx)
        if budget < len(clone) + len(split):     # guard hit: grow the strongest first
            order = xp.argsort(-xp.concatenate([clone_grads, split_grads]))[:budget]
            chosen = xp.concatenate([clone, split])[order]
            is_clone = order < len(clone)
            clone, split = chosen[is_clone], chosen[~is_clone]
        return clone, split

    def refinement(self, model, state, step, ctx):
        """-> the whole model's decisions (prune mask, clone rows, split rows), the memory guard applied."""
        grads, prune, clone, split = self.candidates(model, state, step, ctx)
        clone, split = self.guard(model.xp, len(model) - int(prune.sum()), clone, split, grads[clone], grads[split],
                                  ctx)
        return prune, clone, split

    def _refine(self, model, state, step, ctx, decided=None):
        xp = model.xp
        g = model.gaussians
        prune, clone, split = self.refinement(model, state, step, ctx) if decided is None else decided
        prune = prune.copy()
        new = {k: a[clone] for k, a in g.arrays().items()}
        eps = ctx.normal(model, split, (2, 3)).reshape(-1, 3)  # drawn on every rank, split or not
        if len(split):
            # two children per split Gaussian, drawn from it, 1.6x smaller
            parent = xp.repeat(split, 2)
            sigma = xp.exp(g.scales[parent])
            child = {k: a[parent] for k, a in g.arrays().items()}
            child["means"] = g.means[parent] + _quat_rotate(xp, g.quats[parent], sigma * eps)
            child["scales"] = g.scales[parent] - math.log(1.6)
            new = {k: xp.concatenate([new[k], child[k]]) for k in new}
            prune[split] = True
        kept = xp.flatnonzero(~prune)
        model.gather(kept, new)
        carry_rows(state, xp.concatenate([kept, clone, xp.repeat(split, 2)]))
        return {"cloned": int(len(clone)), "split": int(len(split)), "pruned": int(prune.sum()) - int(len(split)),
                "gaussians": len(model)}


@dataclass
class MCMCStrategy(Regularisers, RefineSchedule):
    """3DGS as MCMC (Kheradmand et al. 2024), with a hard cap on the number of Gaussians.

    Dead Gaussians (opacity below ``min_opacity``) are moved onto live ones
    drawn by opacity, new ones are added the same way (5% per refinement, up to
    ``cap_max``), the opacity and scale of every sampled source are adjusted so
    that the rendered mass is preserved, means get opacity-gated noise each
    step, and L1 regularisers push opacities and scales down.
    """
    cap_max: int = 1_000_000
    refine_stop: int = 25_000
    min_opacity: float = 0.005
    growth: float = 0.05
    noise_lr: float = 5e5
    opacity_reg: float = 0.01
    scale_reg: float = 0.01

    def initialize_state(self):
        """Nothing: MCMC reads only the model."""
        return {}

    def after_backward(self, model, state, step, projection, grad, scale=1.0, skip=None):
        pass

    def _relocation(self, xp, opacity, scales, ratio):
        """New opacity and scale of a source sampled ``ratio - 1`` extra times (Eq. 9 of the paper).

        The paper's double sum over i <= n and k < i of C(i-1, k) (-1)^k o^(k+1) / sqrt(k+1) is
        summed over i first (sum_i C(i-1, k) = C(n, k+1)): coeff = sum_j (-1)^(j-1) C(n, j) o^j / sqrt(j),
        its terms made by recurrence in float64.  The double sum's binomials overflowed float32 from
        n of about 130, giving NaN scales to a source drawn that often (a run diverged)."""
        dtype = scales.dtype
        o = opacity.astype(np.float64)
        n = ratio.astype(np.float64)
        o_new = 1.0 - (1.0 - o) ** (1.0 / n)
        coeff = xp.zeros_like(o)
        term = xp.ones_like(o)  # C(n, j) o_new^j; 0 from j = n + 1 on
        for j in range(1, int(n.max()) + 1 if n.size else 1):
            term = term * ((n - (j - 1)) / j) * o_new
            coeff += ((-1.0) ** (j - 1) / math.sqrt(j)) * term
        scale_new = scales + xp.log(xp.maximum(o / xp.maximum(coeff, 1e-300), 1e-12)).astype(dtype)[:, None]
        return o_new.astype(opacity.dtype), scale_new

    def _sample(self, model, count, ctx, candidates):
        """``count`` indices drawn from ``candidates`` with probability proportional to opacity."""
        g = model.gaussians
        p = to_host(_sigmoid(model.xp, g.opacities[candidates])).astype(np.float64)
        return model.xp.asarray(to_host(candidates)[ctx.rng.choice(len(p), size=count, p=p / p.sum())])

    def _clone_from(self, model, src, ctx):
        """Rows for new Gaussians copied from sources ``src``; sources' opacity/scale adjusted in place."""
        xp = model.xp
        g = model.gaussians
        uniq, counts = np.unique(to_host(src), return_counts=True)
        uniq = xp.asarray(uniq)
        ratio = xp.asarray(counts + 1).astype(np.float32)
        opacity = _sigmoid(xp, g.opacities[uniq])
        o_new, s_new = self._relocation(xp, opacity, g.scales[uniq], ratio)
        o_new = xp.clip(o_new, ALPHA_MIN, 1.0 - 1e-6)
        g.opacities[uniq] = xp.log(o_new / (1.0 - o_new))
        g.scales[uniq] = s_new
        for grp in ("opacities", "scales"):
            model.reset_moments(grp, uniq)
        return {k: a[src] for k, a in g.arrays().items()}

    def after_optimizer(self, model, state, step, ctx):
        """Every step the means' noise; every ``refine_every`` steps the dead relocated and the
        model grown towards ``cap_max``."""
        xp = model.xp
        self._perturb(model, ctx)
        done = {}
        if self.refines_at(step, ctx):
            g = model.gaussians
            opacity = _sigmoid(xp, g.opacities)
            dead = xp.flatnonzero(opacity <= self.min_opacity)
            alive = xp.flatnonzero(opacity > self.min_opacity)
            if len(dead) and len(alive):
                src = self._sample(model, len(dead), ctx, alive)
                rows = self._clone_from(model, src, ctx)
                for k, a in model.gaussians.arrays().items():
                    a[dead] = rows[k]
                for grp in ("means", "scales", "quats", "opacities", "sh"):
                    model.reset_moments(grp, dead)
                done["relocated"] = int(len(dead))
            n = len(model)
            target = growth_allowed(n, min(self.cap_max, int(n * (1 + self.growth))) - n,
                                    Context(ctx.scene_scale, ctx.rng, self.cap_max, ctx.free_bytes))
            if target > 0:
                alive = xp.flatnonzero(_sigmoid(xp, model.gaussians.opacities) > self.min_opacity)
                if len(alive):
                    src = self._sample(model, target, ctx, alive)
                    rows = self._clone_from(model, src, ctx)
                    model.gather(xp.arange(n), rows)
                    done["added"] = int(target)
            done["gaussians"] = len(model)
        return done

    def _perturb(self, model, ctx):
        """Opacity-gated Gaussian noise on the means, shaped by each covariance (SGLD step),
        scaled by the step's learning rate of the means."""
        xp = model.xp
        g = model.gaussians
        opacity = _sigmoid(xp, g.opacities)
        gate = 1.0 / (1.0 + xp.exp(100.0 * (opacity - self.min_opacity)))
        eps = ctx.normal(model, xp.arange(len(model)), (3,))
        sigma2 = xp.exp(2.0 * g.scales)
        noise = _quat_rotate(xp, g.quats, sigma2 * eps)
        g.means[...] += (self.noise_lr * ctx.lr_means) * gate[:, None] * noise

