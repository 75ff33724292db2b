"""The pixel-level exchange pipeline over MPI (Splaxel): ranks own boxes of space, and trade pixels.

Space is cut into P axis-aligned boxes by a kd-tree balanced by Gaussian count
(``partition.SpatialPartition``); each rank owns the Gaussians whose centres lie in its box
(projection, rasterization, their backward, Adam, densification).  A step of one view, the same
on every rank (shared seed), as every rank takes part in it:

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

A view's participants are the ranks whose Gaussians can show in it (their bounds' projection,
``partition.visible_region``, without rendering); only they render, compose and trade its
pixels.  With ``consolidation`` each epoch's views are bucketed so that the views of a bucket
have disjoint participants (``consolidate``), and a step trains a bucket: each rank takes part in
at most one of its views, a rank in none moves none of its Gaussians, and the step counts the
bucket's views.  Utilisation (active ranks / P) before and after goes to the log.

Views in flight (``batch_size`` B): a step trains B buckets.  Each rank renders all its views of
the step before the host waits for any, their pixels cross in one all-to-all each way, and Adam
steps once on the mean of their gradients, its betas raised to B and its learning rates scaled by
B ** ``batch_lr_exponent``, as the Gaussian-level batch of B views does (at P = 1 the same step,
tested).  The step's fixed costs (the host's plans and collectives, the launches' latency) are
paid once for B views, and the device renders the later views while the host reads the first's
covered tiles.

Steps in flight (``render_ahead`` K, a FIFO of steps): each step first queues the partial images
of the next K steps' views, then exchanges, composes and back-propagates the oldest, so that the
device renders ahead while the host plans the oldest step's messages and waits for its
collectives.  A step rendered ahead is rendered from the parameters before the K updates in front
of it, and its backward runs after them: its gradient is K steps stale (as in pipelined data
parallelism without weight stashing: no copy of the parameters is kept).  The pipeline empties
where the loop or the strategy acts after a step (a stop, a snapshot, a refinement or reset, an
importance pass) and every ``SETTLE_EVERY`` images, where the Gaussians that left their box
migrate (between those points rows stay where the renders in flight saw them): a run resumed
from a snapshot goes on as the whole run, and a snapshot written mid-flight (a stop signal)
drops the steps in flight and puts their views back.

Where the boxes are separated in depth along every ray, composing in box order is the single
render's blend order, so P ranks train as one (tested); elsewhere Gaussians of two boxes
interleave along a ray and blend in box order instead.  Traffic grows with the pixels, not the
Gaussians in view.

``OffloadedPixelExchangeTrainer`` (``--offload`` with ``--exchange pixel``) holds each rank's
Gaussians out of core (``engine.stores.offload``), the device the working set of its view of the step.
"""

from collections import deque
from dataclasses import replace
from typing import NamedTuple

import numpy as np

import numbasplat as ns
from numbasplat import T_MIN, TILE, TILE_PIXELS
from numbasplat import backend as _backend
from numbasplat.compose import compose, compose_backward
from numbasplat.device import HostCopy
from numbasplat.optim import GROUPS, FlatParams
from numbasplat.rendering import image_from_tiles, image_tiles

from engine.recipe.model import GaussianModel
from engine.recipe.trainer import PhaseClock, crossed
from engine.stores.offload import BLOCK_ROWS, out_of_core
from engine.tools.camera_path import centres
from .distributed import RankedTrainer, even_bounds
from .gaussian_exchange import halo_ranges
from .partition import GROW_PX, SpatialPartition, cluster_boxes, visible_regions

REBALANCE = 1.1  # rebuild the tree after densification when the largest rank holds over this x the mean
SETTLE_EVERY = 100  # the Gaussians that left their box migrate every this many images (steps in flight: the pipeline empties)
SATURATION_EPOCHS = 4  # a view's saturation marks are made anew every this many epochs
# the light under which a box behind is skipped.  Not the rasterizer's cut-off T_MIN (1e-4), as
# Splaxel's: our rasterizer ends a pixel before its transmittance would drop under T_MIN, so a
# partial render never leaves less than T_MIN, and a pixel that ended leaves up to
# T_MIN / (1 - ALPHA_MAX) = 100 T_MIN.  What is skipped weighs under SATURATED of the pixel.
SATURATED = 10 * T_MIN


class ViewPlan:
    """One view of a step: its camera, its participants front to back (``order``: the partition's
    order for the camera, the ranks outside the view left out) and its composers (the
    participants in rank order), each composing a contiguous range of the view's tiles."""

    def __init__(self, cam, participants, partition):
        self.cam = cam
        self.order = [r for r in partition.front_to_back(centres([cam])[0]) if r in participants]
        self.composers = sorted(participants)
        tx, ty = cam.tiles
        self.n_tiles = tx * ty
        self.bounds = even_bounds(self.n_tiles, len(self.composers))
        _, _, self.need_lo, self.need_hi = halo_ranges(self.bounds, tx, self.n_tiles)

    def range(self, j):
        """The tiles composer j composes (first, end)."""
        return int(self.bounds[j]), int(self.bounds[j + 1])

    def need(self, j):
        """The tiles composer j needs: its range and the SSIM windows' halo (first, end)."""
        return int(self.need_lo[j]), int(self.need_hi[j])

    def band(self, j):
        """The rows of pixels holding the tiles composer j needs, (y0, y1), and the first tile of
        that band: composer j works on this band alone (tile t of the view is tile t - first of
        the band, whose tile columns are the view's)."""
        tx = self.cam.tiles[0]
        top, bottom = int(self.need_lo[j]) // tx, -(-int(self.need_hi[j]) // tx)
        return top * TILE, min(bottom * TILE, self.cam.height), top * tx


class PartialRender(NamedTuple):
    """A rank's render of its box's Gaussians for one view of the step (``_render``)."""
    projection: object
    binning: object
    raster: object
    partial: object  # (H, W, 4): premultiplied colour and transmittance
    covered: object  # (tiles,) bool: the tiles its Gaussians cover (the only ones it sends), a ``HostCopy``
    marks: object  # the view's saturation marks used, (ranks, tiles) bool, or None


class StepInFlight(NamedTuple):
    """A step whose views are drawn and whose partial images are queued (``_start_step``), its pixels
    not yet exchanged."""
    views: list  # the training views of its buckets
    plans: list  # each view's ``ViewPlan``
    mine: list  # the views (positions in ``views``) that this rank takes part in
    model: object  # the model rendered (the shard; out of core: the working set; None: this rank renders none)
    state: dict  # the strategy's state of its rows
    renders: dict  # {position: my ``PartialRender``}
    background: object  # the step's background
    first: int  # the images trained before it
    drawn_from: tuple  # (the RNG's state, the epoch's order, its buckets, the utilisation) before its views were
    # drawn; None without steps rendered ahead
    marks_anew: bool  # whether any view of it is composed in full and marked anew (the same on every rank)

    @property
    def end(self):
        """The images trained after it."""
        return self.first + len(self.views)


class TileMessages:
    """The tiles one rank trades with every rank in one all-to-all, for all the step's views: per
    rank, blocks of (the view's position in the step, its tile ids), in the order added (the step's
    views in order, on both sides of a message).  A buffer holds each rank's blocks in rank order."""

    def __init__(self, ranks):
        self.blocks = [[] for _ in range(ranks)]

    def add(self, rank, k, ids):
        self.blocks[rank].append((k, ids))

    def counts(self):
        """Tiles to or from each rank."""
        return np.array([sum(len(ids) for _, ids in blocks) for blocks in self.blocks], np.int64)

    def gather(self, rows_of_block, xp, width=4 * TILE_PIXELS):
        """The buffer of ``rows_of_block(rank, k, ids)``'s rows for every block, in the message order."""
        parts = [rows_of_block(rank, k, ids) for rank, blocks in enumerate(self.blocks) for k, ids in blocks]
        return xp.concatenate(parts) if parts else xp.zeros((0, width), np.float32)

    def rows_of(self, k, rank=None):
        """Where view ``k``'s tiles lie in a buffer laid out as this (from ``rank``, or from every
        rank): (the buffer's row indices, their tile ids), both in the message order."""
        rows, ids, at = [], [], 0
        for r, blocks in enumerate(self.blocks):
            for kk, block in blocks:
                if kk == k and rank in (None, r):
                    rows.append(np.arange(at, at + len(block)))
                    ids.append(block)
                at += len(block)
        empty = np.zeros(0, np.int64)
        return np.concatenate(rows + [empty]), np.concatenate(ids + [empty]).astype(np.int64)


def rank_boxes(means, scales, rows=4096):
    """A rank's Gaussians covered by boxes (``partition.cluster_boxes``: a box each ``rows`` of them,
    grown by their reach) for ``participants``, from their ``means`` and log-``scales`` on any device."""
    return cluster_boxes(_backend.to_host(means), _backend.to_host(scales), rows)


def participants(boxes, cameras):
    """For each camera, the ranks whose Gaussians can show in it (frozenset): those with a box of
    ``boxes`` (each rank's ``rank_boxes``) that the camera sees (``visible_regions``); every rank where
    none does.  Boxes over a few thousand Gaussians each, not one over the rank's: a rank of a scene
    with a far background holds some of the sky, and one box over its Gaussians spans the sky."""
    ranks = len(boxes)
    owner = np.repeat(np.arange(ranks), [len(lo) for lo, _ in boxes])
    lo = np.concatenate([lo for lo, _ in boxes] + [np.zeros((0, 3), np.float32)])
    hi = np.concatenate([hi for _, hi in boxes] + [np.zeros((0, 3), np.float32)])
    out = []
    for cam in cameras:
        seen = visible_regions(lo, hi, cam, grow=GROW_PX)[1]
        out.append(frozenset(np.unique(owner[seen]).tolist()) or frozenset(range(ranks)))
    return out


def consolidate(participants):
    """Splaxel's conflict-free view consolidation: in order, each view joins the first bucket whose
    ranks are disjoint from its participants, else opens a new one.  -> the buckets, as lists of
    the views' positions."""
    buckets, used = [], []
    for k, ranks in enumerate(participants):
        for b, taken in enumerate(used):
            if not taken & ranks:
                buckets[b].append(k)
                used[b] = taken | ranks
                break
        else:
            buckets.append([k])
            used.append(set(ranks))
    return buckets


def utilisation(participants, buckets, ranks):
    """{"utilisation_before", "utilisation_after"}: the mean share of the ranks at work in a step,
    a view a step against the buckets' (U = active ranks / P)."""
    before = float(np.mean([len(s) for s in participants])) / ranks if participants else 0.0
    after = float(np.mean([len(set().union(*(participants[k] for k in b))) for b in buckets])) / ranks \
        if buckets else 0.0
    return {"utilisation_before": before, "utilisation_after": after}


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
        if self.composes_in_full(view, epoch):
            return None
        return np.unpackbits(self.packed[view], count=self.ranks * n_tiles).reshape(self.ranks, n_tiles).astype(bool)

    def composes_in_full(self, view, epoch):
        """Whether ``view`` is composed in full in ``epoch`` (and marked anew): the same on every rank,
        as every rank keeps the same marks."""
        return view not in self.packed or epoch % self.every == 0

    @staticmethod
    def saturated(trans, order, lo, hi, ranks):
        """(ranks, hi - lo) bool: the composer's tiles lo..hi-1 that each rank's box may skip: the light
        reaching it (the product of the transmittances in front, ``trans`` in ``order``) stays under
        ``SATURATED`` on every pixel of the tile.  The ranks behind the first are read in one copy to
        the host (one device wait, not one a rank)."""
        xp = _backend.array_module_of(trans)
        marks = np.zeros((ranks, hi - lo), bool)
        reach, behind = xp.ones(trans.shape[1:], trans.dtype), []
        for k in range(len(order)):
            if k:
                behind.append(image_tiles(reach[..., None], lo, hi).max(axis=1) < SATURATED)
            reach = reach * trans[k]
        if behind:
            marks[list(order[1:])] = _backend.to_host(xp.stack(behind))
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
                 revalidate_every=SATURATION_EPOCHS, consolidation=True, batch_size=None, render_ahead=0, store=None):
        """``saturation``: skip the tiles that a view's boxes in front saturate (see ``Saturation``);
        their marks are made anew every ``revalidate_every`` epochs.  ``consolidation``: train views
        whose participants are disjoint in the same step (``consolidate``); else one view a step.
        ``batch_size``: the views in flight, B buckets a step (default 1).  ``render_ahead``: the steps
        rendered before this one's pixels travel, their gradients as many steps stale (see
        ``train_step``).  ``store``: where the rank's Gaussians live (default: in memory; ``engine.stores.memory``)."""
        self.batch = batch_size or 1
        self.options = replace(self.options, exchange="pixel", batch_size=batch_size, render_ahead=render_ahead,
                               saturation="on" if saturation else "off",
                               consolidation="on" if consolidation else "off")
        super().__init__(dataset, out_dir, cfg, comm, backend, log, transport, store)
        self.saturation = Saturation(self.size, revalidate_every) if saturation else None
        self.consolidation = consolidation
        self._buckets, self.utilisation = [], {}
        self.render_ahead, self._in_flight = int(render_ahead), deque()  # (StepInFlight, oldest first)
        self.partition = None
        self.time_phases = None  # the phases synced at log steps (see _timing)
        ahead = f", {self.render_ahead} step(s) rendered ahead" if self.render_ahead else ""
        self.log(f"{self.size} ranks, pixel exchange, {self.batch} bucket(s) of views a step{ahead}, device buffers "
                 f"through: {self.exchange.transport.name}")

    def pipeline_fields(self):
        return {"exchange": "pixel", "saturation": self.saturation is not None, "consolidation": self.consolidation,
                "batch size": self.batch, "render ahead": self.render_ahead}

    # ------------------------------------------------------------------ ownership
    def start_from(self, model_state, strategy_state=None):
        """Every rank holds the same whole state (the same seed, or the same snapshot, whatever P
        wrote it), builds the same tree over its means and keeps the Gaussians of its box (steps in
        flight, which render the model replaced, are dropped)."""
        self._drop_in_flight()
        means = model_state["params"]["means"]
        self.partition = SpatialPartition.build(means, self.size)
        owner = self.partition.owner(means)
        mine = owner == self.rank
        rows = {w: {g: a[mine] for g, a in model_state[w].items()} for w in ("params", "m", "v") if w in model_state}
        model = GaussianModel.from_state({**model_state, **rows}, self.store.home, *self.adam_betas())
        counts = np.bincount(owner, minlength=self.size)
        self.offset, self.total = int(counts[:self.rank].sum()), len(means)
        self.store.hold(model, ({k: model.xp.asarray(a[mine]) for k, a in strategy_state.items()} if strategy_state
                                else self.strategy.initialize_state()))

    def _migrate(self, model, state):
        """Send the Gaussians whose centres left this rank's box to its owner, with their Adam moments
        and strategy statistics: one all-to-all of the leaving rows alone, packed side by side as bytes
        (every rank then holds the rows from lower ranks, its own kept rows, the rows from higher ranks:
        a stable sort by owner on every rank).  The kept rows are copied once, group by group, into the
        new shard's buffers.  ``model``, ``state``: the shard and its strategy state (where it lives between
        steps: the store's home).  -> (the new shard, its state, how many moved over all ranks)."""
        xp = model.xp
        dest = self.partition.owner(model.group("means"))  # on the device: only counts come back
        leaving = dest != self.rank
        moving = int(self.exchange.allreduce_sum(np.array([float(leaving.sum())]))[0])
        if moving == 0:
            return model, state, 0
        n = len(dest)
        rows = xp.flatnonzero(leaving)
        rows = rows[xp.argsort(dest[rows].astype(np.int64) * n + rows)]  # by owner, then row
        send_counts = _backend.to_host(xp.bincount(dest[rows], minlength=self.size)).astype(np.int64)
        columns = _migrating_columns(model, state, n)
        arrived, got = self.exchange.alltoallv(_row_bytes(columns, rows), send_counts)
        below = int(got[:self.rank].sum())
        incoming = _from_row_bytes(arrived, columns)
        keep = xp.flatnonzero(~leaving)
        kept = slice(below, below + len(keep))
        flat = {w: FlatParams(len(keep) + len(arrived), model.sh_bases, xp) for w in ("params", "m", "v")}
        strategy = {}
        for (w, g), a in columns.items():
            if w == "strategy":
                new = strategy[g] = xp.empty((flat["params"].n,) + a.shape[1:], a.dtype)
            else:
                new = flat[w].view(g)
            came = incoming[w, g]
            new[:below], new[kept], new[kept.stop:] = came[:below], xp.asarray(a)[keep], came[below:]
        model = GaussianModel.from_flat(flat["params"], flat["m"].data, flat["v"].data, model.adam.step_count,
                                        self.store.home, *self.adam_betas())
        self._count(len(model))
        return model, strategy, moving

    def _count(self, n):
        """``total`` and this rank's ``offset`` (the Gaussians of lower ranks): the strategy draws its
        random numbers for all ``total`` rows on every rank and takes its own, so the ranks' shared
        RNG (the views' order) stays the same on all (``n``: this rank's Gaussians).  Collective."""
        counts = np.array(self.comm.allgather(n))
        self.offset, self.total = int(counts[:self.rank].sum()), int(counts.sum())
        return counts

    def _rebalance(self, model, state):
        """After densification of the shard ``model`` (``state``: its strategy state): migrate what left
        its box, and rebuild the tree (every rank the same one, from every rank's means) when the largest
        rank holds over ``REBALANCE`` x the mean.  -> (the new shard, its state, {"migrated": Gaussians
        moved, "rebuilt": whether the tree was} for the log)."""
        model, state, moved = self._migrate(model, state)
        counts = self._count(len(model))
        rebuilt = bool(counts.max() > REBALANCE * max(counts.mean(), 1))
        if rebuilt:
            means = np.concatenate(self.comm.allgather(model.host_arrays()["means"]))
            self.partition = SpatialPartition.build(means, self.size)
            model, state, again = self._migrate(model, state)
            moved += again
            if self.saturation is not None:  # marks are per box: new boxes, new marks
                self.saturation.packed.clear()
        return model, state, {"migrated": moved, "rebuilt": rebuilt}

    # ------------------------------------------------------------------ which views a step trains
    def _boxes(self):
        """Every rank's ``rank_boxes`` (of its shard's means and scales, which an out-of-core store reads
        from its host table).  Collective: one allgather of a few boxes a rank."""
        return self.comm.allgather(rank_boxes(self.store.group("means"), self.store.group("scales")))

    def _participants(self, views):
        """For each view, the ranks whose Gaussians can show in it (``participants``).  The same on
        every rank."""
        return participants(self._boxes(), [self.data.train[v].camera for v in views])

    def _next_views(self):
        """The step's views and their participants: ``batch`` buckets (the views in flight), each the
        next bucket of the epoch with consolidation (``consolidate``: views whose participants are
        disjoint, trained side by side), else one view that every rank takes part in; a rank takes
        part in at most one view of a bucket.  ``order`` keeps the views of the epoch still to train,
        so a snapshot resumes the epoch."""
        views, parts = [], []
        for _ in range(self.batch):
            bucket = self._next_bucket()
            views += [v for v, _ in bucket]
            parts += [s for _, s in bucket]
        return views, parts

    def _next_bucket(self):
        """The next bucket of the epoch: [(view, its participants)]."""
        if not self.consolidation:
            return [(self.next_view(), frozenset(range(self.size)))]
        if not self._buckets:
            if not self.order:
                self.order = list(self.rng.permutation(len(self.data.train)))
            views = self.order[::-1]  # next_view's order: the list is popped from its end
            parts = self._participants(views)
            buckets = consolidate(parts)
            self._buckets = [[(views[k], parts[k]) for k in bucket] for bucket in buckets]
            self.utilisation = utilisation(parts, buckets, self.size)
        bucket = self._buckets.pop(0)
        taken = {v for v, _ in bucket}
        self.order = [v for v in self.order if v not in taken]
        return bucket

    # ------------------------------------------------------------------ one step
    def train_step(self):
        """The oldest step in flight: its pixels exchanged and composed, its Gaussians back-propagated
        and updated.  With ``render_ahead`` K the next K steps' views are rendered first (from the
        parameters as they are now, before this step's update), so that the device renders them while
        the host plans and waits for this step's exchanges; the pipeline empties (no step rendered
        ahead past it) where the loop or the strategy acts after a step (``_settles_after``)."""
        clock = PhaseClock(self.backend, self._timing())
        flight = self._in_flight
        if not flight:
            flight.append(self._start_step(self.step, clock))
        while len(flight) <= self.render_ahead and not self._settles_after(flight[-1]):
            flight.append(self._start_step(flight[-1].end, clock))
        clock.end("render")
        return self._finish_step(flight.popleft(), clock)

    def _start_step(self, first, clock):
        """Step 1 of the module's docstring: draw the views of the step that begins at image ``first``
        and queue my partial images of those I take part in (kept on the device until the step is
        trained).  -> its ``StepInFlight``."""
        drawn_from = None  # (only a step that may be dropped in flight keeps what its draws changed)
        if self.render_ahead:
            drawn_from = (self.rng.bit_generator.state, list(self.order), [list(b) for b in self._buckets],
                          dict(self.utilisation))
        views, parts = self._next_views()
        bg = self.step_background()
        none = np.zeros(3, np.float32)
        epoch, degree = first // len(self.data.train), self.sh_degree_now(first)
        plans = [ViewPlan(self.data.train[v].camera, parts[k], self.partition) for k, v in enumerate(views)]
        mine = [k for k, s in enumerate(parts) if self.rank in s]  # the views I take part in (and compose a range of)
        model, state = self.store.checkout([views[k] for k in mine], self.upcoming_views(len(mine)))
        renders = {k: self._render(model, plans[k], views[k], epoch, degree,
                                   bg if plans[k].order[-1] == self.rank else none, clock) for k in mine}
        marks_anew = self.saturation is not None and any(self.saturation.composes_in_full(v, epoch) for v in views)
        return StepInFlight(views, plans, mine, model, state, renders, bg, first, drawn_from, marks_anew)

    def _settles_after(self, step):
        """Whether no step may be rendered ahead past ``step`` (a ``StepInFlight``): where the training
        loop acts (``loop_acts_after``), where the strategy refines or resets the Gaussians, and every
        ``SETTLE_EVERY`` images, where the Gaussians that left their box migrate (rows that move would
        leave a render in flight pointing at others).  The same on every rank."""
        first, end = step.first, step.end
        return self._migration_due(first, end) or self.strategy.acts_at(end, self.context(prev_step=first))

    def _migration_due(self, prev, step):
        """Whether the step from image ``prev`` to ``step`` ends where the Gaussians that left their box
        migrate: every ``SETTLE_EVERY`` images and where the loop acts (a snapshot, an evaluation, the
        end).  Not every step: a migration is a collective and rebuilds the shard's buffers, and between
        migrations a Gaussian that left its box only blends in its old box's order."""
        return crossed(prev, step, SETTLE_EVERY) or self.loop_acts_after(prev, step)

    def save_snapshot(self, path=None):
        """The snapshot of the steps trained (``_drop_in_flight``: a stop signal may come mid-flight)."""
        self._drop_in_flight()
        super().save_snapshot(path)

    def _drop_in_flight(self):
        """Drop the steps rendered ahead and not trained, and put the RNG and the epoch's views back as
        they were before the oldest was drawn, so that they are drawn and rendered again."""
        if self._in_flight:
            state, self.order, self._buckets, self.utilisation = self._in_flight[0].drawn_from
            self.rng.bit_generator.state = state
            self._in_flight.clear()

    def _finish_step(self, flight, clock):
        """Steps 2-4 of the module's docstring for the step in flight ``flight``, a method per phase of
        ``trainer.PHASES``.  -> (loss, events)."""
        covered, sent, recv, recv_tiles = self._forward_exchange(flight)
        clock.end("forward_exchange")
        shares, back, returned, grads = self._compose_views(flight, covered, recv, recv_tiles)
        clock.end("loss")
        sent_back = back.gather(lambda s, k, ids: grads[s, k], self.xp)
        got, _ = self.exchange.alltoallv(sent_back, back.counts(), returned.counts())
        clock.end("backward_exchange")
        seen = self._owner(flight, returned, got, clock)
        events = self._optimizer(flight, seen, clock)
        clock.end("refine")
        loss = float(self.exchange.allreduce_sum(np.array([sum(map(float, shares))]))[0]) / len(flight.views)
        clock.end("reduce")
        self.stats = self._step_stats(flight, sent, sent_back, clock)
        return loss, events

    def _forward_exchange(self, flight):
        """Step 2: every composer of a view gets the partial tiles of its range and their halo from each
        of the view's participants, only those the participant covers (elsewhere its partial is
        nothing: colour 0, or the background at the back, and transmittance 1): one message a rank for
        all the step's views.  -> (every rank's covered tiles per view, the tiles sent, the tiles
        received and their ``TileMessages``)."""
        me, plans, renders = self.rank, flight.plans, flight.renders
        covered = _allgather_covered(self.comm, plans, {k: r.covered.get() for k, r in renders.items()})
        send, recv_tiles = TileMessages(self.size), TileMessages(self.size)
        for k in flight.mine:
            plan, j_me = plans[k], plans[k].composers.index(me)
            for j, d in enumerate(plan.composers):
                send.add(d, k, _covered_tiles(covered, me, k, *plan.need(j)))
                recv_tiles.add(d, k, _covered_tiles(covered, d, k, *plan.need(j_me)))
        sent = send.gather(lambda d, k, ids: image_tiles(renders[k].partial, ids), self.xp)
        recv, _ = self.exchange.alltoallv(sent, send.counts(), recv_tiles.counts())
        return covered, sent, recv, recv_tiles

    def _compose_views(self, flight, covered, recv, recv_tiles):
        """Step 3: compose my tiles of each of my views in its participants' order (``_compose``), my
        share of its loss, and the gradients of each participant's partial image on my tiles that it
        covers; the composers' new saturation marks put together.  -> (my loss shares, the gradients'
        ``TileMessages`` out and back, {(participant, view): its gradient tiles})."""
        me, none = self.rank, np.zeros(3, np.float32)
        shares, back, returned, new_marks, grads = [], TileMessages(self.size), TileMessages(self.size), [], {}
        self._view0 = None
        for k in flight.mine:
            plan, j_me = flight.plans[k], flight.plans[k].composers.index(me)
            (lo, hi), first = plan.range(j_me), plan.band(j_me)[2]
            share, d_layers, marks = self._compose(plan, k, flight.views[k], recv, recv_tiles, flight.background,
                                                   none, flight.renders[k].marks)
            shares.append(share)
            if marks is not None:
                new_marks.append((k, lo, hi, marks))
            for layer, s in enumerate(plan.order):
                ids = _covered_tiles(covered, s, k, lo, hi)
                back.add(s, k, ids)
                grads[s, k] = image_tiles(d_layers[layer], ids - first)
            for j, d in enumerate(plan.composers):
                returned.add(d, k, _covered_tiles(covered, me, k, *plan.range(j)))
        if flight.marks_anew:
            self._update_marks(flight.views, flight.plans,
                               [m for block in self.comm.allgather(new_marks) for m in block])
        return shares, back, returned, grads

    def _owner(self, flight, returned, got, clock):
        """Step 4's backward of my Gaussians: the raster backward of each of my views from the gradients
        of my partial images (``got``, laid out as ``returned``), then ``owner_backward``.  -> visible-only
        Adam's rows (None: this rank takes part in no view of the step, or ``visible_adam`` is off)."""
        if not flight.mine:
            return None
        grads = []
        for k in flight.mine:
            render, cam = flight.renders[k], flight.plans[k].cam
            rows, ids = returned.rows_of(k)
            d_partial = image_from_tiles(got[rows], ids, cam.height, cam.width)
            grads.append(ns.rasterize_backward(render.projection, render.binning, render.raster,
                                               self.xp.ascontiguousarray(d_partial[..., :3]),
                                               d_alpha=-self.xp.ascontiguousarray(d_partial[..., 3]),
                                               backend=self.backend))
        clock.end("backward")
        seen = self.owner_backward(flight.model, flight.state, [flight.renders[k].projection for k in flight.mine],
                                   grads)
        clock.end("owner")
        return seen

    def _optimizer(self, flight, seen, clock):
        """Step 4's update: Adam at the batch's learning rates (a rank in no view of the step moves none
        of its Gaussians; Adam counts the step; the phase "optimizer" of ``clock``), then ``_after_step``:
        densification, ownership.  -> the strategy's events."""
        model = flight.model
        lr, cols = self.learning_rates(batched=True)
        if flight.mine:
            model.adam.step(model.grads.data, cols, seen)
        elif model is not None:
            model.adam.step(model.grads.data, self.learning_rates()[1], self.xp.zeros(len(model), bool))
        prev = self.step
        self.step += len(flight.views)
        clock.end("optimizer")
        ctx = self.context(lr_means=lr["means"], prev_step=prev, offset=self.offset)
        events = self._after_step(model, flight.state, ctx, lr)
        self._last_view = tuple(flight.views)
        return events

    def _step_stats(self, flight, sent, sent_back, clock):
        """The step's ``stats``: its views, the pixels' bytes and tiles sent (of those the views' plans
        could send, and those saturation skipped), the saturation and utilisation counts, the phases'
        times and the store's."""
        plans, me = flight.plans, self.rank
        full = sum(b - a for k in flight.mine for a, b in map(plans[k].need, range(len(plans[k].composers))))
        saturated = sum(int(r.marks[me].sum()) for r in flight.renders.values() if r.marks is not None)
        return {"views": len(flight.views), "pixel_bytes": int(sent.nbytes + sent_back.nbytes),
                "tiles_sent": int(len(sent)), "tiles_full": full, "tiles_saturated": saturated,
                **(self.saturation.counts if self.saturation else {}), **self.utilisation, **clock.stats(),
                **self.store.step_stats()}

    def _render(self, model, plan, view, epoch, sh_degree, background, clock):
        """My partial image of ``view`` (``plan``) at ``sh_degree``: premultiplied colour and
        transmittance on ``background`` (the participant at the back renders on the view's background,
        and composition adds none, so one rank's partial image is the render itself), the tiles that
        the boxes in front saturate skipped.  -> a ``PartialRender``."""
        c, xp, me = self.cfg, self.xp, self.rank
        p = ns.project(model.gaussians, plan.cam, sh_degree=sh_degree, antialias=c.antialias,
                       backend=self.backend, check=False)
        clock.end("project")
        binning = ns.bin_tiles(p, backend=self.backend)
        marks = self.saturation.marks(view, epoch, plan.n_tiles) if self.saturation is not None else None
        if marks is not None and marks[me].any():  # saturated by the boxes in front: skipped
            binning.ranges[xp.asarray(marks[me])] = 0
        r = ns.rasterize(p, binning, background, self.backend)
        partial = xp.concatenate([r.image, r.trans[..., None]], axis=2)
        covered = HostCopy((binning.ranges[:, 1] - binning.ranges[:, 0]) > 0)
        return PartialRender(p, binning, r, partial, covered, marks)

    def _compose(self, plan, k, view, recv, recv_tiles, bg, none, marks):
        """Compose my range of the tiles of training view ``view`` (the step's k-th; ``plan``) from the
        partial tiles received (``recv``, laid out as ``recv_tiles``), on the band of rows that holds the
        tiles I need (the rest of the view is not mine), and my share of its loss (``marks``: the view's
        saturation marks used, None where it was composed in full, to mark anew).  -> (my share of the
        loss, lazy; the gradients of each participant's partial band, in ``plan.order``, (rows, W, 4)
        each; the new saturation marks of my range, or None)."""
        xp = self.xp
        j = plan.composers.index(self.rank)
        lo, hi = plan.range(j)
        y0, y1, first = plan.band(j)
        nothing = np.array([0, 0, 0, 1], np.float32)
        layers = []
        for s in plan.order:
            rows, ids = recv_tiles.rows_of(k, s)
            layers.append(image_from_tiles(recv[rows], ids - first, y1 - y0, plan.cam.width,
                                           fill=np.append(bg, 1).astype(np.float32) if s == plan.order[-1]
                                           else nothing))
        colours = xp.stack([a[..., :3] for a in layers])
        trans = xp.stack([a[..., 3] for a in layers])
        band, _ = compose(colours, trans, none)
        new_marks = None
        if self.saturation is not None and marks is None:  # a full composition: mark anew
            new_marks = Saturation.saturated(trans, plan.order, lo - first, hi - first, self.size)
        image = xp.zeros((plan.cam.height, plan.cam.width, 3), band.dtype)  # the loss normalises by the view
        image[y0:y1] = band
        target = self.targets[view]
        loss, d_image = self.view_loss(image, target, (lo, hi))
        if self.batch > 1:
            d_image *= np.float32(1.0 / self.batch)  # each view's 1/B share of the batch loss
        d_colours, d_trans = compose_backward(colours, trans, none, d_image[y0:y1])
        if k == 0:  # the step's first view: the progress PSNR's
            self._view0 = (image, target, lo, hi)
        d_layers = [xp.concatenate([d_colours[n], d_trans[n][..., None]], axis=2) for n in range(len(plan.order))]
        return loss, d_layers, new_marks

    def upcoming_views(self, n):
        """This rank's views in the next step's buckets of the epoch, where it has any (at most ``n``)."""
        return [v for bucket in self._buckets[:self.batch] for v, ranks in bucket if self.rank in ranks][:n]

    def _after_step(self, model, state, ctx, lr):
        """The step's ``model`` (``state``: its strategy state) back to the store (``lr``: its learning
        rates), then the strategy's refinements and resets on the whole shard, and the Gaussians that
        left their box to its owner where they migrate (``_migration_due``, with no step in flight;
        after a refinement the tree rebuilt if unbalanced).  Out of core the whole shard is gathered
        (and cut into blocks anew) only where the strategy acts, or where they migrate and some left
        their box on any rank (only the working set's rows moved).  Collective.  -> the strategy's
        events."""
        self.store.checkin(model, state, lr)
        migrates = not self._in_flight and self._migration_due(ctx.prev_step, self.step)
        if self.store.out_of_core and not self.strategy.acts_at(self.step, ctx):
            if not migrates:
                return {}
            leaving = 0 if model is None else int((self.partition.owner(model.group("means")) != self.rank).sum())
            if not int(self.exchange.allreduce_sum(np.array([float(leaving)]))[0]):
                return {}
        model, state = self.store.whole()
        events = self.strategy.after_optimizer(model, state, self.step, ctx)
        if "cloned" in events:
            model, state, moves = self._rebalance(model, state)
            events.update(moves, gaussians=self.total)
            self._buckets = []  # boxes and Gaussians changed: plan the rest of the epoch anew
        elif migrates:
            model, state, _ = self._migrate(model, state)
        self.store.hold(model, state)
        return events

    def _update_marks(self, views, plans, blocks):
        """Put the composers' new saturation marks (``blocks``: (view in the bucket, lo, hi, (P, hi - lo))
        or None, from every rank) together, view by view."""
        fresh = {}
        for block in blocks:
            if block is None:
                continue
            k, lo, hi, marks = block
            fresh.setdefault(k, np.zeros((self.size, plans[k].n_tiles), bool))[:, lo:hi] = marks
        for k, marks in fresh.items():
            self.saturation.update(views[k], marks)

    def log_extra(self):
        """Every rank's statistics (``RankedTrainer.log_extra``); and a check that every rank trained the
        same view (they share the RNG that orders the views: a rank that drew more would compose other
        cameras' pixels)."""
        views = self.comm.allgather(getattr(self, "_last_view", None))
        if len(set(views)) > 1:
            raise RuntimeError(f"the ranks trained different views at step {self.step}: {views}")
        return super().log_extra()


class OffloadedPixelExchangeTrainer(PixelExchangeTrainer):
    """The pipeline above with each rank's Gaussians out of core (``--offload`` with ``--exchange
    pixel`` under ``mpiexec``): its store an ``engine.stores.offload.OutOfCoreStore``, the rank's box's
    Gaussians in blocks in host memory or on disk, the device holding the blocks that its view of the
    step sees.  A step renders, back-propagates and updates that working set (visible-only Adam);
    Gaussians that left the box can only be among its rows, so only they are checked, and where any
    rank's did, or the strategy acts, every rank gathers its whole shard in host memory, migrates (and
    refines, and rebuilds the tree) as in memory, and cuts it into blocks anew."""

    def __init__(self, dataset, out_dir, cfg, comm, backend=None, log=print, transport="auto", saturation=True,
                 revalidate_every=SATURATION_EPOCHS, consolidation=True, batch_size=None, mode="host",
                 offload_dir=None, host_memory=0, gpu_memory=0, prefetch=True, block_rows=BLOCK_ROWS,
                 offload_adam="device"):
        self.options, store = out_of_core(self.options, mode, offload_dir, host_memory, gpu_memory, prefetch,
                                          block_rows, shard=True, adam=offload_adam)
        super().__init__(dataset, out_dir, cfg, comm, backend, log, transport, saturation, revalidate_every,
                         consolidation, batch_size, store=store)  # (no steps rendered ahead: each loads its own)


def _allgather_covered(comm, plans, mine):
    """Every rank's covered tiles of the step's views (``mine``: this rank's, {view: (tiles,) bool}),
    as [{view: (tiles,) bool}] a rank, a rank's dict holding the views it takes part in.  One
    fixed-size allgather of bits: every rank knows the step's plans, so the layout (each view's tiles
    in the step's order) needs no sizes exchanged and no pickling.  Collective."""
    starts = np.cumsum([0] + [plan.n_tiles for plan in plans])
    bits = np.zeros(int(starts[-1]), bool)
    for k, tiles in mine.items():
        bits[starts[k]:starts[k + 1]] = tiles
    packed = np.packbits(bits)
    every = np.empty((comm.Get_size(), len(packed)), np.uint8)
    comm.Allgather(packed, every)
    every = np.unpackbits(every, axis=1, count=len(bits)).astype(bool)
    return [{k: every[r, starts[k]:starts[k + 1]] for k, plan in enumerate(plans) if r in plan.composers}
            for r in range(len(every))]


def _covered_tiles(covered, source, k, first, last):
    """The tiles first..last-1 of the step's view ``k`` that rank ``source`` covers (``covered``: every
    rank's {view: covered tiles}, gathered): those it sends, or is sent gradients of."""
    return first + np.flatnonzero(covered[source][k][first:last])


def _migrating_columns(model, strategy_state, n):
    """What a migrating Gaussian takes along: {(which, name): (n, ...) array} of its parameters, both
    Adam moments and the strategy's per-Gaussian state (the arrays of ``n`` rows)."""
    columns = {(w, g): model.group(g, w) for w in ("params", "m", "v") for g in GROUPS}
    columns.update({("strategy", k): a for k, a in strategy_state.items() if len(a) == n})
    return columns


def _row_bytes(columns, rows):
    """Rows ``rows`` of every array of ``columns``, their bytes side by side: one (len(rows), B) uint8
    table, which one all-to-all moves whatever the arrays' dtypes."""
    xp = _backend.array_module_of(rows)
    parts = [xp.ascontiguousarray(xp.asarray(a)[rows]).reshape(len(rows), _width(a)).view(np.uint8)
             for a in columns.values()]
    return xp.concatenate(parts, axis=1) if parts else xp.zeros((len(rows), 0), np.uint8)


def _from_row_bytes(table, columns):
    """The arrays of ``_row_bytes``'s table: {key: array} shaped and typed as ``columns``' arrays."""
    xp = _backend.array_module_of(table)
    out, at = {}, 0
    for key, a in columns.items():
        width = _width(a) * a.dtype.itemsize
        part = xp.ascontiguousarray(table[:, at:at + width])
        out[key] = part.view(a.dtype).reshape((len(table),) + a.shape[1:])
        at += width
    return out


def _width(a):
    """The values in one row of ``a`` (1 for a 1D array)."""
    return int(np.prod(a.shape[1:], dtype=np.int64))
