"""The Gaussian-level exchange pipeline over MPI: Gaussian owners and tile renderers (Grendel's split).

Every rank owns a contiguous shard of the Gaussians (projection, projection
backward, Adam, densification) and renders a contiguous range of the batch's
tiles (binning, rasterization, backward).  One step for a batch of B views,
the same on every rank (shared seed):

1. the B images' tiles are cut into P ranges balanced by the measured cost
   (intersections per tile, from the previous batch);
2. each owner projects its shard for all B cameras;
3. forward all-to-all: a record goes to every rank owning a tile in its span;
4. renderers bin and rasterize their tiles and compute their tiles' share of
   the loss; only the shares are summed.  The global loss (L1 + windowed SSIM)
   needs neighbouring pixels: each renderer first receives the rendered tiles
   within one tile row of its own (``_share_tiles``).  The tile-local loss
   (``--loss tile``) needs none and is fused with forward and backward on GPUs;
5. renderers run the raster backward on their tiles; the backward all-to-all
   (dense, or ByteSplat's zero-eliding sparse encoding) returns the
   screen-space gradients to the owners, which accumulate them in place;
6. owners back-propagate through projection, step Adam (learning rates x
   sqrt(B), betas ^ B, as Grendel does) and densify.
Results do not depend on P: with the same batch, P ranks give 1 rank's parameters.
One rank (``COMM_SELF``) runs the same pipeline: batched training in one process.

The shards are contiguous ranges of rows (``--shard contiguous``), or BlitzGS's index-parity
shards (``--shard parity``): rank r owns the global rows congruent to r modulo P, so that
Gaussians made at one time and place (a refinement's clones, a region of the SfM points) spread
over every rank.  Renderers see the records of each view in global row order either way (with
parity shards they sort them by a global index sent alongside), so that depth ties break as on
one rank.  With the workload switches (engine/recipe/workload.py) each owner hides from each view's
projection the rows of its shard that the view skips: they are neither sent nor rendered.
"""
from dataclasses import dataclass, field, replace

import numpy as np

import numbasplat as ns
from numbasplat import GRAD_FIELDS, PROJ_FIELDS, TILE
from numbasplat import backend as _backend
from numbasplat.rendering import image_from_tiles, image_tiles
from comm.sparse import exchange_dense, exchange_sparse

from engine.recipe.model import GaussianModel
from engine.recipe.strategy import STATISTICS
from engine.recipe.trainer import PhaseClock
from engine.recipe.workload import imbalance
from engine.stores.offload import BLOCK_ROWS, out_of_core
from .distributed import RankedTrainer, balanced_bounds, even_bounds

GLOBAL_ROW = "global_row"  # parity shards, over a refinement: each row's (its parent's) global row before it


def _views_of(first, last, n_tiles):
    """The views holding any of the batch's tiles first..last-1 (view b has tiles b*n_tiles...)."""
    return range(first // n_tiles, (last - 1) // n_tiles + 1) if last > first else range(0)


@dataclass
class BatchStep:
    """What one step of ``GaussianExchangeTrainer`` carries from phase to phase: the batch's views,
    cameras and checked-out shard (``model``, its strategy ``state``), SH degree and background, the
    renderers' tile ranges (``bounds``, P + 1 over the batch's ``n_tiles`` x B tiles), whether the phases
    are synced (``timed``); then each phase's results, in the order they are made."""
    views: list
    cams: list
    model: object
    state: dict
    degree: int
    bg: object
    n_tiles: int
    bounds: object
    device_bounds: object
    lo: int                    # my tiles of the batch: lo .. hi - 1
    hi: int
    timed: bool
    projs: list = None         # project: the shard's projection per view
    send: object = None        # plan: the records sent, the plan slot of each, the rows per destination
    route: object = None
    send_counts: object = None
    recv_views: object = None  # (P sources, B): rows received per view; and their intersections
    recv_isect: object = None
    recv: object = None        # forward exchange: the records received, their counts, each one's view
    recv_counts: object = None
    view_of: object = None
    order: object = None       # parity shards: the received rows of each view in global row order
    G: object = None           # render: the received rows' screen-space gradients; each tile's intersections
    cost: object = None
    shares: list = field(default_factory=list)    # the loss's shares of my tiles (lazy: read at reduce)
    frames: list = field(default_factory=list)    # global loss: (view b, first, last, p, binning, render, target)
    rendered: dict = field(default_factory=dict)  # {view b: its render}
    d_images: list = field(default_factory=list)  # loss: each frame's image gradient
    out: object = None         # backward exchange: the gradients of the shard's rows per view
    comm_stats: dict = None
    projected: list = None     # owner, at timed steps: the shard's Gaussians each view saw


class GaussianExchangeTrainer(RankedTrainer):
    """``Trainer`` whose step is the batched owner/renderer pipeline above; ``model`` is this
    rank's shard, global rows ``offset + stride * (0 .. len(model) - 1)`` of ``total``."""
    culls_views = True

    def __init__(self, dataset, out_dir, cfg, comm, batch_size=None, grad_comm="sparse", backend=None,
                 log=print, transport="auto", shard="contiguous", store=None):
        self.batch = batch_size or comm.Get_size()
        self.grad_comm, self.shard = grad_comm, shard
        self.options = replace(self.options, exchange="gaussian", batch_size=batch_size, grad_comm=grad_comm,
                               shard=shard)
        super().__init__(dataset, out_dir, cfg, comm, backend, log, transport, store)
        self.log(f"{self.size} ranks, batch {self.batch}, device buffers through: {self.exchange.transport.name}")
        self.tile_cost = None
        self.time_phases = None  # the phases synced at log steps (see _timing)

    # ------------------------------------------------------------------ sharding
    def start_from(self, model_state, strategy_state=None):
        """Every rank holds the same whole state (the same seed, or the same snapshot) and keeps
        its shard of the rows (an even range, or every P-th row)."""
        total = len(model_state["params"]["means"])
        mine = self._shard_rows(total)
        rows = {w: {g: a[mine] for g, a in model_state[w].items()} for w in ("params", "m", "v") if w in model_state}
        model = GaussianModel.from_state({**model_state, **rows}, *self._model_options())
        self.total = total
        self.store.hold(model, ({k: model.xp.asarray(a[mine]) for k, a in strategy_state.items()} if strategy_state
                                else self.strategy.initialize_state()))

    @property
    def stride(self):
        """Global rows between two local ones: P with parity shards, else 1."""
        return self.size if self.shard == "parity" else 1

    def _shard_rows(self, total):
        """This rank's rows of a model of ``total`` rows: a slice (sets ``offset``)."""
        if self.shard == "parity":
            self.offset = self.rank
            return slice(self.rank, total, self.size)
        lo, hi = (int(b) for b in even_bounds(total, self.size)[self.rank:self.rank + 2])
        self.offset = lo
        return slice(lo, hi)

    def _owners(self, index, total):
        """The rank owning each global row ``index`` of a model of ``total`` rows."""
        if self.shard == "parity":
            return index % self.size
        return np.searchsorted(even_bounds(total, self.size), index, side="right") - 1

    def whole_rows(self, parts):
        """The ranks' shards in global row order: every P-th row from each with parity shards."""
        if self.shard != "parity":
            return np.concatenate(parts)
        whole = np.empty((sum(len(a) for a in parts),) + parts[0].shape[1:], parts[0].dtype)
        for r, a in enumerate(parts):
            whole[r::self.size] = a
        return whole

    def _model_options(self):
        """Where the shard is made (the store's home: the device, or the host out of core), and Adam's
        betas (``adam_betas``)."""
        return (self.store.home,) + self.adam_betas()

    def pipeline_fields(self):
        return {"batch size": self.batch, "gradient exchange": self.grad_comm, "shard": self.shard}

    def pipeline_arrays(self):
        """The last step's intersections per tile, which split the next step's tiles between the
        renderers: a run resumed with them splits (and so sums each Gaussian's gradient) as the
        uninterrupted run does, to the bit."""
        return {} if self.tile_cost is None else {"tile_cost": np.asarray(self.tile_cost, np.float64)}

    def restore_pipeline_arrays(self, arrays):
        self.tile_cost = arrays.get("tile_cost")

    # ------------------------------------------------------------------ one step
    def _send_plan(self, projs, n_tiles, bounds):
        """The forward exchange's rows, grouped by destination rank, then by view, in record order:
        every projected record (view b, Gaussian n) with a tile span goes to each rank whose tile
        range meets the span.  Built on the device, where the records are, with one sync (the
        counts) whatever P is.  Returns the rows; a (P, 2B) table of the rows and of their tile
        intersections per destination and view (the renderer then knows the size of its binning
        without asking the device); and each row's route b * N + n (where its gradient goes back)."""
        xp = self.xp
        B, N = len(projs), len(projs[0].proj)
        plan = xp.empty((2, self.size, B, N), np.int32)    # [goes, tile count if it goes][rank, view, record]
        for b, p in enumerate(projs):
            ns.rendering.route_plan(p, b, b * n_tiles, bounds, plan, self.backend)
        # the sums over records, from one running count of the whole plan (a sum over the last axis
        # would give each of the few (rank, view) rows one thread block): its value at each row's end
        running = xp.cumsum(plan.ravel(), dtype=np.int64)
        ends = _backend.to_host(running[N - 1::N]) if N else np.zeros(2 * self.size * B, np.int64)  # the one sync
        table = np.diff(ends, prepend=0).reshape(2, self.size, B)
        table = np.concatenate([table[0], table[1]], axis=1)
        slot = running[:self.size * B * N]  # the running count of plan[0] flattened
        total = int(table[:, :B].sum())
        send = xp.empty((total, PROJ_FIELDS + 1), np.float32)
        route = xp.empty(total, np.int64)
        for b, p in enumerate(projs):
            ns.rendering.route_fill(p, b, plan, slot, send, route, self.backend)
        return send, table, route

    def _share_tiles(self, rendered, bounds, cam):
        """The rendered pixels the global loss needs from other ranks, by one all-to-all of 16x16 tiles
        (``halo_ranges``: which; a rank's own tiles stay where they are).  ``rendered``: {view: image}
        of this rank's views (right on its own tiles).  Returns {view: image} of its views, right on
        its tiles and their halo (``rendered``'s own image where no other rank's tile is needed)."""
        xp = self.xp
        n_tiles = cam.tiles[0] * cam.tiles[1]
        start, end, _, _ = halo_ranges(bounds, cam.tiles[0], n_tiles)
        me, ranks = self.rank, np.arange(self.size)
        end[ranks, ranks] = start[ranks, ranks]  # nothing to oneself
        parts = [xp.zeros((0, TILE * TILE * 3), np.float32)]
        for a, e in zip(start[me], end[me]):
            for b in _views_of(a, e, n_tiles):
                parts.append(image_tiles(rendered[b], max(a - b * n_tiles, 0), min(e - b * n_tiles, n_tiles)))
        recv, _ = self.exchange.alltoallv(xp.concatenate(parts), end[me] - start[me], end[:, me] - start[:, me])
        tiles = np.concatenate([np.arange(a, e) for a, e in zip(start[:, me], end[:, me])])  # recv's, in order
        have = dict(rendered)
        for b in np.unique(tiles // n_tiles):
            rows = np.flatnonzero(tiles // n_tiles == b)
            have[b] = image_from_tiles(recv[xp.asarray(rows)], tiles[rows] - b * n_tiles, cam.height, cam.width,
                                       base=rendered[b])
        return have

    def train_step(self):
        """One step of ``batch`` views: a method per phase of ``trainer.PHASES``, in the order of the
        module's docstring (``BatchStep`` carries what a phase leaves to the next)."""
        clock = PhaseClock(self.backend, self._timing())
        step = self._begin_batch(clock.synced)
        self._project(step)
        clock.end("project")
        self._plan(step)
        clock.end("plan")
        self._forward_exchange(step)
        clock.end("forward_exchange")
        self._render(step)
        clock.end("render")
        have = {} if self.cfg.loss == "tile" else self._share_tiles(step.rendered, step.bounds, step.cams[0])
        clock.end("halo_exchange")
        self._loss(step, have)
        clock.end("loss")
        self._backward(step)
        clock.end("backward")
        self._backward_exchange(step)
        clock.end("backward_exchange")
        seen = self._owner(step)
        clock.end("owner")
        events = self._optimizer(step, seen, clock)
        clock.end("refine")
        loss = self._reduce(step)
        clock.end("reduce")
        self.stats = {"forward_rows": int(len(step.send)), "forward_bytes": int(step.send.nbytes), **clock.stats(),
                      **step.comm_stats, **self.store.step_stats()}
        if step.projected is not None:
            self.stats["projected"] = sum(step.projected)
        return loss, events

    def _begin_batch(self, timed):
        """Step 1 of the module's docstring: the batch's views drawn and their model checked out of the
        store, and the renderers' tile ranges, uploaded first: an upload waits for the device to idle,
        which it is now (the last step ended reading its results), and not once the projections run.
        ``timed``: the phases are synced.  -> the step's ``BatchStep``."""
        views = [self.next_view() for _ in range(self.batch)]
        model, state = self.store.checkout(views, self.upcoming_views(self.batch))
        cams = [self.data.train[i].camera for i in views]
        tx, ty = cams[0].tiles
        if any(cam.tiles != (tx, ty) for cam in cams):
            raise ValueError("distributed training needs all training images of one size")
        n_tiles = tx * ty
        bounds = (even_bounds(self.batch * n_tiles, self.size) if self.tile_cost is None
                  else balanced_bounds(self.tile_cost, self.size))
        lo, hi = int(bounds[self.rank]), int(bounds[self.rank + 1])
        return BatchStep(views, cams, model, state, self.sh_degree_now(), self.step_background(), n_tiles, bounds,
                         self.xp.asarray(bounds), lo, hi, timed)

    def _project(self, step):
        """Step 2: the shard projected for every camera, less what each view's mask and LOD gate skip."""
        for i in step.views:
            self.workload.viewed(i, self.backend)
        step.projs = [self.project_view(step.model, step.state, i, step.degree) for i in step.views]

    def _plan(self, step):
        """Step 3's plan: the records each renderer gets, and the (source, view) row and intersection
        counts, exchanged first."""
        step.send, table, step.route = self._send_plan(step.projs, step.n_tiles, step.device_bounds)
        recv_table = self.exchange.alltoall_ints(table)  # (P sources, 2B): rows, intersections per view
        step.recv_views, step.recv_isect = recv_table[:, :self.batch], recv_table[:, self.batch:]
        step.send_counts = table[:, :self.batch].sum(1)

    def _forward_exchange(self, step):
        """Step 3: the records and their tile counts to the renderers (with parity shards, the rows of
        each view put in global row order, as one rank has them)."""
        step.recv, step.recv_counts = self.exchange.alltoallv(step.send, step.send_counts, step.recv_views.sum(1))
        step.view_of = _view_of(self.xp, step.recv_views)
        if self.shard == "parity" and self.size > 1:
            step.order = self._global_order(step.route, len(step.model), step.send_counts, step.recv_counts,
                                            step.view_of)
            step.recv, step.view_of = step.recv[step.order], step.view_of[step.order]

    def _render(self, step):
        """Step 4's render of my tiles of each view: the received records of all views binned at once
        (view b's tile t is tile b * n_tiles + t of the batch); with the tile loss also its share of my
        tiles and their raster backward (fused on GPUs).  Keeps each tile's intersections (the next
        bounds)."""
        c, xp, n_tiles, lo, hi = self.cfg, self.xp, step.n_tiles, step.lo, step.hi
        perms = [self.s3im_permutations() for _ in range(self.batch)] if c.loss == "tile" else None
        step.G = xp.zeros((len(step.recv), GRAD_FIELDS), np.float32)
        step.cost = xp.zeros(self.batch * n_tiles, np.int32)
        self._view0 = None
        # the received records: ten fields, then the tile count (the kernels read the ten)
        counts = step.recv[:, PROJ_FIELDS].astype(np.int32)
        binning = ns.bin_tiles(ns.Projection(step.cams[0], None, step.recv, None, counts, step.degree, c.antialias),
                               self.backend, total=int(step.recv_isect.sum()), view_of=step.view_of,
                               n_views=self.batch)
        binning.ranges[:lo] = 0
        binning.ranges[hi:] = 0
        step.cost[lo:hi] = binning.ranges[lo:hi, 1] - binning.ranges[lo:hi, 0]
        for b in _views_of(lo, hi, n_tiles):
            p = ns.Projection(step.cams[b], None, step.recv, None, counts, step.degree, c.antialias)
            view = ns.Binning(binning.ids, binning.ranges[b * n_tiles:(b + 1) * n_tiles], binning.n_isect)
            first, last = max(lo - b * n_tiles, 0), min(hi - b * n_tiles, n_tiles)  # my tiles of view b
            target = self.targets[step.views[b]]
            if perms is not None:
                mine = np.zeros(n_tiles, bool)
                mine[first:last] = True
                share, _, image = self.tile_loss(p, view, target, perms[b], step.bg, want_image=b == 0,
                                                 tiles=mine, grad=step.G)
                step.shares.append(share)
            else:
                r = ns.rasterize(p, view, step.bg, self.backend)
                step.frames.append((b, first, last, p, view, r, target))
                image = step.rendered[b] = r.image
            if b == 0:  # the progress PSNR's share, computed at log steps only (progress_psnr)
                self._view0 = (image, target, first, last)

    def _loss(self, step, have):
        """Step 4's global loss: each view's share of my tiles, on its render that the halo exchange
        completed (``have``)."""
        for b, first, last, *_, target in step.frames:
            share, d_image = self.view_loss(have[b], target, (first, last))
            step.shares.append(share)
            step.d_images.append(d_image)

    def _backward(self, step):
        """Step 5's raster backward of my tiles into the received rows' gradients, each view's 1/B share
        of the batch loss, back in the order the rows came."""
        for (*_, p, view, r, _), d in zip(step.frames, step.d_images):
            ns.rasterize_backward(p, view, r, d, grad=step.G, backend=self.backend)
        if self.batch > 1:
            step.G *= np.float32(1.0 / self.batch)
        if step.order is not None:
            G_received = self.xp.empty_like(step.G)
            G_received[step.order] = step.G
            step.G = G_received

    def _backward_exchange(self, step):
        """Step 5's exchange: the gradients back to the owners of the rows (sparse or dense), into
        ``step.out``: (B x shard rows, GRAD_FIELDS)."""
        step.out = self.xp.zeros((self.batch * len(step.model), GRAD_FIELDS), np.float32)
        args = (self.exchange, step.G, step.recv_counts, step.route, step.out, self.backend, step.timed)
        if self.grad_comm == "sparse":
            step.comm_stats = exchange_sparse(*args)
        else:  # the rows coming back are the rows this rank sent forward
            step.comm_stats = exchange_dense(*args, step.send_counts)

    def _owner(self, step):
        """Step 6's backward: each view's projection backward and statistics (``owner_backward``); at
        timed steps, the shard's Gaussians each view saw (a sync each).  -> visible-only Adam's rows."""
        width = len(step.model)
        grads = [step.out[b * width:(b + 1) * width] for b in range(len(step.projs))]
        seen = self.owner_backward(step.model, step.state, step.projs, grads)
        if step.timed:
            step.projected = [int((p.counts > 0).sum()) for p in step.projs]
        return seen

    def _optimizer(self, step, seen, clock):
        """Step 6's update: Adam at the batch's learning rates (of the rows ``seen``), the shard back
        to the store (the phase "optimizer" of ``clock``), densification.  -> the strategy's events."""
        lr, cols = self.learning_rates(batched=True)
        step.model.adam.step(step.model.grads.data, cols, seen)
        prev = self.step
        self.step += self.batch
        # shards change only in start_from and _reorder_after_refine, which set offset and stride
        ctx = self.context(lr_means=lr["means"], prev_step=prev, offset=self.offset, stride=self.stride)
        if ctx.max_gaussians:  # --max-gaussians caps the whole model: each owner grows to its share
            ctx.max_gaussians = int(np.bincount(self._owners(np.arange(ctx.max_gaussians), ctx.max_gaussians),
                                                minlength=self.size)[self.rank])
        self.store.checkin(step.model, step.state, lr)
        clock.end("optimizer")
        return self._refine(ctx)

    def _reduce(self, step):
        """The loss and the tile costs (the next bounds), summed over the ranks last: by now the device
        is done with them.  -> the step's loss."""
        summed = self.exchange.allreduce_sum(np.concatenate([[sum(map(float, step.shares)) / self.batch],
                                                             _backend.to_host(step.cost.astype(np.float64))]))
        loss, self.tile_cost = float(summed[0]), summed[1:]
        return loss

    def _refine(self, ctx):
        """The strategy's refinement or reset after the step's Adam update (``ctx``: its context) on the
        whole shard, and the shards evened out after a refinement: in memory at every step, out of core
        where the strategy acts (the shard gathered in host memory and cut into blocks anew).  -> its
        events."""
        if self.store.out_of_core and not self.strategy.acts_at(self.step, ctx):
            return {}
        model, state = self.store.whole()
        tracked = self.stride > 1 and self.strategy.refines_at(self.step, ctx)
        if tracked:  # the refinement carries it to the new rows (strategy.carry_rows): where each came from
            state[GLOBAL_ROW] = self.offset + self.stride * model.xp.arange(len(model), dtype=np.int64)
        events = self.strategy.after_optimizer(model, state, self.step, ctx)
        parents = _backend.to_host(state.pop(GLOBAL_ROW)) if tracked else None
        if "cloned" in events:
            model, state = self._reorder_after_refine(model, state, events, parents)
            events["gaussians"] = self.total
        self.store.hold(model, state)
        return events

    def _global_order(self, route, width, send_counts, recv_counts, view_of):
        """The permutation that puts the received rows of each view in global row order (parity
        shards; the rows arrive by source rank): each sent row's global index goes alongside it."""
        local = route % max(width, 1)  # the shard row of each sent row (plan slot b * width + row)
        index = local * self.size + self.rank
        got, _ = self.exchange.alltoallv(index, send_counts, recv_counts)
        key = view_of.astype(np.int64) * (self.total + 1) + got.reshape(-1)
        return self.xp.argsort(key)

    def _reorder_after_refine(self, model, state, events, parents=None):
        """Put the Gaussians in the order one rank would have: every rank's kept ones,
        then every rank's clones, then every rank's split children; then even shards.

        The global order decides the random draws of later splits and breaks depth
        ties, so this keeps P ranks equal to one; evening the shards out also
        rebalances the owners.  Rows move by one all-to-all (parameters and both
        Adam moments together) and are put in order where they land.  With parity shards a
        rank's rows interleave with the others' in each part: ``parents`` (each row's, or its
        parent's, global row before the refinement) orders them, by one gather of those keys.
        ``model``, ``state``: the shard and its strategy state.  -> (the new shard, its state)."""
        n_new = events["cloned"] + 2 * events["split"]
        parts = np.array(self.comm.allgather((len(model) - n_new, events["cloned"], 2 * events["split"])))
        before = np.cumsum(parts, axis=0) - parts            # each segment's rows on lower ranks
        seg_start = np.concatenate([[0], np.cumsum(parts.sum(0))[:-1]])
        kind = np.repeat(np.arange(3), parts[self.rank])    # 0 kept, 1 clone, 2 child, per local row
        within = np.arange(len(kind)) - np.concatenate([[0], np.cumsum(parts[self.rank])[:-1]])[kind]
        new_index = seg_start[kind] + before[self.rank, kind] + within
        if parents is not None:  # one rank's order: by part, then parent, then which of the two children
            old_total = self.total
            key = (kind * 2 * old_total + 2 * parents + np.where(kind == 2, within % 2, 0)).astype(np.int64)
            new_index = np.searchsorted(np.sort(np.concatenate(self.comm.allgather(key))), key)
        total = int(parts.sum())
        dest = self._owners(new_index, total)
        order = np.argsort(dest, kind="stable")
        counts = np.bincount(dest, minlength=self.size).astype(np.int64)
        arrays = model.state()
        send = {w: {g: a[order] for g, a in arrays[w].items()} for w in ("params", "m", "v")}
        # what outlives a refinement (the workload's weights and masks) moves with the rows
        send["strategy"] = {k: _backend.to_host(a)[order] for k, a in state.items() if k not in STATISTICS}
        recv_index, _ = self.exchange.alltoallv(new_index[order], counts)
        place = np.argsort(recv_index, kind="stable")
        moved = {}
        for w, groups in send.items():
            moved[w] = {}
            for g, a in groups.items():
                got, _ = self.exchange.alltoallv(a.reshape(len(a), -1), counts)
                moved[w][g] = got[place].reshape((-1,) + a.shape[1:])
        moved["step"] = arrays["step"]
        carried = moved.pop("strategy")
        model = GaussianModel.from_state(moved, *self._model_options())
        self._shard_rows(total)
        self.total = total
        state = self.strategy.initialize_state()  # fresh statistics after a refinement anyway
        state.update({k: model.xp.asarray(a) for k, a in carried.items()})
        return model, state

    def log_extra(self):
        """Every rank's statistics (``RankedTrainer.log_extra``) and, with BlitzGS's cuts, the imbalance of
        the Gaussians the ranks' views saw (max / mean)."""
        extra = super().log_extra()
        every = extra["rank_stats"]
        if all("projected" in s for s in every):
            extra["projected_imbalance"] = imbalance([s["projected"] for s in every])
        return extra


class OffloadedGaussianExchangeTrainer(GaussianExchangeTrainer):
    """The pipeline above with each rank's shard out of core (``--offload`` under ``mpiexec``): its
    store an ``engine.stores.offload.OutOfCoreStore``, the shard's Gaussians in blocks in host memory or on
    disk, the device holding the blocks that the batch's views see.  A step trains the working set of
    its batch as the shard (visible-only Adam: the rows that any of its views saw); a refinement or
    reset gathers the whole shard in host memory, where the shards are evened out as in memory, and
    cuts it into blocks anew.  Contiguous shards: parity shards would track global rows through the
    working sets."""

    def __init__(self, dataset, out_dir, cfg, comm, batch_size=None, grad_comm="sparse", backend=None, log=print,
                 transport="auto", shard="contiguous", mode="host", offload_dir=None, host_memory=0, gpu_memory=0,
                 prefetch=True, block_rows=BLOCK_ROWS, offload_adam="device"):
        self.options, store = out_of_core(self.options, mode, offload_dir, host_memory, gpu_memory, prefetch,
                                          block_rows, shard=True, adam=offload_adam)
        super().__init__(dataset, out_dir, cfg, comm, batch_size, grad_comm, backend, log, transport, shard, store)


def halo_ranges(bounds, tiles_x, n_tiles):
    """The tiles that the global loss's renderers trade (``_share_tiles``), from the renderers'
    tile ranges ``bounds`` over the batch (P + 1) and the views' tile grid.

    A renderer holds only its own tiles; L1 + SSIM also needs the tiles within one tile row of
    its own, in its views: the loss's two 11x11 windows reach 10 pixels.  Every rank knows the
    bounds, so what goes where is known without asking.  Returns (start, end, need_lo, need_hi):
    source rank s sends tiles start[s, d] .. end[s, d] - 1 to destination d (its own to itself
    too), which needs tiles need_lo[d] .. need_hi[d] - 1 in all."""
    bounds = np.asarray(bounds, np.int64)
    lo, hi = bounds[:-1], bounds[1:]
    reach = tiles_x + 1
    need_lo = np.maximum(lo - reach, lo // n_tiles * n_tiles)
    need_hi = np.where(hi > lo, np.minimum(hi + reach, -(-hi // n_tiles) * n_tiles), need_lo)
    start = np.maximum(lo[:, None], need_lo[None, :])            # [source, destination]
    end = np.maximum(np.minimum(hi[:, None], need_hi[None, :]), start)
    return start, end, need_lo, need_hi


def _view_of(xp, counts):
    """Each received row's view, int32: rows arrive grouped by source rank, then by view
    (``counts``: (P, B) rows per source and view)."""
    counts = np.asarray(counts, np.int64)
    ends = np.cumsum(counts.ravel())
    run = xp.searchsorted(xp.asarray(ends), xp.arange(int(ends[-1]), dtype=np.int64), side="right")
    return (run % counts.shape[1]).astype(np.int32)
