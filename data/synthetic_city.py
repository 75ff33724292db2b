"""A procedural city with a known ground truth: the large-scene benchmark (issue 22).

Why: the systems we implement (Splaxel's consolidation, the offloading's working
sets, the distributed trainer) are built for city-scale captures such as Mill-19
and MatrixCity: millions of Gaussians, thousands of views, heavy occlusion, and
views that each see a different part of the scene.  None can be downloaded here,
so this module builds such a scene from a seed, renders it with our own
rasterizer and writes a dataset that ``run.py train`` loads unchanged.

The scene (world z up, metres): a square grid of blocks separated by streets.
Each block holds a few box buildings of different heights (taller towards the
centre, some with a tower on top) or, now and then, a park.  Facades, roofs,
the ground and parked cars are opaque, flat Gaussians lying in their surface
(one axis along the normal, thin), so they occlude as walls do; their colours
draw windows, floors, road markings and crosswalks, with a per-Gaussian jitter
for texture.  Trees (a trunk and a crown of leaf Gaussians) stand on the
sidewalks and in the parks; fields surround the city; a far sphere of big
Gaussians is the sky, distant mountains and terrain.

The cameras: street-level paths (a vehicle or pedestrian walking the street
grid, looking roughly along the street) and aerial orbits around points of the
city, above the tallest building.  A street view sees a corridor of facades,
so views far apart share almost no Gaussians; an orbit sees its neighbourhood.

What ``generate`` writes to the output folder (a COLMAP text model):

    images/00000_street.png ...   ground truth, 8-bit RGB; names sort in capture
                                  order, so the loaders' split (every 8th sorted
                                  image is a test view, Inria's llffhold) holds
                                  out every 8th captured view
    sparse/0/cameras.txt          one PINHOLE camera
    sparse/0/images.txt           the poses (world to camera, OpenCV axes)
    sparse/0/points3D.txt         the initial point cloud: a noisy 1.5% of the
                                  city's surface Gaussians, as SfM would give
    ground_truth.ply              the ground-truth Gaussians (3DGS layout)
    synth.json                    the parameters and the Gaussian counts per part

Ground truth is rendered in float32 without antialiasing (on the GPU when the
backend is CUDA), on a black background, the trainer's default, which the sky
sphere hides anyway.  Everything depends on the seed only: the layout and the
cameras come from one random generator each, and every per-Gaussian number is
a hash of (seed, stream, Gaussian index), so the Gaussians are made in chunks
(memory stays bounded) without the chunking changing them.
"""
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

import numbasplat as ns
from numbasplat import backend as _backend
from numbasplat.math.sh import C0, C1

from .atomic import atomic_path
from .colmap import qvec_to_rotmat
from .ply import save_ply


@dataclass(frozen=True)
class Preset:
    gaussians: int
    views: int
    width: int
    height: int
    blocks: int      # the city is blocks x blocks


PRESETS = {
    "small": Preset(gaussians=1_000_000, views=300, width=960, height=540, blocks=5),
    "large": Preset(gaussians=32_000_000, views=1500, width=1920, height=1080, blocks=14),
}

# The ground truth's SH degree.  Degree 1 gives the windows a view-dependent sheen
# (looking up at glass shows the sky) for the trainer's higher bands to learn, at
# 23 floats a Gaussian: 2.9 GB for 32M, where degree 3 (59 floats) would be 7.6 GB
# on the host, the GPU and in the PLY.  Everything but the glass is view-independent.
SH_DEGREE = 1
BACKGROUND = (0.0, 0.0, 0.0)   # the trainer's default; the sky sphere covers every direction

# Layout, in metres
BLOCK = 50.0        # block side, sidewalks included
ROAD = 12.0         # curb to curb
SIDEWALK = 4.0     # wide enough for the street trees' crowns
PITCH = BLOCK + ROAD
ALLEY = 2.0         # between the lots of a block
FLOOR = 3.5         # storey height: windows and roof lines follow it
PARK_SHARE = 0.08   # of the blocks
FIELD_REACH = 2.5   # the fields reach FIELD_REACH x the city's half-size
FIELD_SPACING = 6.0  # fields are far and seen at grazing angles: coarser Gaussians
DOME_REACH = 5.0    # sky sphere radius, in city half-sizes (beyond the fields' corners)

# The Gaussian budget: the surfaces share one spacing; trees and the sky get a share
TREE_SHARE = 0.06
DOME_SHARE = 0.03
DOME_MIN = 32
TREE_MIN = 2        # a trunk and a crown
PLANAR_SCALE = 0.6  # in-plane sigma / spacing: neighbours overlap into an opaque surface
THIN = 0.03         # normal sigma / spacing: flat Gaussians
OPAQUE = 5.0        # opacity logit of surfaces and sky: 0.993, above the rasterizer's 0.99 cap
LEAF = 3.0          # opacity logit of leaves: 0.95

# Cameras
HFOV = math.radians(70.0)
STREET_SHARE = 0.7   # of the views; the rest are aerial
PATH_VIEWS = 30      # views of one street path
PATH_STEP = 6.0      # metres between consecutive views of a path
LANE = 2.0           # street cameras stay within LANE of the centreline (parked cars start at 3 m)
ORBIT_VIEWS = 20

SPARSE_SHARE = 0.015      # of the city's surface Gaussians become initial points
SPARSE_NOISE = 0.01       # their positional noise, in units of the median building side
CHUNK = 1 << 21           # Gaussians generated at once

PARTS = ("buildings", "cars", "ground", "fields", "trees", "sky")
SURFACE_PARTS = PARTS[:4]
CITY_PARTS = ("buildings", "cars", "ground", "trees")   # where SfM finds points
FACADE, ROOF, GROUND, CAR, GLASS, FIELD = range(6)      # face materials


# ----------------------------------------------------------------------------- parameters

def parse_resolution(res):
    """(width, height) from 'WxH' or a pair; ValueError naming --res otherwise."""
    if res is None:
        return None
    try:
        if isinstance(res, str):
            w, h = res.lower().split("x")
        else:
            w, h = res
        w, h = int(w), int(h)
    except (ValueError, TypeError):
        raise ValueError(f"--res must be WIDTHxHEIGHT, e.g. 960x540; got {res!r}") from None
    if w <= 0 or h <= 0:
        raise ValueError(f"--res must have a positive width and height, got {res!r}")
    return w, h


def _positive(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _preset(name):
    if name not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}; got {name!r}")
    return PRESETS[name]


# ----------------------------------------------------------------------------- hashed randomness

_M64 = (1 << 64) - 1


def _uniform(seed, stream, index):
    """Uniform numbers in [0, 1) that depend only on (seed, stream, index): splitmix64.

    Per-Gaussian randomness comes from here rather than from a generator's
    sequence, so a Gaussian's values do not depend on how the work is chunked."""
    key = ((int(seed) & _M64) * 0x9E3779B97F4A7C15 + (int(stream) + 1) * 0xD1B54A32D192ED03) & _M64
    x = np.atleast_1d(np.asarray(index)).astype(np.uint64) ^ np.uint64(key)
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# ----------------------------------------------------------------------------- layout

@dataclass
class CityLayout:
    """Where everything stands.  Boxes are (x0, y0, z0, x1, y1, z1)."""
    blocks: int
    seed: int
    half: float             # the city spans [-half, half]^2 (outer streets included)
    buildings: np.ndarray   # (B, 6) boxes, towers included
    styles: np.ndarray      # (B, 5): facade r, g, b, window pitch, share of lit windows
    cars: np.ndarray        # (C, 6) car bodies; each has a cabin (``car_cabins``)
    car_colours: np.ndarray  # (C, 3)
    trees: np.ndarray       # (T, 4): x, y, trunk height, crown radius
    parks: np.ndarray       # (blocks, blocks) bool
    sky: np.ndarray         # (6, 4): cloud wave vectors (3) and phases
    mountains: np.ndarray   # (4,): phases of the mountain skyline

    @property
    def streets(self):
        """Coordinates of the street centrelines (the same along x and y)."""
        return (np.arange(self.blocks + 1) - self.blocks / 2.0) * PITCH

    @property
    def tallest(self):
        return float(self.buildings[:, 5].max()) if len(self.buildings) else 0.0

    @property
    def dome_radius(self):
        return DOME_REACH * self.half

    def car_cabins(self):
        """(C, 6) the cabin box on each car body: shorter, narrower, set back 0.2 m."""
        b = self.cars
        long_x = ((b[:, 3] - b[:, 0]) > (b[:, 4] - b[:, 1]))[:, None]
        half = np.where(long_x, (1.2, 0.8), (0.8, 1.2))
        centre = 0.5 * (b[:, :2] + b[:, 3:5]) + np.where(long_x, (-0.2, 0.0), (0.0, -0.2))
        return np.concatenate([centre - half, b[:, 5:6], centre + half, b[:, 5:6] + 0.5], 1)


FACADE_PALETTE = np.array([(0.72, 0.70, 0.66), (0.78, 0.68, 0.52), (0.62, 0.33, 0.25), (0.86, 0.86, 0.84),
                           (0.32, 0.38, 0.44), (0.70, 0.45, 0.32), (0.62, 0.70, 0.76), (0.55, 0.55, 0.52)])
CAR_PALETTE = np.array([(0.9, 0.9, 0.9), (0.08, 0.08, 0.09), (0.6, 0.62, 0.64), (0.65, 0.08, 0.07),
                        (0.1, 0.2, 0.5), (0.3, 0.32, 0.33), (0.85, 0.7, 0.2)])


def plan_city(blocks, seed):
    """The layout of a ``blocks`` x ``blocks`` city (deterministic in ``seed``)."""
    rng = np.random.default_rng([int(seed), 1])
    half = blocks * PITCH / 2.0 + ROAD / 2.0
    streets = (np.arange(blocks + 1) - blocks / 2.0) * PITCH
    inner = BLOCK - 2 * SIDEWALK
    buildings, styles, cars, colours, trees = [], [], [], [], []
    parks = rng.random((blocks, blocks)) < PARK_SHARE
    for i in range(blocks):
        for j in range(blocks):
            x0, y0 = streets[i] + ROAD / 2, streets[j] + ROAD / 2   # the block's corner
            d = math.hypot(x0 + BLOCK / 2, y0 + BLOCK / 2) / half  # 0 at the centre, ~1.4 at the corners
            if parks[i, j]:
                for _ in range(int(inner * inner / 80)):
                    trees.append((x0 + SIDEWALK + rng.uniform(2, inner - 2), y0 + SIDEWALK + rng.uniform(2, inner - 2),
                                  rng.uniform(2.0, 3.5), rng.uniform(1.8, 3.2)))
            else:
                _plan_block(rng, x0 + SIDEWALK, y0 + SIDEWALK, inner, d, buildings, styles)
            _plan_block_edges(rng, x0, y0, cars, colours, trees)
    buildings = np.array(buildings, np.float64).reshape(-1, 6)
    styles = np.array(styles, np.float64).reshape(-1, 5)
    sky = np.concatenate([rng.normal(0.0, 9.0, (6, 3)), rng.uniform(0, 2 * np.pi, (6, 1))], 1)
    return CityLayout(blocks, int(seed), half, buildings, styles, np.array(cars, np.float64).reshape(-1, 6),
                      np.array(colours, np.float64).reshape(-1, 3), np.array(trees, np.float64).reshape(-1, 4),
                      parks, sky, rng.uniform(0, 2 * np.pi, 4))


def _split(rng, length, parts):
    """Cut ``length`` into ``parts`` random lots with alleys between: [(start, end)]."""
    w = rng.uniform(0.7, 1.3, parts)
    w = w / w.sum() * (length - ALLEY * (parts - 1))
    starts = np.concatenate([[0.0], np.cumsum(w[:-1] + ALLEY)])
    return list(zip(starts, starts + w))


def _plan_block(rng, x0, y0, inner, centrality, buildings, styles):
    """The buildings of one block's interior (lots with a box each, some with a tower)."""
    downtown = 1.0 + 2.5 * math.exp(-(centrality / 0.45) ** 2)
    for lx0, lx1 in _split(rng, inner, int(rng.integers(1, 4))):
        for ly0, ly1 in _split(rng, inner, int(rng.integers(1, 4))):
            s = rng.uniform(0.0, 1.5, 4)
            bx0, bx1 = x0 + lx0 + s[0], x0 + lx1 - s[1]
            by0, by1 = y0 + ly0 + s[2], y0 + ly1 - s[3]
            height = math.exp(rng.normal(math.log(16.0), 0.45)) * downtown
            height = FLOOR * max(2, round(min(height, 160.0) / FLOOR))
            colour = FACADE_PALETTE[rng.integers(len(FACADE_PALETTE))] + rng.uniform(-0.05, 0.05, 3)
            style = (*np.clip(colour, 0, 1), rng.choice([2.5, 3.0, 3.5]), rng.uniform(0.03, 0.2))
            buildings.append((bx0, by0, 0.0, bx1, by1, height))
            styles.append(style)
            # now and then a tower on the roof, listed right after its base (city_faces relies on it)
            if height > 30 and rng.random() < 0.3:
                k = rng.uniform(0.5, 0.75)
                cx, cy = rng.uniform(bx0, bx1), rng.uniform(by0, by1)
                wx, wy = k * (bx1 - bx0) / 2, k * (by1 - by0) / 2
                cx, cy = np.clip(cx, bx0 + wx, bx1 - wx), np.clip(cy, by0 + wy, by1 - wy)
                top = height + FLOOR * int(rng.integers(3, 12))
                buildings.append((cx - wx, cy - wy, height, cx + wx, cy + wy, top))
                styles.append(style)


def _plan_block_edges(rng, x0, y0, cars, colours, trees):
    """Trees on the block's four sidewalks and cars parked at the curbs beside it."""
    for side in range(4):
        along_x = side < 2
        # the curb line and the outward direction (towards the street)
        if along_x:
            curb, out = (y0, -1.0) if side == 0 else (y0 + BLOCK, 1.0)
        else:
            curb, out = (x0, -1.0) if side == 2 else (x0 + BLOCK, 1.0)
        start = x0 if along_x else y0
        t = 3.0 + rng.uniform(0, 3)
        while t < BLOCK - 3.0:
            if rng.random() > 0.25:
                lat = curb - out * 1.5   # on the sidewalk, 1.5 m from the curb: the crown stays off the walls
                pos = (start + t, lat) if along_x else (lat, start + t)
                trees.append((*pos, rng.uniform(2.5, 4.0), rng.uniform(1.5, SIDEWALK - 1.6)))
            t += 9.0 + rng.uniform(-1.5, 1.5)
        for t in np.arange(7.0, BLOCK - 6.0, 6.0):
            if rng.random() < 0.35:
                lat = curb + out * 2.1   # the car's centre, 1.2 m off the curb
                a0, a1 = start + t - 2.2, start + t + 2.2
                l0, l1 = lat - 0.9, lat + 0.9
                box = (a0, l0, 0.15, a1, l1, 1.05) if along_x else (l0, a0, 0.15, l1, a1, 1.05)
                cars.append(box)
                colours.append(CAR_PALETTE[rng.integers(len(CAR_PALETTE))])


# ----------------------------------------------------------------------------- surfaces

@dataclass
class Faces:
    """Flat rectangles, each sampled on a regular grid of Gaussians: the points
    origin + s u + t v with s in [0, width], t in [0, height], normal u x v.
    ``holes`` cut grid points out of a face (the ground under a building)."""
    origin: np.ndarray      # (F, 3)
    u: np.ndarray           # (F, 3) unit
    v: np.ndarray           # (F, 3) unit
    size: np.ndarray        # (F, 2) width, height
    coarse: np.ndarray      # (F,) spacing multiplier (the fields are coarser)
    material: np.ndarray    # (F,) FACADE, ROOF, ...
    colour: np.ndarray      # (F, 3) base colour
    style: np.ndarray       # (F, 2) window pitch, share of lit windows (facades)
    part: np.ndarray        # (F,) index into PARTS
    hole_face: np.ndarray   # (H,) ascending
    hole_box: np.ndarray    # (H, 4) s0, s1, t0, t1 in the face's coordinates

    def __len__(self):
        return len(self.origin)

    def grid(self, spacing):
        """(nu, nv): the grid of each face at a spacing (at least one point a side)."""
        step = spacing * self.coarse
        nu = np.maximum(1, np.rint(self.size[:, 0] / step)).astype(np.int64)
        nv = np.maximum(1, np.rint(self.size[:, 1] / step)).astype(np.int64)
        return nu, nv

    def hole_spans(self, nu, nv):
        """(i0, i1, j0, j1): the grid indices [i0, i1) x [j0, j1) inside each hole.  Counting
        and sampling both use these, so they agree to the point."""
        f = self.hole_face
        du, dv = self.size[f, 0] / nu[f], self.size[f, 1] / nv[f]
        box = self.hole_box

        def span(lo, hi, step, n):
            first = np.clip(np.floor(lo / step - 0.5) + 1, 0, n).astype(np.int64)
            end = np.clip(np.ceil(hi / step - 0.5), 0, n).astype(np.int64)
            return first, np.maximum(end, first)

        i0, i1 = span(box[:, 0], box[:, 1], du, nu[f])
        j0, j1 = span(box[:, 2], box[:, 3], dv, nv[f])
        return i0, i1, j0, j1

    def counts(self, spacing):
        """Gaussians of each face at a spacing."""
        nu, nv = self.grid(spacing)
        i0, i1, j0, j1 = self.hole_spans(nu, nv)
        cut = np.bincount(self.hole_face, (i1 - i0) * (j1 - j0), minlength=len(self)).astype(np.int64)
        return nu * nv - cut


class _FaceList:
    """Collects faces row by row (``city_faces``)."""

    def __init__(self):
        self.rows, self.holes = [], []

    def add(self, origin, u, v, size, material, part, colour=(0.5, 0.5, 0.5), style=(3.0, 0.0), coarse=1.0):
        self.rows.append((origin, u, v, size, coarse, material, colour, style, part))
        return len(self.rows) - 1

    def box(self, b, sides, top, part, colour, style=(3.0, 0.0)):
        """The four walls (u horizontal, v up, normal outwards) and the roof of a box; returns the roof's index."""
        x0, y0, z0, x1, y1, z1 = b
        X, Y, Z = np.eye(3)
        w, d, h = x1 - x0, y1 - y0, z1 - z0
        for origin, u, width in (((x0, y0, z0), X, w), ((x1, y1, z0), -X, w),
                                 ((x1, y0, z0), Y, d), ((x0, y1, z0), -Y, d)):
            self.add(origin, u, Z, (width, h), sides, part, colour, style)
        return self.add((x0, y0, z1), X, Y, (w, d), top, part, colour, style)

    def faces(self):
        cols = list(zip(*self.rows))
        origin, u, v, size, coarse, material, colour, style, part = (np.array(c, np.float64) for c in cols)
        holes = sorted(self.holes, key=lambda h: h[0])
        return Faces(origin, u, v, size, coarse, material.astype(np.int64), colour, style, part.astype(np.int64),
                     np.array([h[0] for h in holes], np.int64),
                     np.array([h[1] for h in holes], np.float64).reshape(-1, 4))


def city_faces(layout):
    """Every flat surface of the city, in part order: buildings, cars, ground, fields."""
    fl = _FaceList()
    X, Y = np.eye(3)[:2]
    roofs = []
    for k, (b, st) in enumerate(zip(layout.buildings, layout.styles)):
        if b[2] > 0:   # a tower: it stands on the roof of the building before it, which it hides
            base = layout.buildings[k - 1]
            fl.holes.append((roofs[k - 1], (b[0] - base[0], b[3] - base[0], b[1] - base[1], b[4] - base[1])))
        roofs.append(fl.box(b, FACADE, ROOF, PARTS.index("buildings"), st[:3], st[3:5]))
    for body, cabin, colour in zip(layout.cars, layout.car_cabins(), layout.car_colours):
        fl.box(body, CAR, CAR, PARTS.index("cars"), colour)
        fl.box(cabin, GLASS, CAR, PARTS.index("cars"), colour)
    ground, streets, half = PARTS.index("ground"), layout.streets, layout.half
    on_ground = layout.buildings[layout.buildings[:, 2] == 0.0]
    block_of = np.floor((0.5 * (on_ground[:, :2] + on_ground[:, 3:5]) - streets[0]) / PITCH).astype(int)
    for i in range(layout.blocks):
        for j in range(layout.blocks):
            x0, y0 = streets[i] + ROAD / 2, streets[j] + ROAD / 2
            f = fl.add((x0, y0, 0.0), X, Y, (BLOCK, BLOCK), GROUND, ground)
            for b in on_ground[(block_of == (i, j)).all(1)]:
                fl.holes.append((f, (b[0] - x0, b[3] - x0, b[1] - y0, b[4] - y0)))
    for c in streets:   # streets along x (intersections included), then the segments along y between them
        fl.add((-half, c - ROAD / 2, 0.0), X, Y, (2 * half, ROAD), GROUND, ground)
    for c in streets:
        for a in streets[:-1]:
            fl.add((c - ROAD / 2, a + ROAD / 2, 0.0), X, Y, (ROAD, BLOCK), GROUND, ground)
    far = FIELD_REACH * half
    fields = PARTS.index("fields")
    for origin, size in (((-far, -far), (far - half, 2 * far)), ((half, -far), (far - half, 2 * far)),
                         ((-half, -far), (2 * half, far - half)), ((-half, half), (2 * half, far - half))):
        fl.add((*origin, 0.0), X, Y, size, FIELD, fields, coarse=FIELD_SPACING)
    return fl.faces()


# ----------------------------------------------------------------------------- colours

def _jitter(seed, index, rgb, amount):
    """``rgb`` varied per Gaussian (a brightness change and a smaller one per channel): texture."""
    bright = 1.0 + amount * (2.0 * _uniform(seed, 10, index) - 1.0)
    tint = np.stack([0.3 * amount * (2.0 * _uniform(seed, 11 + c, index) - 1.0) for c in range(3)], 1)
    return np.clip(rgb * bright[:, None] + tint, 0.0, 1.0)


GLASS_RGB = np.array((0.16, 0.20, 0.27))
LIT_RGB = np.array((0.85, 0.75, 0.50))
SHOP_RGB = np.array((0.24, 0.21, 0.18))
SHEEN = np.array((0.10, 0.13, 0.18)) / C1   # SH degree-1 z coefficient of glass: brighter looking up


def _facade_colours(seed, face, s, z, width, base, pitch, lit):
    """Walls: storeys of windows (some lit), a shop-front ground floor, floor slabs.
    Returns the colours and the glass mask (the Gaussians with a sheen)."""
    level = z / FLOOR
    storey = np.floor(level)
    fz = level - storey
    margin = 0.5 * np.mod(width, pitch)              # windows centred on the wall
    pos = (s - margin) / pitch
    column = np.floor(pos)
    fs = pos - column
    inside = (s >= margin) & (s <= width - margin)
    upper = storey >= 1
    window = inside & upper & (fz > 0.3) & (fz < 0.85) & (fs > 0.18) & (fs < 0.82)
    shop = inside & ~upper & (fz > 0.08) & (fz < 0.8) & (fs > 0.08) & (fs < 0.92)
    rgb = base * np.where(fz < 0.06, 0.8, 1.0)[:, None]
    pane = (face * 4096 + storey.astype(np.int64)) * 4096 + np.maximum(column, 0).astype(np.int64)
    glass = np.where((_uniform(seed, 20, pane) < lit)[:, None], LIT_RGB, GLASS_RGB)
    glass = glass * (0.8 + 0.4 * _uniform(seed, 21, pane))[:, None]
    rgb = np.where(window[:, None], glass, rgb)
    rgb = np.where(shop[:, None], SHOP_RGB, rgb)
    return rgb, window | shop


def _ground_colours(layout, x, y):
    """Asphalt with centre dashes and crosswalks, sidewalks, paved lots and park lawns."""
    q = np.stack([x, y], 1) - layout.streets[0]
    m = np.mod(q, PITCH)
    d = np.minimum(m, PITCH - m)                     # distance to the nearest street line, per axis
    road = d < ROAD / 2
    rgb = np.empty((len(x), 3))
    rgb[:] = (0.48, 0.46, 0.42)                      # paved lot
    block = np.clip(np.floor(q / PITCH).astype(int), 0, layout.blocks - 1)
    rgb[layout.parks[block[:, 0], block[:, 1]]] = (0.27, 0.45, 0.20)
    rgb[(d < ROAD / 2 + SIDEWALK).any(1)] = (0.60, 0.59, 0.56)  # sidewalk
    rgb[road.any(1)] = (0.22, 0.22, 0.23)            # asphalt
    for a in (0, 1):                                 # a street along axis 1 - a: its line is at d[:, a] = 0
        b = 1 - a
        on = road[:, a] & ~road[:, b]
        dash = on & (d[:, a] < 0.15) & (np.mod(q[:, b], 6.0) < 3.0)
        cross = on & (d[:, b] < ROAD / 2 + SIDEWALK) & (np.mod(q[:, a], 1.0) < 0.5) & (d[:, a] > 0.5)
        rgb[dash] = (0.85, 0.78, 0.45)
        rgb[cross] = (0.82, 0.82, 0.80)
    return rgb


FIELD_PALETTE = np.array([(0.42, 0.52, 0.25), (0.55, 0.50, 0.30), (0.35, 0.45, 0.22), (0.60, 0.58, 0.40)])


def _field_colours(seed, x, y):
    patch = (np.floor(x / 40.0).astype(np.int64) * 100003 + np.floor(y / 40.0).astype(np.int64))
    return FIELD_PALETTE[(_uniform(seed, 40, patch) * len(FIELD_PALETTE)).astype(int)]


def _face_colours(layout, faces, seed, face, s, pos, index):
    """Colours (N, 3) and the glass mask of face Gaussians."""
    mat = faces.material[face]
    rgb = np.empty((len(face), 3))
    glass = np.zeros(len(face), bool)
    sel = mat == FACADE
    if sel.any():
        f = face[sel]
        rgb[sel], glass[sel] = _facade_colours(seed, f, s[sel], pos[sel, 2], faces.size[f, 0], faces.colour[f],
                                               faces.style[f, 0], faces.style[f, 1])
    sel = mat == ROOF
    rgb[sel] = 0.42 * (0.75 + 0.5 * _uniform(seed, 30, face[sel]))[:, None]
    sel = mat == CAR
    rgb[sel] = faces.colour[face[sel]]
    sel = mat == GLASS
    rgb[sel], glass[sel] = (0.10, 0.12, 0.15), True
    sel = mat == GROUND
    rgb[sel] = _ground_colours(layout, pos[sel, 0], pos[sel, 1])
    sel = mat == FIELD
    rgb[sel] = _field_colours(seed, pos[sel, 0], pos[sel, 1])
    return _jitter(seed, index, rgb, np.where(mat == GROUND, 0.12, 0.08)), glass


# ----------------------------------------------------------------------------- Gaussians

def _quats(R):
    """wxyz quaternions (w >= 0) of rotation matrices (n, 3, 3), Shepperd's method (stable for all)."""
    R = np.asarray(R, np.float64)
    tr = R[:, 0, 0] + R[:, 1, 1] + R[:, 2, 2]
    cand = np.stack([tr, R[:, 0, 0], R[:, 1, 1], R[:, 2, 2]], 1)
    k = cand.argmax(1)
    r = np.sqrt(np.maximum(1.0 + 2.0 * cand.max(1) - tr, 1e-300))
    s = 0.5 / r
    a = (R[:, 2, 1] - R[:, 1, 2]) * s, (R[:, 0, 2] - R[:, 2, 0]) * s, (R[:, 1, 0] - R[:, 0, 1]) * s
    b = (R[:, 0, 1] + R[:, 1, 0]) * s, (R[:, 0, 2] + R[:, 2, 0]) * s, (R[:, 1, 2] + R[:, 2, 1]) * s
    cases = [np.stack([0.5 * r, a[0], a[1], a[2]], 1),
             np.stack([a[0], 0.5 * r, b[0], b[1]], 1),
             np.stack([a[1], b[0], 0.5 * r, b[2]], 1),
             np.stack([a[2], b[1], b[2], 0.5 * r], 1)]
    q = np.choose(k[:, None], cases)
    return np.where(q[:, :1] < 0, -q, q)


def _frame_quats(u, v):
    """Quaternions of the frames (u, v, u x v): a flat Gaussian's in-plane axes and normal."""
    return _quats(np.stack([u, v, np.cross(u, v)], 2))


@dataclass
class CityModel:
    """The ground truth: Gaussians (numpy float32, SH degree ``SH_DEGREE``) and where each part lies."""
    gaussians: ns.Gaussians
    parts: dict          # name -> (start, end)
    spacing: float       # metres between neighbouring surface Gaussians


def _allocate(n, sh_degree=SH_DEGREE):
    k = (sh_degree + 1) ** 2
    return ns.Gaussians(np.empty((n, 3), np.float32), np.empty((n, 3), np.float32), np.empty((n, 4), np.float32),
                        np.empty(n, np.float32), np.zeros((n, k, 3), np.float32))


def _store(g, start, means, scales, quats, logit, rgb, glass=None):
    end = start + len(means)
    g.means[start:end] = means
    g.scales[start:end] = np.log(scales)
    g.quats[start:end] = quats
    g.opacities[start:end] = logit
    g.sh[start:end, 0] = (rgb - 0.5) / C0
    if glass is not None and glass.any():
        g.sh[start:end, 2][glass] = SHEEN          # sh[:, 2] weighs C1 * (view direction z)
    return end


def budget(layout, faces, n):
    """(spacing, Gaussians per tree, sky Gaussians) that make ``n`` in all.

    The surfaces share one spacing, the largest whose count fits what the trees
    (TREE_SHARE) and the sky (DOME_SHARE) leave; the sky takes the remainder, so
    the total is exactly ``n``.  ValueError naming --gaussians when ``n`` cannot
    hold one Gaussian a face, two a tree and DOME_MIN for the sky."""
    n_trees = len(layout.trees)
    floor = int(faces.counts(np.inf).sum())
    least = floor + TREE_MIN * n_trees + DOME_MIN
    if n < least:
        raise ValueError(f"--gaussians {n} is too few for this {layout.blocks}x{layout.blocks}-block city: it needs "
                         f"at least {least} (one Gaussian a surface, {TREE_MIN} a tree, {DOME_MIN} for the sky)")
    per_tree = max(TREE_MIN, int(TREE_SHARE * n) // max(n_trees, 1))
    sky = max(DOME_MIN, int(DOME_SHARE * n))
    if n - per_tree * n_trees - sky < floor:
        per_tree, sky = TREE_MIN, DOME_MIN
    target = n - per_tree * n_trees - sky
    lo, hi = 1e-3, 1e4   # bisect (in log) for the smallest spacing whose count fits
    if faces.counts(lo).sum() <= target:
        hi = lo
    for _ in range(64):
        mid = math.sqrt(lo * hi)
        if faces.counts(mid).sum() <= target:
            hi = mid
        else:
            lo = mid
    return hi, per_tree, n - per_tree * n_trees - int(faces.counts(hi).sum())


def city_gaussians(layout, n, seed=None, sh_degree=SH_DEGREE):
    """The ground-truth model of ``layout`` with exactly ``n`` Gaussians, made in chunks; its colours of SH degree
    ``SH_DEGREE``, held at ``sh_degree`` (the higher bands zero: rows as wide as a model trained at it)."""
    seed = layout.seed if seed is None else seed
    faces = city_faces(layout)
    spacing, per_tree, n_sky = budget(layout, faces, n)
    g = _allocate(n, max(sh_degree, SH_DEGREE))
    parts = {}
    counts = faces.counts(spacing)
    start = 0
    for name in SURFACE_PARTS:
        sel = np.flatnonzero(faces.part == PARTS.index(name))
        begin = start
        if len(sel):
            start = _sample_faces(layout, faces, sel[0], sel[-1] + 1, spacing, counts, g, start, seed)
        parts[name] = (begin, start)
    parts["trees"] = (start, start + per_tree * len(layout.trees))
    start = _sample_trees(layout, per_tree, g, start, seed)
    parts["sky"] = (start, start + n_sky)
    start = _sample_sky(layout, n_sky, g, start, seed)
    assert start == n, (start, n)
    return CityModel(g, parts, spacing)


def _chunks(sizes, limit=None):
    """Consecutive index ranges [a, b) whose sizes add up to about ``limit`` (default CHUNK; at least one item)."""
    limit = CHUNK if limit is None else limit
    ends = np.cumsum(sizes)
    a = 0
    while a < len(sizes):
        base = ends[a - 1] if a else 0
        b = max(a + 1, int(np.searchsorted(ends, base + limit, side="right")))
        yield a, b
        a = b


def _sample_faces(layout, faces, first, last, spacing, counts, g, start, seed):
    """The Gaussians of faces first..last-1 into ``g`` from ``start``; returns the end."""
    nu, nv = faces.grid(spacing)
    spans = faces.hole_spans(nu, nv)
    quats = _frame_quats(faces.u, faces.v)
    for a, b in _chunks(counts[first:last]):
        a, b = a + first, b + first
        full = nu[a:b] * nv[a:b]
        offset = np.cumsum(full) - full
        face = np.repeat(np.arange(a, b), full)
        k = np.arange(int(full.sum())) - np.repeat(offset, full)
        i, j = k % nu[face], k // nu[face]
        keep = np.ones(len(face), bool)
        for h in range(*np.searchsorted(faces.hole_face, [a, b])):
            f = faces.hole_face[h]
            i0, i1, j0, j1 = (int(x[h]) for x in spans)
            keep[offset[f - a] + (np.arange(j0, j1)[:, None] * nu[f] + np.arange(i0, i1)).ravel()] = False
        face, i, j = face[keep], i[keep], j[keep]
        du, dv = faces.size[face, 0] / nu[face], faces.size[face, 1] / nv[face]
        s, t = (i + 0.5) * du, (j + 0.5) * dv
        pos = faces.origin[face] + faces.u[face] * s[:, None] + faces.v[face] * t[:, None]
        index = np.arange(start, start + len(face))
        rgb, glass = _face_colours(layout, faces, seed, face, s, pos, index)
        scales = np.stack([PLANAR_SCALE * du, PLANAR_SCALE * dv, THIN * np.minimum(du, dv)], 1)
        start = _store(g, start, pos, scales, quats[face], OPAQUE, rgb, glass)
    return start


TREE_PALETTE = np.array([(0.20, 0.38, 0.14), (0.28, 0.45, 0.18), (0.18, 0.32, 0.12), (0.35, 0.42, 0.16)])


def _sample_trees(layout, per_tree, g, start, seed):
    """Each tree: a trunk of stacked upright Gaussians and a crown of leaf Gaussians in an ellipsoid."""
    trunk = max(1, per_tree // 12)
    crown = per_tree - trunk
    for a, b in _chunks(np.full(len(layout.trees), per_tree)):
        tr = layout.trees[a:b]
        m = len(tr)
        index = start + np.arange(m * per_tree).reshape(m, per_tree)
        k = np.arange(per_tree)
        x, y, height, radius = (np.repeat(tr[:, c], per_tree) for c in range(4))
        index = index.ravel()
        is_trunk = np.tile(k < trunk, m)
        # trunk
        z_trunk = height * (np.tile(k, m) + 0.5) / trunk
        # crown: uniform in an ellipsoid of radii (r, r, 0.85 r) above the trunk
        cz = 2.0 * _uniform(seed, 50, index) - 1.0
        phi = 2.0 * np.pi * _uniform(seed, 51, index)
        rho = radius * np.cbrt(_uniform(seed, 52, index))
        ring = np.sqrt(1.0 - cz * cz) * rho
        means = np.stack([x + np.where(is_trunk, 0.0, ring * np.cos(phi)),
                          y + np.where(is_trunk, 0.0, ring * np.sin(phi)),
                          np.where(is_trunk, z_trunk, height + 0.7 * radius + 0.85 * rho * cz)], 1)
        leaf = 0.9 * radius * max(crown, 1) ** (-1.0 / 3.0)
        scales = np.where(is_trunk[:, None], np.stack([np.full_like(x, 0.18), np.full_like(x, 0.18),
                                                       0.6 * height / trunk], 1),
                          np.stack([leaf, leaf, 0.5 * leaf], 1))
        quats = np.stack([_uniform(seed, 53 + c, index) - 0.5 for c in range(4)], 1)
        quats[is_trunk] = (1.0, 0.0, 0.0, 0.0)
        tree = np.repeat(np.arange(a, b), per_tree)
        green = TREE_PALETTE[(_uniform(seed, 57, tree) * len(TREE_PALETTE)).astype(int)]
        green = green * (0.7 + 0.5 * _uniform(seed, 58, index))[:, None] + 0.04 * cz[:, None]
        rgb = np.where(is_trunk[:, None], (0.33, 0.24, 0.15), green)
        logit = np.where(is_trunk, OPAQUE, LEAF)
        start = _store(g, start, means, scales, quats, logit, _jitter(seed, index, rgb, 0.05))
    return start


def _sky_colours(layout, seed, d, index):
    """Terrain below the horizon, a hazy mountain skyline, then sky from pale to deep blue, with clouds."""
    elev = np.arcsin(np.clip(d[:, 2], -1.0, 1.0))
    az = np.arctan2(d[:, 1], d[:, 0])
    p = layout.mountains
    ridge = 0.02 + 0.05 * (0.5 + 0.5 * np.sin(3 * az + p[0])) * (0.6 + 0.4 * np.sin(7 * az + p[1])) \
        + 0.01 * np.sin(19 * az + p[2])
    t = np.clip(elev / (np.pi / 2), 0.0, 1.0) ** 0.6
    rgb = (1 - t)[:, None] * (0.80, 0.86, 0.93) + t[:, None] * (0.32, 0.52, 0.85)
    waves = layout.sky
    cloud = sum(np.sin(d @ w[:3] + w[3]) for w in waves) / math.sqrt(len(waves) / 2.0)
    cloud = np.clip((cloud - 1.0) / 0.8, 0.0, 1.0) * (elev > 0.08)
    rgb = rgb * (1 - cloud)[:, None] + 0.95 * cloud[:, None]
    rgb = np.where((elev < ridge)[:, None], (0.42, 0.47, 0.55), rgb)
    rgb = np.where((elev < 0)[:, None], (0.33, 0.38, 0.28), rgb)
    return _jitter(seed, index, rgb, 0.03)


def _sample_sky(layout, n, g, start, seed):
    """A sphere of big flat Gaussians (a Fibonacci lattice) facing the city, far outside it."""
    radius = layout.dome_radius
    size = radius * math.sqrt(4 * math.pi / n)
    for a, b in _chunks(np.ones(n, np.int64)):
        k = np.arange(a, b) + 0.5
        z = 1.0 - 2.0 * k / n
        r = np.sqrt(1.0 - z * z)
        phi = k * math.pi * (3.0 - math.sqrt(5.0))
        d = np.stack([r * np.cos(phi), r * np.sin(phi), z], 1)
        east = np.stack([-d[:, 1], d[:, 0], np.zeros_like(z)], 1)
        east /= np.maximum(np.linalg.norm(east, axis=1, keepdims=True), 1e-12)
        east[r < 1e-9] = (1.0, 0.0, 0.0)
        north = np.cross(d, east)
        quats = _frame_quats(east, north)
        scales = np.tile((0.75 * size, 0.75 * size, 0.02 * size), (len(k), 1))
        index = np.arange(start, start + len(k))
        start = _store(g, start, radius * d, scales, quats, OPAQUE, _sky_colours(layout, seed, d, index))
    return start


# ----------------------------------------------------------------------------- cameras

@dataclass
class CityView:
    """One captured view: its image name, kind ('street' or 'aerial'), the pose as
    written to images.txt, and the camera rebuilt from that pose as the loader does."""
    name: str
    kind: str
    qvec: np.ndarray    # (4,) w, x, y, z: world to camera
    tvec: np.ndarray    # (3,)
    camera: ns.Camera

    @property
    def position(self):
        R = self.camera.viewmat[:3, :3]
        return -R.T @ self.camera.viewmat[:3, 3]


def intrinsics(width, height):
    """(fx, fy, cx, cy) of the one pinhole camera: HFOV wide, square pixels, centred."""
    f = width / (2.0 * math.tan(HFOV / 2.0))
    return f, f, width / 2.0, height / 2.0


def pose_camera(position, yaw, pitch, width, height):
    """(qvec, tvec, camera) of a camera at ``position`` looking along ``yaw`` (from +x towards +y)
    and ``pitch`` (up from the horizon), level (no roll).  The camera's rotation is the
    one the loader gets back from ``qvec``, so the ground truth is rendered from exactly
    the poses a training run reads."""
    cy, sy, cp, sp = math.cos(yaw), math.sin(yaw), math.cos(pitch), math.sin(pitch)
    forward = np.array([cp * cy, cp * sy, sp])
    right = np.array([sy, -cy, 0.0])
    R = np.stack([right, np.cross(forward, right), forward])   # OpenCV axes: x right, y down, z forward
    q = _quats(R[None])[0]
    R = qvec_to_rotmat(q)
    t = -R @ np.asarray(position, np.float64)
    viewmat = np.eye(4)
    viewmat[:3, :3], viewmat[:3, 3] = R, t
    return q, t, ns.Camera(viewmat, *intrinsics(width, height), width, height)


def _even(total, parts):
    """``total`` split into ``parts`` near-equal counts."""
    return [total // parts + (k < total % parts) for k in range(parts)]


STEPS = np.array([(1, 0), (0, 1), (-1, 0), (0, -1)])


def street_poses(layout, n, rng):
    """(n, 5) x, y, z, yaw, pitch: random walks over the inner streets (straight on at half
    the crossings, else a turn), a view every PATH_STEP metres, PATH_VIEWS a walk.  Each walk
    keeps a lane within LANE of the centreline and an eye height of 1.6-3 m; a view looks
    along the street, up to 30 degrees aside and 0-10 degrees up."""
    nb, streets = layout.blocks, layout.streets
    lo, hi = (1, nb - 1) if nb >= 3 else (0, nb)   # the inner streets: buildings on both sides
    poses = []
    for m in _even(n, max(1, -(-n // PATH_VIEWS))) if n else []:
        node = rng.integers(lo, hi + 1, 2)
        nodes, heading = [node], None
        while (len(nodes) - 1) * PITCH < m * PATH_STEP:
            options = [d for d in range(4) if (lo <= node + STEPS[d]).all() and (node + STEPS[d] <= hi).all()
                       and (heading is None or d != (heading + 2) % 4)]
            heading = heading if heading in options and rng.random() < 0.5 else options[rng.integers(len(options))]
            node = node + STEPS[heading]
            nodes.append(node)
        lane, eye = rng.uniform(-LANE + 0.3, LANE - 0.3), rng.uniform(1.6, 3.0)
        for k in range(m):
            s = (k + 0.5) * PATH_STEP
            seg = int(s // PITCH)
            a, b = streets[nodes[seg]], streets[nodes[seg + 1]]
            along = (b - a) / PITCH
            xy = a + along * (s - seg * PITCH) + np.array([-along[1], along[0]]) * (lane + rng.uniform(-0.3, 0.3))
            yaw = math.atan2(along[1], along[0]) + math.radians(rng.uniform(-30, 30))
            poses.append((xy[0], xy[1], eye, yaw, math.radians(rng.uniform(0, 10))))
    return np.array(poses, np.float64).reshape(-1, 5)


def aerial_poses(layout, n, rng):
    """(n, 5) x, y, z, yaw, pitch: orbits of ORBIT_VIEWS views around points spread over the
    city (one per cell of a grid, in random order), each looking at its centre on the ground
    from 15% to 50% above the tallest building plus 15 m, 1 to 1.8 blocks away."""
    if n == 0:
        return np.zeros((0, 5))
    sizes = _even(n, -(-n // ORBIT_VIEWS))
    grid = math.ceil(math.sqrt(len(sizes)))
    cell = 1.6 * layout.half / grid
    poses = []
    for m, c in zip(sizes, rng.permutation(grid * grid)[:len(sizes)]):
        centre = -0.8 * layout.half + (np.array([c % grid, c // grid]) + 0.5 + rng.uniform(-0.3, 0.3, 2)) * cell
        height = layout.tallest * rng.uniform(1.15, 1.5) + 15.0
        radius = rng.uniform(1.0, 1.8) * PITCH
        start = rng.uniform(0, 2 * np.pi)
        for k in range(m):
            a = start + 2 * np.pi * k / m
            poses.append((centre[0] + radius * math.cos(a), centre[1] + radius * math.sin(a), height,
                          a + np.pi, -math.atan2(height, radius)))
    return np.array(poses, np.float64)


def city_views(layout, n, width, height, seed=None, street_share=STREET_SHARE):
    """The ``n`` views in capture order: ``street_share`` of them street paths, then the aerial orbits.
    Image names are the capture index, zero-padded, and the kind: they sort in capture order."""
    rng = np.random.default_rng([layout.seed if seed is None else int(seed), 2])
    n_street = int(round(street_share * n))
    poses = [("street", p) for p in street_poses(layout, n_street, rng)]
    poses += [("aerial", p) for p in aerial_poses(layout, n - n_street, rng)]
    digits = max(5, len(str(n - 1)))
    views = []
    for i, (kind, (x, y, z, yaw, pitch)) in enumerate(poses):
        q, t, cam = pose_camera((x, y, z), yaw, pitch, width, height)
        views.append(CityView(f"{i:0{digits}d}_{kind}.png", kind, q, t, cam))
    return views


# ----------------------------------------------------------------------------- initial points

def sparse_points(layout, model, seed=None):
    """(xyz float64, rgb uint8): what SfM would give, a random SPARSE_SHARE of the city's surface
    Gaussians (not the fields and sky, too far for parallax), moved by a Gaussian noise of
    SPARSE_NOISE times the median building side, in their ground-truth colours."""
    rng = np.random.default_rng([layout.seed if seed is None else int(seed), 3])
    ranges = [model.parts[p] for p in CITY_PARTS]
    sizes = np.array([b - a for a, b in ranges])
    pick = np.sort(rng.choice(int(sizes.sum()), max(1, int(round(SPARSE_SHARE * sizes.sum()))), replace=False))
    part = np.searchsorted(np.cumsum(sizes), pick, side="right")
    index = pick - (np.cumsum(sizes) - sizes)[part] + np.array([a for a, _ in ranges])[part]
    base = layout.buildings[layout.buildings[:, 2] == 0.0]
    side = float(np.median(np.concatenate([base[:, 3] - base[:, 0], base[:, 4] - base[:, 1]]))) if len(base) else 1.0
    g = model.gaussians
    xyz = g.means[index].astype(np.float64) + rng.normal(0.0, SPARSE_NOISE * side, (len(index), 3))
    rgb = np.rint(np.clip(g.sh[index, 0].astype(np.float64) * C0 + 0.5, 0.0, 1.0) * 255).astype(np.uint8)
    return xyz, rgb


# ----------------------------------------------------------------------------- writing

def _text(path, text):
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)


def write_colmap_text(folder, views, width, height, xyz, rgb):
    """cameras.txt (one PINHOLE camera), images.txt (no 2D points) and points3D.txt (no tracks)
    in ``folder``; floats as Python writes them back exactly, so the poses round-trip."""
    folder = Path(folder)
    params = " ".join(repr(float(p)) for p in intrinsics(width, height))
    _text(folder / "cameras.txt", "# CAMERA_ID MODEL WIDTH HEIGHT PARAMS[]\n# Number of cameras: 1\n"
                                  f"1 PINHOLE {width} {height} {params}\n")
    lines = ["# IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID NAME, then POINTS2D[] (none here)",
             f"# Number of images: {len(views)}"]
    for i, v in enumerate(views):
        pose = " ".join(repr(float(x)) for x in (*v.qvec, *v.tvec))
        lines += [f"{i + 1} {pose} 1 {v.name}", ""]
    _text(folder / "images.txt", "\n".join(lines) + "\n")
    with atomic_path(folder / "points3D.txt") as tmp:
        table = np.column_stack([np.arange(1, len(xyz) + 1), xyz, rgb, np.ones(len(xyz))])
        np.savetxt(tmp, table, fmt="%d %.4f %.4f %.4f %d %d %d %.1f",
                   header=f"POINT3D_ID X Y Z R G B ERROR TRACK[] (no tracks)\nNumber of points: {len(xyz)}")


def to_8bit(image):
    """A float image in [0, 1] as uint8, rounded as the trainer saves its renders."""
    return (np.clip(image, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def _save_png(path, pixels):
    Image.fromarray(pixels).save(path)


def exposure_gains(n_views, sigma, seed):
    """(n_views, 3) per-channel gains exp(sigma * z), z standard normal from the seed: a capture's
    exposure and white balance varying from photo to photo.  Held-out views (every 8th) keep 1,
    so their images stay the scene's own colours, which a per-image colour correction learned on
    the training views (``--appearance``) cannot reach.  ``sigma`` 0: all ones."""
    gains = np.exp(sigma * np.random.default_rng([int(seed), 2]).standard_normal((n_views, 3)))
    gains[::8] = 1.0
    return gains


def render_views(gaussians, views, folder, progress=True, backend=None, gains=None):
    """Render every view (float32, no antialiasing, on the backend's device: ``backend`` None is
    the process default), times its ``gains`` row where given (exposure_gains), and write it as an
    8-bit PNG in ``folder``; a thread pool encodes while the next view renders."""
    xp = _backend.array_module(backend)
    dev = ns.Gaussians(**{k: xp.asarray(a) for k, a in gaussians.arrays().items()})
    dev.validate(xp)   # finite, once: the renders skip the check (a device sync each)
    workers = max(1, min(8, os.cpu_count() or 1))
    bar = tqdm(total=len(views), desc="rendering", unit="view", disable=not progress)
    try:
        with ThreadPoolExecutor(workers) as pool:
            pending = []
            for k, view in enumerate(views):
                frame = ns.render(dev, view.camera, background=BACKGROUND, antialias=False, backend=backend,
                                  check=False)
                image = _backend.to_host(frame.image)
                if gains is not None:
                    image = image * gains[k].astype(image.dtype)
                pending.append(pool.submit(_save_png, Path(folder) / view.name, to_8bit(image)))
                while len(pending) > 2 * workers:   # bound the images waiting in memory
                    pending.pop(0).result()
                bar.update()
            for f in pending:
                f.result()
    finally:
        bar.close()


OUTPUTS = ("images", "sparse", "ground_truth.ply", "synth.json")


def _prepare(out, force):
    """Make the output folder; ValueError naming --out if it is a file, or not empty without ``force``
    (which removes what an earlier generation wrote there, nothing else)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"--out {out} is not empty; add --force to overwrite it")
        for name in OUTPUTS:
            p = out / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "sparse" / "0").mkdir(parents=True, exist_ok=True)
    return out


def generate(out, preset="small", gaussians=None, views=None, resolution=None, seed=0, force=False, progress=True,
             backend=None, exposure=0.0, blocks=None, street_share=STREET_SHARE, sh_degree=SH_DEGREE):
    """Write the city dataset of ``preset`` to the folder ``out`` (see the module docstring).

    ``gaussians``, ``views``, ``resolution`` ('WxH' or (W, H)) and ``blocks`` (the city is blocks x
    blocks) override the preset's; ``sh_degree``: the ground truth's SH degree (above ``SH_DEGREE`` its higher
    bands are zero).  ``street_share``: the share of street views, the rest aerial (0:
    an aerial capture, as Mill-19's; a street view down a long street has half the city in its
    frustum, an orbit a neighbourhood: the out-of-core trainer's working sets).  ``exposure`` > 0 varies the training images' exposure
    (exposure_gains; the gains go to synth.json).  ``backend`` renders ('cpu' or 'cuda'; None: the
    process default).  Bad values raise ValueError naming the command-line option.
    Returns a summary (the contents of synth.json, plus seconds)."""
    p = _preset(preset)
    n = _positive("--gaussians", gaussians) or p.gaussians
    n_views = _positive("--views", views) or p.views
    city_blocks = _positive("--blocks", blocks) or p.blocks
    if not (isinstance(street_share, (int, float)) and 0 <= street_share <= 1):
        raise ValueError(f"--street-share must be a number in [0, 1], got {street_share!r}")
    width, height = parse_resolution(resolution) or (p.width, p.height)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"--seed must be a non-negative integer, got {seed!r}")
    if not (isinstance(exposure, (int, float)) and 0 <= exposure < 2):
        raise ValueError(f"--exposure must be a number in [0, 2), got {exposure!r}")
    if sh_degree not in (1, 2, 3):
        raise ValueError(f"--sh-degree must be 1, 2 or 3, got {sh_degree!r}")
    seconds = {}
    t0 = time.perf_counter()
    layout = plan_city(city_blocks, seed)
    faces = city_faces(layout)
    budget(layout, faces, n)   # --gaussians too few: say so before writing anything
    out = _prepare(out, force)
    model = city_gaussians(layout, n, sh_degree=sh_degree)
    city = city_views(layout, n_views, width, height, street_share=street_share)
    xyz, rgb = sparse_points(layout, model)
    seconds["scene"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_colmap_text(out / "sparse" / "0", city, width, height, xyz, rgb)
    save_ply(out / "ground_truth.ply", model.gaussians)
    summary = {
        "preset": preset, "seed": int(seed), "blocks": city_blocks, "gaussians": n, "sh_degree": sh_degree,
        "parts": {k: list(v) for k, v in model.parts.items()}, "spacing_m": model.spacing,
        "tallest_m": layout.tallest, "width": width, "height": height, "views": n_views,
        "street_views": sum(v.kind == "street" for v in city), "aerial_views": sum(v.kind == "aerial" for v in city),
        "test_views": len(city[::8]), "initial_points": len(xyz), "background": list(BACKGROUND),
        "exposure": float(exposure),
    }
    gains = exposure_gains(n_views, exposure, seed) if exposure > 0 else None
    if gains is not None:
        summary["exposure_gains"] = gains.round(6).tolist()
    _text(out / "synth.json", json.dumps(summary, indent=1) + "\n")
    seconds["write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    render_views(model.gaussians, city, out / "images", progress, backend, gains)
    seconds["render"] = time.perf_counter() - t0
    return dict(summary, seconds=seconds)
