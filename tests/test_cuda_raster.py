"""The CUDA kernels match the CPU backend (under the CUDA simulator in CI)."""
from pathlib import Path

import pytest

from conftest import simulator_test

test_cuda_kernels_match_cpu_backend_in_simulator = simulator_test(
    Path(__file__).with_name("check_cuda_raster.py"), "all CUDA checks passed", timeout=900)


def test_gradient_records_are_added_into_a_view_never_a_copy():
    """The raster kernels add into a flat view of the (N, 12) records: a copy would lose them."""
    import numpy as np
    from numbasplat.cuda.tile import NG, flat_records
    grad = np.zeros((5, NG), np.float32)
    flat = flat_records(grad)
    flat[NG + 2] = 1.0
    assert grad[1, 2] == 1.0
    with pytest.raises(ValueError, match="C-contiguous"):
        flat_records(np.zeros((NG, 5), np.float32).T)
