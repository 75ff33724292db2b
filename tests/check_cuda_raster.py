"""CUDA kernels against the CPU backend on the same float32 scenes.

Runs under the CUDA simulator in CI (tests/test_cuda_raster.py) and on a real GPU
(``python tests/check_cuda_raster.py`` in scripts/gpu_check.sh).  Exits non-zero on
any mismatch beyond: images 1e-5 absolute, gradients and contribution totals 1e-4 relative,
dominant Gaussians none.  ``python tests/check_cuda_raster.py fused-adam``: Adam fused into the
projection backward against the separate Adam alone (``compare_fused_adam``; the simulator's run of
it is tests/test_fused_adam.py's).
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numbasplat as ns  # noqa: E402
from numbasplat.backend import SIM, array_module, to_host  # noqa: E402
from numbasplat.cuda.tile import BLOCK  # noqa: E402
from tests.binning_cases import check_binning_ranges, check_ranges_from_counts  # noqa: E402
from tests.scenes import edge_case_scene, look_at_camera, reach_table  # noqa: E402

IMAGE_TOL = 1e-5
GRAD_TOL = 1e-4


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def compare(g, cam, bg, antialias, seed, sh_degree=None):
    xp = array_module("cuda")
    dev = ns.Gaussians(**{k: xp.asarray(a) for k, a in g.arrays().items()})
    rng = np.random.default_rng(seed)
    H, W = cam.height, cam.width
    d_img = rng.normal(size=(H, W, 3)).astype(np.float32)
    d_alpha = rng.normal(size=(H, W)).astype(np.float32)
    d_depth = (0.1 * rng.normal(size=(H, W))).astype(np.float32)
    out = {}
    for backend, gg, put in (("cpu", g, np.asarray), ("cuda", dev, xp.asarray)):
        f = ns.render(gg, cam, sh_degree=sh_degree, background=bg, antialias=antialias, backend=backend)
        grads, rec = ns.render_backward(gg, f, put(d_img), put(d_alpha), put(d_depth), backend=backend)
        out[backend] = dict(image=f.image, alpha=f.render.alpha, depth=f.render.depth, last=f.render.last,
                            records=rec, **{"d_" + k: v for k, v in grads.arrays().items()})
        # accumulating into existing gradients (the distributed pipeline's batches)
        acc = ns.Gaussians(**{k: put(np.ones(v.shape, np.float32)) for k, v in grads.arrays().items()})
        ns.project_backward(gg, f.projection, rec, acc, accumulate=True, backend=backend)
        out[backend].update({"acc_" + k: v for k, v in acc.arrays().items()})
    failures = []
    for key, ref in out["cpu"].items():
        got, ref = to_host(out["cuda"][key]), np.asarray(ref)
        if key.startswith(("d_", "acc_")) or key == "records":
            err, tol = rel(got, ref), GRAD_TOL
        else:
            err, tol = float(np.abs(got.astype(np.float64) - ref).max()), IMAGE_TOL
        status = "ok" if err <= tol else "FAIL"
        print(f"  {key:12s} {status} err={err:.2e} (tol {tol:g})")
        if err > tol:
            failures.append(key)
    return failures


def compare_adam(steps=3):
    """Fused Adam on both backends, all Gaussians and then a visible subset."""
    n = 60 if SIM else 5000  # the simulator runs a thread at a time
    from numbasplat.optim import Adam, FlatParams, column_lrs
    xp = array_module("cuda")
    g = edge_case_scene(n=n, seed=3, dtype=np.float32)
    a, b = FlatParams.from_gaussians(g), FlatParams.from_gaussians(g)
    b.data = xp.asarray(b.data)
    oa, ob = Adam(a, backend="cpu"), Adam(b, backend="cuda")
    rng = np.random.default_rng(4)
    lrs = column_lrs({"means": 1e-3, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}, a.sh_bases)
    for step in range(steps):
        vis = None if step == 0 else rng.random(n) < 0.5
        grads = rng.normal(size=a.size).astype(np.float32)
        oa.step(grads, lrs, vis)
        ob.step(xp.asarray(grads), lrs, None if vis is None else xp.asarray(vis))
        ob.step(xp.asarray(grads), lrs, skip=xp.ones(1, np.int32))  # skipped: leaves the state
        ob.step_count -= 1
    print("adam")
    failures = []
    for key, got, ref in (("params", b.data, a.data), ("m", ob.m, oa.m), ("v", ob.v, oa.v)):
        err = rel(to_host(got), np.asarray(ref))
        print(f"  {key:12s} {'ok' if err <= GRAD_TOL else 'FAIL'} err={err:.2e} (tol {GRAD_TOL:g})")
        if err > GRAD_TOL:
            failures.append("adam " + key)
    return failures


FUSED_ADAM_TOL = 1e-6


def compare_fused_adam(steps=2, sizes=((48, 40, 3, 3), (40, 48, 3, 1), (48, 40, 1, 1)), n=200 if SIM else 5000):
    """The projection backward with Adam fused (``project_backward_adam``) against the projection backward
    then ``Adam.update``, on the CUDA backend: at each step both from the same state and the same
    screen-space gradients (the raster backward's atomics vary from run to run), every Gaussian and
    visible-only, per-group rates; parameters and both moments within FUSED_ADAM_TOL (the separate
    Adam kernel's fast division and square root against the fused kernels' exact ones); a skipped step
    leaves the state as it was.  ``sizes``: (W, H, SH degree stored, SH degree rendered), non-square
    images; ``n`` Gaussians (200 in the simulator: two blocks of the SH kernel)."""
    from numbasplat.optim import Adam, FlatParams, column_lrs
    from numbasplat.rendering import project_backward_adam
    xp = array_module("cuda")
    lr = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3, "sh_rest": 1e-4}

    def clone(adam, cols):
        """A copy of ``adam``'s model and moments, set for the next step."""
        c = Adam(adam.params.like(adam.params.data.copy()), backend="cuda", m=adam.m.copy(), v=adam.v.copy())
        c.step_count = adam.step_count
        c.set_step(cols)
        return c

    print("fused Adam")
    failures = []
    for W, H, stored, degree in sizes:
        g = edge_case_scene(n=n, seed=30 + stored, dtype=np.float32, degree=stored)
        params = FlatParams.from_gaussians(g, xp)
        rng = np.random.default_rng(stored)
        m = (1e-3 * rng.normal(size=params.size)).astype(np.float32)  # as if trained before: a Gaussian not drawn
        state = Adam(params, backend="cuda", m=xp.asarray(m), v=xp.asarray(m * m + 1e-7))  # moves unless visible-only
        cam = look_at_camera(W=W, H=H)
        cols = column_lrs(lr, state.params.sh_bases)
        for step in range(steps):
            f = ns.render(state.params.gaussians(), cam, sh_degree=degree, backend="cuda")
            d_img = xp.asarray(rng.normal(size=(H, W, 3)).astype(np.float32))
            rec = ns.rasterize_backward(f.projection, f.binning, f.render, d_img, backend="cuda")
            p = f.projection
            for visible in (False, True):
                apart, fused = clone(state, cols), clone(state, cols)
                grads = apart.params.like(xp.zeros(apart.params.size, np.float32))
                ns.project_backward(apart.params.gaussians(), p, rec, grads.gaussians(), accumulate=False,
                                    backend="cuda")
                apart.update(grads.data, p.counts > 0 if visible else None)
                project_backward_adam(p, rec, fused, visible=visible, backend="cuda")
                label = f"{W}x{H} SH {degree} of {stored} step {step} {'visible' if visible else 'all'}"
                for key, got, ref in (("params", fused.params.data, apart.params.data), ("m", fused.m, apart.m),
                                      ("v", fused.v, apart.v)):
                    err = rel(to_host(got), to_host(ref))
                    ok = err <= FUSED_ADAM_TOL
                    print(f"  {label:34s} {key:6s} {'ok' if ok else 'FAIL'} err={err:.2e} (tol {FUSED_ADAM_TOL:g})")
                    if not ok:
                        failures.append(f"fused adam {label} {key}")
                hidden = to_host(p.counts) == 0
                moved = to_host(fused.params.like(fused.params.data != state.params.data).view("opacities"))
                if not hidden.any() or (moved[hidden].any() if visible else not moved[hidden].all()) \
                        or not moved[~hidden].all():
                    print(f"  {label}: the Gaussians not drawn {'moved' if visible else 'kept still'} FAIL")
                    failures.append(f"fused adam {label} visible")
                if not visible:
                    after = fused
            skipped = clone(state, cols)
            project_backward_adam(p, rec, skipped, skip=xp.ones(1, np.int32), backend="cuda")
            for key, got, ref in (("params", skipped.params.data, state.params.data), ("m", skipped.m, state.m),
                                  ("v", skipped.v, state.v)):
                if not np.array_equal(to_host(got), to_host(ref)):
                    print(f"  {W}x{H} step {step} skipped: {key} changed FAIL")
                    failures.append(f"fused adam skip {key}")
            state = after
    return failures


def wide_scene(n=300, seed=11, grow=6.0):
    """``edge_case_scene`` with its Gaussians ``grow`` times larger, seen at 320x224 (20x14 tiles):
    from a few tiles to the whole image, so binning emits narrow Gaussians a thread each and wide
    ones (``EMIT_WIDE`` tiles or more) a warp each, in the same blocks."""
    g = edge_case_scene(n=n, seed=seed, dtype=np.float32)
    g.scales += np.float32(np.log(grow))
    return g, look_at_camera(W=320, H=224)


def compare_binning_room():
    """Binning into room (``bin_tiles(room=)``) on both backends: with room to spare and with too
    little, the same ranges, the same Gaussians in them, the same overflow flag and total; on a
    small image, and on the wide scene (most Gaussians over many tiles)."""
    failures = []
    for scene in ("small", "wide"):
        g, cam = ((edge_case_scene(n=40, seed=10, dtype=np.float32), look_at_camera(W=37, H=29))
                  if scene == "small" else wide_scene())
        failures += _compare_binning_room(g, cam, scene)
    return failures


def _compare_binning_room(g, cam, scene):
    from numbasplat.cuda.raster import EMIT_WIDE
    xp = array_module("cuda")
    failures = []
    total = None
    for name, spare in (("exact", None), ("spare", 9), ("short", -5)):
        out = {}
        for backend, put in (("cpu", np.asarray), ("cuda", xp.asarray)):
            p = ns.project(ns.Gaussians(**{k: put(a) for k, a in g.arrays().items()}), cam, backend=backend)
            if total is None:
                total = ns.bin_tiles(p, backend=backend).n_isect
                wide = int((to_host(p.counts) >= EMIT_WIDE).sum())
            b = ns.bin_tiles(p, backend=backend, room=None if spare is None else total + spare)
            ranges = to_host(b.ranges)
            out[backend] = (ranges, [list(to_host(b.ids)[s:e]) for s, e in ranges],
                            0 if spare is None else int(to_host(b.overflow)[0]), int(to_host(b.total)[0]))
        ok = (np.array_equal(out["cpu"][0], out["cuda"][0]) and out["cpu"][1:] == out["cuda"][1:]
              and out["cpu"][2] == (spare is not None and spare < 0) and out["cpu"][3] == total)
        ok &= scene == "small" or wide >= 50  # the wide scene must exercise the warps' emission
        print(f"binning {scene}, {name}: {'ok' if ok else 'FAIL'} ({total} intersections, {wide} Gaussians over "
              f"{EMIT_WIDE} tiles or more)")
        if not ok:
            failures.append(f"binning {scene} {name}")
    return failures


def compare_screen_stats():
    """The densification statistics of a view (``screen_gradient_stats``) on both backends, with the
    skip flag clear and set, and with a view mask hiding every other row (counted, with no gradient)."""
    xp = array_module("cuda")
    g, cam = edge_case_scene(n=40, seed=10, dtype=np.float32), look_at_camera(W=37, H=29)
    grad = np.random.default_rng(5).normal(size=(40, 12)).astype(np.float32)
    mask = np.packbits((np.arange(40) % 2 == 0)[:, None], axis=1)
    failures = []
    for skip, masked in ((0, False), (1, False), (0, True)):
        out = {}
        for backend, put in (("cpu", np.asarray), ("cuda", xp.asarray)):
            gg = ns.Gaussians(**{k: put(a) for k, a in g.arrays().items()})
            p = ns.project(gg, cam, backend=backend)
            if masked:
                ns.cull(p, gg, put(mask), 0, 0.0, backend)
            sums, seen = put(np.ones(40, np.float32)), put(np.ones(40, np.int32))
            radius = put(np.full(40, 3.0, np.float32))
            ns.rendering.screen_gradient_stats(p, put(grad), 0.5, (10, 11), sums, seen, radius,
                                               put(np.full(1, skip, np.int32)), backend)
            out[backend] = [to_host(a) for a in (sums, seen, radius)]
        ok = (rel(out["cuda"][0], out["cpu"][0]) <= GRAD_TOL and all(np.array_equal(a, b) for a, b in
              zip(out["cuda"][1:], out["cpu"][1:])) and (out["cpu"][1] > 1).any() != bool(skip))
        if masked:  # the hidden rows in view are counted without their gradient
            ok = ok and (out["cpu"][1][::2] > 1).any() and (out["cpu"][0][::2] == 1).all()
        print(f"screen gradient stats, skip {skip}{', masked' if masked else ''}: {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"screen stats skip {skip}{' masked' if masked else ''}")
    return failures


def compare_reach_boxes():
    """The out-of-core blocks' boxes (``numbasplat.rows.reach_boxes``, a thread block a segment, one
    of them empty) on both backends, within float32 rounding."""
    from numbasplat.rows import reach_boxes
    xp = array_module("cuda")
    table, starts, sizes = reach_table(seed=1)
    want = reach_boxes(table, starts, sizes, 2, 7, 4.0, "cpu")
    got = reach_boxes(*(xp.asarray(a) for a in (table, starts, sizes)), 2, 7, 4.0, "cuda")
    ok = all(np.allclose(to_host(b), a, rtol=1e-6) for a, b in zip(want, got))
    print(f"reach boxes {'ok' if ok else 'FAIL'}")
    return [] if ok else ["reach boxes"]


def compare_pool_rows():
    """The out-of-core working set's pool rows (``numbasplat.rows.pool_rows``: a scan on the GPU, a
    chunked count on the CPU) on both backends, 3M rows (3000 in the simulator): equal."""
    from numbasplat.math.jit import SIM
    from numbasplat.rows import pool_rows
    xp = array_module("cuda")
    rng = np.random.default_rng(2)
    n, blocks = (3000, 7) if SIM else (3_000_000, 700)
    block = rng.integers(0, blocks, n).astype(np.int32)
    position = rng.integers(0, 4096, n).astype(np.int32)
    slot = np.where(rng.random(blocks) < 0.3, rng.permutation(blocks), -1).astype(np.int64)
    total = int((slot[block] >= 0).sum())
    want = pool_rows(block, position, slot, 4096, total, "cpu")
    got = to_host(pool_rows(*(xp.asarray(a) for a in (block, position, slot)), 4096, total, "cuda"))
    ok = np.array_equal(got, want)
    print(f"pool rows {'ok' if ok else 'FAIL'} ({total} of {n} rows)")
    return [] if ok else ["pool rows"]


def compare_row_normals():
    """Densification's noise (``numbasplat.rows.row_normals``: a thread per element on the GPU) on
    both backends, parity-sharded rows: within the float32 rounding of log, cos and sqrt."""
    from numbasplat.rows import row_normals
    xp = array_module("cuda")
    rows = np.arange(0, 3000, 3, dtype=np.int64)
    want = row_normals(2**62 + 12345, rows, 6, 1, 4, "cpu")
    got = to_host(row_normals(2**62 + 12345, xp.asarray(rows), 6, 1, 4, "cuda"))
    ok = np.allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"row normals {'ok' if ok else 'FAIL'} (largest |z| {np.abs(want).max():.2f})")
    return [] if ok else ["row normals"]


def compare_block_moves(steps=40):
    """The out-of-core blocks' moves (``engine.stores.offload.DeviceCache``) on the GPU against numpy: each
    step fetches its blocks, queues the next step's on the copy stream (``prefetch``), and changes its
    own rows on the kernels' stream (``+= step``), as training does; after a flush the host's table is
    the same.  On a real GPU the table is page-locked and the moves run beside the kernels: a missing
    wait between the streams shows as a wrong row.  (In the simulator both sides are numpy.)"""
    from engine.stores.offload import BlockIndex, DeviceCache, HostBlocks, RowLayout
    from numbasplat.backend import on_gpu
    from numbasplat.device import is_pinned, pinned_empty
    rng = np.random.default_rng(3)
    block_rows, blocks, slots = (4096, 48, 12) if on_gpu("cuda") else (16, 12, 5)
    n = block_rows * blocks - 7
    index = BlockIndex(rng.uniform(-1, 1, (n, 3)), np.full((n, 3), -3.0), block_rows)
    layout = RowLayout(1, {"count": np.zeros(0, np.int32)})
    start = rng.normal(size=(n, layout.columns_total)).astype(np.float32)
    views = [np.sort(rng.choice(blocks, rng.integers(1, slots // 2 + 1), replace=False)) for _ in range(steps + 1)]
    tables = []
    for xp in (np, array_module("cuda")):
        table = pinned_empty(start.shape) if xp is not np else np.empty_like(start)
        table[...] = start
        host = HostBlocks()
        host.reset({b: table[index.starts[b]:index.starts[b] + index.sizes[b]] for b in range(blocks)}, whole=table)
        cache = DeviceCache(xp, layout, block_rows, slots, index, direct=table if xp is not np else None)
        for k in range(steps):
            cache.fetch(views[k], index, host)
            cache.prefetch(views[k + 1], views[k], index, host)
            rows = cache.rows(views[k], int(index.sizes[views[k]].sum()))
            cache.pool[rows] = cache.pool[rows] * 1.5 + k  # (a kernel's work on the step's rows)
            cache.changed(views[k])
        cache.flush(index, host)
        tables.append(table)
    ok = np.array_equal(tables[0], tables[1]) and is_pinned(tables[1]) == on_gpu("cuda") and not is_pinned(start)
    print(f"block moves {'ok' if ok else 'FAIL'} ({steps} steps, {blocks} blocks in {slots} slots)")
    return [] if ok else ["block moves"]


def compare_routes():
    """The forward exchange's send plan (route_plan, route_fill) on both backends, for two views
    and four ranks, one of them with no tiles: the same plan and the same rows, exactly."""
    xp = array_module("cuda")
    cam = look_at_camera(W=45, H=34)
    n_tiles = cam.tiles[0] * cam.tiles[1]
    bounds = np.array([0, 5, 5, n_tiles + 3, 2 * n_tiles], np.int64)
    projs = [ns.project(edge_case_scene(n=70, seed=s, dtype=np.float32), cam, backend="cpu") for s in (5, 6)]
    out = {}
    for backend, put in (("cpu", np.asarray), ("cuda", xp.asarray)):
        ps = [ns.Projection(p.camera, None, put(p.proj), None, put(p.counts), p.sh_degree, p.antialias)
              for p in projs]
        plan = put(np.zeros((2, 4, 2, 70), np.int32))
        for b, p in enumerate(ps):
            ns.rendering.route_plan(p, b, b * n_tiles, bounds, plan, backend)
        slot = put(np.cumsum(to_host(plan)[0].ravel()))
        total = int(to_host(slot)[-1])
        send, route = put(np.zeros((total, 11), np.float32)), put(np.zeros(total, np.int64))
        for b, p in enumerate(ps):
            ns.rendering.route_fill(p, b, plan, slot, send, route, backend)
        out[backend] = [to_host(a) for a in (plan, send, route)]
    print("routes")
    same = all(np.array_equal(a, b) for a, b in zip(out["cpu"], out["cuda"]))
    spread = out["cpu"][0][0].sum(axis=(1, 2))
    print(f"  plan and rows {'ok' if same else 'FAIL'} (records per rank {spread.tolist()})")
    return [] if same and spread[1] == 0 and (spread[[0, 2, 3]] > 0).all() else ["routes"]


def compare_cull():
    """``ns.cull`` on both backends: a mask over two bytes (bit 11), the LOD gate, both, the gate
    sparing every third row, and neither: the same rows hidden, exactly."""
    xp = array_module("cuda")
    g = edge_case_scene(n=90, seed=14, dtype=np.float32)
    g.scales[::4] -= 3.0  # fine ones for the gate
    cam = look_at_camera(W=33, H=27)
    skip = np.packbits(np.random.default_rng(15).random((90, 16)) < 0.3, axis=1)
    spare = (np.arange(90) % 3 == 0).astype(np.uint8)
    failures = []
    for name, mask, min_px, spared in (("mask", skip, 0.0, None), ("lod", None, 1.5, None), ("both", skip, 1.5, None),
                                       ("spare", skip, 1.5, spare), ("none", None, 0.0, None)):
        out = {}
        for backend, put in (("cpu", np.asarray), ("cuda", xp.asarray)):
            gg = ns.Gaussians(**{k: put(a) for k, a in g.arrays().items()})
            p = ns.cull(ns.project(gg, cam, backend=backend), gg, None if mask is None else put(mask), 11, min_px,
                        backend, None if spared is None else put(spared))
            out[backend] = (to_host(p.counts), to_host(p.radii))
        same = all(np.array_equal(a, b) for a, b in zip(out["cpu"], out["cuda"]))
        print(f"cull {name}: {'ok' if same else 'FAIL'} ({int((out['cpu'][0] > 0).sum())} of 90 drawn)")
        if not same:
            failures.append("cull " + name)
    return failures


def compare_contributions():
    """Each pixel's dominant Gaussian (exactly) and each Gaussian's total (GRAD_TOL) on both
    backends: the small scene (early stops), a faint crowd on one tile that spans two batches of
    records, and no intersections."""
    xp = array_module("cuda")
    crowd = edge_case_scene(n=300, seed=12, dtype=np.float32, degree=0)
    crowd.opacities[:] = -4.0  # faint: the pixels go on past the first batch
    behind = edge_case_scene(n=8, seed=13, dtype=np.float32, degree=0)
    behind.means[:, 2] = -3.0
    failures = []
    for name, g, cam in (("scene", edge_case_scene(n=40, seed=10, dtype=np.float32), look_at_camera(W=37, H=29)),
                         ("crowd", crowd, look_at_camera(W=20, H=16, f=4.0)),
                         ("behind", behind, look_at_camera(W=20, H=17))):
        out = {}
        for backend, put in (("cpu", np.asarray), ("cuda", xp.asarray)):
            gg = ns.Gaussians(**{k: put(a) for k, a in g.arrays().items()})
            p = ns.project(gg, cam, backend=backend)
            b = ns.bin_tiles(p, backend=backend)
            out[backend] = [to_host(a) for a in ns.contributions(p, b, backend=backend)] + [to_host(b.ranges)]
        (dom, total, ranges), (dom_gpu, total_gpu, _) = out["cpu"], out["cuda"]
        same = np.array_equal(dom, dom_gpu)
        err = rel(total_gpu, total) if total.any() else float(np.abs(total_gpu).max(initial=0.0))
        per_tile = (ranges[:, 1] - ranges[:, 0]).max(initial=0)
        print(f"contributions {name}: dominant {'ok' if same else 'FAIL'} "
              f"({int((dom != dom_gpu).sum())} pixels differ), total {'ok' if err <= GRAD_TOL else 'FAIL'} "
              f"err={err:.2e} (tol {GRAD_TOL:g}; most Gaussians on a tile {per_tile})")
        if not (same and err <= GRAD_TOL) or (name == "crowd" and per_tile <= BLOCK):
            failures.append("contributions " + name)
    return failures


def main(sizes=((37, 29, 40), (48, 32, 150))):  # (W, H, Gaussians): 150 spans two blocks
    failures = []
    for i, (W, H, n) in enumerate(sizes):
        # (antialias, SH degree rendered, degree stored): degree 1 of 3 uses part of each row,
        # a stored degree 1 has rows of 4 coefficients; the larger scenes (blocks spanned) take the first
        variants = ((False, None, 3), (True, 1, 3), (False, None, 1))
        for antialias, degree, stored in variants if i == 0 else variants[:1]:
            g = edge_case_scene(n=n, seed=10 + i, dtype=np.float32, degree=stored)
            cam = look_at_camera(W=W, H=H)
            print(f"scene {W}x{H} antialias={antialias} sh_degree={degree} of {stored}")
            failures += compare(g, cam, (0.1, 0.5, 0.9), antialias, seed=i, sh_degree=degree)
    # the empty scene
    empty = ns.Gaussians(*(np.zeros(s, np.float32) for s in ((0, 3), (0, 3), (0, 4), (0,), (0, 1, 3))))
    print("empty scene")
    failures += compare(empty, look_at_camera(W=20, H=17), (0.3, 0.3, 0.3), False, seed=9)
    failures += compare_adam()
    if not SIM:  # (minutes in the simulator: tests/test_fused_adam.py runs it there on its own)
        failures += compare_fused_adam()
    failures += compare_binning_room()
    if not SIM:  # (the simulator's run of them, on small images: tests/test_binning.py)
        failures += [f"binning {label}" + (" deterministic" if deterministic else "")
                     for label, deterministic in check_binning_ranges("cuda")]
        failures += [f"ranges from the counts of {rows} tiles" for rows in check_ranges_from_counts("cuda")]
    failures += compare_screen_stats()
    failures += compare_routes()
    failures += compare_contributions()
    failures += compare_cull()
    failures += compare_reach_boxes()
    failures += compare_pool_rows()
    failures += compare_row_normals()
    failures += compare_block_moves()
    print("FAILED: " + ", ".join(failures) if failures else "all CUDA checks passed")
    return 1 if failures else 0


def main_fused_adam():
    """``compare_fused_adam`` alone (``python tests/check_cuda_raster.py fused-adam``)."""
    failures = compare_fused_adam()
    print("FAILED: " + ", ".join(failures) if failures else "all fused Adam checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main_fused_adam() if sys.argv[1:] == ["fused-adam"] else main())
