"""``bin_tiles``' tile ranges, made from the counts its emission adds up, and its sort keys, written by the
emission in their final form, against the plain reference of tests/binning_cases.py: on the CPU backend,
and on the CUDA kernels under the simulator (small images)."""
import numpy as np

import numbasplat as ns
from conftest import simulator_test
from numbasplat import rendering as rz
from tests.binning_cases import binning_cases, check_binning_ranges, check_ranges_from_counts


def test_tile_ranges_are_the_runs_of_the_sorted_keys():
    assert check_binning_ranges("cpu") == []
    assert check_ranges_from_counts("cpu") == []


def test_the_binning_cases_hold_what_the_ranges_could_get_wrong():
    """Empty tiles between full ones, pad slots (a part's tiles outside its rows), a view with no tile
    among views with theirs, keys of both widths."""
    cases = {label: (p, kw) for label, p, kw in binning_cases("cpu")}
    b = ns.bin_tiles(cases["sparse scene"][0], backend="cpu")
    full = np.flatnonzero(b.ranges[:, 1] > b.ranges[:, 0])
    assert len(full) > 1 and (b.ranges[full[0]:full[-1]] == 0).all(axis=1).any()
    p, kw = cases["tile rows (1, 3)"]
    assert int(p.counts.sum()) > ns.bin_tiles(p, backend="cpu", **kw).ranges[:, 1].max()
    p, kw = cases["views"]
    ranges = ns.bin_tiles(p, backend="cpu", **kw).ranges.reshape(3, -1, 2)
    assert (ranges[0, :, 1] > 0).any() and (ranges[1] == 0).all() and (ranges[2, :, 1] > 0).any()
    for label in ("32-bit keys", "32-bit keys of views"):
        p, kw = cases[label]
        keys = kw.get("n_views", 1) * int(np.prod(p.camera.tiles))
        assert rz.tile_key_dtype(keys) == np.uint32 and p.counts.sum() > 0
    assert rz.tile_key_dtype(2**16 - 1) == np.uint16  # (the pad key, the tiles' count, still fits)


test_cuda_binning_ranges_in_simulator = simulator_test("""
    from tests.binning_cases import check_binning_ranges, check_ranges_from_counts
    failures = check_binning_ranges("cuda", large=False) + check_ranges_from_counts("cuda")
    assert not failures, failures
    print("binning ranges ok")
""", "binning ranges ok", timeout=600)
