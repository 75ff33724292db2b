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
