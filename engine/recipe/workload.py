"""BlitzGS's management of the active workload (issue 27): fewer Gaussians per step.

Three switches, each off by default (``TrainConfig``), each measurable alone and together:

* **Scheduled importance scoring** (``--importance-every N``, model level).  At the steps of
  ``scoring_steps`` a pass renders every training view with the forward kernels only (no
  gradients) and sums each Gaussian's blending weights ``T_i alpha_i`` over the pixels it
  reaches, per view (``numbasplat.rendering.contributions`` with ``colour=False``: the kernel of
  the hardware-aware pruning, on records of unit colour).  Its importance is the sum over the
  views, normalised by the largest.  The pass then

  - prunes the Gaussians whose normalised importance is below ``--importance-prune T`` (0: none);
  - stores each Gaussian's densification weight ``w_i = min(1, I_i / median(I_j > 0))`` (``I``
    the unnormalised importance; 0 for a Gaussian that contributes nowhere).  The default
    strategy densifies on its mean screen-space gradient times ``w_i``
    (``strategy.IMPORTANCE_WEIGHT``): Gaussians that contribute at least as much as the median
    one densify as before, the others as if their gradient were smaller in proportion, so new
    Gaussians go where the image is made.  Clones and split children inherit their parent's
    weight, until the next pass;
  - stores each view's mask (``strategy.VIEW_SKIP``): the Gaussians whose weights in that view
    sum to under ``view_mask_below`` (1/255 by default: removing such a Gaussian changes no pixel
    by more than about one level of an 8-bit image), those outside the view or hidden behind others
    included.  Refinements carry the masks as the weights; new Gaussians take their parent's.  An
    opacity reset drops them (``DefaultStrategy.after_optimizer``): every Gaussian is then
    translucent, and those hidden behind others show until the pass after the reset.
* **Per-view culling** (``--view-masks on``, view level, needs the scoring): until the next pass a
  view hides its masked rows from its projection (``Workload.cull``, ``ns.cull``: one pass over
  the rows on the device, no gather and no sync): they cost neither binning nor rasterization, and
  their gradients are zero for the step (with ``--visible-adam`` Adam leaves them alone, as any
  Gaussian the view does not see).  The densification statistics still count the view for them,
  with no gradient, as a run without masks counts it (where their gradient is negligible): the mean
  gradient over only the views that do not mask a Gaussian would densify the masked model more.
* **Distance-based LOD gate** (``--lod-min-px R``, view level): a view skips the Gaussians too fine
  for it: those whose footprint ``3 max(exp(scales)) max(fx, fy) / d`` (the 3-sigma radius in
  pixels of its largest axis at distance ``d`` from the camera centre; on the optical axis the
  projection's 3-sigma radius, before its 0.3-pixel blur) is under R (``ns.cull``, in the same
  pass as the masks).  Evaluation renders never skip (``Trainer.view_image`` renders everything),
  and there the rasterizer's blur draws a sub-pixel Gaussian as a dot at its full opacity: so with
  the importance pass on, each pass finds the Gaussians that the gate hides from every training
  view that draws them (``LodReach``), which would never train yet still draw, and the gate spares
  them until the next pass (``LOD_SPARE``, carried by refinements to the rows they make).

The pass runs on the root rank for the whole model (``Trainer.gather_state``), which then starts
every rank from the pruned model with its weights and masks (``Trainer.start_from``): the same
under any pipeline that supports the switches (``Trainer.culls_views``) and any rank count.  Its
time is logged (``importance_pass`` records of OUT/log.jsonl) and summed (``seconds``).  Its
kernels (the contributions kernel on a GPU, and there the array operations only it uses) compile at
the start of a run that has a pass to come (``Workload.warm``: a pass on a few rows, timed apart), not
inside the first pass.

**Auto** (``--view-masks auto``, ``--lod-views auto``): each pass also measures each view's visible
share (the fraction of the Gaussians that its projection draws), and until the next pass the masks
and the gate apply only to the views under ``--cull-share-below``: where a view sees a small part of
the scene (a street view of a city) they hide much of what it would draw; where it sees most of it
they hide little, while their pass over every row stays (issue 62: every switch did not pay on a 360°
capture).  Before the first pass no view culls.
"""
import dataclasses
import math
import time

import numpy as np

import numbasplat as ns
from numbasplat import backend as _backend

from .strategy import IMPORTANCE_WEIGHT, LOD_SPARE, STATISTICS, VIEW_SKIP


def scoring_steps(iterations, every, waits=()):
    """The steps after which the importance pass runs: every multiple of ``every`` below
    ``iterations``, and once more at 90% of the run (rounded down) unless one of them falls in
    its last 15%, so that the final stretch trains on fresh masks.  A pass due within one of the
    windows ``waits`` ((first, end) steps: after an opacity reset, ``opacity_resets``) waits until
    its end: right after a reset every Gaussian is nearly transparent, and the pass would prune
    and mask them all.  Passes moved past the end are dropped.  ``every`` 0: none."""
    if every <= 0 or iterations <= 1:
        return []

    def waited(s):
        for first, end in waits:
            if first <= s < end:
                s = end
        return s
    steps = [s for s in map(waited, range(every, iterations, every)) if s < iterations]
    final = waited((9 * iterations) // 10)
    if 0 < final < iterations and not any((85 * iterations) // 100 <= s for s in steps):
        steps.append(final)
    return sorted(set(steps))


VIEW_MASKS = ("on", "off", "auto")  # --view-masks: auto masks the views that see a small part (``Workload.cuts_view``)
LOD_VIEWS = ("all", "auto")         # --lod-views: the views the LOD gate applies to
WARM_ROWS, WARM_VIEWS = 64, 9  # ``Workload.warm``'s pass: every kernel compiles, little to compute (over 8
                                # views: the masks' bytes lie strided, as in a run's pass)
DRAWN_SAMPLE_EVERY = 4  # the log's Gaussians drawn per view: counted on the views 0, 4, 8... (a count is 2 launches)
RECOVERY_SHARE = 6  # a pass waits a sixth of the reset period after a reset (500 of 3DGS's 3000 steps)


def opacity_resets(strategy, iterations):
    """The windows (reset, reset + reset_every // RECOVERY_SHARE) after the opacity resets of
    ``strategy`` (the default strategy's rule) up to ``iterations``: the opacities relearn in them."""
    resets = strategy.reset_steps(iterations) if hasattr(strategy, "reset_steps") else []  # (MCMC: none)
    return [(r, r + strategy.reset_every // RECOVERY_SHARE) for r in resets]


def view_bit(packed, view, xp):
    """(N,) bool: bit ``view`` of each row of ``packed`` (N, bytes) uint8, in np.packbits' order."""
    return ((packed[:, view // 8] >> np.uint8(7 - view % 8)) & np.uint8(1)).astype(bool)


def set_view_bit(packed, view, rows_set, xp):
    """Set bit ``view`` of the rows where ``rows_set`` (N,) is true (np.packbits' order)."""
    packed[:, view // 8] |= rows_set.astype(np.uint8) << np.uint8(7 - view % 8)


def importance_scores(g, cameras, sh_degree, antialias, mask_below, backend=None, clock=None, lod=None, drawn=None):
    """-> (importance (N,) float64: each Gaussian's sum of ``T alpha`` over the pixels of every
    view, skip (N, ceil(V / 8)) uint8: bit v set where its sum in view v is under ``mask_below``),
    on the backend's arrays: every view projected, binned and composited by the contributions
    kernel on unit colours (forward only).  ``clock``: a ``trainer.PhaseClock`` that times the
    stages, summed over the views (scripts/pass_profile.py).  ``lod``: a ``LodReach`` to tell what
    the LOD gate keeps from training (the renders here never skip).  ``drawn``: a (V,) int64 array
    of the backend's kind that gets each view's count of the Gaussians its projection draws (on a
    tile or more: in the view), written on the device (no sync): the views' visible shares that
    ``--view-masks auto`` and ``--lod-views auto`` choose by."""
    xp = _backend.array_module(backend)
    n = len(g)
    total = xp.zeros(n, np.float64)
    skip = xp.zeros((n, (len(cameras) + 7) // 8), np.uint8)
    mark = clock.end if clock is not None else (lambda stage: None)
    for v, cam in enumerate(cameras):
        p = ns.project(g, cam, sh_degree=sh_degree, antialias=antialias, backend=backend, check=False)
        if drawn is not None:
            drawn[v:v + 1] = xp.count_nonzero(p.counts)
        gated = lod.gated(p, g, backend) if lod is not None else None
        mark("project")
        b = ns.bin_tiles(p, backend=backend)
        mark("bin")
        _, weight = ns.contributions(p, b, backend=backend, colour=False)
        mark("contributions")
        total += weight
        set_view_bit(skip, v, weight < mask_below, xp)
        if gated is not None:
            lod.add(weight, gated)
        mark("masks")
    return total, skip


class LodReach:
    """What the LOD gate (``--lod-min-px``) keeps from training, told by the importance pass: a
    gated Gaussian gets no gradient in that view, yet it still renders there at evaluation (with
    the rasterizer's 0.3-pixel blur a sub-pixel Gaussian draws a dot at its full opacity).  Over the
    pass's views: the share of the rendered weight (``T alpha``) that the gate hid, and the
    Gaussians it hid from every view that draws them (they no longer train at all)."""

    def __init__(self, n, min_px, xp):
        self.min_px = min_px
        self.drawn = xp.zeros(n, bool)    # drawn in some view
        self.trained = xp.zeros(n, bool)  # drawn, and not gated, in some view
        self.hidden_weight = xp.zeros((), np.float64)
        self.weight = xp.zeros((), np.float64)

    def gated(self, p, g, backend):
        """(N,) bool: the Gaussians that projection ``p`` draws and the gate hides from it."""
        drawn = p.counts > 0
        q = dataclasses.replace(p, radii=p.radii.copy(), counts=p.counts.copy())
        ns.cull(q, g, None, 0, self.min_px, backend)
        self.drawn |= drawn
        self.trained |= q.counts > 0
        return drawn & (q.counts == 0)

    def add(self, weight, gated):
        """A view's ``T alpha`` sums, and what of them the gate hid."""
        self.weight += weight.sum()
        self.hidden_weight += (weight * gated).sum()  # (no boolean index: that would sync)

    def untrained(self):
        """(N,) bool: the Gaussians drawn in some view and hidden from each."""
        return self.drawn & ~self.trained

    def report(self, kept=None):
        """{"lod_hidden_weight": the share of the views' rendered weight that the gate hid from
        training, "lod_untrained": the ``untrained`` Gaussians (of the rows ``kept``, where given)}."""
        untrained = self.untrained() if kept is None else self.untrained()[kept]
        weight = float(self.weight)
        return {"lod_hidden_weight": float(self.hidden_weight) / weight if weight > 0 else 0.0,
                "lod_untrained": int(untrained.sum())}


def densify_weights(importance, xp):
    """``min(1, I / median(I > 0))``: 1 for the Gaussians contributing at least as much as the
    median contributing one, in proportion below it, 0 where none (all 1 if none contributes)."""
    positive = importance[importance > 0]
    if len(positive) == 0:
        return xp.ones(len(importance), np.float32)
    median = float(xp.median(positive))
    return xp.minimum(importance / median, 1.0).astype(np.float32)


class Workload:
    """The switches of one run (a ``TrainConfig``'s) and what they keep between passes: the
    pass's schedule and total time, and the active Gaussians per view since the last log."""

    def __init__(self, cfg, n_views):
        self.every, self.prune, self.masks = cfg.importance_every, cfg.importance_prune, cfg.view_masks != "off"
        self.mask_below, self.lod_px, self.n_views = cfg.view_mask_below, cfg.lod_min_px, n_views
        self.cfg = cfg  # (its iterations as they are when asked: a resume may change them)
        if cfg.view_masks not in VIEW_MASKS:
            raise ValueError(f"--view-masks must be on, off or auto, got {cfg.view_masks!r}")
        if cfg.lod_views not in LOD_VIEWS:
            raise ValueError(f"--lod-views must be all or auto, got {cfg.lod_views!r}")
        if self.masks and not self.every:
            raise ValueError(f"--view-masks {cfg.view_masks} needs the importance pass that makes the masks: "
                             "give --importance-every N")
        if cfg.lod_views == "auto" and not (self.every and self.lod_px > 0):
            raise ValueError("--lod-views auto needs the LOD gate (--lod-min-px R) and the importance pass that "
                             "measures the views' visible shares (--importance-every N)")
        # auto: the views where masks / the gate apply, from the last pass's visible shares
        self.auto_masks, self.auto_lod = cfg.view_masks == "auto", cfg.lod_views == "auto"
        self.share_below = cfg.cull_share_below
        self.visible_share = None  # (V,) float64, host: each view's share of the Gaussians in it at the last pass
        self.warmup_seconds = 0.0  # ``warm``'s, at the start of a run
        self._warmed = False
        if self.every and cfg.strategy != "default":
            raise ValueError("--importance-every needs --strategy default (its weights and masks follow the "
                             "default strategy's refinements)")
        if self.prune and not self.every:
            raise ValueError("--importance-prune needs --importance-every N (the pass that prunes)")
        self.seconds = 0.0     # the passes' time, all together
        self.passes = 0
        self._drawn, self._views = None, 0  # Gaussians drawn (a tile or more), views counted, since the last log
        self._schedule = (None, [])  # ((the run length, the strategy), its scoring steps)

    @property
    def on(self):
        """Whether any switch is on."""
        return bool(self.every or self.lod_px > 0)

    @property
    def culls(self):
        """Whether views may skip Gaussians (view masks or the LOD gate)."""
        return self.masks or self.lod_px > 0

    def cuts_view(self, view):
        """Whether ``view``'s share of the Gaussians in it was under ``cull_share_below`` at the
        last pass (``auto``'s choice: where a view sees a small part of the scene, the masks and the
        gate hide much of what it would draw; where it sees most, they cost a pass over every row
        for little).  False before any pass."""
        return self.visible_share is not None and bool(self.visible_share[view] < self.share_below)

    def cuts(self, view):
        """(whether ``view`` applies its mask, its LOD gate's ``min_px``: 0 for none) now."""
        auto = self.cuts_view(view) if self.auto_masks or self.auto_lod else False
        masks = self.masks and (auto or not self.auto_masks)
        lod = self.lod_px if self.lod_px > 0 and (auto or not self.auto_lod) else 0.0
        return masks, lod

    def scores_after(self, prev, step, strategy=None):
        """Whether a pass is due after a step that went from ``prev`` to ``step`` (a batch crosses
        several images at once), where ``strategy`` resets the opacities."""
        return any(prev < s <= step for s in self.steps(strategy))

    def steps(self, strategy=None):
        """The run's scoring steps (``scoring_steps``) where ``strategy`` resets the opacities."""
        if not self.every:
            return []
        iterations = self.cfg.iterations
        if self._schedule[0] != (iterations, strategy):  # once a run: a resume or a pruning may change them
            self._schedule = ((iterations, strategy),
                              scoring_steps(iterations, self.every, opacity_resets(strategy, iterations)))
        return self._schedule[1]

    # ------------------------------------------------------------------ the view level
    def viewed(self, view, backend):
        """The host's count of a training step of ``view`` (before its device work, which a step graph
        may replay): the views of ``drawn_per_view``'s sample, every ``DRAWN_SAMPLE_EVERY``-th view."""
        if not self.on:
            return
        if self._drawn is None:  # a device total that the steps add to in place (so a graph's replays add too)
            self._drawn = _backend.array_module(backend).zeros((), np.int64)
        if view % DRAWN_SAMPLE_EVERY == 0:
            self._views += 1

    def cull(self, p, g, state, view, backend):
        """Hide from ``p``, the projection for training view ``view`` of the Gaussians ``g`` (a model
        or a shard, ``state`` its strategy state), those that its mask or the LOD gate skips where the
        view applies them (``cuts``; ``ns.cull``: in place, no sync), and add what it draws to
        ``drawn_per_view``'s total where the view is in the sample (``viewed``).  -> ``p``."""
        if not self.on:
            return p
        masks, lod_px = self.cuts(view) if self.culls else (False, 0.0)
        if masks or lod_px > 0:
            def scored(key, wanted):  # a pass's rows for these Gaussians (None: off, or no pass scored them yet)
                rows = state.get(key) if wanted else None
                return rows if rows is not None and len(rows) == len(g) else None
            ns.cull(p, g, scored(VIEW_SKIP, masks), view, lod_px, backend, scored(LOD_SPARE, lod_px > 0))
        if self._drawn is not None and view % DRAWN_SAMPLE_EVERY == 0:  # two launches, on the device alone
            xp = _backend.array_module_of(p.counts)
            xp.add(self._drawn, xp.count_nonzero(p.counts), out=self._drawn)
        return p

    def log_fields(self):
        """{"drawn_per_view": the mean Gaussians drawn (on a tile or more) per view since the last
        call, over the steps of every ``DRAWN_SAMPLE_EVERY``-th view} with a switch on (none where no
        view was counted), then start counting again (a sync)."""
        if not self.on or self._drawn is None:
            return {}
        drawn, views = float(self._drawn), self._views
        self._drawn.fill(0)
        self._views = 0
        return {"drawn_per_view": drawn / views} if views else {}

    # ------------------------------------------------------------------ the model level
    def score(self, trainer):
        """The importance pass on ``trainer``'s whole model (collective): prune, weigh, mask, and
        start every rank from the result.  -> the events to log."""
        t0 = time.perf_counter()
        gathered = trainer.whole_state()
        result = None
        if gathered is not None:
            result = self._score_whole(trainer, *gathered)
        model_state, strategy_state, report, visible_share = trainer.from_root(result)
        self.visible_share = visible_share
        trainer.start_from(model_state, strategy_state)
        trainer.barrier()
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        self.passes += 1
        return {"importance_pass": {**report, "seconds": seconds}, "gaussians": report["gaussians"]}

    def _score_whole(self, trainer, model_state, strategy_state, views=None):
        """The pass on the root: the whole states in (``Trainer.whole_state``: host arrays, or a
        single process's device arrays), the kept rows of them out, the pass's report and the
        views' visible shares; over the first ``views`` training views (None: all)."""
        xp, backend = trainer.xp, trainer.backend
        params = model_state["params"]
        g = ns.Gaussians(**{k: xp.asarray(a) for k, a in params.items()})  # (no copy where on the device)
        cameras = [v.camera for v in trainer.data.train[:views]]
        t0 = time.perf_counter()
        lod = LodReach(len(g), self.lod_px, xp) if self.lod_px > 0 else None
        drawn = xp.zeros(len(cameras), np.int64)
        importance, skip = importance_scores(g, cameras, trainer.sh_degree_now(), trainer.cfg.antialias,
                                             self.mask_below, backend, lod=lod, drawn=drawn)
        top = float(importance.max()) if len(importance) else 0.0  # (a sync: the renders are done)
        render_seconds = time.perf_counter() - t0
        visible_share = _backend.to_host(drawn) / max(len(g), 1)
        normalised = importance / top if top > 0 else importance
        keep = normalised >= self.prune if self.prune > 0 else xp.ones(len(g), bool)
        if not bool(keep.any()):  # never the whole model
            keep = xp.ones(len(g), bool)
        weights = densify_weights(importance, xp)
        on_host = _backend.array_module_of(params["means"]) is not xp  # gathered states: host results
        rows = _backend.to_host(xp.flatnonzero(keep)) if on_host else xp.flatnonzero(keep)

        def kept_rows(a):  # on the states' side
            return (_backend.to_host(a) if on_host else a)[rows]
        model_state = {**{w: {k: kept_rows(a) for k, a in model_state[w].items()} for w in ("params", "m", "v")},
                       "step": model_state["step"]}
        kept = {k: kept_rows(a) for k, a in strategy_state.items() if k in STATISTICS and len(a) == len(keep)}
        kept[IMPORTANCE_WEIGHT] = kept_rows(weights)
        kept[VIEW_SKIP] = kept_rows(skip)
        if lod is not None:  # the gate spares, until the next pass, what it would keep from every view
            kept[LOD_SPARE] = kept_rows(lod.untrained().astype(np.uint8))
        masked = (float(np.unpackbits(_backend.to_host(kept[VIEW_SKIP]), axis=1, count=len(cameras)).mean())
                  if len(rows) else 0.0)
        report = {"render_seconds": render_seconds,
                  "gaussians_before": len(keep), "gaussians": len(rows), "pruned": len(keep) - len(rows),
                  "masked_fraction": masked, "weight_below_one": float((kept[IMPORTANCE_WEIGHT] < 1).mean())
                  if len(rows) else 0.0, **(lod.report(keep) if lod is not None else {}),
                  "visible_share": float(np.median(visible_share)) if len(visible_share) else 0.0}
        if self.auto_masks or self.auto_lod:
            report["cut_views"] = int((visible_share < self.share_below).sum())
        return model_state, kept, report, visible_share

    def warm(self, trainer):
        """Run the pass once on the first ``WARM_ROWS`` rows of the model and its first ``WARM_VIEWS``
        views (the result dropped) where a pass is due in this run: the first pass then finds its
        kernels compiled (the contributions kernel and the array operations that only the pass uses),
        so its time is the pass's own and the compilation shows apart, in ``warmup_seconds``.
        Collective; once an object."""
        if self._warmed or not any(s > trainer.step for s in self.steps(trainer.strategy)):
            return
        self._warmed = True
        t0 = time.perf_counter()
        gathered = trainer.whole_state()
        if gathered is not None:
            model_state, strategy_state = gathered
            head = {w: {k: a[:WARM_ROWS] for k, a in model_state[w].items()} for w in ("params", "m", "v")}
            rows = len(model_state["params"]["means"])
            state = {k: a[:WARM_ROWS] for k, a in strategy_state.items() if a.ndim and len(a) == rows}
            self._score_whole(trainer, {**head, "step": model_state["step"]}, state, views=WARM_VIEWS)
        trainer.barrier()
        self.warmup_seconds = time.perf_counter() - t0

    def snapshot_arrays(self):
        """What a resumed run needs to cull as this one would: the last pass's visible shares (auto)."""
        return {} if self.visible_share is None else {"visible_share": np.asarray(self.visible_share, np.float64)}

    def restore(self, arrays):
        """Take back ``snapshot_arrays``'s (from a snapshot without them: none, as before any pass)."""
        self.visible_share = arrays.get("visible_share")


def imbalance(per_rank):
    """max / mean of the ranks' counts (1.0: even; nan where all are 0)."""
    counts = np.asarray(per_rank, np.float64)
    mean = counts.mean() if len(counts) else 0.0
    return float(counts.max() / mean) if mean > 0 else math.nan


__all__ = ["RECOVERY_SHARE", "LodReach", "Workload", "densify_weights", "imbalance", "importance_scores",
           "opacity_resets", "scoring_steps", "set_view_bit", "view_bit"]
