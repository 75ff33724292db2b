"""scripts/record_stats.py on a small scene (its Gaussians are mostly faint enough that the exact,
opacity-aware ellipse is smaller than 3DGS's 3-sigma square; an opaque one's can be larger)."""
import importlib.util

import numpy as np

from conftest import REPO_ROOT
from scenes import edge_case_scene, look_at_camera


def _module():
    spec = importlib.util.spec_from_file_location("record_stats", REPO_ROOT / "scripts" / "record_stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_exact_culling_makes_fewer_pairs_than_3_sigma_squares():
    stats = _module().view_stats(edge_case_scene(n=60, seed=3, dtype=np.float32), look_at_camera(W=64, H=48),
                                 3, 4)
    assert 0 < stats["pairs_exact"] < stats["pairs_box"]
    assert 0 < stats["records_exact"] <= stats["records_box"]
    assert stats["records_exact"] <= stats["pairs_exact"]
