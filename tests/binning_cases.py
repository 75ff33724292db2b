"""The binning's cases and its plain reference, shared by tests/test_binning.py (the CPU backend, and the CUDA
kernels under the simulator) and tests/check_cuda_raster.py (a GPU).

``bin_tiles`` makes its tile ranges from the counts its emission adds up, and its emission writes the sort keys
in their final form (a part's tile rows, the views' offsets, 16 bits where they fit).  The reference does
neither: every intersection's tile from an emission of one view over every tile, the rows and the offsets
applied in numpy, a stable sort, and each tile's first and last index in the sorted keys (``np.searchsorted``).
"""
import numpy as np

import numbasplat as ns
from numbasplat import rendering as rz
from numbasplat.backend import array_module, kernels, to_host
from numbasplat.math.tiles import TILE
from tests.scenes import edge_case_scene, look_at_camera


def reference_binning(p, backend, view_of=None, n_views=1, tile_rows=None, room=None):
    """-> (ids, ranges, perm) of ``p``'s binning (host arrays), the plain way: ``backend``'s emission of one view
    over every tile (32-bit tile ids, the pad id ``tiles`` where a slot holds none of the Gaussian's tiles),
    then in numpy: tiles outside ``tile_rows`` made the pad, view b's tile t made b * tiles + t (the pad after
    every view), a stable sort of those keys, and each tile's first and last index in the sorted keys
    ([0, 0) for an empty tile)."""
    xp = array_module(backend)
    tx, ty = p.camera.tiles
    tiles = tx * ty
    n = len(p.counts)
    order = rz.depth_order(p, backend)
    ends = np.cumsum(to_host(p.counts)[to_host(order)], dtype=np.int64)
    slots = (room if n else 0) if room is not None else (int(ends[-1]) if n else 0)
    tile_of, ids = xp.full(slots, tiles, np.uint32), xp.zeros(slots, np.int32)
    if n:
        kernels(backend).emit_intersections(p.proj, order, p.counts, xp.asarray(ends), TILE, tx, ty, p.camera.width,
                                            p.camera.height, xp.zeros(0, np.int32), 0, tiles, tiles, slots, tile_of,
                                            ids, xp.zeros((tiles, 2), np.int32), xp.zeros(1, np.int32))
    keys, ids = to_host(tile_of).astype(np.int64), to_host(ids)
    if tile_rows is not None:
        first, last = tile_rows[0] * tx, min(tile_rows[1] * tx, tiles)
        keys = np.where((keys >= first) & (keys < last), keys, tiles)
    if n_views > 1:
        keys = np.where(keys < tiles, keys + to_host(view_of)[ids].astype(np.int64) * tiles, n_views * tiles)
    perm = np.argsort(keys, kind="stable")
    sorted_keys = keys[perm]
    every = np.arange(n_views * tiles)
    start, end = np.searchsorted(sorted_keys, every, "left"), np.searchsorted(sorted_keys, every, "right")
    ranges = np.where((end > start)[:, None], np.stack([start, end], 1), 0).astype(np.int32)
    return ids[perm], ranges, perm


def projection(g, cam, backend):
    """``g``'s float32 projection on the CPU, its arrays put on ``backend``'s device (the binning's input: the
    same records for both backends)."""
    p = ns.project(g, cam, backend="cpu")
    xp = array_module(backend)
    return ns.Projection(cam, xp.asarray(p.cam), xp.asarray(p.proj), xp.asarray(p.radii), xp.asarray(p.counts),
                         p.sh_degree, p.antialias)


def batch(projs, backend, views=None):
    """The records of the views' projections (one camera) binned at once: their projection and ``view_of``
    (view ``views[b]`` for projection b; default b)."""
    xp = array_module(backend)
    views = range(len(projs)) if views is None else views
    both = ns.Projection(projs[0].camera, projs[0].cam, xp.concatenate([p.proj for p in projs]), None,
                         xp.concatenate([p.counts for p in projs]), projs[0].sh_degree, False)
    view_of = np.concatenate([np.full(len(p.counts), v, np.int32) for p, v in zip(projs, views)])
    return both, xp.asarray(view_of)


def sparse_scene():
    """``edge_case_scene`` shrunk (rotated, unevenly scaled Gaussians of a tile or two each): empty tiles
    between full ones."""
    g = edge_case_scene(n=12, seed=2, dtype=np.float32)
    return ns.Gaussians(**{**g.arrays(), "scales": g.scales - np.float32(2.0)})


def binning_cases(backend, large=True):
    """(label, projection, ``bin_tiles`` keywords) of every kind of binning: scenes of rotated, unevenly
    scaled Gaussians (some behind the camera, off the image, culled; a sparse one leaves empty tiles between
    full ones) on non-square images; a batch of views (the middle one touches no tile); each part of a split
    in tile rows (one part of no rows), in the view's depth order; into room with unwritten pad slots and
    into too little room; an empty projection and one that touches no tile.  ``large``: also an image and a
    batch of views whose keys need 32 bits."""
    cam = look_at_camera(64, 40)
    scene = edge_case_scene(n=60, seed=7, dtype=np.float32)
    p = projection(scene, cam, backend)
    total = int(to_host(p.counts).sum())
    yield "scene", p, {}
    yield "sparse scene", projection(sparse_scene(), look_at_camera(64, 56), backend), {}
    projs = [projection(edge_case_scene(n=30, seed=s, dtype=np.float32), cam, backend) for s in (3, 4)]
    behind = projection(edge_case_scene(n=8, dtype=np.float32).rows(0, 1), cam, backend)  # (behind the camera)
    both, view_of = batch([projs[0], behind, projs[1]], backend)
    yield "views", both, dict(view_of=view_of, n_views=3)
    yield "views into room", both, dict(view_of=view_of, n_views=3, room=int(to_host(both.counts).sum()) + 5)
    ty = cam.tiles[1]
    rows = [(0, 1), (1, ty), (ty, ty)]
    counts = rz.tile_row_counts(p, rows, backend)
    order = rz.depth_order(p, backend)
    for k, part in enumerate(rows):
        part_p = p.with_counts(counts[k])
        yield f"tile rows {part}", part_p, dict(tile_rows=part, order=order)
        yield f"tile rows {part} into room", part_p, dict(tile_rows=part, order=order,
                                                          room=int(to_host(counts[k]).sum()) + 3)
    yield "room to spare", p, dict(room=total + 11)
    yield "too little room", p, dict(room=total // 2)
    yield "no room", p, dict(room=0)
    yield "empty projection", rz.empty_projection(cam, 0, np.float32, 3, False, backend), {}
    yield "no tile touched", behind, {}
    if large:
        yield "32-bit keys", projection(scene, look_at_camera(4200, 4100, f=1200.0), backend), {}  # (263 x 257 tiles)
        many = 2**16 // int(np.prod(cam.tiles)) + 1
        both, view_of = batch(projs, backend, views=(many - 1, 1))
        yield "32-bit keys of views", both, dict(view_of=view_of, n_views=many)


def check_binning_ranges(backend, large=True):
    """-> the (label, deterministic) of each case (``binning_cases``) whose binning differs from the reference:
    its ranges, its sorted ids, and (``deterministic``) its permutation; printed case by case."""
    failures = []
    for label, p, kw in binning_cases(backend, large):
        ids, ranges, perm = reference_binning(p, backend, **{k: v for k, v in kw.items() if k != "order"})
        for deterministic in (False, True):
            b = ns.bin_tiles(p, backend=backend, deterministic=deterministic, **kw)
            same = (to_host(b.ranges).dtype == np.int32 and np.array_equal(to_host(b.ranges), ranges)
                    and np.array_equal(to_host(b.ids), ids)
                    and (not deterministic or np.array_equal(to_host(b.perm), perm)))
            print(f"  binning {label:28s} {'deterministic' if deterministic else '':13s} {'ok' if same else 'FAIL'}")
            if not same:
                failures.append((label, deterministic))
    return failures


def check_ranges_from_counts(backend, sizes=(1, 31, 33, 1000, 2500)):
    """-> the row counts at which ``ranges_from_counts`` (counts of random tiles, a third of them empty, in the
    end column) differs from a cumulative sum: a tile at a time up to a block of threads, then several a
    thread, a run that does not divide among the threads."""
    xp = array_module(backend)
    rng = np.random.default_rng(0)
    failures = []
    for rows in sizes:
        counts = np.where(rng.random(rows) < 0.3, 0, rng.integers(1, 50, rows)).astype(np.int32)
        ends = np.cumsum(counts)
        ranges = xp.asarray(np.stack([np.zeros(rows, np.int32), counts], 1))
        kernels(backend).ranges_from_counts(ranges)
        if not np.array_equal(to_host(ranges), np.where((counts > 0)[:, None], np.stack([ends - counts, ends], 1), 0)):
            failures.append(rows)
    return failures
