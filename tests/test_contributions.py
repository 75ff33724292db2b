"""The contributions pass (``rendering.contributions``): each pixel's dominant Gaussian and each
Gaussian's total contribution, on hand-made records whose answer is known and against an
independent float64 numpy reference that composites every pixel from the records."""
import numpy as np

import numbasplat as ns
from numbasplat.cpu.raster import visit_tiles
from numbasplat.math import geometry as geo
from numbasplat.math.blend import dominant_step, gaussian_alpha
from numbasplat.math.tiles import TILE
from tests.scenes import edge_case_scene, look_at_camera

# hand-made records (u, v, conic a, b, c, opacity, r, g, b, depth): isotropic, sigma in pixels
BRIGHT, BLACK, OCCLUDED, SIDE, TIE_BACK, TIE_FRONT = range(6)
SCENE = (  # (u, v, sigma, opacity, colour, depth)
    (18.0, 14.0, 4.0, 0.95, (0.9, 0.6, 0.3), 4.0),   # BRIGHT: the large opaque one in the middle
    (9.5, 7.5, 2.5, 0.98, (0.0, 0.0, 0.0), 2.0),     # BLACK: in front of BRIGHT's upper left, opaque
    (18.0, 14.0, 1.2, 0.9, (0.2, 0.9, 0.4), 6.0),    # OCCLUDED: small, behind BRIGHT's centre
    (33.0, 23.0, 2.0, 0.7, (0.1, 0.3, 0.8), 3.0),    # SIDE: alone at the lower right
    (30.5, 5.5, 1.5, 0.5, (2.0, 0.0, 0.0), 1.5),     # TIE_BACK: twice as bright as TIE_FRONT, behind it
    (30.5, 5.5, 1.5, 0.5, (1.0, 0.0, 0.0), 1.0),     # TIE_FRONT: at pixel (30, 5)'s centre alpha 0.5: a tie
)


def records_projection(rows, cam):
    """A Projection of records given directly (their tile counts as projection computes them)."""
    proj = np.zeros((len(rows), ns.rendering.go.PROJ_FIELDS))
    for n, (u, v, sigma, opacity, colour, depth) in enumerate(rows):
        proj[n] = (u, v, sigma ** -2, 0.0, sigma ** -2, opacity, *colour, depth)
    tx, ty = cam.tiles
    counts = np.zeros(len(rows), np.int32)
    for n in range(len(rows)):
        counts[n] = visit_tiles(n, proj, TILE, tx, ty, cam.width, cam.height, (0, 0, 0, 0), 0, 0, counts, counts,
                                None, False, 0, 1)
    return ns.Projection(cam, None, proj, None, counts, 0, False)


def reference_contributions(p):
    """Plain float64 numpy: every pixel composites the visible records in depth order."""
    proj = p.proj.astype(np.float64)
    u, v, ca, cb, cc, opac = proj[:, :6].T
    norm = np.linalg.norm(proj[:, 6:9], axis=1)
    order = [i for i in np.argsort(proj[:, 9], kind="stable") if p.counts[i] > 0]
    H, W = p.camera.height, p.camera.width
    dominant = np.full((H, W), -1)
    total = np.zeros(len(proj))
    for py in range(H):
        for px in range(W):
            T, best = 1.0, 0.0
            for i in order:
                dx, dy = u[i] - (px + 0.5), v[i] - (py + 0.5)
                s = 0.5 * (ca[i] * dx * dx + cc[i] * dy * dy) + cb[i] * dx * dy
                a = min(float(geo.ALPHA_MAX), opac[i] * np.exp(-s))
                if s < 0 or a < geo.ALPHA_MIN:
                    continue
                if T * (1 - a) <= geo.T_MIN:
                    break
                k = T * a * norm[i]
                total[i] += k
                if k > best:
                    best, dominant[py, px] = k, i
                T *= 1 - a
    return dominant, total


def test_dominant_step_ties_keep_the_first_and_nothing_is_not_dominant():
    assert dominant_step(0.5, 0.6, 0.8, 0.0, 7, 0.4, 3) == (0.5, 0.5, 7)   # |(0.6, 0.8, 0)| = 1
    assert dominant_step(0.25, 2.0, 0.0, 0.0, 7, 0.5, 3) == (0.5, 0.5, 3)  # a tie: the earlier stays
    assert dominant_step(0.0, 1.0, 1.0, 1.0, 7, 0.0, -1) == (0.0, 0.0, -1)
    assert dominant_step(0.9, 0.0, 0.0, 0.0, 7, 0.0, -1) == (0.0, 0.0, -1)  # opaque but black


def test_hand_made_scene_has_its_known_dominant_gaussians():
    cam = look_at_camera(W=40, H=30)
    p = records_projection(SCENE, cam)
    b = ns.bin_tiles(p, backend="cpu")
    dominant, total = ns.contributions(p, b, backend="cpu")
    assert dominant.dtype == np.int32 and dominant.shape == (30, 40)
    assert total.dtype == np.float32 and total.shape == (len(SCENE),)
    ref_dominant, ref_total = reference_contributions(p)
    np.testing.assert_array_equal(dominant, ref_dominant)
    np.testing.assert_allclose(total, ref_total, rtol=1e-6)
    # behind BRIGHT's centre: contributes, never dominates
    assert total[OCCLUDED] > 0 and not (dominant == OCCLUDED).any()
    # black: in front and nearly opaque at its centre pixel, where BRIGHT behind it still wins
    black_alpha = lambda px, py: gaussian_alpha(*p.proj[BLACK, :6], px + 0.5, py + 0.5)[0]
    assert black_alpha(9, 7) == 0.98 and dominant[7, 9] == BRIGHT
    assert total[BLACK] == 0 and not (dominant == BLACK).any()
    # no Gaussian at all (the lower left), or only the black one (its upper left): nothing dominates
    assert dominant[29, 0] == -1 and dominant[3, 4] == -1 and black_alpha(4, 3) > geo.ALPHA_MIN
    assert dominant[22, 32] == SIDE and dominant[14, 17] == BRIGHT
    # at (30, 5) both tie at 0.5 * 1 = 0.5 * 0.5 * 2: the front one, though listed later; around
    # it alpha < 0.5 and the brighter one behind wins
    assert dominant[5, 30] == TIE_FRONT and dominant[5, 31] == TIE_BACK and dominant[6, 30] == TIE_BACK
    assert (dominant == -1).sum() > 400


def test_random_scene_matches_reference_and_the_forward_pass():
    """Overlaps, an opaque stack (early stop), a culled and a faint Gaussian: the reference's
    answer, and every dominant Gaussian within the forward pass's contributing range."""
    g, cam = edge_case_scene(n=30, seed=2), look_at_camera(W=37, H=29)
    frame = ns.render(g, cam, backend="cpu")
    p, b = frame.projection, frame.binning
    dominant, total = ns.contributions(p, b, backend="cpu")
    ref_dominant, ref_total = reference_contributions(p)
    np.testing.assert_array_equal(dominant, ref_dominant)
    np.testing.assert_allclose(total, ref_total, rtol=1e-6)
    assert len(np.unique(dominant)) > 5 and total[3] == 0  # (Gaussian 3 is culled)
    tx = cam.tiles[0]
    for py, px in zip(*np.nonzero(dominant >= 0)):
        start = b.ranges[(py // TILE) * tx + px // TILE, 0]
        assert dominant[py, px] in b.ids[start:frame.render.last[py, px]]


def test_empty_scene_and_no_intersections():
    cam = look_at_camera(W=20, H=17)
    empty = ns.Gaussians(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros((0, 4)), np.zeros(0), np.zeros((0, 1, 3)))
    behind = edge_case_scene(n=8)
    behind.means[:, 2] = -3.0
    for g in (empty, behind):
        p = ns.project(g, cam, backend="cpu")
        b = ns.bin_tiles(p, backend="cpu")
        assert b.n_isect == 0
        dominant, total = ns.contributions(p, b, backend="cpu")
        np.testing.assert_array_equal(dominant, np.full((17, 20), -1, np.int32))
        assert dominant.dtype == np.int32 and total.dtype == np.float32
        np.testing.assert_array_equal(total, np.zeros(len(g), np.float32))
