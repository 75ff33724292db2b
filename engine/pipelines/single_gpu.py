"""The single-process pipeline: the whole model on one device, one view per step.

The step: render the view, L1 + SSIM loss (or ``--loss tile``: L1 + S3IM per
tile, fused with forward and backward on GPUs), backward through
rasterization and projection, the strategy's statistics, fused Adam, the
strategy's densification; each a phase of ``trainer.PHASES`` (``stats``).
Where nothing else needs the parameters' gradients, Adam's update runs inside
the projection backward's kernels (``SingleGPUTrainer.fuses_adam``).
On a GPU the step bins its view into room kept for it (``BinningRoom``), so
that the host queues whole steps without waiting for the device.
"""
import numpy as np

import numbasplat as ns
from numbasplat import backend as _backend
from numbasplat.chunks import chunked_frame, rasterize_chunk, rasterize_chunk_backward
from numbasplat.device import DeviceValues, pinned_empty, queue_to_host, stream_event
from numbasplat.loss import psnr
from numbasplat.rendering import (ROOM_MARGIN, ROOM_SLACK, behind_state, front_state, project_backward_adam,
                                  room_slots)

from engine.recipe.model import GROUPS, GaussianModel
from engine.recipe.strategy import Context
from engine.recipe.trainer import PhaseClock, Trainer
from engine.stores.offload import BLOCK_ROWS, out_of_core
from .step_graphs import StepGraphs, array_key


class BinningRoom:
    """Room for each view's tile intersections, so that a step bins without reading their total
    back (``bin_tiles(room=)``): that read is a device sync, after which the GPU idles while the
    host queues the rest of the step.

    A view's room is its last total, scaled by the model's growth since, times ``MARGIN``, plus
    ``SLACK``; a view not binned before is binned exactly (one sync).  Each step's total is copied
    to the host as it is binned and read when the next step bins (by then it has arrived).  A view
    whose intersections did not fit had its step skipped on the device (``Binning.overflow``:
    Adam and the strategy's statistics leave that step out); it is counted in ``overflows``, its
    room is set from the total it had, and it waits in ``skipped`` for the trainer, which trains
    it again at the step after the one that read the overflow, so that no view loses its turn.
    A step calls ``plan`` (host), ``bin_into`` (device: what a step graph captures) and ``record``
    (host).  On an aggregate device (``parts``: its split's parts) each part bins its tile rows into
    a room of its own: rooms and totals are then tuples of each part's, and a view overflows where
    any part's did.

    An opacity reset shrinks every Gaussian's reach (it follows the opacity), so the totals fall,
    then climb back faster than the model grows as the opacities recover: ``hold_totals`` keeps
    each view's room at least what it took before the reset, grown with the model since, for its
    next ``HOLD_VISITS`` binnings (the skipped steps come in the epochs right after a reset, while
    densification still grows the model: BENCHMARKS.md, Large scenes)."""
    MARGIN = ROOM_MARGIN
    SLACK = ROOM_SLACK
    HOLD_VISITS = 4

    def __init__(self, parts=None):
        self.parts = parts   # a split binning's parts (``Placement.bin_tiles``); None: one binning
        self.last = {}       # view -> (its intersections, the model's Gaussians) when it was last binned
        self.held = {}       # view -> [its intersections before a reset, the model's Gaussians then, binnings left]
        self.pending = None  # (view, Gaussians, room, the event after its total's copy) of the last step
        self.overflows = 0
        self.skipped = []    # views whose step was skipped, not yet trained again
        self._total = pinned_empty(parts or 1, np.int64)  # each step's total lands here (read before the next)

    def expected(self, view, gaussians):
        """The intersections ``view`` is expected to have with a model of ``gaussians``: its last
        total (and one held from before a reset), grown with the model since (None: never binned)."""
        if view not in self.last:
            return None
        def grown(total, then):  # a total taken with a model of ``then`` Gaussians, scaled to today's
            return np.asarray(total, np.float64) * max(gaussians / max(then, 1), 1.0)
        total = grown(*self.last[view])
        if view in self.held:
            total = np.maximum(total, grown(*self.held[view][:2]))
        return total

    def room(self, view, gaussians):
        """Slots for ``view``'s intersections with a model of ``gaussians`` (None: bin exactly); split,
        a tuple of each part's."""
        total = self.expected(view, gaussians)
        return None if total is None else room_slots(total, self.MARGIN, self.SLACK)

    def hold_totals(self):
        """After an opacity reset: each view's room keeps its total from before it for a while."""
        self.settle()
        self.held = {view: [total, then, self.HOLD_VISITS] for view, (total, then) in self.last.items()}

    def fits(self, view, gaussians, room):
        """Whether ``room`` slots (a step graph's: ``engine.pipelines.step_graphs``) still hold the intersections
        ``expected`` with half the margin and ``SLACK`` to spare (the whole margin would capture the
        graph again at nearly every binning, none would leave more steps skipped)."""
        total = self.expected(view, gaussians)
        return total is not None and bool(np.all(np.asarray(room) >= (1 + (self.MARGIN - 1) / 2) * total + self.SLACK))

    def plan(self, view, gaussians):
        """Before binning ``view``: read the last step's total, count this binning against the held
        totals.  -> its room (None: bin exactly)."""
        self.settle()
        room = self.room(view, gaussians)
        if view in self.held:
            self.held[view][2] -= 1
            if not self.held[view][2]:
                del self.held[view]
        return room

    def bin_into(self, p, room, placement, deterministic=False):
        """The device's part: ``placement``'s ``bin_tiles`` of the projection ``p`` into ``room``, its
        total queued for the host (a step graph captures this)."""
        b = placement.bin_tiles(p, room=room, deterministic=deterministic)
        if room is not None:
            queue_to_host(b.total, self._total)
        return b

    def record(self, view, gaussians, room, exact_total=None):
        """After the step is queued: the total of an exact binning (``room`` None: ``exact_total``), or
        the room's total to read when the next step bins."""
        if room is None:
            self.last[view] = (exact_total, gaussians)
        else:
            self.pending = (view, gaussians, room, stream_event())

    def settle(self):
        """Read the last step's total, and count its overflow."""
        if self.pending is not None:
            view, n, room, event = self.pending
            self.pending = None
            if event is not None:
                event.synchronize()
            total = int(self._total[0]) if self.parts is None else tuple(int(k) for k in self._total)
            self.last[view] = (total, n)
            if np.any(np.asarray(total) > np.asarray(room)):
                self.overflows += 1
                self.skipped.append(view)


class SingleGPUTrainer(Trainer):
    """``Trainer`` with the whole model in this process (on the GPU, or the CPU backend).

    ``--deterministic`` (``cfg.deterministic``): binned and raster backward in a fixed order
    (``rasterize_backward(deterministic=True)``), so a run of one seed and data gives the same bits
    every time; the rest of the step is so already (each Gaussian's projection backward, statistics
    and Adam update are its own thread's, the loss's sums are per tile and added on the host, the
    binning's sorts are stable, densification's draws are functions of a key and the row).  Its
    slot buffer is scratch of the step, so a step graph captures it with the rest."""
    culls_views = True
    supports_deterministic = True  # (``pipeline_options.check``)
    binning_room = None  # bin into kept room (``BinningRoom``)? None: on GPUs; True: always (tests); False: never
    _room = None
    _graphs = None       # the step graphs (``engine.pipelines.step_graphs``), once a step may use them
    _graphs_held = None  # (from, until, until is a limit): ``_graphs_hold_until``'s last answer
    _random_bg = None    # with ``random_background`` and step graphs: the device values each step's is written to

    def _room_for(self, view, model):
        """Binning room for this step's view (``BinningRoom.plan``), where ``binning_room`` says so
        and no colour correction is trained (its per-image update sees the render and has no skip
        flag) and the view is not trained in chunks (each chunk bins exactly); the view of a step skipped
        for room goes back in the order (trains next).  Out of core the room is a view's working set's:
        the same view checks out the same blocks, grown as the model grows.
        -> (room: None bins exactly, whether the step bins into room at all)."""
        wanted = _backend.on_gpu(self.backend) if self.binning_room is None else self.binning_room
        if not wanted or self.appearance is not None or getattr(model, "chunked", False):
            return None, False
        if self._room is None:
            self._room = BinningRoom(self.placement.binnings if self.placement.binnings > 1 else None)
        room = self._room.plan(view, len(model))
        while self._room.skipped:  # the last step's view did not fit: it trains next (popped from the end)
            self.order.append(self._room.skipped.pop())
        return room, True

    def log_extra(self):
        """The steps skipped because their intersections outgrew their room, once there are any; the
        steps replayed from a graph and the graphs captured, so far."""
        extra = super().log_extra()
        if self._graphs is not None:
            extra.update(graph_replays=self._graphs.replays, graph_captures=self._graphs.captures,
                         graph_not_captured=self._graphs.unreplayed,  # (their graphs would not have been replayed)
                         graph_capture_seconds=round(self._graphs.capture_seconds, 3))
            if self._graphs.failures:
                extra.update(graph_capture_failures=self._graphs.failures,
                             graph_capture_failure=self._graphs.last_failure)
        if self._room is not None:
            self._room.settle()
            if self._room.overflows:
                extra["binning_overflows"] = self._room.overflows
        return extra

    def start_from(self, model_state, strategy_state=None):
        if self._graphs is not None:
            self._graphs.clear()
        if self.store.out_of_core and set(model_state) == {"params"} and not strategy_state:
            self.store.hold_new(model_state["params"])  # (cut into blocks as read: no whole model beside them)
            return
        model = GaussianModel.from_state(model_state, self.store.home)
        self.store.hold(model, ({k: model.xp.asarray(a) for k, a in strategy_state.items()} if strategy_state
                                else self.strategy.initialize_state()))

    def gather_state(self):
        model, state = self.store.whole()
        return model.state(), {k: _backend.to_host(a) for k, a in state.items()}

    def saved_state(self):
        return self.store.saved_state()

    def saved_gaussians(self):
        return self.store.saved_gaussians()

    def whole_state(self):
        """The model's own buffers and strategy state, on the device (the importance pass cuts its
        rows there: no copies to the host and back)."""
        model, state = self.store.whole()
        groups = {w: {g: model.group(g, w) for g in GROUPS} for w in ("params", "m", "v")}
        return {**groups, "step": model.adam.step_count}, dict(state)

    def whole_model(self):
        """The whole model, to render and score (the store's ``rendered``: out of core, on the device where
        the pool holds it)."""
        return self.store.rendered()

    def train_step(self):
        """The host's part of the step around its device work (``_device_step``), which a step graph
        captures and replays (``engine.pipelines.step_graphs``) where ``_graphs_now`` allows: the view's model
        checked out of the store (the model itself in memory; out of core, the view's working set) and
        checked in after Adam, the strategy's refinement on the whole model."""
        strategy = self.strategy
        timed = self._timing()
        clock = PhaseClock(self.backend, timed)
        i = self.next_view()
        model, state = self.store.checkout([i], self.upcoming_views(1))
        if self.store.out_of_core:
            clock.end("owner")
        bg = self.step_background()
        degree = self.sh_degree_now()
        lr, cols = self.learning_rates()
        model.adam.set_step(cols)  # on the device, where the step's Adam reads them
        self.placement.prepare_adam(model.adam)
        room, roomed = self._room_for(i, model)
        self.workload.viewed(i, self.backend)

        def step(room, captured):  # the device's part (a captured step keeps its loss, not its render)
            image, loss, total = self._device_step(model, state, i, bg, degree, room, roomed, clock)
            return (None if captured else image), loss, total

        graphs = self._graphs_now(timed)
        if self._graphs is not None and self.cfg.random_background:  # the graphs read it on the device
            if self._random_bg is None:
                on_gpu = _backend.on_gpu(self.backend)  # (the render's precision there: float32)
                self._random_bg = DeviceValues(3, np.float32 if on_gpu else np.float64, self.backend)
            bg = self._random_bg.write(bg)
        if graphs is None:
            image, loss, total = step(room, False)
        else:
            key = (len(model), *self._schedule_key(self.step), self.fuses_adam(),
                   "random" if self.cfg.random_background else bg.tobytes(),
                   array_key([model.params.data, *model.adam.buffers(), *state.values()]  # (the gradients: kept,
                             + ([] if model.kept_grads is None else [model.kept_grads.data])))  # or made in the step)
            fits = lambda captured_room: self._room.fits(i, len(model), captured_room)  # noqa: E731
            (image, loss, total), room = graphs.run(i, key, room, fits, step,
                                                  comes_again=lambda: self._comes_again(i))
            loss = loss.again()  # (the graph keeps its loss unread: each replay's is read from its sums)
        if roomed:
            self._room.record(i, len(model), room, total)
            self.store.binned(len(model), total if room is None else room)  # (the slots the step took)
        # (a graph keeps its loss, not its render: progress_psnr renders a replayed step's view when asked)
        self._progress_view = (image, i)
        self.step += 1
        self.store.checkin(model, state, lr)
        clock.end("optimizer")
        events = self._refine(self.context(lr_means=lr["means"]))
        if events and self._graphs is not None:
            self._graphs.clear()
        if self._room is not None and events.get("opacity_reset"):
            self._room.hold_totals()
        clock.end("refine")
        self.stats = {**self.store.step_stats(), **clock.stats()}
        return loss, events

    def _refine(self, ctx):
        """The strategy's refinement or reset after the step (``ctx``: its context) on the whole model: in
        memory at every step; out of core only where it acts, on the device if the pool holds every
        block, and the result cut into blocks anew.  -> its events."""
        if self.store.out_of_core and not self.strategy.acts_at(self.step, ctx):
            return {}
        if self.store.out_of_core:
            events = self.store.refine(self.strategy, self.step, ctx)  # block by block, where it can
            if events is not None:
                return events
        model, state = self.store.whole(device=True)
        events = self.strategy.after_optimizer(model, state, self.step, ctx)
        if self.store.out_of_core:
            self.store.hold(model, state)
        return events

    def _device_step(self, model, state, i, bg, degree, room, roomed, clock):
        """View ``i``'s render, loss, backward, the strategy's statistics and Adam's update of ``model``
        (with the strategy ``state`` of its rows: the store's checkout), on the device alone: nothing
        here reads a device value or changes the host's state (but the tile loss's statistics, a loss
        never captured), so that a step graph can replay it.  ``room``, ``roomed``: ``_room_for``'s.
        -> (the render, the loss, the intersections of an exact binning)."""
        p = self.project_view(model, state, i, degree)
        clock.end("project")
        fixed = self.cfg.deterministic
        b = (self._room.bin_into(p, room, self.placement, deterministic=fixed) if roomed
             else self.placement.bin_tiles(p, deterministic=fixed))
        if not roomed:  # (exact: its intersections known on the host, which an out-of-core store's budget follows)
            self.store.binned(len(model), b.n_isect)
        image, loss, grad = self._render_loss_backward(p, b, i, bg, clock)
        if self.fuses_adam():
            self._owner_backward_adam(model, state, p, grad, skip=b.overflow)
            clock.end("owner")
        else:
            visible = self.owner_backward(model, state, [p], [grad], skip=b.overflow)
            clock.end("owner")
            self.placement.adam_update(model.adam, model.grads.data, visible, skip=b.overflow)
        return image, loss, (self.placement.slots(b) if roomed and room is None else None)

    def fuses_adam(self):
        """Whether this step's Adam update runs inside the projection backward's kernels
        (``rendering.project_backward_adam``), with ``cfg.fuse_adam`` on: where nothing needs the
        parameters' gradients between the two, so that each element's update is the separate Adam's to
        the bit.  Not on the aggregate device (``placement.split``: its parts split the projection
        backward and Adam by rows, ``Placement.adam_update``), nor out of core (Adam's moments are
        columns of the store's row table: ``RowsAdam``), nor at a step where the strategy's regularisers
        act (``owner_backward`` adds theirs to the gradient buffer before Adam).  The
        densification statistics read the screen-space gradients, which stay; visible-only Adam's mask
        is the projection's, which the kernels read.  Adam's time then counts in the phase "owner"."""
        return (self.cfg.fuse_adam == "on" and not self.placement.split and not self.store.out_of_core
                and not self.strategy.regularises_at(self.step))

    def _owner_backward_adam(self, model, state, p, grad, skip=None):
        """``owner_backward`` of the step's one view and Adam's update of ``model``, fused
        (``fuses_adam``): the strategy's statistics of the view, then the projection backward applying
        the update that ``model.adam.set_step`` prepared (``visible_adam``: to the Gaussians the view
        draws); ``skip``: the device flag of a step left out."""
        self.strategy.after_backward(model, state, self.step, p, grad, self.batch, skip=skip)
        project_backward_adam(p, grad, model.adam, visible=self.cfg.visible_adam, skip=skip, backend=self.backend)

    def _render_loss_backward(self, p, b, i, bg, clock):
        """View ``i``'s render of the projection ``p`` (binned: ``b``) on ``bg``, its loss, and the raster
        backward: the tile loss's fused pass, or the global loss (of the render as the colour correction
        changes it, where trained; ``bg`` changes the render only, as in 3DGS).  -> (the image that the loss
        saw, the loss, the screen-space gradients)."""
        target = self.targets[i]  # (bg changes the render only, as in 3DGS)
        if self.cfg.loss == "tile":
            loss, grad, image = self.tile_loss(p, b, target, self.s3im_permutations(), bg, want_image=True)
            clock.end("render")
            return image, loss, grad
        r = self.placement.rasterize(p, b, bg)
        clock.end("render")
        corrected = self.appearance is not None
        image = self.appearance.apply(r.image, i) if corrected else r.image  # what the loss sees
        loss, d_img = self.view_loss(image, target)
        if corrected:
            d_img = self.appearance.backward(d_img, r.image, i)
        clock.end("loss")
        grad = self.placement.rasterize_backward(p, b, r, d_img, deterministic=self.cfg.deterministic)
        clock.end("backward")
        return image, loss, grad

    def _schedule_key(self, step):
        """The parts of a step graph's key that the schedules set, at the step that starts at ``step``: the SH
        degree, whether densification has ended, whether the regularisers act."""
        return (self.sh_degree_now(step), step >= getattr(self.strategy, "refine_stop", 0),
                self.strategy.regularises_at(step))

    def _comes_again(self, view):
        """Whether ``view`` trains again while a step graph captured now holds (``StepGraphs.run``'s ``comes_again``):
        before the first later step whose key differs (``_graphs_hold_until``), at its place in the epoch's
        order, or if the epoch holds it no more, in the next epoch, at half of it (its place there is drawn
        then).  While the model densifies, a capture of many views sees most of them once between two
        refinements: those steps run as usual rather than be captured for no replay."""
        order, now = self.order, self.step
        try:
            ahead = order[::-1].index(view)  # (the order is popped from its end)
        except ValueError:
            ahead = len(order) + len(self.data.train) // 2
        return now + 1 + ahead < self._graphs_hold_until(now)

    def _graphs_hold_until(self, now):
        """The first step start after ``now`` whose step graphs differ from those of the step starting at ``now``:
        the model refined or reset at the end of the step before (the graphs dropped), or a schedule's part of
        the key changed; looked for up to four epochs ahead, and kept while it holds."""
        views = len(self.data.train)
        held = self._graphs_held
        if held is None or not held[0] <= now < held[1] or (held[2] and now >= held[0] + 2 * views):
            parts, ctx, limit = self._schedule_key(now), Context(self.data.scene_scale, None), now + 4 * views + 2
            changes = getattr(self.strategy, "acts_at", self.strategy.refines_at)  # (MCMC: its refinements)
            t = now + 1
            while t < limit and not changes(t, ctx) and self._schedule_key(t) == parts:
                t += 1
            self._graphs_held = held = (now, t, t == limit)  # (from, until, whether until is the limit alone)
        return held[1]

    def _graphs_now(self, timed):
        """The step graphs where this step may use one: on a GPU with ``cfg.step_graphs`` on, binning
        into room, the global loss (the tile loss draws its arrangements on the host), no colour
        correction (its per-image values live on the host), one device (virtual parts too: their streams fork
        from the step's stream and join it, captured with it), not a timed step (its phases are synced), and
        a store whose checked-out model stays the same from step to step (``steady``: the model in memory;
        out of core, the whole model as the working set, with Adam on the device).  None otherwise."""
        c = self.cfg
        if self._graphs is None:
            wanted = (c.step_graphs == "on" and _backend.on_gpu(self.backend) and self.binning_room is not False
                      and c.loss != "tile" and self.appearance is None and self.placement.devices is None)
            if not wanted:
                return None
            self._graphs = StepGraphs()
        return None if timed or not self.store.steady else self._graphs

    def progress_psnr(self):
        """PSNR of the last step's view: its render, or where a step graph replayed the step (which
        keeps no render), the view rendered now, after the step's update."""
        image, i = self._progress_view
        if image is None:
            image = self.view_image(self.whole_model(), self.data.train[i].camera)
        return psnr(image, self.targets[i])


TOUR_BELOW = 0.5  # --view-order auto: a tour while the device's pool holds under this share of the blocks


class OffloadTrainer(SingleGPUTrainer):
    """The single-process pipeline with its model out of core (``OutOfCoreStore``; see above).

    ``mode``: host or disk; ``offload_dir``, ``host_memory`` (bytes): disk mode's folder and host cache;
    ``gpu_memory`` (bytes, 0: ``GPU_SHARE`` of the device's free memory, no cap on the CPU backend): the
    device's pool of blocks and the working sets built from them; ``prefetch``: disk mode reads the next
    view's blocks ahead on a thread; ``offload_adam``: where Adam runs, device or host (its moments then
    only in the host's tier: ``engine.stores.offload.host_adam``; the backward then writes the gradients over
    the working set's parameters, which the host's Adam does not read).  BlitzGS's switches are refused
    (``culls_views``): their per-Gaussian weights and masks would live beside the blocks, not in their rows.

    A view whose working set is larger than the device's pool is trained in depth-ordered chunks of
    its rows (``_chunked_step``; the store's ``ChunkedView``): the same step, in a chunk's memory."""
    culls_views = False
    supports_deterministic = False

    def __init__(self, dataset, out_dir, cfg, backend=None, log=print, block_rows=BLOCK_ROWS, mode="host",
                 offload_dir=None, host_memory=0, gpu_memory=0, prefetch=True, offload_adam="device"):
        self.options, store = out_of_core(self.options, mode, offload_dir, host_memory, gpu_memory, prefetch,
                                          block_rows, adam=offload_adam)
        store.chunked_views = True
        store.grads_over_params = True  # (one projection backward per checked-out model: a view's, or a chunk's)
        super().__init__(dataset, out_dir, cfg, backend, log, store=store)

    def _device_step(self, model, state, i, bg, degree, room, roomed, clock):
        if getattr(model, "chunked", False):
            return self._chunked_step(model, i, bg, degree, clock)
        return super()._device_step(model, state, i, bg, degree, room, roomed, clock)

    def _chunked_step(self, view, i, bg, degree, clock):
        """View ``i``'s step in depth-ordered chunks (``view``: the store's ``ChunkedView``), the step body
        of ``_device_step`` a chunk at a time: each chunk checked out, projected, binned and rasterized
        front to back with each pixel's state carried (``numbasplat.chunks``); the loss of the whole
        image; then back to front, each chunk checked out again (but the last, still in the pool with its
        projection and binning), its raster backward from the state the chunks behind left,
        ``owner_backward``, visible-only Adam on its rows, checked in.  Equal to the unchunked step: each
        Gaussian is in one chunk, its gradient whole when its chunk's backward ran.
        -> (the render, the loss, None)."""
        camera, backend = self.data.train[i].camera, self.backend
        chunks = view.depth_chunks(camera, self.cfg.antialias)
        frame = chunked_frame(camera, chunks, degree, self.cfg.antialias, backend=backend)
        pixels = front_state(camera, backend)
        last = None
        for k in range(len(chunks)):
            last = None  # (the chunk before let go before this one is made: the budget holds one chunk)
            model, state = view.checkout(k)
            p = self.project_view(model, state, i, degree)
            b = ns.bin_tiles(p, backend=backend)
            self.store.binned(len(model), b.n_isect)
            rasterize_chunk(frame, k, p, b, pixels, bg, backend)
            last = (model, state, p, b)  # (the last chunk's backward runs first)
            model = state = p = b = None
        clock.end("render")
        image = frame.image
        loss, d_img = self.view_loss(image, self.targets[i])
        clock.end("loss")
        pixels = behind_state(frame.render, None, backend)
        for k in range(len(chunks) - 1, -1, -1):
            if k < len(chunks) - 1:
                model = state = p = b = grad = visible = None  # (the chunk before let go first)
                model, state = view.checkout(k)
                p = self.project_view(model, state, i, degree)
                b = ns.bin_tiles(p, backend=backend)
            else:
                model, state, p, b = last
                last = None
            grad = rasterize_chunk_backward(frame, k, p, b, d_img, pixels, backend=backend)
            visible = self.owner_backward(model, state, [p], [grad])
            model.adam.update(model.grads.data, visible)
            view.checkin(k, model, state)
        clock.end("owner")
        return image, loss, None

    def epoch_view_order(self):
        """auto: a tour along the cameras while the device's pool holds under ``TOUR_BELOW`` of the
        blocks (consecutive views then share most of their blocks, and random views would move most
        of theirs), else random: a tour's neighbouring views in a row cost quality (2.3 dB on a city
        whose pool held 85% of the blocks, for no fewer moves: BENCHMARKS.md, "Out-of-core")."""
        if self.cfg.view_order != "auto":
            return self.cfg.view_order
        return "trajectory" if self.store.prefers_tour(TOUR_BELOW) else "random"
