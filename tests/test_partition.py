"""engine/pipelines/partition.py: Splaxel's kd-tree boxes (balanced, covering space), their front-to-back
order for a camera (checked along rays) and the visible region of a box (against sampled points)."""
import numpy as np
import pytest

import numbasplat as ns
from engine.pipelines.partition import SpatialPartition, visible_region, visible_regions
from engine.tools.camera_path import look_at


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 8])
def test_boxes_cover_space_once_and_balance_the_count(ranks):
    rng = np.random.default_rng(ranks)
    points = rng.normal(size=(6000, 3)) * [4.0, 1.0, 0.5]  # one long axis: the first splits take it
    part = SpatialPartition.build(points, ranks)
    probe = rng.uniform(-20, 20, size=(2000, 3))
    inside = ((probe[:, None] >= part.lo) & (probe[:, None] < part.hi)).all(axis=2)
    assert (inside.sum(axis=1) == 1).all()  # every point of space in exactly one box
    counts = np.bincount(part.owner(points), minlength=ranks)
    assert counts.sum() == 6000 and part.imbalance(points) <= 1.01, counts
    if ranks > 1:
        assert part.root.axis == 0


@pytest.mark.parametrize("ranks", [2, 4, 7])
def test_front_to_back_order_holds_along_every_ray(ranks):
    rng = np.random.default_rng(10 + ranks)
    part = SpatialPartition.build(rng.normal(size=(3000, 3)), ranks)
    for _ in range(20):
        centre = rng.normal(size=3) * 3
        position = {r: k for k, r in enumerate(part.front_to_back(centre))}
        assert sorted(position) == list(range(ranks))
        for _ in range(20):
            direction = rng.normal(size=3)
            along = centre + np.linspace(0.01, 12, 400)[:, None] * direction / np.linalg.norm(direction)
            seen = [position[r] for r in part.owner(along)]
            assert seen == sorted(seen)  # a ray meets the boxes in the order given


def test_visible_region_bounds_the_box_and_is_tight():
    cam = ns.Camera(look_at((0.0, -6.0, 1.0), (0, 0, 0)), 60.0, 60.0, 40.0, 30.0, 80, 60)
    rng = np.random.default_rng(0)
    for lo, hi in (([-1, -1, -1], [1, 1, 1]), ([-3, -8, -1], [3, -2, 2]), ([0.5, -1, 0], [9, 9, 9])):
        lo, hi = np.array(lo, float), np.array(hi, float)
        rect = visible_region(lo, hi, cam, grow=0)
        pts = rng.uniform(lo, hi, size=(20000, 3))
        c = pts @ cam.viewmat[:3, :3].T + cam.viewmat[:3, 3]
        front = c[:, 2] > 0.01
        u = cam.fx * c[front, 0] / c[front, 2] + cam.cx
        v = cam.fy * c[front, 1] / c[front, 2] + cam.cy
        on = (u >= 0) & (u < cam.width) & (v >= 0) & (v < cam.height)
        assert rect is not None and on.any()
        x0, y0, x1, y1 = rect
        assert (u[on] >= x0).all() and (u[on] < x1).all() and (v[on] >= y0).all() and (v[on] < y1).all()
        # tight: the rectangle is the sampled points' own, give or take the sampling and a pixel
        assert u[on].min() - x0 < 3 and x1 - u[on].max() < 3 and v[on].min() - y0 < 3 and y1 - v[on].max() < 3
    boxes = np.array([[[-1, -1, -1], [1, 1, 1]], [[-3, -8, -1], [3, -2, 2]], [[-1, -20, -1], [1, -10, 1]]], float)
    rects, seen = visible_regions(boxes[:, 0], boxes[:, 1], cam, grow=2)  # many boxes at once: each as alone
    for (lo, hi), rect, s in zip(boxes, rects, seen):
        alone = visible_region(lo, hi, cam, grow=2)
        assert (alone is None) == (not s) and (alone is None or alone == tuple(rect))
    assert seen.tolist() == [True, True, False]
    grown = visible_region(np.array([-0.2, -0.2, -0.2]), np.array([0.2, 0.2, 0.2]), cam, grow=5)
    tight = visible_region(np.array([-0.2, -0.2, -0.2]), np.array([0.2, 0.2, 0.2]), cam, grow=0)
    assert grown[0] == tight[0] - 5 and grown[2] == tight[2] + 5
    assert visible_region(np.array([-1, -20, -1.0]), np.array([1, -10, 1.0]), cam, grow=3) is None  # behind
    assert visible_region(np.array([50, -1, -1.0]), np.array([60, 1, 1.0]), cam, grow=3) is None  # beside
    from engine.pipelines.partition import PARALLEL_BOXES
    centres = rng.uniform(-12, 12, (PARALLEL_BOXES + 5, 3))  # past PARALLEL_BOXES: the parallel pass, as box by box
    half = rng.uniform(0.1, 3.0, (len(centres), 3))
    rects, seen = visible_regions(centres - half, centres + half, cam, grow=2)
    few = [visible_regions(centres[a:a + 100] - half[a:a + 100], centres[a:a + 100] + half[a:a + 100], cam, grow=2)
           for a in range(0, len(centres), 100)]
    np.testing.assert_array_equal(np.concatenate([f[1] for f in few]), seen)
    np.testing.assert_array_equal(np.concatenate([f[0] for f in few]), rects)
    assert 0 < seen.sum() < len(seen)


def test_morton_codes_interleave_each_axis_bits_and_morton_order_is_their_stable_argsort():
    """The compiled codes against the bits interleaved one by one in NumPy (uneven bounds on each axis), and
    the packed sort against NumPy's stable argsort: ties (equal codes, repeated block numbers) keep row order,
    and keys too wide to pack beside their rows fall back to the argsort."""
    from engine.pipelines.partition import morton_codes, morton_order, stable_argsort
    rng = np.random.default_rng(3)
    points = rng.normal(size=(5000, 3)) * [10.0, 0.5, 3.0] + [100.0, -2.0, 0.0]
    points[:500] = points[500:1000]  # equal points: equal codes
    lo, hi = points.min(axis=0), points.max(axis=0)
    for bits in (10, 4):
        q = ((points - lo) / (hi - lo) * (2 ** bits - 1)).astype(np.uint64)
        expected = np.zeros(len(points), np.uint64)
        for b in range(bits):
            for axis in range(3):
                expected |= ((q[:, axis] >> np.uint64(b)) & np.uint64(1)) << np.uint64(3 * b + axis)
        codes = morton_codes(points, bits)
        assert np.array_equal(codes, expected)
        assert np.array_equal(morton_order(points, bits), np.argsort(expected, kind="stable"))
    blocks = rng.integers(0, 37, 10000)
    assert np.array_equal(stable_argsort(blocks, 6), np.argsort(blocks, kind="stable"))
    wide = rng.integers(0, 2 ** 62, 3000, dtype=np.int64)
    wide[:100] = wide[100:200]
    assert np.array_equal(stable_argsort(wide, 62), np.argsort(wide, kind="stable"))  # (62 + 12 bits: the argsort)
    assert len(stable_argsort(np.zeros(0, np.int64), 1)) == 0 and len(morton_codes(np.zeros((0, 3)))) == 0
