"""The rendering API: project, bin, rasterize, and the backward of each.

Stages are separate calls because the distributed pipelines put exchanges
between them (projection is per Gaussian, everything after binning per tile).
``render`` and ``render_backward`` chain them for the single-GPU case.

Arrays live where the backend wants them: numpy for ``cpu`` (and the CUDA
simulator), CuPy for ``cuda`` on a GPU.  Every function takes ``backend=None``
meaning the process default, and runs that backend's kernels
(``numbasplat.backend.kernels``).
"""
from dataclasses import dataclass

import numpy as np

from . import backend as _backend
from .device import HostCopy, address
from .gaussians import CHECKS, Gaussians
from .math import gaussian_ops as go
from .math.tiles import TILE, TILE_PIXELS, tile_grid
from .tile_loss import loss_from_tile_sums, tile_loss_sums

INT32_MAX = 2**31 - 1
ROOM_MARGIN, ROOM_SLACK = 1.2, 4096  # binning into room (``bin_tiles(room=)``): slots for an expected total


def room_slots(total, margin=ROOM_MARGIN, slack=ROOM_SLACK):
    """Slots to bin into (``bin_tiles(room=)``) where ``total`` intersections are expected: ``margin`` times
    it plus ``slack``, at most ``INT32_MAX``.  ``total`` a number -> an int; each part's of a split binning
    (a sequence) -> a tuple of each part's."""
    slots = np.minimum((margin * np.asarray(total, np.float64)).astype(np.int64) + slack, INT32_MAX)
    return int(slots) if slots.ndim == 0 else tuple(int(k) for k in slots)


def _dispatch(backend):
    """The backend's kernels and array module."""
    kernels = _backend.kernels(backend)
    return kernels, kernels.array_module()


@dataclass
class Camera:
    """Pinhole camera: 4x4 world-to-camera (OpenCV axes) and intrinsics in pixels."""
    viewmat: np.ndarray
    fx: float
    fy: float
    cx: float
    cy: float
    width: int
    height: int

    def __post_init__(self):
        self.viewmat = np.asarray(self.viewmat, np.float64)
        if self.viewmat.shape != (4, 4):
            raise ValueError(f"camera viewmat must be 4x4, got shape {self.viewmat.shape}")
        for name in ("fx", "fy", "cx", "cy"):
            val = float(getattr(self, name))
            if not np.isfinite(val):
                raise ValueError(f"camera {name} is not finite: {val}")
            setattr(self, name, val)
        if not np.isfinite(self.viewmat).all():
            raise ValueError("camera viewmat has non-finite values")
        if self.fx <= 0 or self.fy <= 0:
            raise ValueError(f"camera focal lengths must be positive, got fx={self.fx}, fy={self.fy}")
        if int(self.width) <= 0 or int(self.height) <= 0:
            raise ValueError(f"camera size must be positive, got {self.width}x{self.height}")
        self.width = int(self.width)
        self.height = int(self.height)

    @classmethod
    def from_K(cls, viewmat, K, width, height):
        K = np.asarray(K, np.float64)
        return cls(viewmat, K[0, 0], K[1, 1], K[0, 2], K[1, 2], width, height)

    @property
    def tiles(self):
        return tile_grid(self.width, self.height)

    def packed(self):
        """The 19 floats the kernels read: R (row-major), t, fx, fy, cx, cy, camera centre."""
        R = self.viewmat[:3, :3]
        t = self.viewmat[:3, 3]
        centre = -R.T @ t
        return np.concatenate([R.ravel(), t, [self.fx, self.fy, self.cx, self.cy], centre])


@dataclass
class Projection:
    camera: Camera
    cam: object          # packed camera on the device
    proj: object         # (N, PROJ_FIELDS), or wider rows (the kernels read the first PROJ_FIELDS)
    radii: object        # (N, 2) int32, 0 where not visible
    counts: object       # (N,) int32 tiles touched
    sh_degree: int
    antialias: bool

    def rows(self, first, last):
        """The records of Gaussians first..last-1: views of this projection's arrays (what a
        projection of those rows alone writes, ``project(into=)``)."""
        return Projection(self.camera, self.cam, self.proj[first:last], self.radii[first:last],
                          self.counts[first:last], self.sh_degree, self.antialias)

    def with_counts(self, counts):
        """This projection with other tile counts (a part of the tiles' share: ``bin_tiles(tile_rows=)``)."""
        return Projection(self.camera, self.cam, self.proj, self.radii, counts, self.sh_degree, self.antialias)


def empty_projection(camera, n, dtype, sh_degree, antialias, backend=None):
    """A ``Projection`` of ``n`` Gaussians into ``camera`` not yet written (``project(into=)`` writes
    its rows)."""
    kernels, xp = _dispatch(backend)
    return Projection(camera, _constant(xp, camera.packed().astype(dtype)), xp.zeros((n, go.PROJ_FIELDS), dtype),
                      xp.empty((n, 2), np.int32), xp.empty(n, np.int32), int(sh_degree), bool(antialias))


@dataclass
class Binning:
    ids: object          # (M,) int32 Gaussian of each intersection, sorted by (tile, depth)
    ranges: object       # (tiles, 2) int32 [start, end) into ids
    n_isect: int         # M: the intersections, or with ``bin_tiles(room=)`` the slots they were binned into
    total: object = None     # (1,) int64 on the device: the intersections (with ``room``, maybe more than M)
    overflow: object = None  # with ``room``: (1,) int32 on the device, 1 if the intersections did not fit
    # ``bin_tiles(deterministic=True)`` keeps what ``rasterize_backward(deterministic=True)`` sums by:
    perm: object = None      # (M,) int64 the slot each sorted intersection was emitted at (a Gaussian's are
                             # contiguous: ends[k] - counts[order[k]], ..., ends[k] - 1)
    order: object = None     # (N,) int64 the Gaussians in depth order
    ends: object = None      # (N,) int64 the running count of tiles in that order


@dataclass
class Render:
    image: object        # (H, W, 3)
    trans: object        # (H, W) final transmittance T; alpha = 1 - T
    depth: object        # (H, W) sum of w_i z_i (divide by alpha for expected depth)
    last: object         # (H, W) int32 end of the contributing range
    background: object

    @property
    def alpha(self):
        return 1.0 - self.trans


def project(g: Gaussians, camera: Camera, sh_degree=None, antialias=False, backend=None, check=None, into=None):
    """Project every Gaussian into ``camera``'s image: its screen-space record (EWA splatting, the
    colour of its SH towards the camera) and the count of tiles it touches, which ``bin_tiles`` sorts by.

    Args:
        g: the Gaussians in 3DGS's parameters (before activation), arrays of the backend's kind (CuPy on
            a GPU, numpy on the CPU and in the simulator), float32 (the CPU also takes float64, and then
            computes in it, for finite-difference checks), all of one dtype:
            ``means`` (N, 3): the centres in world space;
            ``scales`` (N, 3): the logarithms of the standard deviations along the Gaussian's axes;
            ``quats`` (N, 4): the rotations as wxyz quaternions, not necessarily of unit length;
            ``opacities`` (N,): the opacity logits (the opacity is their sigmoid);
            ``sh`` (N, K, 3): the spherical-harmonics coefficients of each colour channel, K = (d + 1)^2
            for a degree d <= 3, band 0 holding (rgb - 0.5) / C0.
        camera: a pinhole ``Camera``: ``viewmat`` (4, 4) world to camera in OpenCV axes (x right, y down,
            z forward), ``fx``, ``fy``, ``cx``, ``cy`` in pixels (pixel i covers [i, i + 1)), ``width``
            and ``height`` in pixels.
        sh_degree: the SH bands to evaluate, 0 .. ``g.sh_degree()`` (None: every band ``g.sh`` holds).
        antialias: scale each opacity by sqrt(det(cov) / det(cov + 0.3 I)), making up for the screen-space
            dilation of its 2D covariance (Mip-Splatting's 2D filter, gsplat's "antialiased" mode).
        backend: "cpu" or "cuda" (None: the process default, ``numbasplat.BACKEND``).
        check: whether to check that the parameters are finite, a device sync (None: unless
            ``NUMBASPLAT_CHECKS=0``); their shapes are always checked (``ValueError``).
        into: a ``Projection`` of ``len(g)`` rows of ``g``'s dtype to write (``Projection.rows`` of a
            larger one: a part of the Gaussians projected on its own, ``numbasplat.placement``), and
            return; None: new arrays.

    Returns:
        A ``Projection``, its arrays on the backend's device:
        ``proj`` (N, PROJ_FIELDS) of ``g``'s dtype: each Gaussian's record, u, v (its centre in pixels),
        conic a, b, c (the inverse of its 2D covariance + 0.3 I, in pixels), opacity (after the sigmoid and
        ``antialias``), r, g, b (the SH colour + 0.5, clamped at 0) and its depth (camera z);
        ``radii`` (N, 2) int32: its half extents in pixels along x and y, out to where its alpha falls
        to 1/255;
        ``counts`` (N,) int32: the TILE x TILE pixel tiles it touches.
        A Gaussian that is not drawn has radii and count 0: one behind the near plane, degenerate or of
        opacity not above ALPHA_MIN (its record then all 0), or one off the image.  Also ``cam`` (the
        packed camera on the device) and ``camera``, ``sh_degree`` and ``antialias`` as they were used.
    """
    kernels, xp = _dispatch(backend)
    g.validate(xp, CHECKS if check is None else check)
    dtype = g.means.dtype
    degree = g.sh_degree() if sh_degree is None else int(sh_degree)
    if not 0 <= degree <= g.sh_degree():
        raise ValueError(f"sh_degree must be in 0..{g.sh_degree()}, got {sh_degree}")
    n = len(g)
    if into is None:
        into = empty_projection(camera, n, dtype, degree, antialias, backend)
    elif len(into.counts) != n or into.proj.dtype != dtype or into.sh_degree != degree:
        raise ValueError(f"project: into holds {len(into.counts)} {into.proj.dtype} rows of degree "
                         f"{into.sh_degree}, for {n} {dtype} Gaussians of degree {degree}")
    tx, ty = camera.tiles
    if n:
        kernels.project(g.means, g.quats, g.scales, g.opacities, g.sh, degree, into.cam, camera.width,
                        camera.height, bool(antialias), TILE, tx, ty, into.proj, into.radii, into.counts)
    return into


LOD_SIGMAS = 3.0  # ``cull``'s footprint: this many standard deviations of the largest axis


def cull(p: Projection, g: Gaussians, skip=None, bit=0, min_px=0.0, backend=None, spare=None):
    """Hide rows of the projection ``p`` of ``g`` in place (no tiles), so that binning,
    rasterization and ``project_backward`` pass over them (their gradients are 0): those with bit
    ``bit`` set in their row of ``skip`` ((N, bytes) uint8, np.packbits' order; None: none), which
    keep their radius (the densification statistics still count the view: ``screen_gradient_stats``),
    and, with ``min_px`` > 0, those whose footprint (``LOD_SIGMAS`` standard deviations of the
    largest axis times the larger focal length over the distance to the camera centre) is under
    ``min_px`` pixels, but the rows where ``spare`` ((N,) uint8; None: none) is set (radius 0).
    One pass over the rows, with no sync: culling after projection rather than gathering the kept
    rows before it.  -> ``p``."""
    kernels, xp = _dispatch(backend)
    if skip is None:
        skip = xp.zeros((0, 1), np.uint8)
    elif skip.shape[0] != len(g) or not 0 <= bit < 8 * skip.shape[1]:
        raise ValueError(f"cull: skip of shape {skip.shape} has no bit {bit} for each of {len(g)} rows")
    if spare is None:
        spare = xp.zeros(0, np.uint8)
    elif spare.shape != (len(g),) or spare.dtype != np.uint8:
        raise ValueError(f"cull: spare must be ({len(g)},) uint8, got {spare.shape} {spare.dtype}")
    if len(g):
        kernels.cull(g.means, g.scales, p.cam, skip, bit // 8, 7 - bit % 8, np.float32(min_px),
                     np.float32(LOD_SIGMAS), spare, p.radii, p.counts)
    return p


def _stable_argsort(xp, a):
    # CuPy's argsort is a stable radix sort; numpy needs to be asked
    return xp.argsort(a, kind="stable") if xp is np else xp.argsort(a)


def projection_bytes(dtype=np.float32):
    """Device bytes ``project`` allocates per Gaussian: its record (``PROJ_FIELDS`` of ``dtype``), radii
    (2 int32) and tile count (int32)."""
    return go.PROJ_FIELDS * np.dtype(dtype).itemsize + 2 * 4 + 4


def gradient_record_bytes(dtype=np.float32):
    """Device bytes ``rasterize_backward`` allocates per Gaussian: its gradient record (``GRAD_FIELDS`` of
    ``dtype``)."""
    return go.GRAD_FIELDS * np.dtype(dtype).itemsize


# ``bin_tiles`` at its peak, per Gaussian: the depth order and the running counts (the depth keys are
# freed once sorted, in ``depth_order``)
BINNING_GAUSSIAN_BYTES = 8 + 8
BINNING_RANGE_BYTES = 8  # per tile: its [start, end)


def tile_key_dtype(tiles):
    """The dtype of the intersections' sort keys (``bin_tiles``) over ``tiles`` tiles (of every view binned
    at once): uint16 while they and the pad key after them fit, else uint32."""
    return np.dtype(np.uint16) if tiles < 2**16 else np.dtype(np.uint32)


def binning_intersection_bytes(tiles):
    """Device bytes ``bin_tiles`` (exact, one view) holds at once per intersection at its peak, the larger
    of its sort's and its gather's: the id (int32) and sort key (``tile_key_dtype``) as emitted and the
    sort's permutation (int64); then, the keys let go once sorted, the emitted id, the permutation and the
    sorted id (CuPy's sort adds its scratch: not counted; the returned ``Binning`` keeps the sorted ids
    alone).  Its peak: ``BINNING_GAUSSIAN_BYTES`` per Gaussian, this per intersection and
    ``BINNING_RANGE_BYTES`` per tile (the counts the emission adds up, turned into the ranges in place)."""
    return max(4 + tile_key_dtype(tiles).itemsize + 8, 4 + 8 + 4)


def sort_scratch_bytes(tiles):
    """Device bytes per intersection that a GPU's sort of the intersections takes beside ``bin_tiles``'
    arrays, an estimate: CuPy's argsort sorts a copy of the keys, by thrust's radix sort, which double
    buffers the keys and the int64 indices (numpy's sort on the CPU takes no arrays: none counted there)."""
    key = tile_key_dtype(tiles).itemsize
    return key + key + 8


def depth_order(p: Projection, backend=None):
    """The binning's first sort: ``p``'s Gaussians by depth, those that touch no tile last (N float32
    keys, stable: ties in index order)."""
    kernels, xp = _dispatch(backend)
    depth = xp.empty(len(p.counts), np.float32)  # culled Gaussians sort last and emit nothing (no compaction: no sync)
    if len(depth):
        kernels.depth_keys(p.proj, p.counts, depth)
    return _stable_argsort(xp, depth)


def bin_tiles(p: Projection, backend=None, total=None, view_of=None, n_views=1, room=None, deterministic=False,
              tile_rows=None, order=None):
    """Every tile-Gaussian intersection, sorted by (tile, depth); per-tile ranges.

    Two short sorts instead of one of 64-bit (tile, depth) keys: the visible
    Gaussians by depth (N float32 keys), then their intersections, emitted in
    that order, stably by tile id (16-bit keys when the tiles fit:
    ``tile_key_dtype``).  Ties keep Gaussian index order, as a single stable key
    sort would.  ``total``, the sum of ``p.counts`` where the caller knows it,
    saves reading it back (a sync).

    ``room`` bins without knowing the total (no sync either): into that many slots.
    If the total does not fit, the Gaussians from the first one that does not fit
    (in depth order) on are left out, and ``Binning.overflow`` (a device flag) says
    so; ``Binning.total`` holds the total on the device, to read later.

    Records of several views of one size (a renderer's batch under MPI) bin at
    once with ``view_of`` (each record's view, int32) and ``n_views``: view b's
    tile t is then tile b * tiles + t of the ranges.

    The emission writes each intersection's sort key in its final form and width
    (the view's offset and a part's rows applied) and counts each tile's
    intersections as it writes them; each tile's range comes from those counts,
    not from the sorted order (a read of every key through the permutation).

    ``deterministic``: the binning also keeps the permutation from emitted to sorted
    intersections, the depth order and its running counts (``Binning.perm``, ``order``,
    ``ends``), by which ``rasterize_backward(deterministic=True)`` sums in a fixed order.

    ``tile_rows`` (first, last): the intersections of those rows of tiles only (a part of the
    tiles, ``numbasplat.placement``), ``p``'s counts being the part's (``tile_row_counts``: the
    Gaussians whose tile span reaches the rows); their tiles outside the rows sort after every
    tile, in no range, so each tile of the rows holds what a binning of every tile gives it, in
    the same order.  With ``room``, the part's intersections go into that many slots, as above.

    ``order``: ``depth_order`` of a projection of the same Gaussians whose tile counts cover
    ``p``'s (the view's, shared by the parts of its tile rows), which saves the sort: a Gaussian
    that touches none of ``p``'s tiles emits nothing wherever it sorts, and the others keep their
    relative order, so the binning is the one of ``p``'s own order.
    """
    kernels, xp = _dispatch(backend)
    tx, ty = p.camera.tiles
    n_tiles = tx * ty
    keep_from, keep_to = 0, n_tiles  # the view's tiles that get their own key; the others the pad key
    if tile_rows is not None:
        if n_views != 1:
            raise ValueError("bin_tiles: tile_rows bins one view")
        keep_from, keep_to = tile_rows[0] * tx, min(tile_rows[1] * tx, n_tiles)
    n_keys = n_views * n_tiles  # view b's tile t: key b * n_tiles + t; the pad key, n_keys, sorts after them all
    n = len(p.counts)
    order = depth_order(p, backend) if order is None else order
    ends = xp.cumsum(p.counts[order], dtype=np.int64)
    device_total = ends[-1:] if n else xp.zeros(1, np.int64)
    if room is not None:
        if not 0 <= int(room) <= INT32_MAX:
            raise ValueError(f"bin_tiles: room must be 0..{INT32_MAX} slots, got {room}")
        slots = int(room) if n else 0
    else:
        if total is None or xp is np:  # (free on the CPU, where the tests check the callers' totals)
            known, total = total, int(device_total[0])
            if known is not None and known != total:
                raise ValueError(f"bin_tiles: total {known} given, but the counts add up to {total}")
        if total > INT32_MAX:
            raise ValueError(f"{total} tile-Gaussian intersections exceed the int32 limit; "
                             "render at a lower resolution or with fewer/smaller Gaussians")
        slots = int(total)
    # slots left unwritten (room to spare) keep the pad key, which sorts after every tile, and
    # Gaussian 0 (a valid row for the CPU backward's per-slot rows, which stay 0 there)
    ids = xp.zeros(slots, np.int32) if room is not None else xp.empty(slots, np.int32)
    key_dtype = tile_key_dtype(n_keys)
    tile_of = xp.full(slots, n_keys, key_dtype) if room is not None else xp.empty(slots, key_dtype)
    overflow = xp.zeros(1, np.int32)
    # the emission counts each tile's intersections into its row's end column; the sort is stable and by
    # tile, so the counts alone give each tile's run of the sorted order (empty tiles: [0, 0))
    ranges = xp.zeros((n_keys, 2), np.int32)
    if n:
        views = xp.ascontiguousarray(view_of, np.int32) if n_views > 1 else _constant(xp, np.zeros(0, np.int32))
        kernels.emit_intersections(p.proj, order, p.counts, ends, TILE, tx, ty, p.camera.width, p.camera.height,
                                   views, keep_from, keep_to, n_keys, slots, tile_of, ids, ranges, overflow)
    if slots:
        perm = _stable_argsort(xp, tile_of)
        tile_of = None  # (sorted: let go before the gather)
        ids = ids[perm]
        kernels.ranges_from_counts(ranges)
    b = Binning(ids, ranges, slots, device_total, overflow if room is not None else None)
    if deterministic:
        b.perm = perm if slots else xp.zeros(0, np.int64)
        b.order, b.ends = order, ends
    return b


def tile_row_bounds(camera, row_ranges):
    """The first tile of each part that the contiguous ``row_ranges`` of ``camera``'s tile rows make, and
    the tiles' end: (parts + 1,) int64 on the host."""
    tx, ty = camera.tiles
    return np.array([min(first * tx, tx * ty) for first, _ in row_ranges] + [tx * ty], np.int64)


def tile_row_counts(p: Projection, row_ranges, backend=None, bounds=None):
    """Each part's tile counts of ``p``'s Gaussians, for the parts of the tiles that the contiguous
    ``row_ranges`` of tile rows make (``bin_tiles(tile_rows=)``): a Gaussian's count where its
    tile span reaches the part's rows (``route_plan``'s test, one launch for every part), 0
    elsewhere.  ``bounds``: the parts' first tiles and the end, where the caller keeps them on the
    device.  -> (parts, N) int32, each row contiguous."""
    kernels, xp = _dispatch(backend)
    if bounds is None:
        bounds = tile_row_bounds(p.camera, row_ranges)
    plan = xp.zeros((2, len(row_ranges), 1, len(p.counts)), np.int32)
    route_plan(p, 0, 0, bounds, plan, backend)
    return xp.ascontiguousarray(plan[1, :, 0])


def route_plan(p: Projection, view, first_tile, bounds, plan, backend=None):
    """The ranks that render view ``view``'s records (``gaussian_ops.route_body``): plan[0, d, view]
    marks the records that go to rank d, plan[1, d, view] their tile counts.  ``bounds``: the
    ranks' first tiles over the batch (P + 1), int64, on the host or already on the device (an
    upload from the host waits for the device to idle: a step's views share one); the view's tile
    ids start at ``first_tile``."""
    kernels, xp = _dispatch(backend)
    if len(p.proj):
        tx, ty = p.camera.tiles
        if not isinstance(bounds, xp.ndarray):  # (new bounds every step: not a cached constant)
            bounds = xp.asarray(np.asarray(bounds, np.int64))
        kernels.route(p.proj, p.counts, TILE, tx, ty, first_tile, bounds, view, plan)


def route_fill(p: Projection, view, plan, slot, send, route, backend=None):
    """Write view ``view``'s records into the send rows ``plan`` gives them (``slot``: the running
    count of plan[0] flattened): record, tile count, and route view * N + n."""
    kernels, _ = _dispatch(backend)
    if len(p.proj):
        kernels.route_fill(p.proj, p.counts, view, plan, slot, send, route)


def _background(xp, background, dtype):
    """The background as the kernels take it: a device copy of 3 host values, or (a trainer's
    ``DeviceValues`` that it rewrites each step) a (3,) array of the backend's kind and ``dtype``
    as it is."""
    if _backend.array_module_of(background) is xp and xp is not np and background.shape == (3,) \
            and background.dtype == dtype:
        return background
    bg = np.zeros(3) if background is None else np.asarray(background, np.float64).reshape(-1)
    if bg.shape != (3,) or not np.isfinite(bg).all():
        raise ValueError(f"background must be 3 finite values, got {background!r}")
    return _constant(xp, bg.astype(dtype))


_CONSTANTS = {}


def _constant(xp, a):
    """A read-only device copy of a small host array, reused while its values recur (the views'
    cameras, the background): an upload from pageable memory first waits for the GPU to idle."""
    if xp is np:
        return a
    key = (a.dtype.str, a.shape, a.tobytes())
    if key not in _CONSTANTS:
        if len(_CONSTANTS) >= 4096:
            _CONSTANTS.clear()
        _CONSTANTS[key] = xp.asarray(a)
    return _CONSTANTS[key]


def rasterize(p: Projection, b: Binning, background=None, backend=None, state=None, tile_rows=None, into=None):
    """Composite each pixel's Gaussians front to back, as 3DGS does: C = sum_i c_i alpha_i T_i + T bg,
    T_i = prod_{j<i} (1 - alpha_j), alpha_i = min(0.99, opacity_i exp(-sigma_i)) at the pixel's centre.
    A Gaussian of alpha under 1/255 is passed over; the pixel ends at the Gaussian that would take its
    transmittance to T_MIN (1e-4) or below, without it.

    Args:
        p: the ``Projection`` of the Gaussians (``project``): ``proj`` (N, PROJ_FIELDS) float32 records
            (float64 on the CPU where ``project`` ran in float64), and its ``camera``, whose ``width``
            W and ``height`` H are the image's.
        b: the ``Binning`` of ``p`` (``bin_tiles``): ``ids`` (M,) int32, the Gaussian of each
            tile-Gaussian intersection, sorted by tile, then by depth; ``ranges`` (tiles, 2) int32, each
            row-major tile's [start, end) in ``ids``.
        background: the colour behind the Gaussians: 3 values (None: black), or a (3,) array of the
            backend's kind and ``proj``'s dtype, used as it is (a trainer rewrites one each step).
        backend: "cpu" or "cuda" (None: the process default, ``numbasplat.BACKEND``).
        state: for a chunk of a view's Gaussians (``numbasplat.chunks``), the pixels' state after the
            chunks in front of it (``front_state``: transmittance, colour and depth so far, and whether
            the pixel has ended at T_MIN), which compositing starts from instead of an empty pixel and
            leaves updated: the chunks then composite exactly as one pass over all their Gaussians.
        tile_rows: (first, last): composite the pixels of those rows of tiles only (a part of the
            tiles, ``numbasplat.placement``; ``b`` may then be ``bin_tiles(tile_rows=)``'s), into the
            ``Render`` ``into`` (its other pixels left as they are).  None: every tile.
        into: the ``Render`` to write (None: new arrays; required with ``tile_rows``).

    Returns:
        A ``Render``, its arrays on the backend's device, of ``proj``'s dtype unless said:
        ``image`` (H, W, 3): C;
        ``trans`` (H, W): the transmittance T left (the pixel's alpha is 1 - T);
        ``depth`` (H, W): sum_i w_i z_i, w_i = alpha_i T_i (divide by the alpha for the expected depth);
        ``last`` (H, W) int32: the end of the pixel's contributing range in ``b.ids`` (after its last
        contributor), where ``rasterize_backward`` starts;
        ``background`` (3,): the background as the kernels took it.
        With ``state``, ``image``, ``trans`` and ``depth`` are those of every chunk so far (the image
        over the background), ``last`` is this chunk's.
    """
    kernels, xp = _dispatch(backend)
    W, H = p.camera.width, p.camera.height
    dtype = p.proj.dtype
    bg = _background(xp, background, dtype)
    if into is None:
        if tile_rows is not None:
            raise ValueError("rasterize: tile_rows writes into a Render (into=) that holds the other tiles")
        into = empty_render(H, W, dtype, bg, backend)
    parts = {} if tile_rows is None else {"tile_rows": tuple(tile_rows)}
    if state is None:
        kernels.raster_forward(p.proj, b.ids, b.ranges, W, H, TILE, p.camera.tiles[0], bg, into.image, into.trans,
                               into.depth, into.last, **parts)
    else:
        _check_state(kernels, state, H, W, "rasterize")
        kernels.raster_forward(p.proj, b.ids, b.ranges, W, H, TILE, p.camera.tiles[0], bg, into.image, into.trans,
                               into.depth, into.last, state=state, **parts)
    return into


def empty_render(H, W, dtype, background, backend=None):
    """A ``Render`` of an H x W image not yet written (``rasterize(into=)`` writes its tiles), on
    ``background`` (a (3,) array as ``rasterize`` takes it)."""
    kernels, xp = _dispatch(backend)
    return Render(xp.empty((H, W, 3), dtype), xp.empty((H, W), dtype), xp.empty((H, W), dtype),
                  xp.empty((H, W), np.int32), background)


STATE_FIELDS = 6  # a pixel's state between the chunks of a view (``math.blend``: FRONT_FIELDS, BEHIND_FIELDS)


def _check_state(kernels, state, H, W, where):
    dtype = kernels.STATE_DTYPE
    if state.shape != (STATE_FIELDS, H, W) or state.dtype != dtype or not state.flags.c_contiguous:
        raise ValueError(f"{where}: state must be a C-contiguous ({STATE_FIELDS}, {H}, {W}) {np.dtype(dtype).name} "
                         f"array, got {state.shape} {state.dtype}")


def front_state(camera: Camera, backend=None):
    """The pixels' state before the first chunk of a view's Gaussians (``rasterize(state=)``): no
    Gaussian yet, transmittance 1.  (STATE_FIELDS, H, W) of the backend's ``STATE_DTYPE``
    (float64 on the CPU, so that chunks round as one pass does; float32 on the GPU): the
    transmittance T, the colour r, g, b and depth summed so far, 1 where the pixel has ended."""
    kernels, xp = _dispatch(backend)
    state = xp.zeros((STATE_FIELDS, camera.height, camera.width), kernels.STATE_DTYPE)
    state[0] = 1.0
    return state


def behind_state(r: Render, d_alpha=None, backend=None):
    """The pixels' backward state behind the last chunk of a view (``rasterize_backward(state=)``)
    from its final render ``r`` (the last chunk's): the transmittance T left, what lies behind
    the Gaussians (T times the background; depth 0) and the gradient of the loss by that T
    (``d_alpha`` (H, W) times T: the alpha is 1 - T).  (STATE_FIELDS, H, W) of the backend's
    ``STATE_DTYPE``: T, s_r, s_g, s_b, s_depth, d_alpha * T, as the unchunked backward starts."""
    kernels, xp = _dispatch(backend)
    H, W = r.trans.shape
    state = xp.empty((STATE_FIELDS, H, W), kernels.STATE_DTYPE)
    T = r.trans
    state[0] = T
    for c in range(3):
        state[1 + c] = T * r.background[c]
    state[4] = 0.0
    state[5] = 0.0 if d_alpha is None else d_alpha * T
    return state


def contributions(p: Projection, b: Binning, backend=None, colour=True):
    """Each pixel's dominant Gaussian and each Gaussian's total contribution over the view
    (issue 23's contribution pruning keeps the Gaussians that dominate some pixel).

    Gaussian i contributes ``T_i alpha_i |c_i|`` to a pixel, |c_i| the L2 norm of its RGB colour
    in this view (``blend.dominant_step`` says why), composited as ``rasterize`` does: front to
    back, with its alpha threshold and early stop.  ``colour=False``: ``T_i alpha_i`` alone, its
    blending weight (BlitzGS's importance, issue 27), by the same kernel on a copy of the records
    whose colours are of length 1.  Returns (dominant, total) on the backend's arrays: (H, W)
    int32, the row of ``p.proj`` of each pixel's largest contributor (the first in front-to-back
    order on a tie), -1 where none contributes; (N,) float32, the sum of each Gaussian's
    contributions over the pixels."""
    kernels, xp = _dispatch(backend)
    if not colour:
        unit = p.proj[:, :go.PROJ_FIELDS].copy()
        unit[:, go.RED], unit[:, go.GREEN], unit[:, go.BLUE] = 1.0, 0.0, 0.0
        p = Projection(p.camera, p.cam, unit, p.radii, p.counts, p.sh_degree, p.antialias)
    W, H = p.camera.width, p.camera.height
    total = xp.zeros(p.proj.shape[0], np.float32)
    if not b.n_isect:
        return xp.full((H, W), -1, np.int32), total
    dominant = xp.empty((H, W), np.int32)
    kernels.contributions(p.proj, b.ids, b.ranges, W, H, TILE, p.camera.tiles[0], dominant, total)
    return dominant, total


def rasterize_backward(p: Projection, b: Binning, r: Render, d_image, d_alpha=None, d_depth=None, grad=None,
                       backend=None, deterministic=False, state=None, tile_rows=None):
    """Screen-space gradient records (N, GRAD_FIELDS), added into ``grad`` if given.

    ``tile_rows`` (first, last): the backward of those rows of tiles only (``rasterize(tile_rows=)``'s
    part, with its binning and ``r`` the render it wrote into); None: every tile.

    ``state``: for a chunk of a view's Gaussians (``numbasplat.chunks``), the pixels' backward state
    behind it (``behind_state`` for the last chunk, then what the chunk behind left): each pixel's
    backward starts from it instead of from ``r.trans``, ``r.background`` and ``d_alpha`` (which
    are not read), and leaves its state in front of the chunk there for the chunk before it.
    ``r.last`` is where each pixel's backward starts in this chunk's ``b.ids``.

    ``deterministic``: the same bits at every run (``b`` from ``bin_tiles(deterministic=True)``).
    On a GPU each Gaussian's gradient is otherwise added up over its tiles' warps by float atomics,
    in an order that varies from run to run; here the warps' sums go to a slot each and are added
    per Gaussian in a fixed order (``numbasplat.cuda.raster.raster_backward``; 384 bytes of
    scratch per intersection).  The CPU backend's sums are in a fixed order either way."""
    kernels, xp = _dispatch(backend)
    W, H = p.camera.width, p.camera.height
    dtype = p.proj.dtype
    if grad is None:
        grad = xp.zeros((p.proj.shape[0], go.GRAD_FIELDS), dtype)
    d_alpha = xp.zeros((H, W), dtype) if d_alpha is None else d_alpha
    d_depth = xp.zeros((H, W), dtype) if d_depth is None else d_depth
    fixed = None
    if deterministic:
        if b.perm is None:
            raise ValueError("rasterize_backward(deterministic=True) needs the binning of "
                             "bin_tiles(deterministic=True)")
        fixed = (b.perm, b.order, b.ends, p.counts)
    parts = {} if tile_rows is None else {"tile_rows": tuple(tile_rows)}
    if state is not None:
        _check_state(kernels, state, H, W, "rasterize_backward")
        if b.n_isect:
            kernels.raster_backward(p.proj, b.ids, b.ranges, W, H, TILE, p.camera.tiles[0], r.background, r.trans,
                                    r.last, d_image, d_alpha, d_depth, grad, fixed=fixed, state=state, **parts)
    elif b.n_isect:
        kernels.raster_backward(p.proj, b.ids, b.ranges, W, H, TILE, p.camera.tiles[0], r.background, r.trans,
                                r.last, d_image, d_alpha, d_depth, grad, fixed=fixed, **parts)
    return grad


def project_backward(g: Gaussians, p: Projection, grad, out: Gaussians = None, accumulate=True, backend=None):
    """Parameter gradients (a ``Gaussians`` of arrays) into ``out`` if given:
    added to it, or written over it with ``accumulate=False``.  ``out`` may hold ``g``'s own arrays
    (``_same_arrays``): each Gaussian's gradients are then written over its parameters, every use of a
    parameter read before its gradient overwrites it, for an optimizer that holds the parameters
    elsewhere and needs their gradients alone (the out-of-core store's Adam on the host); written over,
    never added."""
    kernels, xp = _dispatch(backend)
    if out is None:
        out = Gaussians(**{k: xp.empty_like(a) for k, a in g.arrays().items()})
        accumulate = False
    if len(g):
        rows = (len(g), -1)  # the SH of a Gaussian as one row: its values are contiguous
        args = (g.means, g.quats, g.scales, g.opacities, g.sh.reshape(rows), p.sh_degree, p.cam, p.camera.width,
                p.camera.height, p.antialias, p.proj, p.counts, grad)
        if _same_arrays(g, out):
            if accumulate:
                raise ValueError("project_backward: gradients written over their parameters cannot be added to them")
            kernels.project_backward_over_params(*args)
        else:
            kernels.project_backward(*args, out.means, out.quats, out.scales, out.opacities, out.sh.reshape(rows),
                                     bool(accumulate))
    return out


def _same_arrays(a: Gaussians, b: Gaussians):
    """Whether every array of ``b`` is the one of ``a`` (the same memory, shape and strides)."""
    same = lambda x, y: address(x) == address(y) and x.shape == y.shape and x.strides == y.strides  # noqa: E731
    return all(same(x, getattr(b, k)) for k, x in a.arrays().items())


def project_backward_adam(p: Projection, grad, adam, visible=False, skip=None, backend=None):
    """``project_backward`` with ``adam``'s update of the step fused into it: each Gaussian's gradients,
    as its kernel computes them, go straight into the Adam update of its parameters and moments
    (``numbasplat.math.adam``, as ``Adam.update`` applies it), instead of into a gradient buffer that
    Adam reads back: the buffer is neither written nor read, and Adam takes no launch of its own.
    The parameters are ``adam.params``' (the Gaussians ``p`` projected); the rates and bias
    corrections those ``adam.set_step`` wrote.  ``visible``: visible-only Adam, the Gaussians ``p``
    does not draw (no tiles: ``p.counts > 0`` is the mask) keep their state; ``skip``: a (1,) int32
    device flag, set: nothing changes (``Adam.update``'s).  Exact where nothing else needs the
    gradients before the update (not a regulariser's, a batch's sum, a split by rows)."""
    kernels, xp = _dispatch(backend)
    if not adam.fusable():
        raise ValueError("project_backward_adam: the optimizer's moments are not flat buffers like its parameters")
    g = adam.params.gaussians()
    if len(p.counts) != len(g):
        raise ValueError(f"project_backward_adam: a projection of {len(p.counts)} Gaussians, the optimizer's "
                         f"parameters hold {len(g)}")
    if len(g):
        m, v, lr, b1, b2, eps, corrections = adam.step_values()
        rows = (len(g), -1)  # the SH of a Gaussian as one row: its values are contiguous
        kernels.project_backward_adam(g.means, g.quats, g.scales, g.opacities, g.sh.reshape(rows), p.sh_degree, p.cam,
                                      p.camera.width, p.camera.height, p.antialias, p.proj, p.counts, grad,
                                      m.means, m.quats, m.scales, m.opacities, m.sh.reshape(rows),
                                      v.means, v.quats, v.scales, v.opacities, v.sh.reshape(rows),
                                      lr["means"], lr["quats"], lr["scales"], lr["opacities"], lr["sh"], bool(visible),
                                      _constant(xp, np.zeros(1, np.int32)) if skip is None else skip,
                                      b1, b2, eps, corrections)


def screen_gradient_stats(p: Projection, grad, scale, columns, sums, seen, max_radius, skip=None, backend=None):
    """Densification statistics of one view, in one pass over its Gaussians: add each drawn
    Gaussian's screen-space gradient norm (record columns ``columns``, in NDC units: times half the
    image's width and height, and ``scale``) into ``sums`` (N,) float32, one into ``seen`` (N,)
    int32 for each Gaussian in view (a radius: drawn, or hidden by the view's mask, ``cull``), and
    raise ``max_radius`` (N,) float32 to its larger radius; the norms and counts are left out where
    the (1,) int32 device flag ``skip`` is set (a step the optimizer skips)."""
    kernels, xp = _dispatch(backend)
    if skip is None:
        skip = _constant(xp, np.zeros(1, np.int32))
    if len(p.counts):
        kernels.screen_stats(grad, p.counts, p.radii, int(columns[0]), int(columns[1]),
                             np.float32(0.5 * p.camera.width * scale), np.float32(0.5 * p.camera.height * scale),
                             skip, sums, seen, max_radius)


_TILE_INDEX = {}


def _tile_index(xp, H, W):
    """Per row-major tile, the flat indices of its TILE*TILE pixels: (for reading, clipped into
    the image; for writing, H*W -- a spare pixel -- past the border).  Cached per size."""
    key = (xp.__name__, H, W)
    if key not in _TILE_INDEX:
        tx, ty = tile_grid(W, H)
        y = (np.arange(ty)[:, None, None, None] * TILE + np.arange(TILE)[None, None, :, None])
        x = (np.arange(tx)[None, :, None, None] * TILE + np.arange(TILE)[None, None, None, :])
        inside = (y < H) & (x < W)
        write = np.where(inside, y * W + x, H * W).reshape(tx * ty, TILE_PIXELS)
        _TILE_INDEX[key] = (xp.asarray(np.minimum(write, H * W - 1)), xp.asarray(write))
    return _TILE_INDEX[key]


def image_tiles(image, first, last=None):
    """Row-major tiles first..last-1 (or the tiles of the index array ``first``) of an (H, W, C)
    image as rows of TILE*TILE*C values (the pixels past the border are filler): how renderers
    send each other their pixels."""
    xp = _backend.array_module_of(image)
    H, W, C = image.shape
    read, _ = _tile_index(xp, H, W)
    picked = read[first:last] if last is not None else read[first]
    return image.reshape(H * W, C)[picked].reshape(len(picked), TILE_PIXELS * C)


def tiles_squared_error(image, target, first, last):
    """Sum of (image - target)^2 over row-major tiles first..last-1, a device scalar: a
    renderer's share of an image's error (the pixels past the border count 0)."""
    xp = _backend.array_module_of(image)
    H, W, C = image.shape
    _, write = _tile_index(xp, H, W)
    d = xp.zeros((H * W + 1, C), image.dtype)  # + the spare pixel, 0
    d[:H * W] = (image - target).reshape(H * W, C)
    e = d[write[first:last]]
    return (e * e).sum()


def image_from_tiles(rows, first, H, W, fill=0.0, base=None):
    """An (H, W, C) image holding ``image_tiles`` rows as tiles first, first+1, ... (or as the tiles
    of the index array ``first``); ``fill`` (a value, or one per channel) elsewhere, or the pixels of
    the (H, W, C) image ``base`` (left as it is)."""
    xp = _backend.array_module_of(rows)
    C = rows.shape[1] // TILE_PIXELS
    _, write = _tile_index(xp, H, W)
    flat = xp.empty((H * W + 1, C), rows.dtype)  # + the spare pixel
    if base is None:
        flat[...] = xp.asarray(fill, rows.dtype)
    else:
        flat[:H * W] = base.reshape(H * W, C)
    at = write[first:first + len(rows)] if np.ndim(first) == 0 else write[first]
    flat[at] = rows.reshape(len(rows), TILE_PIXELS, C)
    return flat[:H * W].reshape(H, W, C)


def tile_pixel_mask(xp, tile_mask, tiles_x, tiles_y, W, H):
    """(H, W) bool pixel mask of the tiles marked in a row-major tile mask."""
    grid = np.asarray(tile_mask).reshape(tiles_y, tiles_x).repeat(TILE, 0).repeat(TILE, 1)
    return xp.asarray(grid[:H, :W])


def rasterize_tile_loss(p: Projection, b: Binning, target, perms, lam=0.2, background=None, fuse=True,
                        max_fused=None, want_image=False, backend=None, tiles=None, lazy=False, grad=None):
    """Forward, tile-local loss (L1 + S3IM) and backward over every tile.

    On the GPU, tiles whose Gaussians fit in shared memory take ByteSplat's fused
    kernel; the others (and every tile on the CPU, or with ``fuse=False``) take
    raster forward, ``tile_loss`` and raster backward.  With ``tiles`` (a bool
    mask) the loss is those tiles' share (a renderer's, under MPI).  Returns
    (loss, gradient records, image or None, stats); the loss is a ``LazyLoss``
    with ``lazy=True`` (reading it waits for the device).  The gradient records
    are added into ``grad`` if given.
    """
    kernels, xp = _dispatch(backend)
    W, H = p.camera.width, p.camera.height
    tx, ty = p.camera.tiles
    R = perms.shape[0]
    bg = _background(xp, background, p.proj.dtype)
    if grad is None:
        grad = xp.zeros((p.proj.shape[0], go.GRAD_FIELDS), p.proj.dtype)
    stats = {"fused_tiles": 0.0, "fused_gaussians": 0.0, "max_fused": -1}
    big = None  # the tiles left to the unfused path (None: all of them)
    if fuse and kernels.FUSED_TILE_LOSS:
        per_tile = HostCopy(b.ranges[:, 1] - b.ranges[:, 0])
        limit = kernels.fused_budget() if max_fused is None else int(max_fused)
        image = xp.empty((H, W, 3), np.float32)
        partials = xp.empty((b.ranges.shape[0], 2), np.float32)  # every tile under the limit writes its row
        kernels.fused_raster_loss_backward(p.proj, b.ids, b.ranges, W, H, tx, bg, target, perms, lam, limit,
                                           want_image, image, grad, partials)
        per_tile = per_tile.get()  # (the fused kernel is queued: the GPU works while the host waits)
        big = per_tile > limit
        n_big = int(np.count_nonzero(big))
        total = int(per_tile.sum())
        on_fused = total - int(per_tile[big].sum())
        stats = {"fused_tiles": (len(big) - n_big) / len(big), "fused_gaussians": on_fused / max(total, 1),
                 "max_fused": limit}
        tile_sums = partials
        if n_big:
            b = Binning(b.ids, xp.ascontiguousarray(xp.where(xp.asarray(big)[:, None], b.ranges, 0).astype(np.int32)),
                        b.n_isect)
    if big is None or n_big:
        r = rasterize(p, b, background, backend)
        sums, d_img = tile_loss_sums(r.image, target, perms, lam, backend=backend)
        rasterize_backward(p, b, r, d_img, grad=grad, backend=backend)
        if big is None:
            image, tile_sums = r.image, sums
        else:  # the tiles over the budget: their image and loss sums from the unfused path
            tile_sums = xp.where(xp.asarray(big)[:, None], sums, partials)
            if want_image:
                image = xp.where(tile_pixel_mask(xp, big, tx, ty, W, H)[..., None], r.image, image)
    loss = loss_from_tile_sums(tile_sums, lam, W, H, R, tiles)
    return (loss if lazy else float(loss)), grad, (image if want_image else None), stats


@dataclass
class Frame:
    """Everything one forward render keeps for its backward."""
    projection: Projection
    binning: Binning
    render: Render

    @property
    def image(self):
        return self.render.image


def render(g: Gaussians, camera: Camera, sh_degree=None, background=None, antialias=False, backend=None,
           check=None, deterministic=False):
    """Project, bin and rasterize; ``check=False`` skips the finiteness check (a device sync);
    ``deterministic``: binned for ``render_backward(deterministic=True)``."""
    p = project(g, camera, sh_degree, antialias, backend, check)
    b = bin_tiles(p, backend, deterministic=deterministic)
    return Frame(p, b, rasterize(p, b, background, backend))


def render_backward(g: Gaussians, frame: Frame, d_image, d_alpha=None, d_depth=None, out=None, accumulate=False,
                    backend=None, deterministic=False):
    """Parameter gradients and the screen-space gradient records of one render.

    Gradients are written into ``out`` (a new ``Gaussians`` if None), or added
    to it with ``accumulate=True`` (several views per step).  ``deterministic``: the same bits
    at every run (``rasterize_backward``; the frame from ``render(deterministic=True)``)."""
    grad = rasterize_backward(frame.projection, frame.binning, frame.render, d_image, d_alpha, d_depth,
                              backend=backend, deterministic=deterministic)
    return project_backward(g, frame.projection, grad, out, accumulate=accumulate, backend=backend), grad
