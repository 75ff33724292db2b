"""The pixel-level exchange pipeline over MPI (Splaxel): ranks own boxes of space, and trade pixels.

Space is cut into P axis-aligned boxes by a kd-tree balanced by Gaussian count
(``partition.SpatialPartition``); each rank owns the Gaussians whose centres lie in its box
(projection, rasterization, their backward, Adam, densification).  One step, one view, the same
on every rank (shared seed):

1. every rank renders its own Gaussians on a zero background: a partial image of premultiplied
   colour and transmittance per pixel;
2. the view's tiles are cut into P contiguous ranges, one per composing rank; each rank sends
   every composer the partial tiles it needs (its range and, for the global loss's two 11x11
   windows, the tiles within one tile row: ``gaussian_exchange.halo_ranges``);
3. each composer composes its tiles front to back in the boxes' order for this camera (the
   kd-tree's order from the camera centre, valid for every ray: ``compose``; the box at the back
   renders on the background, so one rank's partial image is the single render itself),
   computes its tiles' share of the loss and the gradients with respect to every rank's partial
   colour and transmittance (``compose_backward``), and sends them back;
4. every rank back-propagates through its partial render and projection, steps Adam and densifies
   its Gaussians; those whose centres left the box migrate to its owner, and after densification
   the tree is rebuilt when the largest rank holds over ``REBALANCE`` times the mean.

Two reductions cut the pixels sent: a rank sends only the tiles its Gaussians cover (spatial),
and on later visits of a view it neither renders nor sends the tiles that the boxes in front of
its own saturate (``Saturation``; ``saturation=False`` turns it off).

Where the boxes are separated in depth along every ray, composing in box order is the single
render's blend order, so P ranks train as one (tested); elsewhere Gaussians of two boxes
interleave along a ray and blend in box order instead.  Traffic grows with the pixels, not the
Gaussians in view.
"""

import numpy as np

import numbasplat as ns
from numbasplat import backend as _backend
from numbasplat.compose import compose, compose_backward
from numbasplat.loss import l1_ssim_loss
from numbasplat.math.geometry import T_MIN
from numbasplat.rendering import image_from_tiles, image_tiles

from .distributed import RankedTrainer, even_bounds
from .gaussian_exchange import halo_ranges
from .model import GaussianModel
from .camera_path import centres
from .partition import SpatialPartition
from .trainer import PhaseClock

REBALANCE = 1.1  # rebuild the tree after densification when the largest rank holds over this x the mean
SATURATION_EPOCHS = 4  # a view's saturation marks are made anew every this many epochs
# the light under which a box behind is skipped.  Not the rasterizer's cut-off T_MIN (1e-4), as
# Splaxel's: our rasterizer ends a pixel before its transmittance would drop under T_MIN, so a
# partial render never leaves less than T_MIN, and a pixel that ended leaves up to
# T_MIN / (1 - ALPHA_MAX) = 100 T_MIN.  What is skipped weighs under SATURATED of the pixel.
SATURATED = 10 * T_MIN


class Saturation:
    """Saturation reduction: the tiles of a view where the boxes in front of a rank's box leave
    less than ``SATURATED`` of the light on every pixel are marked for that rank; on
    later visits of the view it neither renders nor sends them.  Marks go stale as the Gaussians
    change: a view's marks are made from a full composition on its first visit and again every
    ``every`` epochs, which also counts the marks that were wrong (a marked tile no longer
    saturated)."""

    def __init__(self, ranks, every):
        self.ranks, self.every = ranks, every
        self.packed = {}  # view -> np.packbits of its (ranks, tiles) marks
        self.counts = {"saturation_marks_checked": 0, "saturation_marks_wrong": 0}

    def marks(self, view, epoch, n_tiles):
        """(ranks, tiles) bool marks to use for ``view`` in ``epoch``; None: compose it fully (and mark)."""
        if view not in self.packed or epoch % self.every == 0:
            return None
        return np.unpackbits(self.packed[view], count=self.ranks * n_tiles).reshape(self.ranks, n_tiles).astype(bool)

    @staticmethod
    def saturated(trans, order, lo, hi):
        """(ranks, hi - lo) bool: the composer's tiles lo..hi-1 that each rank's box may skip: the light
        reaching it (the product of the transmittances in front, ``trans`` in ``order``) stays under
        ``SATURATED`` on every pixel of the tile."""
        xp = _backend.array_module_of(trans)
        marks = np.zeros((len(order), hi - lo), bool)
        reach = xp.ones(trans.shape[1:], trans.dtype)
        for k, s in enumerate(order):
            if k:
                marks[s] = _backend.to_host(image_tiles(reach[..., None], lo, hi).max(axis=1) < SATURATED)
            reach = reach * trans[k]
        return marks

    def update(self, view, marks):
        """Keep ``view``'s new (ranks, tiles) marks, counting its old ones that were wrong."""
        old = self.packed.get(view)
        if old is not None:
            old = np.unpackbits(old, count=marks.size).reshape(marks.shape).astype(bool)
            self.counts["saturation_marks_checked"] += int(old.sum())
            self.counts["saturation_marks_wrong"] += int((old & ~marks).sum())
        self.packed[view] = np.packbits(marks)


class PixelExchangeTrainer(RankedTrainer):
    """``Trainer`` whose step is the pixel-level pipeline above; ``model`` is the Gaussians of this
    rank's box of ``partition``."""

    def __init__(self, dataset, out_dir, cfg, comm, backend=None, log=print, transport="auto", saturation=True,
                 revalidate_every=SATURATION_EPOCHS):
        """``saturation``: skip the tiles that a view's boxes in front saturate (see ``Saturation``);
        their marks are made anew every ``revalidate_every`` epochs."""
        if cfg.loss != "global":
            raise ValueError("--exchange pixel trains with --loss global for now")
        if cfg.strategy != "default":
            raise ValueError(f"--exchange pixel densifies with the default strategy, not {cfg.strategy!r}")
        super().__init__(dataset, out_dir, cfg, comm, backend, log, transport)
        self.batch = 1
        self.saturation = Saturation(self.size, revalidate_every) if saturation else None
        self.partition = None
        self.time_phases = None  # the phases synced at log steps (see _timing)
        self._view0 = None
        self.log(f"{self.size} ranks, pixel exchange, device buffers through: {self.exchange.transport.name}")

    def pipeline_fields(self):
        return {"exchange": "pixel", "saturation": self.saturation is not None}

    # ------------------------------------------------------------------ ownership
    def start_from(self, model_state, strategy_state=None):
        """Every rank holds the same whole state (the same seed, or the same snapshot, whatever P
        wrote it), builds the same tree over its means and keeps the Gaussians of its box."""
        means = model_state["params"]["means"]
        self.partition = SpatialPartition.build(means, self.size)
        mine = self.partition.owner(means) == self.rank
        rows = {w: {g: a[mine] for g, a in model_state[w].items()} for w in ("params", "m", "v") if w in model_state}
        self.model = GaussianModel.from_state({**model_state, **rows}, self.backend)
        counts = np.bincount(self.partition.owner(means), minlength=self.size)
        self.offset, self.total = int(counts[:self.rank].sum()), len(means)
        self.strategy_state = ({k: self.xp.asarray(a[mine]) for k, a in strategy_state.items()} if strategy_state
                               else self.strategy.initialize_state())

    def _migrate(self):
        """Send the Gaussians whose centres left this rank's box to its owner, with their Adam moments
        and strategy statistics: one all-to-all of rows.  -> how many moved over all ranks."""
        dest = self.partition.owner(self.model.host_arrays()["means"])
        moving = int(self.exchange.allreduce_sum(np.array([float((dest != self.rank).sum())]))[0])
        if moving == 0:
            return 0
        order = np.argsort(dest, kind="stable")  # kept rows stay in their order, arrivals follow by source
        counts = np.bincount(dest, minlength=self.size).astype(np.int64)
        state = self.model.state()
        moved = {"step": state["step"]}
        for w in ("params", "m", "v"):
            moved[w] = {g: self._rows_to_owners(a, order, counts) for g, a in state[w].items()}
        strategy = {k: self._rows_to_owners(_backend.to_host(a), order, counts)
                    for k, a in self.strategy_state.items() if len(a) == len(dest)}
        self.model = GaussianModel.from_state(moved, self.backend)
        self.strategy_state = {k: self.xp.asarray(a) for k, a in strategy.items()}
        self._count()
        return moving

    def _count(self):
        """``total`` and this rank's ``offset`` (the Gaussians of lower ranks): the strategy draws its
        random numbers for all ``total`` rows on every rank and takes its own, so the ranks' shared
        RNG (the views' order) stays the same on all.  Collective."""
        counts = np.array(self.comm.allgather(len(self.model)))
        self.offset, self.total = int(counts[:self.rank].sum()), int(counts.sum())
        return counts

    def _rows_to_owners(self, a, order, counts):
        width = int(np.prod(a.shape[1:]))  # (a rank may hold no rows: no -1 in the shape)
        got, _ = self.exchange.alltoallv(np.ascontiguousarray(a[order].reshape(len(a), width)), counts)
        return got.reshape((-1,) + a.shape[1:])

    def _rebalance(self):
        """After densification: migrate what left its box, and rebuild the tree (every rank the same
        one, from every rank's means) when the largest rank holds over ``REBALANCE`` x the mean.
        -> {"migrated": Gaussians moved, "rebuilt": whether the tree was} for the log."""
        moved = self._migrate()
        counts = self._count()
        rebuilt = bool(counts.max() > REBALANCE * max(counts.mean(), 1))
        if rebuilt:
            means = np.concatenate(self.comm.allgather(self.model.host_arrays()["means"]))
            self.partition = SpatialPartition.build(means, self.size)
            moved += self._migrate()
            if self.saturation is not None:  # marks are per box: new boxes, new marks
                self.saturation.packed.clear()
        return {"migrated": moved, "rebuilt": rebuilt}

    # ------------------------------------------------------------------ one step
    def train_step(self):
        c, xp, model = self.cfg, self.xp, self.model
        clock = PhaseClock(self.backend, self._timing())
        i = self.next_view()
        cam = self.data.train[i].camera
        target = self.targets[i]
        bg = self.step_background()
        g = model.gaussians
        H, W = cam.height, cam.width
        tx, ty = cam.tiles
        n_tiles = tx * ty
        # 1. my partial image: premultiplied colour and transmittance; the box at the back renders on
        # the background (and composition adds none), so one rank's partial image is the render itself
        order = self.partition.front_to_back(centres([cam])[0])
        none = np.zeros(3, np.float32)
        p = ns.project(g, cam, sh_degree=self.sh_degree_now(), antialias=c.antialias, backend=self.backend,
                       check=False)
        clock.end("project")
        binning = ns.bin_tiles(p, backend=self.backend)
        marks = self.saturation.marks(i, self.step // len(self.data.train), n_tiles) if self.saturation else None
        if marks is not None and marks[self.rank].any():  # the tiles the boxes in front saturate: not rendered
            binning.ranges[xp.asarray(marks[self.rank])] = 0
        r = ns.rasterize(p, binning, bg if order[-1] == self.rank else none, self.backend)
        partial = xp.concatenate([r.image, r.trans[..., None]], axis=2)
        clock.end("render")
        # 2. every composer gets the partial tiles of its range and their halo from every rank, only
        # those that rank's Gaussians cover (elsewhere its partial is nothing: colour 0, or the
        # background at the back, and transmittance 1): the tiles its binning holds, known to all
        covered = self.comm.allgather(_backend.to_host((binning.ranges[:, 1] - binning.ranges[:, 0]) > 0))
        bounds = even_bounds(n_tiles, self.size)
        lo, hi = int(bounds[self.rank]), int(bounds[self.rank + 1])
        _, _, need_lo, need_hi = halo_ranges(bounds, tx, n_tiles)

        def tiles(source, first, last):  # the tiles of first..last-1 that ``source`` sends
            return first + np.flatnonzero(covered[source][first:last])
        mine = [tiles(self.rank, int(a), int(b)) for a, b in zip(need_lo, need_hi)]
        theirs = [tiles(s, int(need_lo[self.rank]), int(need_hi[self.rank])) for s in range(self.size)]
        send = xp.concatenate([image_tiles(partial, ids) for ids in mine])
        recv, _ = self.exchange.alltoallv(send, np.array([len(t) for t in mine]), np.array([len(t) for t in theirs]))
        clock.end("forward_exchange")
        # 3. compose my tiles in the boxes' order for this camera, my share of the loss, its gradients
        starts = np.concatenate([[0], np.cumsum([len(t) for t in theirs])])
        nothing = np.array([0, 0, 0, 1], np.float32)
        layers = [image_from_tiles(recv[starts[s]:starts[s + 1]], theirs[s], H, W,
                                   fill=np.append(bg, 1).astype(np.float32) if s == order[-1] else nothing)
                  for s in order]
        colours = xp.stack([a[..., :3] for a in layers])
        trans = xp.stack([a[..., 3] for a in layers])
        image, _ = compose(colours, trans, none)
        if self.saturation is not None and marks is None:  # a full composition: mark the saturated tiles anew
            mine = self.saturation.saturated(trans, order, lo, hi)
            self.saturation.update(i, np.concatenate(self.comm.allgather(mine), axis=1))
        loss, d_image = l1_ssim_loss(image, target, c.lambda_dssim, backend=self.backend, tiles=(lo, hi), lazy=True)
        d_colours, d_trans = compose_backward(colours, trans, none, d_image)
        self._view0 = (image, target, lo, hi)
        clock.end("loss")
        # ... and send each rank the gradients of its partial image on my tiles that it covers
        back = [None] * self.size
        for k, s in enumerate(order):
            back[s] = image_tiles(xp.concatenate([d_colours[k], d_trans[k][..., None]], axis=2), tiles(s, lo, hi))
        returned = [tiles(self.rank, int(bounds[d]), int(bounds[d + 1])) for d in range(self.size)]
        back = xp.concatenate(back)
        got, _ = self.exchange.alltoallv(back, np.array([len(tiles(s, lo, hi)) for s in range(self.size)]),
                                         np.array([len(t) for t in returned]))
        d_partial = image_from_tiles(got, np.concatenate(returned), H, W)  # 0 where I cover nothing
        clock.end("backward_exchange")
        # 4. my Gaussians: raster and projection backward, statistics, Adam, densification, ownership
        grad = ns.rasterize_backward(p, binning, r, xp.ascontiguousarray(d_partial[..., :3]),
                                     d_alpha=-xp.ascontiguousarray(d_partial[..., 3]), backend=self.backend)
        clock.end("backward")
        ns.project_backward(g, p, grad, model.grad_gaussians, accumulate=False, backend=self.backend)
        self.add_strategy_gradients()
        self.strategy.after_backward(model, self.strategy_state, self.step, p, grad)
        clock.end("owner")
        lr, cols = self.learning_rates()
        model.adam.step(model.grads.data, cols)
        self.step += 1
        events = self.strategy.after_optimizer(model, self.strategy_state, self.step,
                                               self.context(lr_means=lr["means"], offset=self.offset, total=self.total))
        self._last_view = i
        if "cloned" in events:
            events.update(self._rebalance(), gaussians=self.total)
        else:
            self._migrate()
        clock.end("optimizer")
        loss = float(self.exchange.allreduce_sum(np.array([float(loss)]))[0])
        clock.end("reduce")
        full = int((need_hi - need_lo).sum())  # the tiles I would send every composer without the reduction
        self.stats = {"pixel_bytes": int(send.nbytes + back.nbytes), "tiles_sent": int(len(send)),
                      "tiles_full": full, "tiles_saturated": int(marks[self.rank].sum()) if marks is not None else 0,
                      **(self.saturation.counts if self.saturation else {}), **clock.stats()}
        return loss, events

    def log_extra(self):
        """The whole model's count; and a check that every rank trained the same view (they share the
        RNG that orders the views: a rank that drew more would compose other cameras' pixels)."""
        views = self.comm.allgather(getattr(self, "_last_view", None))
        if len(set(views)) > 1:
            raise RuntimeError(f"the ranks trained different views at step {self.step}: {views}")
        return {**super().log_extra(), "gaussians_total": self.total}
