"""The built-in demo: a procedural scene rendered by numbasplat itself.

No download: a few hundred coloured Gaussians on a torus knot and a ground
disc are rendered from cameras on two rings around them; training starts
from random points in a box and is scored on held-out views.
"""
import numpy as np

import numbasplat as ns
from numbasplat import C0
from numbasplat import backend as _backend

from .camera_path import look_at


def ground_truth(seed=0):
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 2 * np.pi, 300, endpoint=False)
    knot = np.stack([(2 + np.cos(3 * t)) * np.cos(2 * t), (2 + np.cos(3 * t)) * np.sin(2 * t),
                     np.sin(3 * t) + 1.2], 1) * 0.45
    r = np.sqrt(rng.random(200)) * 2.2
    a = rng.random(200) * 2 * np.pi
    disc = np.stack([r * np.cos(a), r * np.sin(a), np.zeros(200)], 1)
    means = np.concatenate([knot, disc])
    n = len(means)
    hue = np.concatenate([t / (2 * np.pi), 0.1 + 0.05 * rng.random(200)])
    rgb = 0.5 + 0.45 * np.stack([np.cos(2 * np.pi * (hue + k / 3)) for k in range(3)], 1)
    rgb[300:] = rgb[300:] * 0.5 + 0.3
    scales = np.log(np.concatenate([np.full((300, 3), 0.09), np.stack([np.full(200, 0.18)] * 2 + [np.full(200, 0.02)], 1)]))
    quats = rng.normal(size=(n, 4))
    sh = np.zeros((n, 4, 3))
    sh[:, 0] = (rgb - 0.5) / C0
    sh[:, 1:] = rng.normal(0, 0.05, (n, 3, 3))
    return ns.Gaussians(means.astype(np.float32), scales.astype(np.float32), quats.astype(np.float32),
                        np.full(n, 3.0, np.float32), sh.astype(np.float32))


def make_dataset(size=64, n_views=40, seed=0, backend=None):
    """A ``data.Dataset`` of views of ``ground_truth``, every 8th held out."""
    from data import Dataset, View
    g = ground_truth(seed)
    xp = _backend.array_module(backend)
    dev = ns.Gaussians(**{k: xp.asarray(a) for k, a in g.arrays().items()})
    views = []
    for i in range(n_views):
        ang = 2 * np.pi * i / n_views * 3.0
        height = 1.5 + 1.5 * (i % 2)
        eye = (5.0 * np.cos(ang), 5.0 * np.sin(ang), height)
        cam = ns.Camera(look_at(eye, (0, 0, 0.5)), 0.9 * size, 0.9 * size, size / 2, size / 2, size, size)
        frame = ns.render(dev, cam, background=(1.0, 1.0, 1.0), backend=backend)
        img = np.clip(_backend.to_host(frame.image), 0, 1).astype(np.float32)
        views.append(View(f"view{i:03d}.png", np.ascontiguousarray(img), cam))
    test = [v for i, v in enumerate(views) if i % 8 == 0]
    train = [v for i, v in enumerate(views) if i % 8 != 0]
    centres = np.array([np.linalg.inv(v.camera.viewmat)[:3, 3] for v in views])
    scale = 1.1 * float(np.linalg.norm(centres - centres.mean(0), axis=1).max())
    return Dataset(train=train, test=test, points=np.zeros((0, 3), np.float32), colors=np.zeros((0, 3), np.float32),
                   scene_scale=scale, source="builtin-demo", fmt="demo")
