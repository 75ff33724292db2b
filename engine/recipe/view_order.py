"""The order in which an epoch visits the training views.

``random``: a permutation drawn from the run's RNG (3DGS).  ``trajectory``: a tour along the cameras,
so that consecutive views see much of the same scene: out-of-core training (engine/stores/offload.py) then
moves only the blocks that the next view needs and the last one did not.  The tour is greedy nearest
neighbour over the cameras' positions (in units of the scene's scale) and viewing directions, from a
start drawn from the RNG, with every distance scaled by a factor drawn in [1, 1 + ``JITTER``): each
epoch another of the nearby tours, deterministic for a seed.
"""
import numpy as np

VIEW_ORDERS = ("auto", "random", "trajectory")
JITTER = 0.5  # how far an epoch's distances may stretch: tours vary among nearly as short ones


def camera_poses(cameras):
    """-> (positions (V, 3), unit viewing directions (V, 3)) of OpenCV world-to-camera ``cameras``."""
    rot = np.array([c.viewmat[:3, :3] for c in cameras])
    trans = np.array([c.viewmat[:3, 3] for c in cameras])
    positions = -np.einsum("vji,vj->vi", rot, trans)  # -R^T t
    return positions, rot[:, 2, :]  # the camera's +z axis in the world


def trajectory_order(cameras, rng, scale=1.0):
    """The views' indices along a greedy nearest-neighbour tour over ``cameras`` (see above); draws
    the start and the jitter from ``rng``."""
    n = len(cameras)
    if n == 0:
        return []
    positions, directions = camera_poses(cameras)
    dist = (np.linalg.norm(positions[:, None] - positions[None], axis=2) / max(scale, 1e-12)
            + np.linalg.norm(directions[:, None] - directions[None], axis=2))
    dist *= 1.0 + JITTER * rng.random((n, n))
    here = int(rng.integers(n))
    tour, left = [here], np.ones(n, bool)
    left[here] = False
    for _ in range(n - 1):
        here = int(np.argmin(np.where(left, dist[here], np.inf)))
        tour.append(here)
        left[here] = False
    return tour


def epoch_order(kind, cameras, rng, scale=1.0):
    """An epoch's views in visiting order (``kind``: random or trajectory)."""
    if kind == "random":
        return [int(i) for i in rng.permutation(len(cameras))]
    if kind == "trajectory":
        return trajectory_order(cameras, rng, scale)
    raise ValueError(f"unknown view order {kind!r} (random or trajectory)")
