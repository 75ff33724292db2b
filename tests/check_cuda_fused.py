"""The fused raster+loss+backward kernel against the unfused path and the CPU backend.

Runs under the CUDA simulator in CI (tests/test_cuda_fused.py) and on a GPU
(scripts/gpu_check.sh).  Each scene is checked with every tile fused, with a
small budget (tiles over it take the unfused path) and with fusion off; the
crowded scene, whose middle tile holds more than one load batch, takes fusion
off there through the budget, and is checked where that tile has more Gaussians
than the cache holds (they spill past it).
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numbasplat as ns  # noqa: E402
from numbasplat.backend import array_module, to_host  # noqa: E402
from numbasplat.cuda import fused as fz  # noqa: E402
from numbasplat.math.tiles import fused_smem_layout  # noqa: E402
from numbasplat.rendering import rasterize_tile_loss  # noqa: E402
from numbasplat.tile_loss import s3im_permutations  # noqa: E402
from tests.scenes import edge_case_scene, look_at_camera  # noqa: E402


SPILL = 8  # records of the crowded tile that the smaller cache holds besides one load batch


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def run(g, cam, target, perms, backend, want_image=True, **kw):
    xp = array_module(backend)
    gg = ns.Gaussians(**{k: xp.asarray(a) for k, a in g.arrays().items()})
    p = ns.project(gg, cam, backend=backend)
    b = ns.bin_tiles(p, backend=backend)
    loss, grad, image, stats = rasterize_tile_loss(p, b, xp.asarray(target), xp.asarray(perms), 0.2,
                                                   (0.2, 0.3, 0.4), want_image=want_image, backend=backend, **kw)
    params = ns.project_backward(gg, p, grad, backend=backend)
    return loss, to_host(image), to_host(grad), {k: to_host(v) for k, v in params.arrays().items()}, stats, b


def main(repeats=3):
    failures = []
    # the last scene crowds over 256 Gaussians (more than one load batch) onto the middle tile
    # (the first scene's size is no multiple of the tile: its last column and row are cut)
    for i, (W, H, n) in enumerate(((37, 29, 30), (48, 16, 276))):
        g = edge_case_scene(n=n, seed=20 + i, dtype=np.float32)
        cam = look_at_camera(W=W, H=H, f=10.0)  # wide: the border tiles are empty
        target = np.random.default_rng(i).random((H, W, 3)).astype(np.float32)
        perms = s3im_permutations(np.random.default_rng(100 + i), repeats)
        ref = run(g, cam, target, perms, "cpu")
        per_tile = to_host(ref[5].ranges[:, 1] - ref[5].ranges[:, 0])
        assert (per_tile == 0).any() or n > 256, "scene has no empty tile"
        print(f"{W}x{H}: Gaussians per tile {per_tile.tolist()}")
        mid = int(np.median(per_tile[per_tile > 0]))
        configs = [("all fused", {}, None), (f"budget {mid}", {"max_fused": mid}, None)]
        if per_tile.max() <= fz.BLOCK:  # (the crowded tile goes unfused under the budget already)
            configs.append(("unfused", {"fuse": False}, None))
        if per_tile.max() > fz.BLOCK + SPILL:  # a cache smaller than the crowded tile: records spill past it
            configs.append((f"cache {fz.BLOCK + SPILL}", {}, fz.BLOCK + SPILL))
        for label, kw, cache in configs:
            saved, fz.CACHE_RECORDS = fz.CACHE_RECORDS, cache or fz.CACHE_RECORDS
            try:
                got = run(g, cam, target, perms, "cuda", **kw)
            finally:
                fz.CACHE_RECORDS = saved
            errs = {"loss": abs(got[0] - ref[0]), "image": float(np.abs(got[1] - ref[1]).max()),
                    "records": rel(got[2], ref[2]), **{"d_" + k: rel(got[3][k], ref[3][k]) for k in ref[3]}}
            tol = {"loss": 1e-5, "image": 1e-5}
            bad = [k for k, e in errs.items() if e > tol.get(k, 1e-4)]
            print(f"{W}x{H} {label:12s} fused tiles {got[4]['fused_tiles']:.2f} "
                  + " ".join(f"{k}={e:.1e}" for k, e in errs.items()) + (" FAIL" if bad else ""))
            failures += bad
        if i == 0:  # a renderer's share of the loss under MPI (every other tile), from the partial sums:
            mask = np.arange(len(per_tile)) % 2 == 0  # of the fused tiles, and of a mix with no image written
            want = run(g, cam, target, perms, "cpu", tiles=mask)[0]
            for label, kw in (("fused", {}), (f"budget {mid}", {"max_fused": mid, "want_image": False})):
                share = abs(run(g, cam, target, perms, "cuda", tiles=mask, **kw)[0] - want)
                print(f"{W}x{H} loss share, {label}: error {share:.1e}" + (" FAIL" if share > 1e-5 else ""))
                failures += ["share"] if share > 1e-5 else []
    # the layout pruning budgets with on any machine (numbasplat.math.tiles) is the compiled kernel's,
    # or above it by what the compiler drops (so a budget without a GPU is never too large)
    per_block, fixed, per_gaussian, source = fz.fused_layout()
    declared = fused_smem_layout()
    print(f"shared memory: {per_block} B per block ({source}), fixed {fixed} B (declared {declared[0]}), "
          f"{per_gaussian} B a Gaussian (declared {declared[1]}): budget {fz.fused_budget()}")
    failures += [] if fixed <= declared[0] and per_gaussian == declared[1] else ["layout"]
    print("FAILED: " + ", ".join(failures) if failures else "all fused checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
