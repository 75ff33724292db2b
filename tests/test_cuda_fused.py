"""ByteSplat's fused kernel equals the unfused path and the CPU backend (CUDA simulator in CI)."""
from pathlib import Path

from conftest import simulator_test

test_fused_kernel_matches_unfused_and_cpu_in_simulator = simulator_test(
    Path(__file__).with_name("check_cuda_fused.py"), "all fused checks passed", timeout=1500)
