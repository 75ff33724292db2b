"""Forward rendering against an independent dense reference, and the edge cases of bad input."""
import numpy as np
import pytest
from numba import njit

import numbasplat as ns
from numbasplat import rendering as rz
from numbasplat.cuda.tile import WARP_H, WARP_W
from numbasplat.math import gaussian_ops as go
from numbasplat.math.blend import gaussian_alpha, reaches_box
from numbasplat.math.geometry import ALPHA_MIN
from tests.scenes import edge_case_scene, look_at_camera

C0 = 0.28209479177387814


def reference_render(g, cam, bg, antialias=False):
    """Plain numpy: project every Gaussian, then every pixel against every Gaussian in depth order."""
    q = g.quats / np.linalg.norm(g.quats, axis=1, keepdims=True)
    w, x, y, z = q.T
    R = np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                  2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                  2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], 1).reshape(-1, 3, 3)
    M = R * np.exp(g.scales)[:, None, :]
    sigma = M @ M.transpose(0, 2, 1)
    V = cam.viewmat
    pc = g.means @ V[:3, :3].T + V[:3, 3]
    tz = pc[:, 2]
    lim = lambda size, c, f: ((size - c) / f + 0.15 * size / f, c / f + 0.15 * size / f)
    lxp, lxn = lim(cam.width, cam.cx, cam.fx)
    lyp, lyn = lim(cam.height, cam.cy, cam.fy)
    tx = np.clip(pc[:, 0] / tz, -lxn, lxp) * tz
    ty = np.clip(pc[:, 1] / tz, -lyn, lyp) * tz
    J = np.zeros((len(tz), 2, 3))
    J[:, 0, 0] = cam.fx / tz
    J[:, 0, 2] = -cam.fx * tx / tz**2
    J[:, 1, 1] = cam.fy / tz
    J[:, 1, 2] = -cam.fy * ty / tz**2
    T = J @ V[:3, :3]
    cov = T @ sigma @ T.transpose(0, 2, 1)
    det0 = cov[:, 0, 0] * cov[:, 1, 1] - cov[:, 0, 1] ** 2
    cov = cov + 0.3 * np.eye(2)
    det = cov[:, 0, 0] * cov[:, 1, 1] - cov[:, 0, 1] ** 2
    conic = np.linalg.inv(cov)
    comp = np.sqrt(np.clip(det0 / det, 0, None)) if antialias else 1.0
    opac = comp / (1 + np.exp(-g.opacities))
    uv = np.stack([cam.fx * pc[:, 0] / tz + cam.cx, cam.fy * pc[:, 1] / tz + cam.cy], 1)
    # SH colour (degree 0 and 1 only here: the scene below uses degree 1)
    campos = -V[:3, :3].T @ V[:3, 3]
    d = g.means - campos
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    c1 = 0.4886025119029199
    col = C0 * g.sh[:, 0] + 0.5
    if g.sh.shape[1] > 1:
        col += -c1 * d[:, 1:2] * g.sh[:, 1] + c1 * d[:, 2:3] * g.sh[:, 2] - c1 * d[:, 0:1] * g.sh[:, 3]
    col = np.maximum(col, 0)
    ok = (tz >= 0.01) & (det > 0) & (opac > 1 / 255)
    order = [i for i in np.argsort(tz, kind="stable") if ok[i]]
    H, W = cam.height, cam.width
    img = np.zeros((H, W, 3))
    alpha = np.zeros((H, W))
    for py in range(H):
        for px in range(W):
            Tr, c = 1.0, np.zeros(3)
            for i in order:
                dx, dy = uv[i] - (px + 0.5, py + 0.5)
                s = 0.5 * (conic[i, 0, 0] * dx * dx + conic[i, 1, 1] * dy * dy) + conic[i, 0, 1] * dx * dy
                a = min(0.99, opac[i] * np.exp(-s))
                if s < 0 or a < 1 / 255:
                    continue
                if Tr * (1 - a) <= 1e-4:
                    break
                c += a * Tr * col[i]
                Tr *= 1 - a
            img[py, px] = c + Tr * np.asarray(bg)
            alpha[py, px] = 1 - Tr
    return img, alpha


@pytest.mark.parametrize("antialias", [False, True])
def test_forward_matches_dense_reference(antialias):
    g = edge_case_scene(n=20, seed=5, degree=1)
    cam = look_at_camera(W=37, H=21)
    bg = (0.1, 0.2, 0.3)
    frame = ns.render(g, cam, background=bg, antialias=antialias, backend="cpu")
    ref_img, ref_alpha = reference_render(g, cam, bg, antialias)
    assert frame.binning.n_isect > 0
    np.testing.assert_allclose(frame.image, ref_img, atol=1e-9)
    np.testing.assert_allclose(frame.render.alpha, ref_alpha, atol=1e-9)


def test_empty_and_invisible_scenes_give_background_and_zero_gradients():
    cam = look_at_camera()
    bg = (0.3, 0.2, 0.1)
    empty = ns.Gaussians(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros((0, 4)), np.zeros(0), np.zeros((0, 1, 3)))
    behind = edge_case_scene(n=8)
    behind.means[:, 2] = -3.0
    for g in (empty, behind):
        frame = ns.render(g, cam, background=bg, backend="cpu")
        np.testing.assert_array_equal(frame.image, np.broadcast_to(bg, frame.image.shape))
        assert (frame.render.alpha == 0).all()
        grads, _ = ns.render_backward(g, frame, np.ones_like(frame.image), backend="cpu")
        for a in grads.arrays().values():
            assert not a.any()


def test_non_finite_parameters_and_cameras_are_named():
    g = edge_case_scene(n=8)
    g.scales[3, 1] = np.nan
    with pytest.raises(ValueError, match="scales"):
        ns.render(g, look_at_camera(), backend="cpu")
    with pytest.raises(ValueError, match="fx"):
        ns.Camera(np.eye(4), np.inf, 10, 5, 5, 10, 10)
    with pytest.raises(ValueError, match="viewmat"):
        ns.Camera(np.full((4, 4), np.nan), 10, 10, 5, 5, 10, 10)
    with pytest.raises(ValueError, match="background"):
        ns.render(edge_case_scene(n=8), look_at_camera(), background=(0, 1), backend="cpu")


def test_intersection_overflow_is_refused(monkeypatch):
    monkeypatch.setattr(rz, "INT32_MAX", 10)
    with pytest.raises(ValueError, match="int32"):
        ns.render(edge_case_scene(n=20), look_at_camera(), backend="cpu")


def test_binning_takes_a_known_total_and_checks_it():
    """A caller that knows the intersections' total (a renderer under MPI) passes it: the GPU then
    skips a read-back.  On the CPU a wrong total is caught: on the GPU it would overrun buffers."""
    g, cam = edge_case_scene(n=20), look_at_camera()
    p = ns.project(g, cam, backend="cpu")
    ref = ns.bin_tiles(p, backend="cpu")
    b = ns.bin_tiles(p, backend="cpu", total=ref.n_isect)
    np.testing.assert_array_equal(b.ids, ref.ids)
    np.testing.assert_array_equal(b.ranges, ref.ranges)
    with pytest.raises(ValueError, match=f"total {ref.n_isect + 1} given, but the counts add up to {ref.n_isect}"):
        ns.bin_tiles(p, backend="cpu", total=ref.n_isect + 1)


def _ranged(b):
    return [list(b.ids[s:e]) for s, e in b.ranges]


def test_binning_into_room():
    """With room to spare, binning into room lists what exact binning lists; with too little, the
    Gaussians (in depth order) from the first whose intersections do not all fit are left out,
    the overflow flag is set, and the device total is the whole count."""
    g, cam = edge_case_scene(n=30, seed=2), look_at_camera()
    p = ns.project(g, cam, backend="cpu")
    exact = ns.bin_tiles(p, backend="cpu")
    assert exact.overflow is None and int(exact.total[0]) == exact.n_isect > 0
    for room in (exact.n_isect, exact.n_isect + 7):
        b = ns.bin_tiles(p, backend="cpu", room=room)
        assert b.n_isect == room and b.overflow[0] == 0 and int(b.total[0]) == exact.n_isect
        np.testing.assert_array_equal(b.ranges[:, 1] - b.ranges[:, 0], exact.ranges[:, 1] - exact.ranges[:, 0])
        assert _ranged(b) == _ranged(exact)
    depth = np.where(p.counts > 0, p.proj[:, go.DEPTH], np.inf).astype(np.float32)
    order = np.argsort(depth, kind="stable")
    ends = np.cumsum(p.counts[order])
    for room in (exact.n_isect - 1, int(ends[len(ends) // 3]) + 1, 0):
        b = ns.bin_tiles(p, backend="cpu", room=room)
        assert b.overflow[0] == 1 and int(b.total[0]) == exact.n_isect
        kept = set(order[ends <= room])
        want = [[i for i in ids if i in kept] for ids in _ranged(exact)]
        assert _ranged(b) == want
        fit = ends[ends <= room]
        assert sum(map(len, want)) == (int(fit[-1]) if len(fit) else 0)
    with pytest.raises(ValueError, match="room must be"):
        ns.bin_tiles(p, backend="cpu", room=-1)


def test_views_binned_together_as_each_alone():
    """A renderer bins its batch's views at once (view b's tile t is tile b * tiles + t): each view's
    ranges then list the same Gaussians, in the same order, as binning that view alone."""
    cam = look_at_camera()
    projs = [ns.project(edge_case_scene(n=40, seed=s), cam, backend="cpu") for s in (3, 4, 5)]
    both = ns.Projection(cam, None, np.concatenate([p.proj for p in projs]), None,
                         np.concatenate([p.counts for p in projs]), 3, False)
    view_of = np.repeat(np.arange(3, dtype=np.int32), 40)
    together = ns.bin_tiles(both, backend="cpu", view_of=view_of, n_views=3)
    n_tiles = cam.tiles[0] * cam.tiles[1]
    assert together.ranges.shape == (3 * n_tiles, 2)
    for b, p in enumerate(projs):
        alone = ns.bin_tiles(p, backend="cpu")
        for t, (s, e) in enumerate(alone.ranges):
            s2, e2 = together.ranges[b * n_tiles + t]
            np.testing.assert_array_equal(together.ids[s2:e2], alone.ids[s:e] + 40 * b)
    assert together.n_isect == sum(int(p.counts.sum()) for p in projs) > 0


def test_emission_respects_projected_counts():
    """Binning writes exactly counts[n] slots per Gaussian even if its own
    tile test disagrees (the GPU may round the two passes differently)."""
    g, cam = edge_case_scene(n=20), look_at_camera()
    p = ns.project(g, cam, backend="cpu")
    ref = ns.bin_tiles(p, backend="cpu")
    n = int(np.flatnonzero(p.counts > 1)[0])
    for delta in (2, -1):
        p.counts[n] += delta
        b = ns.bin_tiles(p, backend="cpu")
        p.counts[n] -= delta
        assert b.n_isect == ref.n_isect + delta
        ranged = np.concatenate([b.ids[s:e] for s, e in b.ranges])
        if delta > 0:  # the padding lands in no tile
            np.testing.assert_array_equal(ranged, np.concatenate([ref.ids[s:e] for s, e in ref.ranges]))
        else:          # one intersection of n is dropped, nothing else moves
            assert len(ranged) == ref.n_isect - 1 and (ranged != n).sum() == (ref.ids != n).sum()


def _tile_min_form(X0, X1, X2, x0, x1, y0, y1):
    """float64: the least X0 x^2 + 2 X1 x y + X2 y^2 over the box [x0, x1] x [y0, y1] (convex: 0 if
    the box holds the origin, else on an edge, where it is a 1D quadratic)."""
    if x0 <= 0 <= x1 and y0 <= 0 <= y1:
        return 0.0
    def edge(A, B, C, d, lo, hi):  # least A d^2 + 2 B d e + C e^2 over e in [lo, hi]
        e = min(hi, max(lo, -B * d / C))
        return A * d * d + 2 * B * d * e + C * e * e
    return min(edge(X0, X1, X2, x0, y0, y1), edge(X0, X1, X2, x1, y0, y1),
               edge(X2, X1, X0, y0, x0, x1), edge(X2, X1, X0, y1, x0, x1))


def test_row_span_is_the_exact_tile_test():
    """The tiles that binning emits per row (``row_span``) are those where some pixel centre has
    the Gaussian at alpha >= 1/255, by a float64 test of every tile, for small, huge, thin,
    rotated and off-screen ellipses; only tiles within 1e-3 of the threshold may differ."""
    from numbasplat.math.geometry import ellipse_rows, row_span
    rng = np.random.default_rng(3)
    W, H, tile = 203, 131, 16
    tiles_x, tiles_y = -(-W // tile), -(-H // tile)
    checked = 0
    for case in range(400):
        sx, sy = np.exp(rng.uniform(-1, 5, 2))  # half-axes of 0.4 to 150 px: a tile to the whole image
        theta = rng.uniform(0, np.pi)
        c, s_ = np.cos(theta), np.sin(theta)
        R = np.array([[c, -s_], [s_, c]])
        cov = R @ np.diag([sx * sx, sy * sy]) @ R.T
        X = np.linalg.inv(cov)
        X0, X1, X2 = np.float32(X[0, 0]), np.float32(X[0, 1]), np.float32(X[1, 1])
        u, v = rng.uniform(-60, W + 60), rng.uniform(-60, H + 60)
        ext = np.float32(rng.uniform(1, 11))
        det = X0 * X2 - X1 * X1
        rows = ellipse_rows(X0, X1, X2, ext, X2 / det, X0 / det)  # the covariance diagonal as footprint's
        for ty in range(tiles_y):
            a, b = row_span(np.float32(u), np.float32(v), X0, X1, rows, ty, tile, tiles_x, W, H)
            y0, y1 = ty * tile + 0.5 - v, min(ty * tile + tile, H) - 0.5 - v
            for tx in range(tiles_x):
                x0, x1 = tx * tile + 0.5 - u, min(tx * tile + tile, W) - 0.5 - u
                q = _tile_min_form(float(X0), float(X1), float(X2), x0, x1, y0, y1)
                if abs(q - ext) > 1e-3 * ext:
                    assert (a <= tx <= b) == (q < ext), (case, ty, tx, q, ext, a, b)
                    checked += q < ext
    assert checked > 2000  # tiles reached, over every case


def test_project_backward_adds_or_overwrites():
    g, cam = edge_case_scene(n=12), look_at_camera()
    frame = ns.render(g, cam, backend="cpu")
    once, rec = ns.render_backward(g, frame, np.ones_like(frame.image), backend="cpu")
    out = ns.Gaussians(**{k: np.full_like(a, np.nan) for k, a in g.arrays().items()})
    ns.project_backward(g, frame.projection, rec, out, accumulate=False, backend="cpu")
    ns.project_backward(g, frame.projection, rec, out, accumulate=True, backend="cpu")
    for k, a in once.arrays().items():
        np.testing.assert_allclose(getattr(out, k), 2 * a, rtol=1e-12, atol=1e-15, err_msg=k)


@njit(cache=False)
def _box_cases(params, boxes, out):
    """out[i]: (reaches_box, max alpha over the warp's 32 pixel centres), all in float32."""
    for i in range(params.shape[0]):
        u, v, ca, cb, cc, o = params[i]
        x0, y0 = boxes[i]
        out[i, 0] = reaches_box(u, v, ca, cb, cc, o, x0, x0 + np.float32(WARP_W - 1), y0, y0 + np.float32(WARP_H - 1))
        best = np.float32(0.0)
        for row in range(WARP_H):
            for col in range(WARP_W):
                a = gaussian_alpha(u, v, ca, cb, cc, o, x0 + np.float32(col), y0 + np.float32(row))[0]
                best = max(best, a)
        out[i, 1] = best


def test_warp_cull_is_conservative_and_culls():
    """A warp skips a Gaussian only when none of its 32 pixels would take it: over thin,
    tilted, near-degenerate and faint Gaussians near the warp's pixels, the cull never drops a pixel
    with alpha >= ALPHA_MIN, and it does drop most of those that reach none."""
    rng = np.random.default_rng(3)
    n = 200000
    sx, sy = np.exp(rng.uniform(np.log(0.3), np.log(60.0), (2, n)))
    th = rng.uniform(0, np.pi, n)
    c, s = np.cos(th), np.sin(th)
    cov = np.stack([c * c * sx**2 + s * s * sy**2, c * s * (sx**2 - sy**2), s * s * sx**2 + c * c * sy**2], 1)
    det = cov[:, 0] * cov[:, 2] - cov[:, 1] ** 2
    conic = np.stack([cov[:, 2], -cov[:, 1], cov[:, 0]], 1) / det[:, None]
    u, v = rng.uniform(-80, 100, (2, n))
    o = np.where(rng.random(n) < 0.1, rng.uniform(0, 0.01, n), rng.uniform(0, 1, n))
    params = np.column_stack([u, v, conic, o]).astype(np.float32)
    boxes = np.column_stack([rng.integers(0, 8, n) * WARP_W + 0.5, rng.integers(0, 4, n) * WARP_H + 0.5])
    out = np.zeros((n, 2), np.float32)
    _box_cases(params, boxes.astype(np.float32), out)
    keep, alpha = out[:, 0] > 0, out[:, 1]
    assert not np.any(~keep & (alpha >= ALPHA_MIN)), "a culled Gaussian reaches a pixel"
    unseen = alpha < ALPHA_MIN
    assert keep[~unseen].all() and unseen.sum() > n // 4
    assert (~keep[unseen]).mean() > 0.9, (~keep[unseen]).mean()
    # an indefinite conic or a NaN opacity is never culled; zero opacity always is
    for ca, cb, cc, op, want in ((1.0, 2.0, 1.0, 0.5, True), (1.0, 0.0, 1.0, np.nan, True),
                                 (1.0, 0.0, 1.0, 0.0, False)):
        got = reaches_box(*np.float32([500.0, 500.0, ca, cb, cc, op, 0.5, 7.5, 0.5, 3.5]))
        assert got == want
