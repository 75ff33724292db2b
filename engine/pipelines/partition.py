"""Splaxel's convex spatial partition: a kd-tree that splits space into P axis-aligned boxes.

Each box is owned by one rank, which holds the Gaussians whose centres lie in it (pixel-level
distributed training, issue 25).  The tree splits at the count-balanced position of the longest
axis of the Gaussians' extent, the lower side taking floor(ranks / 2) of the ranks, so every rank
gets about N / P Gaussians whatever P is.  The boxes cover all of space (the outer faces are at
infinity), so a Gaussian that moves always has an owner.

For a camera, the boxes' front-to-back order is the tree's near-side-first traversal from the
camera's centre (a BSP tree's order): it holds for every ray of that camera, so partial images
rendered box by box compose in that order.  ``visible_region`` bounds the pixels a box can touch
from its vertices alone, without rendering.
"""
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from numbasplat import backend as _backend
from numbasplat.rows import reach_boxes


@dataclass
class Node:
    """An inner node (``axis``, ``value``, ``lower``, ``upper``: points with x[axis] < value go lower)
    or a leaf (``rank``)."""
    axis: int = -1
    value: float = 0.0
    lower: "Node" = None
    upper: "Node" = None
    rank: int = -1


class SpatialPartition:
    """P axis-aligned boxes from a kd-tree over Gaussian centres (``build``)."""

    def __init__(self, root, ranks):
        self.root = root
        self.ranks = ranks
        self.lo = np.full((ranks, 3), -np.inf)
        self.hi = np.full((ranks, 3), np.inf)
        self._bounds(root, np.full(3, -np.inf), np.full(3, np.inf))

    @classmethod
    def build(cls, means, ranks):
        """The tree of ``ranks`` boxes balanced by the count of ``means`` (N, 3)."""
        if ranks < 1:
            raise ValueError(f"a partition needs at least one rank, got {ranks}")
        means = np.asarray(means, np.float64).reshape(-1, 3)
        next_rank = iter(range(ranks))

        def split(points, k):
            if k == 1:
                return Node(rank=next(next_rank))
            extent = points.max(axis=0) - points.min(axis=0) if len(points) else np.ones(3)
            axis = int(np.argmax(extent))
            order = np.sort(points[:, axis])
            low = k // 2
            cut = len(order) * low // k
            if cut == 0:  # too few points to share: the lower side starts empty
                value = float(order[0]) if len(order) else 0.0
            else:  # between the cut's neighbours: the lower side holds ``cut`` points (ties aside)
                value = float(0.5 * (order[cut - 1] + order[cut]))
            below = points[:, axis] < value
            return Node(axis, value, split(points[below], low), split(points[~below], k - low))
        return cls(split(means, ranks), ranks)

    def _bounds(self, node, lo, hi):
        if node.rank >= 0:
            self.lo[node.rank], self.hi[node.rank] = lo, hi
            return
        mid_hi, mid_lo = hi.copy(), lo.copy()
        mid_hi[node.axis] = mid_lo[node.axis] = node.value
        self._bounds(node.lower, lo, mid_hi)
        self._bounds(node.upper, mid_lo, hi)

    def owner(self, points):
        """(N,) int32: the rank whose box holds each point (lower faces inclusive, upper exclusive),
        on the points' device (compared in float64 everywhere, so every caller agrees)."""
        xp = _backend.array_module_of(points)
        points = xp.asarray(points, np.float64).reshape(-1, 3)
        lo, hi = xp.asarray(self.lo), xp.asarray(self.hi)
        inside = ((points[:, None, :] >= lo[None]) & (points[:, None, :] < hi[None])).all(axis=2)
        return xp.argmax(inside, axis=1).astype(np.int32)

    def imbalance(self, points):
        """The largest rank's share of ``points`` over the mean share (1.0: perfectly even)."""
        counts = np.bincount(self.owner(points), minlength=self.ranks)
        return float(counts.max() / max(counts.mean(), 1e-12))

    def front_to_back(self, centre):
        """The ranks in the order a camera at ``centre`` sees their boxes, nearest first."""
        order, stack = [], [self.root]
        centre = np.asarray(centre, np.float64)
        while stack:
            node = stack.pop()
            if node.rank >= 0:
                order.append(node.rank)
                continue
            near, far = (node.lower, node.upper) if centre[node.axis] < node.value else (node.upper, node.lower)
            stack += [far, near]  # the near side is popped first
        return order


REACH = 4.0   # a Gaussian reaches this many of its largest scale past its centre (the boxes a view may see)
GROW_PX = 16  # and this many pixels more on screen (the screen-space blur, the projection's linearisation)
PARALLEL_BOXES = 4096  # visible_regions runs in parallel threads from this many boxes on


def morton_codes(points, bits=10):
    """(N,) uint64 Morton codes of ``points`` quantised to ``bits`` per axis within their bounds."""
    points = np.asarray(points)
    if points.dtype not in (np.float32, np.float64):
        points = points.astype(np.float64)
    code = np.empty(len(points), np.uint64)
    if len(points):
        _morton_codes(np.ascontiguousarray(points), bits, code)
    return code


@njit(parallel=True, cache=True)
def _morton_codes(points, bits, code):
    """``morton_codes``' pass: the points' bounds, then each point's coordinates (in float64) quantised to ``bits``
    within them and their bits interleaved (x lowest)."""
    lo, extent = np.empty(3), np.empty(3)
    for axis in range(3):
        a, b = np.inf, -np.inf
        for i in range(points.shape[0]):
            a, b = min(a, points[i, axis]), max(b, points[i, axis])
        lo[axis], extent[axis] = a, max(b - a, 1e-12)
    top = 2 ** bits - 1
    for i in prange(points.shape[0]):
        c = np.uint64(0)
        for axis in range(3):
            q = np.uint64((np.float64(points[i, axis]) - lo[axis]) / extent[axis] * top)
            for b in range(bits):
                c |= ((q >> np.uint64(b)) & np.uint64(1)) << np.uint64(3 * b + axis)
        code[i] = c


def morton_order(points, bits=10):
    """The points' order along the Morton curve: ``np.argsort(morton_codes(points, bits), kind="stable")``."""
    return stable_argsort(morton_codes(points, bits), 3 * bits)


def stable_argsort(keys, bits):
    """``np.argsort(keys, kind="stable")`` of integer ``keys`` in [0, 2 ** ``bits``), as one sort of each key packed
    with its row (unique values, so any sort is stable; NumPy's vectorised sort of them is several times faster
    than its stable argsort), where both fit 64 bits."""
    n = len(keys)
    row_bits = max(1, (n - 1).bit_length())
    if bits + row_bits > 64:
        return np.argsort(keys, kind="stable")
    packed = (np.asarray(keys).astype(np.uint64) << np.uint64(row_bits)) | np.arange(n, dtype=np.uint64)
    packed.sort()
    return (packed & np.uint64((1 << row_bits) - 1)).astype(np.int64)


def cluster_boxes(means, log_scales, rows=4096, order=None):
    """A tight cover of a set of Gaussians by boxes: ``means`` (host, (N, 3)) cut into runs of ``rows``
    in Morton order (``order``: their argsort, where the caller has it), each run's box grown by
    ``REACH`` of its members' largest scale (``log_scales``) -> (lo, hi), (B, 3).  What a view's
    frustum is tested against where one box over them all would be too coarse (a rank's box of a
    city with a far background spans the sky: every view sees it); the out-of-core trainer's blocks."""
    n = len(means)
    if order is None:
        order = morton_order(means)
    table = np.empty((n, 6), np.float32)  # (the rows in Morton order, gathered straight into one table)
    table[:, :3], table[:, 3:] = np.take(means, order, axis=0), np.take(log_scales, order, axis=0)
    starts = np.arange(0, n, rows, dtype=np.int64)
    return reach_boxes(table, starts, np.minimum(rows, n - starts), 0, 3, REACH, "cpu")


def visible_regions(lo, hi, camera, grow, near=0.01):
    """The pixel rectangles (B, 4) of x0, y0, x1, y1 (end-exclusive) that the boxes [lo, hi] (B, 3,
    finite) can cover in ``camera``'s image, and (B,) whether they cover any pixel: each box's
    part in front of the near plane, projected, bounded, grown by ``grow`` pixels (the largest
    screen-space extent of its Gaussians, which reach past their centres' box) and clipped to the
    image.  A box clipped by the near plane is convex, with the box's corners in front and its
    edges' crossings of the plane as vertices; the image's edges are the frustum's side planes,
    so clipping the rectangle to the image gives the frustum's intersection.  One compiled pass,
    parallel over the boxes where there are ``PARALLEL_BOXES`` or more (the out-of-core trainer culls
    tens of thousands of blocks a step), else serial: a parallel region's threads for a rank's few
    boxes cost more than the pass where the host's ranks keep its cores busy in their collectives."""
    lo, hi = np.ascontiguousarray(lo, np.float64), np.ascontiguousarray(hi, np.float64)
    rects, seen = np.zeros((len(lo), 4), np.int64), np.zeros(len(lo), np.bool_)
    regions = _box_regions_parallel if len(lo) >= PARALLEL_BOXES else _box_regions_serial
    regions(lo, hi, np.ascontiguousarray(camera.viewmat, np.float64), float(camera.fx), float(camera.fy),
                 float(camera.cx), float(camera.cy), int(camera.width), int(camera.height), float(grow), float(near),
                 rects, seen)
    return rects, seen


def _box_regions(lo, hi, viewmat, fx, fy, cx, cy, width, height, grow, near, rects, seen):
    """``visible_regions``' pass: box k's corners (bit a of corner c picks hi on axis a) in camera
    space, those in front and the crossings of its 12 edges with the near plane projected and bounded."""
    for k in prange(lo.shape[0]):
        cam = np.empty((8, 3))
        for c in range(8):
            p0 = hi[k, 0] if c & 1 else lo[k, 0]
            p1 = hi[k, 1] if c & 2 else lo[k, 1]
            p2 = hi[k, 2] if c & 4 else lo[k, 2]
            for i in range(3):
                cam[c, i] = viewmat[i, 0] * p0 + viewmat[i, 1] * p1 + viewmat[i, 2] * p2 + viewmat[i, 3]
        u0, v0, u1, v1 = np.inf, np.inf, -np.inf, -np.inf
        real = False
        for c in range(8):
            for axis in range(4):  # the corner itself (axis 3), then its edges towards hi on each axis
                if axis < 3 and c & (1 << axis):
                    continue
                if axis == 3:
                    if cam[c, 2] < near:
                        continue
                    x, y, z = cam[c, 0], cam[c, 1], cam[c, 2]
                else:
                    d = c | (1 << axis)
                    za, zb = cam[c, 2], cam[d, 2]
                    if not (za - near) * (zb - near) < 0:
                        continue
                    t = (near - za) / (zb - za)
                    x = cam[c, 0] + t * (cam[d, 0] - cam[c, 0])
                    y = cam[c, 1] + t * (cam[d, 1] - cam[c, 1])
                    z = za + t * (zb - za)
                real = True
                u, v = fx * x / z + cx, fy * y / z + cy
                u0, u1, v0, v1 = min(u0, u), max(u1, u), min(v0, v), max(v1, v)
        if not real:
            continue
        x0, y0 = max(np.floor(u0 - grow), 0.0), max(np.floor(v0 - grow), 0.0)
        x1, y1 = min(np.ceil(u1 + grow) + 1, width), min(np.ceil(v1 + grow) + 1, height)
        if x0 < x1 and y0 < y1:
            seen[k] = True
            rects[k, 0], rects[k, 1], rects[k, 2], rects[k, 3] = int(x0), int(y0), int(x1), int(y1)


_box_regions_parallel = njit(parallel=True, cache=True)(_box_regions)
_box_regions_serial = njit(cache=True)(_box_regions)


def visible_region(lo, hi, camera, grow, near=0.01):
    """``visible_regions`` of the one box [lo, hi]: its rectangle (x0, y0, x1, y1), or None."""
    rects, seen = visible_regions(np.asarray(lo)[None], np.asarray(hi)[None], camera, grow, near)
    return tuple(int(x) for x in rects[0]) if seen[0] else None
