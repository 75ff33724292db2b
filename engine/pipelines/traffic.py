"""The bytes a step moves between ranks in each exchange, counted on one device from a model and
its views as the pipelines count them: the Gaussian-level exchange's projected records, gradients
and halo tiles (``step_traffic``: a ``Traffic``), the pixel-level one's partial tiles
(``pixel_traffic``: a ``PixelTraffic``), and view consolidation's utilisation (``view_utilisation``).

``run.py scaling`` reports them and builds its cost model on them (engine/tools/scaling.py);
``--exchange auto`` compares the two exchanges' bytes an image (``exchange_bytes``,
engine/pipelines/__init__.py's ``choose_exchange``).
"""
from collections import namedtuple
from dataclasses import dataclass

import numpy as np

import numbasplat as ns
from numbasplat import GRAD_FIELDS, PROJ_FIELDS, TILE_PIXELS, message_sizes
from numbasplat import backend as _backend
from numbasplat.compose import compose
from numbasplat.loss import l1_ssim_loss

from engine.recipe.trainer import initial_arrays
from .distributed import balanced_bounds, even_bounds
from .gaussian_exchange import halo_ranges

RECORD_BYTES = 4 * (PROJ_FIELDS + 1)  # a forward record: the projection and its tile count, float32
GRAD_BYTES = 4 * GRAD_FIELDS          # a dense gradient row, float32
TILE_BYTES = 4 * 3 * TILE_PIXELS         # a rendered RGB tile, float32


@dataclass
class Traffic:
    """One step of the Gaussian-exchange pipeline over ``ranks`` ranks, counted on one device.

    Matrices are [source, destination] (the diagonal: what a rank keeps); vectors per rank.
    ``records``: projected records that owner s sends renderer d; ``kept``: those whose
    gradient from d's tiles is not zero (the rows the sparse exchange sends back);
    ``halo_tiles``: rendered tiles that s sends d for the global loss.  ``rows``: Gaussians each
    owner holds; ``isect_received``: tile intersections of the records each renderer receives
    (its binning); ``isect_own``: those on its own tiles (its rasterization); ``tiles``: its
    tiles.  ``views``: the batch; ``gaussians``, ``view_tiles`` and ``view_isect`` (the mean
    intersections of a view) are what one rank rendering one view works on."""
    ranks: int
    views: int
    gaussians: int
    view_tiles: int
    view_isect: float
    records: np.ndarray
    kept: np.ndarray
    halo_tiles: np.ndarray
    rows: np.ndarray
    isect_received: np.ndarray
    isect_own: np.ndarray
    tiles: np.ndarray

    def forward_bytes(self):
        return self.records * RECORD_BYTES

    def backward_bytes(self, grad_comm):
        """[renderer, owner] bytes of the gradients going back: every row (dense), or the
        zero-eliding messages of ``comm.sparse`` (their bitmaps, bases and kept rows)."""
        if grad_comm == "dense":
            return self.records.T * GRAD_BYTES
        return np.stack([4 * message_sizes(self.records[:, d], self.kept[:, d], GRAD_FIELDS)
                         for d in range(self.ranks)])

    def halo_bytes(self):
        return self.halo_tiles * TILE_BYTES

    def crossing(self, grad_comm):
        """[source, destination] bytes of every message of the step that crosses ranks."""
        return off_diagonal(self.forward_bytes() + self.backward_bytes(grad_comm) + self.halo_bytes())

    def link_bytes(self, grad_comm):
        """Per rank, the more of the bytes it sends and it receives over other ranks."""
        return rank_bytes(self.crossing(grad_comm))

    def shares(self):
        """Per rank, its part of the work of one rank rendering one view, by what that work grows
        with: projected records (every view of its rows), rows, intersections binned,
        intersections rasterized, pixels; "each": all of it (work every rank does alike)."""
        return {"view_rows": self.views * self.rows / self.gaussians, "rows": self.rows / self.gaussians,
                "isect_received": self.isect_received / self.view_isect,
                "isect_own": self.isect_own / self.view_isect, "pixels": self.tiles / self.view_tiles,
                "each": np.ones(self.ranks)}


def off_diagonal(m):
    """A [source, destination] matrix without what ranks send themselves."""
    return m - np.diag(np.diag(m))


def rank_bytes(m):
    """Per rank, the more of what it sends other ranks and receives from them ([source, destination])."""
    m = off_diagonal(m)
    return np.maximum(m.sum(1), m.sum(0))


def step_traffic(g, cams, targets, ranks, sh_degree, background, lambda_dssim, balanced=True, backend=None):
    """The ``Traffic`` of a step whose batch is ``cams`` (one view per rank; ``targets`` their
    images) over ``ranks`` ranks, from the pipeline's own send plan (``route_plan``) on the
    whole model ``g`` on this device.

    Owners hold even shards of the rows (``even_bounds``, as ``start_from``); the renderers'
    tile ranges balance the batch's own intersections per tile (``balanced``; the trainer
    balances by the previous batch's), else are even.  A record's gradient on renderer d is the
    raster backward of the global loss's image gradient over d's tiles only, so ``kept`` counts
    what the sparse exchange would send.  Views are projected twice (the bounds need every
    view's intersections first), one at a time, so that memory holds one view's buffers."""
    xp = _backend.array_module(backend)
    n, P, B = len(g), ranks, len(cams)
    tx, ty = cams[0].tiles
    n_tiles = tx * ty

    def frame(b):
        p = ns.project(g, cams[b], sh_degree=sh_degree, backend=backend, check=False)
        return p, ns.bin_tiles(p, backend)

    cost = np.concatenate([_backend.to_host(ranges[:, 1] - ranges[:, 0])
                           for ranges in (frame(b)[1].ranges for b in range(B))]).astype(np.int64)
    bounds = balanced_bounds(cost, P) if balanced else even_bounds(B * n_tiles, P)
    owners = even_bounds(n, P)
    shards = list(zip(owners[:-1], owners[1:]))
    records, kept = np.zeros((P, P), np.int64), np.zeros((P, P), np.int64)
    isect_received = np.zeros(P, np.int64)
    plan = xp.empty((2, P, 1, n), np.int32)
    G = xp.empty((n, GRAD_FIELDS), np.float32)
    for b in range(B):
        p, binning = frame(b)
        ns.rendering.route_plan(p, 0, b * n_tiles, bounds, plan, backend)
        goes = plan[0, :, 0]
        records += np.stack([_backend.to_host(goes[:, lo:hi].sum(axis=1, dtype=np.int64)) for lo, hi in shards])
        isect_received += _backend.to_host(plan[1, :, 0].sum(axis=1, dtype=np.int64))
        r = ns.rasterize(p, binning, background, backend)
        _, d_image = l1_ssim_loss(r.image, targets[b], lambda_dssim, backend=backend)
        for d in range(P):
            first, last = max(int(bounds[d]) - b * n_tiles, 0), min(int(bounds[d + 1]) - b * n_tiles, n_tiles)
            if first >= last:
                continue  # d renders none of this view
            mine = binning.ranges.copy()
            mine[:first] = 0
            mine[last:] = 0
            G[...] = 0
            ns.rasterize_backward(p, ns.Binning(binning.ids, mine, binning.n_isect), r, d_image, grad=G,
                                  backend=backend)
            live = (G != 0).any(axis=1) & (goes[d] > 0)
            kept[:, d] += [int(live[lo:hi].sum()) for lo, hi in shards]
    start, end, _, _ = halo_ranges(bounds, tx, n_tiles)
    own = np.concatenate([[0], np.cumsum(cost)])
    return Traffic(ranks=P, views=B, gaussians=n, view_tiles=n_tiles, view_isect=max(cost.sum() / B, 1.0),
                   records=records, kept=kept, halo_tiles=end - start, rows=np.diff(owners),
                   isect_received=isect_received, isect_own=own[bounds[1:]] - own[bounds[:-1]],
                   tiles=np.diff(bounds))


PIXEL_TILE_BYTES = 4 * 4 * TILE_PIXELS  # a partial tile forward (colour and transmittance), or its gradient back


PixelTraffic = namedtuple("PixelTraffic", "forward backward full saturated rows isect composed views order_mse")
PixelTraffic.__doc__ = """``pixel_traffic``'s (P, P) [source, destination] tile counts summed over the views: the
partial tiles sent forward (the composer's range and halo that the source's Gaussians cover) and
back (their gradients, the range alone); those that would go forward without the spatial
reduction; and of the forward ones, those that saturation reduction skips (None: not counted).
The work, per rank (P,): the Gaussians of its box (``rows``), their tile intersections summed over
the views (``isect``: its partial renders), the tiles it composes summed over the views
(``composed``); ``views``: how many views were counted.  ``order_mse``: the mean squared difference
between the boxes' partial images composed in box order and the single render of all the Gaussians
sorted per tile, over the views' pixels (the blend order's approximation on this model; None: not
rendered)."""


def pixel_traffic(g, cams, ranks, sh_degree, backend=None, saturation=False):
    """The bytes of the pixel-level pipeline (``engine/pipelines/pixel_exchange.py``) for each view of ``cams``
    over ``ranks`` boxes of a kd-tree over ``g``'s means, counted on this device as the pipeline
    counts them: a rank sends each composer the partial tiles of the composer's range and halo that
    its Gaussians cover, and gets back the gradients of those in the composer's range.  With
    ``saturation`` each box's partial image is rendered too, the tiles that the boxes in front
    saturate (the marks a view's full composition makes, ``Saturation.saturated``) counted, and the
    composition compared with the single render.  -> ``PixelTraffic``."""
    from .partition import SpatialPartition
    from .pixel_exchange import Saturation, ViewPlan
    xp = _backend.array_module(backend)
    means = _backend.to_host(g.means)
    part = SpatialPartition.build(means, ranks)
    owner = part.owner(means)
    forward, backward, full, saturated = (np.zeros((ranks, ranks), np.int64) for _ in range(4))
    isect, composed = np.zeros(ranks, np.int64), np.zeros(ranks, np.int64)
    squared, pixels = 0.0, 0
    boxes = [g.take(xp.asarray(owner == r)) for r in range(ranks)]
    none = np.zeros(3, np.float32)
    for cam in cams:
        plan = ViewPlan(cam, range(ranks), part)  # every rank takes part (the view a step, unconsolidated)
        bounds, need_lo, need_hi = plan.bounds, plan.need_lo, plan.need_hi
        covered, colours, trans = [], [], []
        composed += np.diff(bounds)
        for r, box in enumerate(boxes):
            p = ns.project(box, cam, sh_degree=sh_degree, backend=backend, check=False)
            b = ns.bin_tiles(p, backend)
            isect[r] += int(b.n_isect)
            covered.append(_backend.to_host(b.ranges[:, 1] - b.ranges[:, 0]) > 0)
            if saturation:
                r_ = ns.rasterize(p, b, none, backend)
                colours.append(r_.image)
                trans.append(r_.trans)
        marks = np.zeros((ranks, plan.n_tiles), bool)
        if saturation:
            in_order = xp.stack([trans[r] for r in plan.order])
            marks = Saturation.saturated(in_order, plan.order, 0, plan.n_tiles, ranks)
            composite, _ = compose(xp.stack([colours[r] for r in plan.order]), in_order, none)
            single = ns.render(g, cam, sh_degree, none, backend=backend, check=False).render.image
            squared += float(((composite - single) ** 2).sum())
            pixels += int(composite.size)
        for r in range(ranks):  # (running counts: a range's tiles are the difference at its ends)
            sent = np.concatenate([[0], np.cumsum(covered[r])])
            skipped = np.concatenate([[0], np.cumsum(covered[r] & marks[r])])
            forward[r] += sent[need_hi] - sent[need_lo]
            backward[r] += sent[bounds[1:]] - sent[bounds[:-1]]
            full[r] += need_hi - need_lo
            saturated[r] += skipped[need_hi] - skipped[need_lo]
    return PixelTraffic(forward, backward, full, saturated if saturation else None,
                        np.bincount(owner, minlength=ranks), isect, composed, len(cams),
                        squared / pixels if saturation else None)


def view_utilisation(g, cams, ranks):
    """View consolidation for the pixel-level pipeline over ``ranks`` boxes of a kd-tree over ``g``'s
    means, on the views ``cams`` (an epoch): each view's participants (``pixel_exchange.participants``),
    its buckets (``consolidate``) -> ``utilisation``'s {"utilisation_before", "utilisation_after"}, with
    "steps" (the buckets) and "views"."""
    from .partition import SpatialPartition
    from .pixel_exchange import consolidate, participants, rank_boxes, utilisation
    means, scales = _backend.to_host(g.means), _backend.to_host(g.scales)
    owner = SpatialPartition.build(means, ranks).owner(means)
    parts = participants([rank_boxes(means[owner == r], scales[owner == r]) for r in range(ranks)], cams)
    buckets = consolidate(parts)
    return {**utilisation(parts, buckets, ranks), "steps": len(buckets), "views": len(cams)}


def exchange_bytes(data, cfg, ranks, backend=None, gaussians=None):
    """Bytes per image crossing ranks in each exchange at ``ranks`` ranks, counted as ``pixel_traffic`` and
    ``step_traffic`` count them on a sample of ``ranks`` training views (evenly spread; one batch) of
    ``gaussians`` (default: the model training starts from): -> {"pixel": ..., "gaussian": ...} (the
    Gaussian-level exchange's forward records, sparse gradients and halo; the pixel-level one's partial
    tiles both ways).  ``--exchange auto``."""
    xp = _backend.array_module(backend)
    if gaussians is None:
        gaussians = ns.Gaussians(**initial_arrays(data, cfg, np.random.default_rng(cfg.seed)))
    arrays = gaussians.arrays()
    g = ns.Gaussians(**{k: xp.asarray(a) for k, a in arrays.items()})
    views = [data.train[int(k)] for k in np.linspace(0, len(data.train) - 1, ranks).round()]
    cams = [v.camera for v in views]
    forward, backward = pixel_traffic(g, cams, ranks, 0, backend)[:2]
    t = step_traffic(g, cams, [xp.asarray(v.image) for v in views], ranks, 0, np.asarray(cfg.background),
                     cfg.lambda_dssim, backend=backend)
    return {"pixel": off_diagonal(forward + backward).sum() * PIXEL_TILE_BYTES / len(cams),
            "gaussian": t.crossing("sparse").sum() / len(cams)}
