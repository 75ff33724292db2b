"""The CUDA kernels' chunked passes (``rasterize(state=)``, ``rasterize_backward(state=)``, with and
without ``deterministic``) against the CPU backend's unchunked render, on float32 scenes.

Runs under the CUDA simulator in CI (tests/test_chunks.py) and on a real GPU
(``python tests/check_chunks.py``).  Exits non-zero on any mismatch beyond: images 1e-5
absolute, gradients 1e-4 relative; and the CUDA chunks against the CUDA unchunked render,
images 1e-6 absolute and gradients 1e-5 relative.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numbasplat as ns  # noqa: E402
from numbasplat.backend import SIM, array_module, to_host  # noqa: E402
from tests.scenes import look_at_camera, tied_scene  # noqa: E402

BG = (0.2, 0.4, 0.1)


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def outputs(image, alpha, depth, grads, records):
    return dict(image=image, alpha=alpha, depth=depth, records=records,
                **{"d_" + k: v for k, v in grads.arrays().items()})


def unchunked(g, cam, w, backend, deterministic=False):
    f = ns.render(g, cam, background=BG, backend=backend, deterministic=deterministic)
    grads, records = ns.render_backward(g, f, *w, backend=backend, deterministic=deterministic)
    return outputs(f.image, f.render.alpha, f.render.depth, grads, records)


def chunked(g, cam, w, size, deterministic=False):
    xp = array_module("cuda")
    chunks = ns.depth_chunks(g, cam, size, backend="cuda")
    f = ns.render_chunked(g, cam, chunks, background=BG, backend="cuda", deterministic=deterministic)
    records = xp.zeros((len(g), ns.GRAD_FIELDS), np.float32)
    grads = ns.render_chunked_backward(g, f, *w, records=records, backend="cuda")
    return outputs(f.image, f.render.alpha, f.render.depth, grads, records), f


def compare(label, got, ref, image_tol, grad_tol):
    failures = []
    for key, want in ref.items():
        a, b = to_host(got[key]).astype(np.float64), to_host(want).astype(np.float64)
        if key.startswith("d_") or key == "records":
            err, tol = rel(a, b), grad_tol
        else:
            err, tol = float(np.abs(a - b).max()), image_tol
        status = "ok" if err <= tol else "FAIL"
        print(f"  {label:28s} {key:10s} {status} err={err:.2e} (tol {tol:g})")
        if err > tol:
            failures.append(f"{label} {key}")
    return failures


def main():
    xp = array_module("cuda")
    g = tied_scene(np.float32, degree=1)
    cam = look_at_camera()  # 40 x 30: 3 x 2 tiles
    dev = ns.Gaussians(**{k: xp.asarray(a) for k, a in g.arrays().items()})
    rng = np.random.default_rng(5)
    w = (rng.normal(size=(cam.height, cam.width, 3)).astype(np.float32),
         rng.normal(size=(cam.height, cam.width)).astype(np.float32),
         (0.1 * rng.normal(size=(cam.height, cam.width))).astype(np.float32))
    w_dev = tuple(xp.asarray(a) for a in w)
    cpu = unchunked(g, cam, w, "cpu")
    cuda = unchunked(dev, cam, w_dev, "cuda")
    n_drawn = int(np.count_nonzero(to_host(ns.project(dev, cam, backend="cuda").counts)))
    sizes = (n_drawn, 7, 1) if not SIM else (n_drawn, 7, 3)
    failures = []
    for size in sizes:
        got, f = chunked(dev, cam, w_dev, size)
        ended = to_host(f.ended)
        print(f"chunks of {size}: {len(f.chunks)} chunks, pixels ended in chunk: "
              f"{dict(zip(*np.unique(ended, return_counts=True)))}")
        if size == 7 and not (ended < len(f.chunks) - 1).any():
            failures.append("no pixel saturates in a chunk before the last")
        failures += compare(f"chunks of {size} vs cpu", got, cpu, 1e-5, 1e-4)
        failures += compare(f"chunks of {size} vs cuda", got, cuda, 1e-6, 1e-5)
    got, _ = chunked(dev, cam, w_dev, 7, deterministic=True)
    failures += compare("deterministic chunks vs cpu", got, cpu, 1e-5, 1e-4)
    failures += compare("deterministic chunks vs cuda", got, unchunked(dev, cam, w_dev, "cuda", True), 1e-6, 1e-5)
    if failures:
        print("FAILED:", ", ".join(failures))
        sys.exit(1)
    print("all chunk checks passed")


if __name__ == "__main__":
    main()
