"""ByteSplat's fused kernel equals the unfused path and the CPU backend (CUDA simulator in CI)."""
from pathlib import Path

import pytest

from conftest import run_sim

CHECK = Path(__file__).with_name("check_cuda_fused.py")


@pytest.mark.sim
@pytest.mark.timeout(1500)
def test_fused_kernel_matches_unfused_and_cpu_in_simulator():
    out = run_sim(CHECK, timeout=1500)
    assert "all fused checks passed" in out.stdout
