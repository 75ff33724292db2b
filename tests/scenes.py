"""Small random scenes with the edge cases the gradient checks must cover."""
import numpy as np

import numbasplat as ns


def look_at_camera(W=40, H=30, f=36.0, dtype=np.float64):
    """A camera at the origin looking down +z (OpenCV axes), principal point off-centre."""
    return ns.Camera(np.eye(4), f, f * 1.1, W * 0.52, H * 0.47, W, H)


def edge_case_scene(n=24, seed=0, dtype=np.float64, degree=3):
    """Gaussians in front of ``look_at_camera`` plus the hard cases:
    one behind the camera, one straddling the image border, one very
    anisotropic, one of near-zero opacity, and an opaque stack in front of the
    rest so that some pixels terminate early."""
    rng = np.random.default_rng(seed)
    z = rng.uniform(2.0, 6.0, n)
    means = np.stack([rng.uniform(-0.5, 0.5, n) * z, rng.uniform(-0.4, 0.4, n) * z, z], 1)
    scales = np.log(rng.uniform(0.05, 0.25, (n, 3)))
    quats = rng.normal(size=(n, 4))
    logits = rng.normal(0.5, 1.0, n)
    sh = rng.normal(0, 0.3, (n, (degree + 1) ** 2, 3))
    sh[:, 0] = rng.normal(0.2, 0.5, (n, 3))
    means[0] = (0.1, 0.0, -2.0)                 # behind the camera
    means[1] = (0.62 * 3.0, 0.1, 3.0)          # partly off-screen (right border)
    scales[2] = np.log((0.6, 0.01, 0.02))      # very anisotropic
    logits[3] = -7.0                            # near-zero opacity (below 1/255: culled)
    logits[4] = -5.0                            # faint but visible
    for k in (5, 6, 7):                         # opaque stack: early termination behind it
        means[k] = (rng.uniform(-0.2, 0.2), rng.uniform(-0.15, 0.15), 1.5 + 0.1 * k)
        scales[k] = np.log((0.35, 0.3, 0.3))
        logits[k] = 5.0
    return ns.Gaussians(means.astype(dtype), scales.astype(dtype), quats.astype(dtype), logits.astype(dtype),
                        sh.astype(dtype))


def tied_scene(dtype=np.float64, n=24, seed=0, degree=3):
    """``edge_case_scene`` (non-identity rotations, uneven scales, an opaque stack in front that
    saturates pixels, Gaussians behind the camera, off the image, under ALPHA_MIN) with four
    Gaussians at one depth (the camera looks down +z from the origin), overlapping on screen."""
    g = edge_case_scene(n=n, seed=seed, dtype=np.float64, degree=degree)
    for k, (x, y) in zip((8, 9, 10, 11), ((0.0, 0.0), (0.05, 0.02), (-0.04, 0.03), (0.02, -0.05))):
        g.means[k] = (x, y, 3.0)
        g.opacities[k] = 1.0
    return ns.Gaussians(**{k: np.ascontiguousarray(a, dtype) for k, a in g.arrays().items()})


def slab_capture(n_slabs=4, per_slab=40, views=6, size=32, seed=0, opaque_top=False, distance=8.0):
    """Gaussians in ``n_slabs`` thin horizontal slabs 1.5 apart, seen from above by ``views``
    cameras: every ray meets the slabs in height order, so a kd-tree of up to ``n_slabs`` boxes
    over them (its cuts fall in the gaps: the longest extent is the height) is separated in
    depth for every camera (two slabs and their gap, 1.7 deep, are wider than the slabs' 1.4, so
    every cut is a height).  -> (a ``data.Dataset`` of renders of the true Gaussians, the
    Gaussians' arrays to start training from: their colours perturbed).  Semi-transparent: no
    pixel saturates, so a render skips nothing; unless ``opaque_top``: the top slab then holds
    large opaque Gaussians that hide most of what is below."""
    from data import Dataset, View
    from engine.tools.camera_path import look_at
    rng = np.random.default_rng(seed)
    n = n_slabs * per_slab
    height = np.repeat(1.5 * np.arange(n_slabs), per_slab) + rng.uniform(-0.1, 0.1, n)
    means = np.column_stack([rng.uniform(-0.7, 0.7, (n, 2)), height])  # narrower than two slabs are deep
    truth = ns.Gaussians(means.astype(np.float32), np.log(rng.uniform(0.06, 0.12, (n, 3))).astype(np.float32),
                         rng.normal(size=(n, 4)).astype(np.float32), rng.uniform(-2.5, -0.5, n).astype(np.float32),
                         rng.normal(0, 0.5, (n, 1, 3)).astype(np.float32))
    if opaque_top:
        top = height > 1.5 * (n_slabs - 1) - 0.5
        truth.scales[top] = np.log(0.4)
        truth.opacities[top] = 6.0
    train = []
    for i in range(views):
        a = 2 * np.pi * i / views
        eye = (0.8 * np.cos(a), 0.8 * np.sin(a), 1.5 * n_slabs + distance)  # ``distance`` above the top
        cam = ns.Camera(look_at(eye, (0.0, 0.0, 0.75 * n_slabs), up=(0, 1, 0)), 0.9 * size, 0.9 * size,
                        size / 2, size / 2, size, size)
        image = np.clip(ns.render(truth, cam, background=np.ones(3, np.float32), backend="cpu").image, 0, 1)
        train.append(View(f"view{i:02d}", np.ascontiguousarray(image, np.float32), cam))
    start = {k: np.array(a) for k, a in truth.arrays().items()}
    start["sh"][:, 0] += rng.normal(0, 0.3, (n, 3)).astype(np.float32)
    data = Dataset(train=train, test=[], scene_scale=2.0, source="slabs", fmt="synthetic")
    return data, start


def cluster_capture(per_cluster=40, views=6, size=32, seed=0):
    """Two clusters of Gaussians 10 apart along x, each seen alone from above by every other view:
    a kd-tree of two boxes puts one cluster in each, and each view has one box in it (the views
    of the two clusters can train side by side).  -> (a ``data.Dataset``, the start's arrays)."""
    from data import Dataset, View
    from engine.tools.camera_path import look_at
    rng = np.random.default_rng(seed)
    n = 2 * per_cluster
    side = np.repeat([-5.0, 5.0], per_cluster)
    means = np.column_stack([side + rng.uniform(-0.7, 0.7, n), rng.uniform(-0.7, 0.7, n), rng.uniform(-0.2, 0.2, n)])
    truth = ns.Gaussians(means.astype(np.float32), np.log(rng.uniform(0.06, 0.12, (n, 3))).astype(np.float32),
                         rng.normal(size=(n, 4)).astype(np.float32), rng.uniform(-1.5, 0.5, n).astype(np.float32),
                         rng.normal(0, 0.5, (n, 1, 3)).astype(np.float32))
    train = []
    for i in range(views):
        x = -5.0 if i % 2 else 5.0
        cam = ns.Camera(look_at((x + 0.2 * np.cos(i), 0.2 * np.sin(i), 3.0), (x, 0.0, 0.0), up=(0, 1, 0)),
                        0.9 * size, 0.9 * size, size / 2, size / 2, size, size)
        image = np.clip(ns.render(truth, cam, background=np.ones(3, np.float32), backend="cpu").image, 0, 1)
        train.append(View(f"view{i:02d}", np.ascontiguousarray(image, np.float32), cam))
    start = {k: np.array(a) for k, a in truth.arrays().items()}
    start["sh"][:, 0] += rng.normal(0, 0.3, (n, 3)).astype(np.float32)
    return Dataset(train=train, test=[], scene_scale=2.0, source="clusters", fmt="synthetic"), start


def reach_table(seed=0, rows=50):
    """A row table whose columns 2-4 are centres and 7-9 log-scales, and segments of it (one empty)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(rows, 12)).astype(np.float32)
    table[:, 7:10] = rng.uniform(-5, 0, (rows, 3))
    starts, sizes = np.array([0, 7, 30, 30, 41], np.int64), np.array([7, 23, 0, 11, 9], np.int64)
    return table, starts, sizes


def central_differences(array, objective, h):
    """d objective / d ``array`` by central differences of step ``h``, one element at a time
    (``array`` is changed in place and restored)."""
    fd = np.zeros_like(array)
    flat, fdf = array.reshape(-1), fd.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        fp = objective()
        flat[i] = old - h
        fm = objective()
        flat[i] = old
        fdf[i] = (fp - fm) / (2 * h)
    return fd
