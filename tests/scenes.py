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
