"""ByteSplat's fused kernel equals the unfused path and the CPU backend (CUDA simulator in CI)."""
from pathlib import Path

import pytest

from conftest import run_sim

CHECK = Path(__file__).with_name("check_fused.py")


@pytest.mark.sim
@pytest.mark.timeout(1500)
def test_fused_kernel_matches_unfused_and_cpu_in_simulator():
    out = run_sim(CHECK, timeout=1500)
    assert "all fused checks passed" in out.stdout


def test_ellipse_box_test_never_misses_a_blended_pixel():
    """The fused kernel skips a warp's rows where ``ellipse_hits_box`` says no: that must never
    drop a pixel centre whose float32 alpha reaches 1/255 (and it must skip something)."""
    import numpy as np
    from numpy import float32 as f32

    from numbasplat.blend import gaussian_alpha
    from numbasplat.geometry import ALPHA_MIN, ellipse_hits_box, opacity_extent
    rng = np.random.default_rng(0)
    misses = skips = 0
    for _ in range(3000):
        L = rng.normal(0, 0.6, (2, 2)) + np.eye(2) * rng.uniform(0.05, 1.5)
        ca, cb, cc = (f32(x) for x in (L @ L.T)[[0, 0, 1], [0, 1, 1]])
        u, v = (f32(x) for x in rng.uniform(-12, 28, 2))
        opacity = f32(rng.choice([rng.uniform(0, 1), rng.uniform(0.003, 0.005)]))
        x0, y0 = f32(0.5), f32(0.5 + 2 * rng.integers(0, 8))
        x1, y1 = f32(15.5), y0 + f32(1)
        hit = ellipse_hits_box(u, v, ca, cb, cc, opacity_extent(opacity) * f32(1.001) + f32(1e-3), x0, x1, y0, y1)
        blended = any(gaussian_alpha(u, v, ca, cb, cc, opacity, f32(x), f32(y))[0] >= ALPHA_MIN
                      for x in np.arange(x0, x1 + 1) for y in (y0, y1))
        misses += blended and not hit
        skips += not hit
    assert misses == 0
    assert skips > 300


def test_launch_groups_cover_the_fused_tiles_once(monkeypatch):
    import numpy as np

    from numbasplat import fused as fz
    monkeypatch.setattr(fz, "_shared_memory", lambda: (232448, 233472, 11280))
    counts = np.random.default_rng(1).integers(0, 6000, 5000).astype(np.int32)
    counts[:50] = 0
    limit = fz.budget()
    order, groups = fz.launch_groups(counts, limit)
    assert sorted(order.tolist()) == np.flatnonzero(counts <= limit).tolist()
    assert groups[0][0] == 0 and groups[-1][1] == len(order)
    for (a, b, largest), nxt in zip(groups, groups[1:] + [(len(order),)]):
        assert b == nxt[0] and largest == counts[order[a:b]].max()
        assert (np.diff(order[a:b]) > 0).all()  # image order within a group
    assert len(groups) == len(fz.BLOCKS_PER_SM) + 1
    assert fz.launch_groups(counts, -1)[1] == []
