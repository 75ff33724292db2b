"""The CUDA kernels match the CPU backend (under the CUDA simulator in CI)."""
from pathlib import Path

import pytest

from conftest import run_sim

CHECK = Path(__file__).with_name("check_cuda.py")


@pytest.mark.sim
@pytest.mark.timeout(900)
def test_cuda_kernels_match_cpu_backend_in_simulator():
    out = run_sim(CHECK, timeout=900)
    assert "all CUDA checks passed" in out.stdout
