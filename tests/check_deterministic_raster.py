"""The deterministic raster backward (``--deterministic``) against the CPU backend and the default
(atomic) backward, on the same float32 scenes.

Runs under the CUDA simulator in CI (tests/test_deterministic.py) and on a real GPU
(``python tests/check_deterministic_raster.py``).  Checks, for each scene:

* its gradients (records and parameters, also accumulated into existing ones) match the CPU
  backend's within check_cuda_raster's tolerance (GRAD_TOL, relative);
* they match the default backward's within float32 rounding (SUM_TOL, relative);
* two calls give the same bits, and so does binning into room to spare (as training bins);
* it adds no float with an atomic (simulator: its atomic adds are counted, and the default
  backward's count must be above 0, so the count is live); in the simulator, whose blocks
  otherwise always run in one order, the second call runs them in a shuffled order (the
  default backward's bits change with it, which is shown).

The scenes: edge_case_scene's Gaussians (random rotations, uneven scales, over several tiles,
several on each tile) on a non-square image, with two clones of identical parameters (equal
depths), and a crowd over one tile that spans two batches of records.
Exits non-zero on any failure.
"""
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numbasplat as ns  # noqa: E402
from numbasplat.backend import SIM, array_module, to_host  # noqa: E402
from numbasplat.cuda.tile import BLOCK  # noqa: E402
from tests.check_cuda_raster import GRAD_TOL, rel  # noqa: E402
from tests.scenes import edge_case_scene, look_at_camera  # noqa: E402

SUM_TOL = 1e-5  # the default and deterministic backward differ by the order of their float32 sums only


def with_clones(g, k, copies=2):
    """``g`` with ``copies`` more Gaussians of exactly Gaussian k's parameters (equal depths)."""
    arrays = {name: np.concatenate([a] + [a[k:k + 1]] * copies) for name, a in g.arrays().items()}
    return ns.Gaussians(**arrays)


def crowd_scene():
    """270 faint Gaussians over a 20x16 image (2x1 tiles): a tile's records span two batches."""
    g = edge_case_scene(n=270, seed=12, dtype=np.float32, degree=0)
    g.opacities[:] = -4.0
    return with_clones(g, 20), look_at_camera(W=20, H=16, f=4.0)


class FloatAtomics:
    """Counts the simulator's atomic adds into float arrays while active (``count``)."""

    def __init__(self):
        self.count = 0

    @contextmanager
    def counting(self):
        from numba.cuda.simulator import kernelapi
        original = kernelapi.FakeCUDAAtomic.add
        counter = self

        def add(atomic, array, index, val):
            if np.asarray(array).dtype.kind == "f":
                counter.count += 1
            return original(atomic, array, index, val)
        kernelapi.FakeCUDAAtomic.add = add
        try:
            yield self
        finally:
            kernelapi.FakeCUDAAtomic.add = original


@contextmanager
def shuffled_blocks(seed):
    """The simulator runs a launch's thread blocks (and starts each block's threads) in a shuffled
    order, as a GPU's scheduler may."""
    from numba.cuda.simulator import kernel as simkernel
    rng = np.random.default_rng(seed)

    class ShuffledNumpy:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def ndindex(*shape):
            points = list(np.ndindex(*shape))
            return [points[i] for i in rng.permutation(len(points))]
    original = simkernel.np
    simkernel.np = ShuffledNumpy()
    try:
        yield
    finally:
        simkernel.np = original


def backward(g, cam, grads_in, backend, deterministic, put, spare=None):
    """(records, parameter gradients, the same accumulated into ones) of one render's backward;
    ``spare``: binned into room for that many intersections more than it has (as training bins)."""
    d_img, d_alpha, d_depth = (put(a) for a in grads_in)
    gg = ns.Gaussians(**{k: put(a) for k, a in g.arrays().items()})
    bg = (0.1, 0.5, 0.9)
    if spare is None:
        f = ns.render(gg, cam, background=bg, backend=backend, deterministic=deterministic)
    else:
        p = ns.project(gg, cam, backend=backend)
        total = int(to_host(p.counts).sum())
        b = ns.bin_tiles(p, backend=backend, room=total + spare, deterministic=deterministic)
        f = ns.rendering.Frame(p, b, ns.rasterize(p, b, bg, backend))
    grads, rec = ns.render_backward(gg, f, d_img, d_alpha, d_depth, backend=backend, deterministic=deterministic)
    acc = put(np.ones(rec.shape, np.float32))
    ns.rasterize_backward(f.projection, f.binning, f.render, d_img, d_alpha, d_depth, grad=acc, backend=backend,
                          deterministic=deterministic)
    out = {"records": rec, "accumulated": acc, **{"d_" + k: v for k, v in grads.arrays().items()}}
    return {k: to_host(v).copy() for k, v in out.items()}


def check_scene(name, g, cam, seed, shuffle_default=False, check_room=False):
    xp = array_module("cuda")
    rng = np.random.default_rng(seed)
    H, W = cam.height, cam.width
    grads_in = (rng.normal(size=(H, W, 3)).astype(np.float32), rng.normal(size=(H, W)).astype(np.float32),
                (0.1 * rng.normal(size=(H, W))).astype(np.float32))
    p = ns.project(g, cam, backend="cpu")
    b = ns.bin_tiles(p, backend="cpu")
    per_tile = b.ranges[:, 1] - b.ranges[:, 0]
    counts = p.counts
    print(f"scene {name} {W}x{H}: {len(g)} Gaussians, {b.n_isect} intersections, {int((counts > 1).sum())} over "
          f"several tiles, most Gaussians on a tile {per_tile.max()}")
    failures = []
    want = backward(g, cam, grads_in, "cpu", False, np.asarray)
    atomics = FloatAtomics()
    with atomics.counting():
        det = backward(g, cam, grads_in, "cuda", True, xp.asarray)
    det_atomics = atomics.count
    atomics.count = 0
    with atomics.counting():
        default = backward(g, cam, grads_in, "cuda", False, xp.asarray)
    default_atomics = atomics.count
    roomy = backward(g, cam, grads_in, "cuda", True, xp.asarray, spare=9) if check_room else None
    if SIM:  # the second call with the blocks in another order (the simulator's is otherwise always the same)
        with shuffled_blocks(seed):
            again = backward(g, cam, grads_in, "cuda", True, xp.asarray)
            shuffled_default = backward(g, cam, grads_in, "cuda", False, xp.asarray) if shuffle_default else None
    else:
        again = backward(g, cam, grads_in, "cuda", True, xp.asarray)
    for key, ref in want.items():
        err_cpu, err_default = rel(det[key], ref), rel(det[key], default[key])
        same = np.array_equal(det[key], again[key])
        ok = err_cpu <= GRAD_TOL and err_default <= SUM_TOL and same
        print(f"  {key:12s} {'ok' if ok else 'FAIL'} vs CPU err={err_cpu:.2e} (tol {GRAD_TOL:g}), vs default "
              f"err={err_default:.2e} (tol {SUM_TOL:g}), two calls{' (blocks shuffled)' if SIM else ''} "
              f"{'the same bits' if same else 'DIFFER'}")
        if not ok:
            failures.append(f"{name} {key}")
    if check_room:
        same = all(np.array_equal(det[k], roomy[k]) for k in det)
        print(f"  binned into room (9 slots spare): {'the same bits' if same else 'DIFFERS'}")
        if not same:
            failures.append(f"{name} room")
    if not np.abs(want["records"]).sum() > 0:
        failures.append(f"{name}: no gradient to compare")
    if SIM:
        ok = det_atomics == 0 and default_atomics > 0
        print(f"  float atomic adds: deterministic {det_atomics}, default {default_atomics}: {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"{name} atomics")
        if shuffle_default:  # (not required: the default backward's bits may or may not follow the order)
            moved = sum(not np.array_equal(default[k], shuffled_default[k]) for k in default)
            print(f"  the default backward with the blocks shuffled: {moved} of {len(default)} outputs changed bits")
    return failures


def main():
    g = edge_case_scene(n=40, seed=21, dtype=np.float32)
    g.scales[8:] += np.float32(np.log(2.0))  # larger: most Gaussians over several tiles
    scenes = [("general", with_clones(g, 12), look_at_camera(W=40, H=24)), ("crowd", *crowd_scene())]
    failures = []
    for i, (name, g, cam) in enumerate(scenes):
        failures += check_scene(name, g, cam, seed=i, shuffle_default=i == 0, check_room=i == 0)
    crowd = ns.bin_tiles(ns.project(scenes[1][1], scenes[1][2], backend="cpu"), backend="cpu")
    if (crowd.ranges[:, 1] - crowd.ranges[:, 0]).max() <= BLOCK:
        failures.append("the crowd scene does not span two batches")
    print("FAILED: " + ", ".join(failures) if failures else "all deterministic checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
