"""CUDA kernels against the CPU backend on the same float32 scenes.

Runs under the CUDA simulator in CI (tests/test_cuda.py) and on a real GPU
(``python tests/check_cuda.py`` in scripts/gpu_check.sh).  Exits non-zero on
any mismatch beyond: images 1e-5 absolute, gradients 1e-4 relative.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numbasplat as ns  # noqa: E402
from numbasplat._backend import array_module, to_host  # noqa: E402
from tests.scenes import edge_case_scene, look_at_camera  # noqa: E402

IMAGE_TOL = 1e-5
GRAD_TOL = 1e-4


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def compare(g, cam, bg, antialias, seed):
    xp = array_module("cuda")
    dev = ns.Gaussians(**{k: xp.asarray(a) for k, a in g.arrays().items()})
    rng = np.random.default_rng(seed)
    H, W = cam.height, cam.width
    d_img = rng.normal(size=(H, W, 3)).astype(np.float32)
    d_alpha = rng.normal(size=(H, W)).astype(np.float32)
    d_depth = (0.1 * rng.normal(size=(H, W))).astype(np.float32)
    out = {}
    for backend, gg, put in (("cpu", g, np.asarray), ("cuda", dev, xp.asarray)):
        f = ns.render(gg, cam, background=bg, antialias=antialias, backend=backend)
        grads, rec = ns.render_backward(gg, f, put(d_img), put(d_alpha), put(d_depth), backend=backend)
        out[backend] = dict(image=f.image, alpha=f.render.alpha, depth=f.render.depth, last=f.render.last,
                            records=rec, **{"d_" + k: v for k, v in grads.arrays().items()})
    failures = []
    for key, ref in out["cpu"].items():
        got, ref = to_host(out["cuda"][key]), np.asarray(ref)
        if key.startswith("d_") or key == "records":
            err, tol = rel(got, ref), GRAD_TOL
        else:
            err, tol = float(np.abs(got.astype(np.float64) - ref).max()), IMAGE_TOL
        status = "ok" if err <= tol else "FAIL"
        print(f"  {key:12s} {status} err={err:.2e} (tol {tol:g})")
        if err > tol:
            failures.append(key)
    return failures


def main(sizes=((37, 29), (48, 32))):
    failures = []
    for i, (W, H) in enumerate(sizes):
        for antialias in (False, True):
            g = edge_case_scene(n=40, seed=10 + i, dtype=np.float32)
            cam = look_at_camera(W=W, H=H)
            print(f"scene {W}x{H} antialias={antialias}")
            failures += compare(g, cam, (0.1, 0.5, 0.9), antialias, seed=i)
    # the empty scene
    empty = ns.Gaussians(*(np.zeros(s, np.float32) for s in ((0, 3), (0, 3), (0, 4), (0,), (0, 1, 3))))
    print("empty scene")
    failures += compare(empty, look_at_camera(W=20, H=17), (0.3, 0.3, 0.3), False, seed=9)
    print("FAILED: " + ", ".join(failures) if failures else "all CUDA checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
