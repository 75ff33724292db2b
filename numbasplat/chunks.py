"""A view rendered in depth-ordered chunks of its Gaussians: the same image and gradients as one
render of them all, with the device memory of a chunk (issue 60: any view under any cap).

The view's visible Gaussians are split by the depth key that ``bin_tiles`` sorts by
(``depth_chunks``), so every tile meets the chunks' Gaussians in the order it would meet them
all.  The forward pass rasterizes the chunks front to back, each pixel starting where the chunk
in front left it (``rasterize(state=)``: its transmittance, colour and depth so far, and whether
it has ended at T_MIN); the backward pass runs them back to front, each pixel starting from what
the chunk behind left (``rasterize_backward(state=)``: its transmittance, the colour and depth
behind, which is ``compose_backward``'s A_{m+1} R_{m+1}, and the gradient by the final
transmittance).  Both states are exactly what one pass carries from one Gaussian to the next, so
the early stop at T_MIN, the ALPHA_MIN cut and the 0.99 clamp act as in one pass, which
composing independent partial images (``numbasplat.compose``) cannot do: a pixel that ends in
one chunk takes nothing from the chunks behind it.

Between chunks only per-pixel state is kept: the state itself (``STATE_FIELDS`` values a pixel),
and for the backward the chunk in which each pixel ended and where in it (``ChunkedFrame.ended``,
``stop``); the backward starts a pixel at the end of its tile's range in a chunk it passed
through (the Gaussians after its last contributor there are under the alpha cut, which the
backward skips as the forward did).  Unless ``keep``, the backward projects and bins each chunk
again (the same bits: both are deterministic), so the memory a view needs is a chunk's.
"""
from dataclasses import dataclass, field

import numpy as np

from . import backend as _backend
from .gaussians import CHECKS, Gaussians
from .math.tiles import TILE
from .rendering import (Camera, Frame, Render, behind_state, bin_tiles, front_state, project, project_backward,
                        rasterize, rasterize_backward)


def _dispatch(backend):
    kernels = _backend.kernels(backend)
    return kernels, kernels.array_module()


def _rows(g: Gaussians, a, b):
    """Rows a..b-1 of ``g`` as views (contiguous: row slices of C-ordered arrays)."""
    return Gaussians(**{k: v[a:b] for k, v in g.arrays().items()})


def depth_keys(g: Gaussians, camera: Camera, antialias=False, batch=None, backend=None, check=None):
    """The sort key of each Gaussian of ``g`` in ``camera``'s view, as ``bin_tiles`` sorts by: its
    depth, or infinity where it is not drawn (behind the camera, off the image, under ALPHA_MIN).
    (N,) float32.  Projected ``batch`` rows at a time (None: all at once), so that the
    projection's memory is a batch's."""
    kernels, xp = _dispatch(backend)
    g.validate(xp, CHECKS if check is None else check)
    n = len(g)
    keys = xp.empty(n, np.float32)
    step = n if batch is None else max(1, int(batch))
    for a in range(0, n, max(step, 1)):
        rows = _rows(g, a, min(n, a + step))
        p = project(rows, camera, sh_degree=0, antialias=antialias, backend=backend, check=False)
        kernels.depth_keys(p.proj, p.counts, keys[a:a + len(rows)])
    return keys


def depth_chunks(g: Gaussians, camera: Camera, chunk_size, antialias=False, backend=None, check=None):
    """The Gaussians of ``g`` drawn in ``camera``'s view, split into chunks of at most
    ``chunk_size``, front to back: a list of (n,) int64 index arrays (on the backend's device), the
    first chunk the nearest, each in depth order.  The order is ``bin_tiles``'s (its depth key,
    ties by index, ``depth_keys``), so chunk k's Gaussians all come before chunk k + 1's in every
    tile, Gaussians of equal depth included.  At least one chunk, empty where nothing is drawn.
    The depth keys are computed ``chunk_size`` rows at a time; one sync (the count drawn)."""
    chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"depth_chunks: chunk_size must be at least 1, got {chunk_size}")
    _, xp = _dispatch(backend)
    keys = depth_keys(g, camera, antialias, chunk_size, backend, check)
    order = xp.argsort(keys, kind="stable") if xp is np else xp.argsort(keys)  # (CuPy's is stable)
    drawn = int(xp.count_nonzero(keys < np.float32(np.inf)))
    order = order[:drawn].astype(np.int64, copy=False)
    return [order[a:a + chunk_size] for a in range(0, drawn, chunk_size)] or [order[:0]]


@dataclass
class ChunkedFrame:
    """What a chunked forward render keeps for its backward: per-pixel arrays and the chunks' index
    arrays, plus each chunk's ``Frame`` where ``render_chunked(keep=True)``."""
    camera: Camera
    chunks: list          # the chunks' index arrays into the Gaussians, front to back
    render: Render        # the view's render; its ``last`` is ``stop``
    ended: object         # (H, W) int32 the chunk in which each pixel ended at T_MIN (len(chunks): none)
    stop: object          # (H, W) int32 where it ended: its ``last`` in that chunk's binning (0: none)
    sh_degree: int = None
    antialias: bool = False
    deterministic: bool = False
    frames: list = field(default=None)  # per chunk: its Frame (keep=True), else None

    @property
    def image(self):
        return self.render.image


def render_chunked(g: Gaussians, camera: Camera, chunks, sh_degree=None, background=None, antialias=False,
                   backend=None, check=None, deterministic=False, keep=False):
    """Render ``g`` in ``camera``'s view one chunk of Gaussians at a time, front to back (``chunks``:
    ``depth_chunks``'s): the same image, transmittance and depth as ``render`` (to the bit on the
    CPU, where the state is float64).  ``keep``: keep each chunk's projection and binning for the
    backward (memory of them all); otherwise ``render_chunked_backward`` computes them again.
    ``deterministic``: the chunks binned for ``rasterize_backward(deterministic=True)``.
    -> ``ChunkedFrame``."""
    kernels, xp = _dispatch(backend)
    g.validate(xp, CHECKS if check is None else check)
    degree = g.sh_degree() if sh_degree is None else int(sh_degree)
    if not chunks:
        raise ValueError("render_chunked: no chunks (depth_chunks gives at least one)")
    frame = chunked_frame(camera, chunks, degree, antialias, deterministic, keep, backend)
    state = front_state(camera, backend)
    for k, idx in enumerate(chunks):
        p = project(g.take(idx), camera, degree, antialias, backend, check=False)
        b = bin_tiles(p, backend, deterministic=deterministic)
        rasterize_chunk(frame, k, p, b, state, background, backend)
    return frame


def chunked_frame(camera: Camera, chunks, sh_degree, antialias=False, deterministic=False, keep=False,
                  backend=None):
    """An empty ``ChunkedFrame`` of ``camera``'s view in ``chunks`` (``depth_chunks``'s, or any list
    of that many chunks), to fill with ``rasterize_chunk`` front to back (its ``render`` is the
    view's once the last chunk is in).  For a caller that holds one chunk's Gaussians at a time
    (the out-of-core trainer) and projects and bins them itself."""
    _, xp = _dispatch(backend)
    H, W = camera.height, camera.width
    return ChunkedFrame(camera, list(chunks), None, xp.full((H, W), len(chunks), np.int32),
                        xp.zeros((H, W), np.int32), int(sh_degree), bool(antialias), bool(deterministic),
                        [] if keep else None)


def rasterize_chunk(frame: ChunkedFrame, k, p, b, state, background=None, backend=None):
    """Chunk ``k``'s part of a chunked forward render (``p``, ``b``: its Gaussians projected and
    binned), each pixel starting from ``state`` (``front_state``, then what the chunk in front
    left: updated in place); records where pixels ended in ``frame``.  -> the chunk's ``Render``."""
    _, xp = _dispatch(backend)
    was_done = state[5] != 0
    r = rasterize(p, b, background, backend, state=state)
    ends_here = (state[5] != 0) & ~was_done
    frame.ended = xp.where(ends_here, np.int32(k), frame.ended)
    frame.stop = xp.where(ends_here, r.last, frame.stop)
    if frame.frames is not None:
        frame.frames.append(Frame(p, b, r))
    frame.render = Render(r.image, r.trans, r.depth, frame.stop, r.background)
    return r


def rasterize_chunk_backward(frame: ChunkedFrame, k, p, b, d_image, state, d_depth=None, render=None,
                             backend=None):
    """Chunk ``k``'s part of a chunked backward (``p``, ``b``: its Gaussians projected and binned
    as the forward did), each pixel starting from ``state`` (``behind_state`` of ``frame.render``,
    then what the chunk behind left: updated in place).  ``render``: the render whose ``trans``
    the raster backward reads (default the view's).  -> the chunk's screen-space gradients."""
    r = frame.render if render is None else render
    last = chunk_last(frame, k, b.ranges, backend)
    return rasterize_backward(p, b, Render(None, r.trans, None, last, frame.render.background), d_image, None,
                              d_depth, backend=backend, deterministic=frame.deterministic, state=state)


_PIXEL_TILES = {}


def _pixel_tiles(xp, H, W):
    """(H, W) int64: the row-major tile of each pixel (cached per size)."""
    key = (xp.__name__, H, W)
    if key not in _PIXEL_TILES:
        tiles_x = (W + TILE - 1) // TILE
        y, x = np.mgrid[:H, :W]
        _PIXEL_TILES[key] = xp.asarray((y // TILE) * tiles_x + x // TILE)
    return _PIXEL_TILES[key]


def chunk_last(frame: ChunkedFrame, k, ranges, backend=None):
    """Where each pixel's backward starts in chunk k's binning (``ranges``): where it ended if it
    ended in chunk k, the end of its tile's range if it passed through chunk k, the start (nothing)
    if it had ended in front.  (H, W) int32."""
    _, xp = _dispatch(backend)
    tiles = _pixel_tiles(xp, frame.camera.height, frame.camera.width)
    end = ranges[:, 1][tiles]
    start = ranges[:, 0][tiles]
    return xp.where(frame.ended == k, frame.stop, xp.where(frame.ended > k, end, start)).astype(np.int32)


def render_chunked_backward(g: Gaussians, frame: ChunkedFrame, d_image, d_alpha=None, d_depth=None, out=None,
                            accumulate=False, records=None, backend=None):
    """Parameter gradients of a chunked render, chunk by chunk from the back: the same as
    ``render_backward`` of one render (to the bit on the CPU).  Written into ``out`` (a new
    ``Gaussians`` if None), or added to it with ``accumulate=True``.  ``records``: an (N,
    GRAD_FIELDS) array that each Gaussian's screen-space gradient record is added into (the
    densification statistics' input), rows of ``g``.  Deterministic where ``frame`` is
    (``render_chunked(deterministic=True)``).  -> ``out``."""
    kernels, xp = _dispatch(backend)
    if out is None:
        out = Gaussians(**{k: xp.zeros_like(a) for k, a in g.arrays().items()})
    elif not accumulate:
        for a in out.arrays().values():
            a[...] = 0
    state = behind_state(frame.render, d_alpha, backend)
    for k in range(len(frame.chunks) - 1, -1, -1):
        idx = frame.chunks[k]
        if not len(idx):  # (nothing drawn: the one chunk is empty)
            continue
        rows = g.take(idx)
        if frame.frames is not None:
            p, b, r = frame.frames[k].projection, frame.frames[k].binning, frame.frames[k].render
        else:
            p = project(rows, frame.camera, frame.sh_degree, frame.antialias, backend, check=False)
            b = bin_tiles(p, backend, deterministic=frame.deterministic)
            r = frame.render
        grad = rasterize_chunk_backward(frame, k, p, b, d_image, state, d_depth, r, backend)
        if records is not None:
            records[idx] += grad
        part = project_backward(rows, p, grad, backend=backend)
        for name, a in part.arrays().items():
            getattr(out, name)[idx] += a
    return out
