"""cli/bench.py's ``info``: which extra, CuPy, CUDA, numba-cuda toolkit, NCCL and MPI this install uses.

Without a GPU here, the GPU stack is simulated (a fake ``cupy`` module, installed versions
given as a dict); the real run on a GPU machine is ``python run.py info``.
"""
import subprocess
import sys
import types

import pytest

from cli import bench
from cli.bench import cuda_extra
from conftest import REPO_ROOT

GPU13 = {"cupy-cuda13x": "14.0.1", "nvidia-nccl-cu13": "2.27.7", "cuda-bindings": "13.0.3", "numba-cuda": "0.30.4"}


def test_extra_from_the_installed_wheels():
    assert cuda_extra(GPU13) == "gpu-cu13 (cupy-cuda13x 14.0.1, nvidia-nccl-cu13 2.27.7, cuda-bindings 13.0.3)"
    cu12 = {"cupy-cuda12x": "14.0.1", "nvidia-nccl-cu12": "2.27.7", "cuda-bindings": "12.9.1"}
    assert cuda_extra(cu12) == "gpu-cu12 (cupy-cuda12x 14.0.1, nvidia-nccl-cu12 2.27.7, cuda-bindings 12.9.1)"


def test_extra_missing_or_mixed_pieces():
    no_nccl = cuda_extra({"cupy-cuda12x": "14.0.1", "cuda-bindings": "12.9.1"})
    assert no_nccl.startswith("gpu-cu12 (cupy-cuda12x 14.0.1, cuda-bindings 12.9.1); incomplete: no nvidia-nccl-cu12")
    assert no_nccl.endswith('(pip install -e ".[gpu-cu12]")')
    wrong_bindings = cuda_extra({**GPU13, "cuda-bindings": "12.9.1"})
    assert "incomplete: numba-cuda's cuda-bindings 12.9.1 is for another CUDA" in wrong_bindings
    both = cuda_extra({"cupy-cuda12x": "14.0.1", "cupy-cuda13x": "14.0.1"})
    assert both.startswith("mixed: cupy-cuda12x and cupy-cuda13x are both installed")


def test_no_extra():
    assert cuda_extra({}).startswith("none: no CuPy, CPU backend only (pip install -e \".[gpu-cu12]\"")
    assert cuda_extra({"cupy": "14.0.1"}) == "none: CuPy 14.0.1 comes from conda-forge or a source build"


def _fake_cupy(monkeypatch, driver=13000):
    """A ``cupy`` reporting CUDA runtime 13.0 and ``driver`` (an exception: no driver)."""
    def driver_version():
        if isinstance(driver, Exception):
            raise driver
        return driver
    runtime = types.SimpleNamespace(runtimeGetVersion=lambda: 13000, driverGetVersion=driver_version)
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "14.0.1"
    cupy.cuda = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", cupy)


def test_cupy_line(monkeypatch):
    _fake_cupy(monkeypatch)
    assert bench._cupy_line() == "CuPy: 14.0.1, CUDA runtime 13.0, driver 13.0"
    _fake_cupy(monkeypatch, driver=RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient"))
    assert bench._cupy_line() == ("CuPy: 14.0.1, CUDA runtime 13.0, no driver (cudaErrorInsufficientDriver: "
                                  "CUDA driver version is insufficient)")
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert bench._cupy_line() == "CuPy: not installed"


def test_nccl_line(monkeypatch):
    from comm import libraries
    monkeypatch.setattr(libraries, "load_nccl", lambda: (types.SimpleNamespace(get_version=lambda: 22707), None))
    monkeypatch.setattr(libraries, "loaded_libraries", lambda stem: ["/v/site-packages/nvidia/nccl/lib/libnccl.so.2"])
    assert bench._nccl_line() == "NCCL: 2.27.7 (/v/site-packages/nvidia/nccl/lib/libnccl.so.2)"
    monkeypatch.setattr(libraries, "load_nccl", lambda: (None, "no CuPy"))
    assert bench._nccl_line() == "NCCL: unavailable (no CuPy)"


def test_info_with_a_simulated_gpu_stack(monkeypatch, capsys):
    """What the GPU machine prints, one line per library, with the extra it infers."""
    from comm import libraries
    _fake_cupy(monkeypatch)
    monkeypatch.setattr(bench, "installed_versions", lambda names: dict(GPU13))
    monkeypatch.setattr(libraries, "load_nccl", lambda: (types.SimpleNamespace(get_version=lambda: 22707), None))
    bench.cmd_info(None)
    out = capsys.readouterr()
    lines = dict(line.split(": ", 1) for line in out.out.splitlines() if ": " in line and not line.startswith("python"))
    assert lines["CUDA extra"] == "gpu-cu13 (cupy-cuda13x 14.0.1, nvidia-nccl-cu13 2.27.7, cuda-bindings 13.0.3)"
    assert lines["CuPy"] == "14.0.1, CUDA runtime 13.0, driver 13.0"
    assert lines["numba-cuda"].startswith("0.30.4, ") and lines["numba-cuda"].endswith("(cuda-bindings 13.0.3)")
    assert lines["NCCL"].startswith("2.27.7 (")
    assert lines["MPI"].endswith("CUDA-aware: no") or lines["MPI"].endswith("CUDA-aware: yes")


def test_info_here_in_a_subprocess():
    """This machine: no GPU, the mpich wheel; nothing on stderr, every line there."""
    r = subprocess.run([sys.executable, "run.py", "info"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env={"NUMBASPLAT_BACKEND": "cpu", "PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    heads = ["numbasplat backend: cpu", "python ", "GPU: ", "CUDA extra: ", "CuPy: ", "numba-cuda: ", "NCCL: ", "MPI: "]
    assert len(lines) == len(heads) and all(ln.startswith(h) for ln, h in zip(lines, heads)), r.stdout
    assert lines[-1].endswith(("CUDA-aware: no", "CUDA-aware: yes")), r.stdout


@pytest.mark.parametrize("cmd", ["bench", "scaling"])
def test_scene_commands_name_a_missing_scene(cmd, tmp_path):
    r = subprocess.run([sys.executable, "run.py", cmd, "--scene", str(tmp_path / "none.npz")], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300, env={"NUMBASPLAT_BACKEND": "cpu",
                                                                         "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and r.stderr.strip().startswith(f"error: benchmark scene not found: {tmp_path}")
