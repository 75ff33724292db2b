"""Placement: where each operator of a training step runs, split across the parts of an aggregate device.

NVIDIA's multi-GPU splatting backend puts the model in CUDA managed memory and splits every
operator across the GPUs, so that the model code has no communication and the GPUs look like one
device.  ``Placement`` is that split, and the one place that knows of it: the trainer calls its
operators where a single device would call ``numbasplat.rendering``'s and ``Adam.update``, and
each operator runs in ``parts`` pieces whose results land in the shared arrays:

    project, project_backward (the SH evaluation within), Adam   by contiguous ranges of Gaussians
    bin_tiles, rasterize, rasterize_backward, image_loss         by contiguous ranges of tile rows

Parts that share a device (virtual parts, or one GPU) share one binning of the view: its intersections
are sorted by tile, so each part's tile rows are a contiguous slice of it, and binning again per part
would repeat the scan of every Gaussian (the count, the emit) once a part.  Parts on separate
devices each bin only the intersections of their own tiles (``bin_tiles(tile_rows=)``), side by
side.  Either way the view's binning is a ``SplitBinning``, each part's tiles holding the lists a
binning of every tile gives them.  What crosses parts is
reduced here, explicitly: the loss (each part's share of the tiles, added: ``SplitLoss``) and
the screen-space gradient records behind the densification statistics (each part's raster
backward adds its tiles' gradients into the records; on separate devices each into its own
buffer, added here in part order).

``Placement(parts)`` alone is the virtual aggregate device (``--virtual-devices N``): the parts
run on this process's device, the GPU or the CPU backend, exactly as N devices would split the
work, so that N = 2 or 3 trains the bits of N = 1 on the CPU (each Gaussian's gradient is added
tile by tile in the same order; every per-Gaussian and per-element operator is its own row's).  On
the CPU they run one after another; on a GPU each part may have a stream of its own (``part_streams``,
``device.PartStreams``), forked from the caller's stream before every split operator and joined
back after it, so that the parts' small launches run side by side as separate devices' would (in a
step graph: the graph's parallel branches).  The parts of an operator write disjoint rows (of
Gaussians, of pixels), so the overlap changes no bit, but for the raster backward's gradient
records, which every part adds into: by float atomics, whose order varies from run to run with or
without the overlap, or, deterministic, in a fixed order that continues part by part, whose parts
therefore stay on the caller's stream, one after another (``rasterize_backward``).  With
``devices`` (real GPU ids, ``--devices``), part k runs with device k current, on its own stream,
the model's arrays in CUDA managed memory (``numbasplat.device``'s managed kit) prefetched to the
device before its part.  ``Placement()`` (one part, no devices) is the plain single device: each
operator is the one call it always was.
"""
from dataclasses import dataclass

import numpy as np

from . import backend as _backend
from . import device as _device
from .math import gaussian_ops as go
from .math.tiles import TILE, tile_grid
from .loss import l1_ssim_loss
from .rendering import (bin_tiles, depth_order, empty_projection, empty_render, project, project_backward, rasterize,
                        rasterize_backward, tile_row_bounds, tile_row_counts, _background)


def even_ranges(n, parts):
    """``parts`` contiguous ranges [first, last) covering 0..n-1, their sizes differing by one at most
    (the larger first)."""
    base, extra = divmod(int(n), int(parts))
    edges = np.cumsum([0] + [base + (k < extra) for k in range(parts)])
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


@dataclass
class SplitBinning:
    """A view's binning in parts of its tile rows: ``parts`` holds each part's (tile rows
    (first, last), the projection with the part's tile counts, its ``Binning``: its tiles'
    intersections alone), or, with ``shared``, the one ``Binning`` of every tile that all parts
    read their rows of (and the view's projection).  Binned into room (``Placement.bin_tiles(room=)``):
    ``total`` the intersections on the device (each part's, (parts,) int64; shared, the view's (1,))
    and ``overflow`` a (1,) device flag, nonzero where any part's did not fit; binned exactly, both None."""
    parts: list
    overflow: object = None
    total: object = None
    shared: object = None

    @property
    def n_isect(self):
        """The slots: the parts' (shared: the one binning's)."""
        return self.shared.n_isect if self.shared is not None else sum(b.n_isect for _, _, b in self.parts)

    @property
    def part_slots(self):
        """Each part's binning's slots (of an exact binning: its intersections), a tuple of ints."""
        return tuple(int(b.n_isect) for _, _, b in self.parts)


class SplitLoss:
    """The loss of a view as the sum of its parts' shares (each a ``LazyLoss`` over its tiles): the
    loss's reduction across parts, read (a device sync) only when ``float`` asks."""

    def __init__(self, shares):
        self.shares = shares

    def again(self):
        """The same shares, not yet read (``LazyLoss.again``: a step graph's replay writes them anew)."""
        return SplitLoss([s.again() for s in self.shares])

    def __float__(self):
        return float(sum(float(s) for s in self.shares))


class Placement:
    """Each operator of a step split ``parts`` ways (see the module's docstring), on ``backend``.

    ``devices``: the GPU of each part (real devices, a list as long as ``parts``); None: every part
    on this process's device (virtual devices).  ``separate_gradients``: each
    part's raster backward adds into its own gradient records, which ``rasterize_backward`` then
    adds up in part order (the reduction separate devices need; default: with ``devices``).
    ``shared_binning``: the parts read their tile rows of one binning of the view (default: where
    they share a device); else each part bins its own rows (``bin_tiles``).  ``part_streams``: each
    part on a CUDA stream of its own, forked and joined around every split operator (a
    ``device.PartStreams``, or True to make one; default: with ``devices``, and with virtual parts on a
    GPU, where side by side their small launches fill it as one part's would); False: every part on the
    caller's stream, one after another."""

    def __init__(self, parts=1, backend=None, devices=None, separate_gradients=None, shared_binning=None,
                 part_streams=None):
        if int(parts) != parts or parts < 1:
            raise ValueError(f"Placement: parts must be a whole number of at least 1, got {parts!r}")
        if devices is not None and len(devices) != parts:
            raise ValueError(f"Placement: {parts} parts on {len(devices)} devices")
        self.parts = int(parts)
        self.backend = backend or _backend.BACKEND
        self.devices = None if devices is None else [int(d) for d in devices]
        self.separate_gradients = (devices is not None and len(set(devices)) > 1) if separate_gradients is None \
            else bool(separate_gradients)
        self.shared_binning = (devices is None or len(set(devices)) == 1) if shared_binning is None \
            else bool(shared_binning)
        if part_streams is None:
            part_streams = devices is not None or (self.parts > 1 and _backend.on_gpu(self.backend))
        if devices is not None and part_streams is False:
            raise ValueError("Placement: parts on separate devices run on their devices' streams (part_streams)")
        if part_streams is True:
            part_streams = _device.PartStreams(self.parts, self.devices)
        self.streams = part_streams or None  # (a device.PartStreams, or None: the caller's stream)
        self._advised = None  # the model buffers whose rows were last advised to their GPUs (``_advise``)
        self._bounds = (None, None)  # (a tile grid, its parts' first tiles on the device: ``_tile_bounds``)

    @property
    def split(self):
        """Whether an operator runs in more than one piece (else each is the plain call)."""
        return self.parts > 1 or self.devices is not None

    @property
    def managed(self):
        """Whether the arrays live in CUDA managed memory (on real devices), where a GPU's free memory
        does not bound the model (it pages from the host past it)."""
        return self.devices is not None

    @property
    def binnings(self):
        """How many binnings a view's split makes, each with its own room (``bin_tiles(room=)``): one
        where the parts share it."""
        return self.parts if self.split and not self.shared_binning else 1

    def describe(self):
        """One line for the log: how the step is split."""
        where = (f"on GPUs {self.devices}" if self.devices is not None else
                 "side by side on this device, a stream each" if self.streams is not None else
                 "one after another on this device")
        return f"aggregate device: every operator split {self.parts} ways, {where}"

    # ------------------------------------------------------------------ the split
    def gaussian_ranges(self, n):
        """Each part's Gaussians: contiguous rows [first, last) of ``n``."""
        return even_ranges(n, self.parts)

    def tile_row_ranges(self, camera):
        """Each part's tiles: contiguous rows of tiles [first, last) of ``camera``'s image."""
        return even_ranges(tile_grid(camera.width, camera.height)[1], self.parts)

    def _in_parts(self, shares, streams=True):
        """``(k, shares[k])`` for each part ``k`` of an operator in turn, what the caller queues with it on
        part ``k``'s stream (and GPU): the parts' streams wait for what the caller's stream had queued
        before the first (a fork), and the caller's stream waits for every part's after the last (a
        join), so that the parts run side by side and what follows reads every part's result.  Without
        part streams, or ``streams`` False, each part queues on the caller's stream, one after another."""
        if self.streams is None or not streams:
            yield from enumerate(shares)
            return
        fork = self.streams.fork()
        for k, share in enumerate(shares):
            with self.streams.on_part(k, fork):
                yield k, share
        self.streams.join()

    # ------------------------------------------------------------------ the operators
    def project(self, g, camera, sh_degree=None, antialias=False, check=None):
        """``rendering.project`` of ``g``, each part projecting its Gaussians into its rows of one
        ``Projection`` (the SH colours evaluated there too)."""
        if not self.split:
            return project(g, camera, sh_degree, antialias, self.backend, check)
        degree = g.sh_degree() if sh_degree is None else int(sh_degree)
        p = empty_projection(camera, len(g), g.means.dtype, degree, antialias, self.backend)
        for k, (a, b) in self._in_parts(self.gaussian_ranges(len(g))):
            _device.prefetch_rows(g.arrays().values(), a, b, self._device_of(k))
            project(g.rows(a, b), camera, degree, antialias, self.backend, check, into=p.rows(a, b))
        return p

    def bin_tiles(self, p, room=None, deterministic=False):
        """``rendering.bin_tiles`` of ``p``: split, a ``SplitBinning`` of the parts' tile rows, either
        one binning of the view that they share (``shared_binning``) or each part's of its rows'
        intersections alone, all in the view's one depth order.  ``room``: slots for the intersections
        (``bin_tiles(room=)``, no sync), an int for each binning (``binnings``: more than one, a
        sequence of each part's); None: exact (each part's: every part's total read in one sync)."""
        if not self.split:
            return bin_tiles(p, self.backend, room=room, deterministic=deterministic)
        ranges = self.tile_row_ranges(p.camera)
        if self.shared_binning:  # (one binning, not split: on the first part's GPU, or the caller's stream)
            for _ in self._in_parts([0], streams=self.devices is not None):
                b = bin_tiles(p, self.backend, room=room, deterministic=deterministic)
            return SplitBinning([(rows, p, b) for rows in ranges], b.overflow, b.total, shared=b)
        if room is not None and len(room) != self.parts:
            raise ValueError(f"Placement.bin_tiles: room for {len(room)} parts, the split has {self.parts}")
        counts = tile_row_counts(p, ranges, self.backend, bounds=self._tile_bounds(p.camera))
        if room is None:
            totals = _backend.to_host(counts.sum(axis=1, dtype=np.int64))  # (every part's, in one sync)
        order = depth_order(p, self.backend)  # (the view's, which every part's binning shares: one sort)
        parts = []
        for k, rows in self._in_parts(ranges):
            part_p = p.with_counts(counts[k])
            exact = dict(total=int(totals[k])) if room is None else dict(room=room[k])
            parts.append((rows, part_p, bin_tiles(part_p, self.backend, order=order, deterministic=deterministic,
                                                  tile_rows=rows, **exact)))
        if room is None:
            return SplitBinning(parts)
        xp = _backend.array_module(self.backend)
        return SplitBinning(parts, overflow=xp.concatenate([b.overflow for _, _, b in parts]).max(keepdims=True),
                            total=xp.concatenate([b.total for _, _, b in parts]))

    def slots(self, b):
        """``bin_tiles``' slots of the binning ``b`` (binned exactly: its intersections): an int for one
        binning, a tuple of each part's for several (``binnings``), as ``bin_tiles(room=)`` takes them."""
        return b.part_slots if self.binnings > 1 else b.n_isect

    def _tile_bounds(self, camera):
        """The parts' first tiles and the end (``tile_row_counts``' bounds) for ``camera``'s tile grid, on the
        device once per grid: an upload inside a step would keep a step graph from capturing it."""
        key = tuple(camera.tiles)
        if self._bounds[0] != key:
            bounds = tile_row_bounds(camera, self.tile_row_ranges(camera))
            self._bounds = (key, _backend.array_module(self.backend).asarray(bounds))
        return self._bounds[1]

    def rasterize(self, p, b, background=None):
        """``rendering.rasterize``: each part composites the pixels of its tile rows into one ``Render``."""
        if not self.split:
            return rasterize(p, b, background, self.backend)
        xp = _backend.array_module(self.backend)
        r = empty_render(p.camera.height, p.camera.width, p.proj.dtype, _background(xp, background, p.proj.dtype),
                         self.backend)
        for _, (rows, part_p, part_b) in self._in_parts(b.parts):
            rasterize(part_p, part_b, r.background, self.backend, tile_rows=rows, into=r)
        return r

    def image_loss(self, image, target, lam, tiles=None):
        """``loss.l1_ssim_loss`` (lazy) of ``image`` against ``target``: split, the sum of each part's
        share over its tile rows (``SplitLoss``), and the image gradient assembled from each part's
        rows (each right on its own tiles).  ``tiles``: a caller's own share of the tiles (one part).
        (Side by side, neighbouring parts write the same values into the SSIM maps of the tile row
        between them, which the CUDA loss keeps in one scratch array: each tile's maps are its own
        pixels', whichever part computes them.)"""
        if not self.split or tiles is not None:
            return l1_ssim_loss(image, target, lam, backend=self.backend, tiles=tiles, lazy=True)
        H, W = image.shape[:2]
        tx = tile_grid(W, H)[0]
        shares, d_image = [], None
        for _, (first, last) in self._in_parts(even_ranges(tile_grid(W, H)[1], self.parts)):
            share, d = l1_ssim_loss(image, target, lam, backend=self.backend, tiles=(first * tx, last * tx),
                                    lazy=True)
            if d_image is None:
                d_image = _backend.array_module(self.backend).empty_like(d)
            d_image[first * TILE:last * TILE] = d[first * TILE:last * TILE]
            shares.append(share)
        return SplitLoss(shares), d_image

    def rasterize_backward(self, p, b, r, d_image, deterministic=False):
        """``rendering.rasterize_backward``: each part's tile rows' backward, its gradients added into
        the view's records (in part order: a Gaussian's gradient is added tile by tile as one pass
        adds it); with ``separate_gradients``, into the part's own records, added up here.  Where the
        order is the bits (``deterministic`` into one record array: each part's sums continue the last
        part's), the virtual parts run one after another on the caller's stream; else side by side
        (float atomics: their order varies from run to run whether or not the parts overlap)."""
        if not self.split:
            return rasterize_backward(p, b, r, d_image, backend=self.backend, deterministic=deterministic)
        xp = _backend.array_module(self.backend)
        shape = (p.proj.shape[0], go.GRAD_FIELDS)
        grads = [xp.zeros(shape, p.proj.dtype) for _ in (b.parts if self.separate_gradients else b.parts[:1])]
        in_order = deterministic and not self.separate_gradients and self.devices is None
        for k, (rows, part_p, part_b) in self._in_parts(b.parts, streams=not in_order):
            rasterize_backward(part_p, part_b, r, d_image, grad=grads[k if self.separate_gradients else 0],
                               backend=self.backend, deterministic=deterministic, tile_rows=rows)
        total = grads[0]
        for more in grads[1:]:  # the cross-part reduction of the screen-space gradients
            total += more
        return total

    def project_backward(self, g, p, grad, out, accumulate=True):
        """``rendering.project_backward`` into ``out``: each part's Gaussians' rows."""
        if not self.split:
            return project_backward(g, p, grad, out, accumulate=accumulate, backend=self.backend)
        for _, (a, b) in self._in_parts(self.gaussian_ranges(len(g))):
            project_backward(g.rows(a, b), p.rows(a, b), grad[a:b], out.rows(a, b), accumulate=accumulate,
                             backend=self.backend)
        return out

    def prepare_adam(self, adam):
        """Upload what the split's ``adam_update`` reads of ``adam`` (each part's rows' layouts, once per
        model size), before a step that a step graph may capture (an upload there stops the capture).
        Call after ``adam.set_step``."""
        if self.split:
            for rows in self.gaussian_ranges(adam.params.n):
                adam.group_spans(*rows)

    def adam_update(self, adam, grads, visible=None, skip=None):
        """``Adam.update`` of the step: each part updates its Gaussians' rows of every group (the rows'
        layouts uploaded first on the caller's stream, where the parts' streams wait for them: parts of
        one size share one)."""
        if not self.split:
            return adam.update(grads, visible, skip)
        self.prepare_adam(adam)
        buffers = (adam.params.data, grads, adam.m, adam.v)
        if self.devices is not None:
            self._advise(adam, buffers)
        for k, rows in self._in_parts(self.gaussian_ranges(adam.params.n)):
            if self.devices is not None:
                for lo, hi in adam.group_spans(*rows):
                    _device.prefetch_rows(buffers, lo, hi, self.devices[k])
            adam.update(grads, visible, skip, rows=rows)

    def _advise(self, adam, buffers):
        """On separate devices, once per model (densification makes new buffers): each part's rows of
        every group of the flat buffers preferred on its GPU and mapped for the others
        (``device.advise_rows``), so that a part's operators find them at home."""
        key = tuple(int(b.data.ptr) for b in buffers) + (adam.params.n,)
        if self._advised == key:
            return
        for k, rows in enumerate(self.gaussian_ranges(adam.params.n)):
            others = [d for d in self.devices if d != self.devices[k]]
            for lo, hi in adam.group_spans(*rows):
                _device.advise_rows(buffers, lo, hi, self.devices[k], others)
        self._advised = key

    def _device_of(self, k):
        return None if self.devices is None else self.devices[k]
