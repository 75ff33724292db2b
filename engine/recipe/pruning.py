"""ByteSplat's hardware-aware pruning: contribution pruning, then pruning to the fused kernel's budget.

After ordinary training (stage 1, up to the end of densification):

* **Stage 2, contribution pruning.**  Every pixel of every training view has a dominant Gaussian,
  the one of largest contribution T * alpha * |c| to its colour (``numbasplat.rendering.
  contributions``).  The union of the dominant Gaussians over the training views is kept, the
  rest removed; then the model is fine-tuned with densification and opacity resets off.
* **Stage 3, pruning to the hardware budget.**  The fused kernel holds a tile's Gaussians in
  shared memory: B = (M_budget - M_fixed) // M_g of them (``fused_budget``).  A tile t of a view
  with N_t Gaussians is over by E_t = max(0, N_t - B), a share P_t = E_t / N_t of its list.  A
  Gaussian's pressure P_i sums P_t over the tiles it meets in all training views; its
  importance I_i is its total contribution over the views over the largest; Q_i = P_i / (I_i +
  eps).  A round removes the ``beta`` percent of the candidates (P_i > 0) of highest Q_i and
  fine-tunes; rounds go on until every tile of every view fits, or ``max_rounds``.

The statistics are computed on the trainer's backend, view by view, by the root rank for the
whole model: one ranking, whatever the number of ranks; the shards are cut anew after each removal.
"""
import json
from dataclasses import asdict, dataclass, replace

import numpy as np

import numbasplat as ns
from numbasplat import backend as _backend
from numbasplat.tile_loss import fused_layout


@dataclass
class PruneConfig:
    """The pruning's settings, made from a ``TrainConfig`` (``of``), whose fields give the defaults."""
    stage: str                         # "contribution" (stage 2 only) or "hardware" (stages 2 and 3)
    fine_tune: int                     # I_M: images of fine-tuning after contribution pruning
    round_fine_tune: int               # I_o: images of fine-tuning after each hardware round
    beta: float                        # percent of the candidates (P_i > 0) a hardware round removes
    max_rounds: int                    # hardware rounds at most
    smem_budget: int | None            # M_budget in bytes (None: the GPU's; on the CPU the H200's)
    eps: float = 1e-6                  # Q_i = P_i / (I_i + eps)

    @classmethod
    def of(cls, cfg, **changes):
        """The pruning settings of a ``TrainConfig``, with ``changes`` (those not None) applied."""
        made = cls(stage=cfg.prune, fine_tune=cfg.prune_fine_tune, round_fine_tune=cfg.prune_round_fine_tune,
                   beta=cfg.prune_beta, max_rounds=cfg.prune_rounds, smem_budget=cfg.smem_budget or None)
        return replace(made, **{k: v for k, v in changes.items() if v is not None})


def train_then_prune(trainer, progress=True, log=print):
    """``trainer.train`` with the pruning its config asks for (``cfg.prune``): stage 1 to
    ``densify_until``, stages 2 (and 3) with their fine-tuning, then on to ``cfg.iterations``
    with densification off.  The fine-tuning counts in the iterations: where fewer are left than
    I_M and the rounds' I_o ask, they are shortened to fit (I_M first).  -> the pruning's report,
    or None where this run did not prune (no pruning asked for, or a resume from past it: a run
    stopped during the pruning's fine-tuning goes on without its remaining rounds)."""
    c = trainer.cfg
    if c.prune == "none":
        trainer.train(progress=progress)
        return None
    total, at = c.iterations, min(c.densify_until, c.iterations)
    report = None
    if trainer.step <= at:
        trainer.train(progress=progress, until=at)
        left = total - trainer.step
        fine_tune = min(c.prune_fine_tune, left)
        rounds = c.prune_rounds if c.prune == "hardware" else 0
        round_fine_tune = min(c.prune_round_fine_tune, (left - fine_tune) // rounds) if rounds else 0
        say = log if trainer.is_root else (lambda *a: None)
        if (fine_tune, round_fine_tune) != (c.prune_fine_tune, c.prune_round_fine_tune if rounds else 0):
            say(f"pruning at step {trainer.step} with {left} of --iters {total} left: fine-tuning {fine_tune} "
                f"images after contribution pruning (I_M {c.prune_fine_tune}) and {round_fine_tune} after each "
                f"round (I_o {c.prune_round_fine_tune}); an earlier --densify-until leaves more")
        report = prune_model(trainer, PruneConfig.of(c, fine_tune=fine_tune, round_fine_tune=round_fine_tune),
                             log=say)
    c.iterations = max(total, trainer.step)
    trainer.train(progress=progress)
    return report


def tile_excess(counts, budget, xp=np):
    """P_t per tile: the share of its ``counts`` Gaussians over ``budget`` (0 for an empty tile)."""
    counts = counts.astype(np.float64)
    over = xp.maximum(counts - budget, 0.0)
    return xp.where(counts > 0, over / xp.maximum(counts, 1.0), 0.0)


def tile_of_intersections(ranges, xp=np):
    """The tile of each intersection of a binning whose per-tile ``ranges`` are contiguous from 0:
    those of ``ids[:len(result)]`` (the ids past them are padding, intersections that the tile
    counts foresaw and the exact ellipse test did not emit)."""
    counts = (ranges[:, 1] - ranges[:, 0]).astype(np.int64)
    return xp.repeat(xp.arange(len(counts)), counts)


def view_pressure(binning, counts, budget, n, xp=np):
    """(n,) each Gaussian's sum of P_t over the tiles it meets in one view's ``binning`` (``counts``:
    its tiles' Gaussians).  Only the intersections in the ranges count: the ids past them are
    padding (``tile_of_intersections``)."""
    tile_of = tile_of_intersections(binning.ranges, xp)
    excess = tile_excess(counts, budget, xp)
    return xp.bincount(binning.ids[:len(tile_of)], weights=excess[tile_of], minlength=n)[:n]


def removal_mask(pressure, importance, beta, eps=1e-6, xp=np):
    """The Gaussians one hardware round removes: of the candidates (pressure > 0), the ``beta``
    percent (at least one while any is left) of highest Q = pressure / (importance + eps); never
    a Gaussian without pressure."""
    candidates = xp.flatnonzero(pressure > 0)
    remove = xp.zeros(len(pressure), bool)
    if len(candidates) == 0:
        return remove
    k = max(1, int(np.floor(len(candidates) * beta / 100.0)))
    q = pressure[candidates] / (importance[candidates] + eps)
    order = xp.argsort(-q, kind="stable")  # ties: the lower row first, so the ranking is one
    remove[candidates[order[:k]]] = True
    return remove


@dataclass
class ViewStatistics:
    """What stages 2 and 3 read from the training views, for the model as it is."""
    dominant: object      # (N,) bool: the dominant Gaussian of some pixel of some view
    importance: object    # (N,) summed contribution over the views, divided by the largest (I_i)
    pressure: object      # (N,) sum of P_t over the tiles each meets in every view (P_i)
    tiles: int            # non-empty tiles over all views
    tiles_within: int     # of those, within the budget
    intersections: int    # tile-Gaussian intersections over all views
    intersections_within: int  # of those, on tiles within the budget

    def eligibility(self):
        """The fraction of tiles within the budget and of the intersections on such tiles."""
        return (self.tiles_within / max(self.tiles, 1), self.intersections_within / max(self.intersections, 1))


def view_statistics(gaussians, cameras, budget, sh_degree=None, antialias=False, backend=None):
    """``ViewStatistics`` of ``gaussians`` over the views of ``cameras``, with ``budget`` Gaussians a tile."""
    xp = _backend.array_module(backend)
    n = len(gaussians)
    dominant = xp.zeros(n, bool)
    total = xp.zeros(n, np.float64)
    pressure = xp.zeros(n, np.float64)
    tiles = within = isect = isect_within = 0
    for cam in cameras:
        p = ns.project(gaussians, cam, sh_degree=sh_degree, antialias=antialias, backend=backend)
        b = ns.bin_tiles(p, backend=backend)
        pixels_dominant, contribution = ns.rendering.contributions(p, b, backend=backend)
        hit = pixels_dominant[pixels_dominant >= 0]
        dominant[hit] = True
        total += contribution.astype(np.float64)
        counts = (b.ranges[:, 1] - b.ranges[:, 0]).astype(np.int64)
        pressure += view_pressure(b, counts, budget, n, xp)
        fits = (counts > 0) & (counts <= budget)
        tiles += int((counts > 0).sum())
        within += int(fits.sum())
        isect += int(counts.sum())
        isect_within += int(counts[fits].sum())
    top = float(total.max()) if n else 0.0
    importance = total / top if top > 0 else total
    return ViewStatistics(dominant, importance, pressure, tiles, within, isect, isect_within)


def fused_budget(smem_budget=None, backend=None):
    """(B, how it was derived): Gaussians per tile within the fused kernel's shared memory."""
    per_block, fixed, per_gaussian, source = fused_layout(smem_budget, backend)
    budget = max(0, (per_block - fixed) // per_gaussian)
    return budget, {"budget": budget, "smem_per_block": per_block, "smem_fixed": fixed,
                    "smem_per_gaussian": per_gaussian, "smem_source": source}


def _whole_statistics(trainer, cameras, budget):
    """``view_statistics`` of ``trainer``'s whole model from ``cameras`` against the fused ``budget``,
    computed on the root and given to every rank (host arrays): one ranking, whatever the ranks.
    Collective."""
    whole = trainer.whole_model()
    stats = None
    if whole is not None:
        g = whole.gaussians
        stats = view_statistics(g, cameras, budget, sh_degree=g.sh_degree(), antialias=trainer.cfg.antialias,
                                backend=trainer.backend)
        stats = ViewStatistics(**{k: _backend.to_host(v) if hasattr(v, "shape") else v
                                  for k, v in vars(stats).items()})
    return trainer.from_root(stats)


def _test_quality(trainer, when, log):
    """The test views' PSNR and SSIM of ``trainer``'s model, said as ``when``'s, on the root (None on the
    others, and without test views).  Collective."""
    summary = trainer.evaluate(lpips=False) if trainer.data.test else None
    if summary is None:
        return None
    log(f"{when}: test PSNR {summary['psnr']:.2f} dB, SSIM {summary['ssim']:.4f}")
    return {"psnr": summary["psnr"], "ssim": summary["ssim"]}


def prune_model(trainer, cfg: PruneConfig, log=print):
    """Stages 2 and (``cfg.stage == "hardware"``) 3 on ``trainer``'s model, fine-tuning it through
    ``trainer.train`` with densification and opacity resets off.  Returns the report: the budget
    and how it was derived, for each stage the Gaussians and the fusion eligibility before and
    after, the fine-tuning's time a step, and the test views' PSNR and SSIM before and after each
    stage (None without test views): a run of many rounds traces quality and speed against the
    share of Gaussians removed."""
    if cfg.stage not in ("contribution", "hardware"):
        raise ValueError(f"--prune must be contribution or hardware, got {cfg.stage!r}")
    budget, how = fused_budget(cfg.smem_budget, trainer.backend)
    log(f"fused budget B = {budget} Gaussians a tile: ({how['smem_per_block']} B of shared memory per block "
        f"({how['smem_source']}) - {how['smem_fixed']} B fixed) // {how['smem_per_gaussian']} B a Gaussian")
    cameras = [v.camera for v in trainer.data.train]
    report = {**how, "config": asdict(cfg), "stages": []}

    def statistics():
        return _whole_statistics(trainer, cameras, budget)

    def quality(when):
        return _test_quality(trainer, when, log)

    def stage(name, stats, remove, images):
        """Remove ``remove``'s rows, fine-tune ``images`` steps, and record the stage: -> the statistics after."""
        before, seconds = len(stats.dominant), trainer.train_seconds
        remove_rows(trainer, remove)
        trainer.fine_tune_from_here(images)
        step_ms = 1e3 * (trainer.train_seconds - seconds) / images if images else None
        after = statistics()
        entry = {"stage": name, "gaussians_before": before, "gaussians_after": len(after.dominant),
                 "tiles_within_before": stats.eligibility()[0], "intersections_within_before": stats.eligibility()[1],
                 "tiles_within_after": after.eligibility()[0], "intersections_within_after": after.eligibility()[1],
                 "step": trainer.step, "fine_tune_step_ms": step_ms, "test": quality(f"after {name}")}
        report["stages"].append(entry)
        if trainer.is_root:
            with open(trainer.out / "log.jsonl", "a") as f:  # beside the fine-tuning's records, at its step
                f.write(json.dumps(entry) + "\n")
        log(f"{name}: {before} -> {entry['gaussians_after']} Gaussians; tiles within the budget "
            f"{100 * entry['tiles_within_before']:.1f}% -> {100 * entry['tiles_within_after']:.1f}%, "
            f"intersections on them {100 * entry['intersections_within_before']:.1f}% -> "
            f"{100 * entry['intersections_within_after']:.1f}%"
            + (f"; fine-tuning {step_ms:.2f} ms a step" if step_ms is not None else ""))
        return after

    report["test_before"] = quality("before pruning")
    stats = statistics()
    after = stage("contribution", stats, ~stats.dominant, cfg.fine_tune)
    if cfg.stage == "hardware":
        for r in range(cfg.max_rounds):
            if after.tiles_within == after.tiles:
                break
            after = stage(f"hardware round {r + 1}", after,
                          removal_mask(after.pressure, after.importance, cfg.beta, cfg.eps, np), cfg.round_fine_tune)
    report["test_after"] = report["stages"][-1]["test"]
    return report


def remove_rows(trainer, remove):
    """Remove the whole model's rows where ``remove`` (host bool) is set, with their Adam moments,
    and start the pipeline again from what is left (under MPI the shards are cut anew, even).
    Collective."""
    gathered = trainer.gather_state()
    state = None
    if gathered is not None:
        model_state, _ = gathered  # the strategy's statistics start afresh (fine_tune_from_here)
        keep = ~np.asarray(remove)
        state = {**{w: {g: a[keep] for g, a in model_state[w].items()} for w in ("params", "m", "v")},
                 "step": model_state["step"]}
    trainer.start_from(trainer.from_root(state))
