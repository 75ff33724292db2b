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


def _scaling(*args, timeout=600):
    return subprocess.run([sys.executable, "run.py", "scaling", *map(str, args)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, env={"NUMBASPLAT_BACKEND": "cpu", "NUMBA_NUM_THREADS": "1",
                                                           "PATH": "/usr/bin:/bin"})


def test_scaling_wants_a_scene_or_a_dataset_not_both(tmp_path):
    r = _scaling("--iters", "1")
    assert r.returncode == 2 and "one of the arguments --scene --data --model is required" in r.stderr, r.stderr
    r = _scaling("--model", tmp_path / "none")
    assert r.returncode == 1 and r.stderr.strip() == f"error: --model {tmp_path / 'none'} does not exist", r.stderr
    r = _scaling("--scene", tmp_path / "s.npz", "--data", tmp_path)
    assert r.returncode == 2 and "argument --data: not allowed with argument --scene" in r.stderr, r.stderr
    r = _scaling("--data", tmp_path)
    assert r.returncode == 1 and r.stderr.strip() == (f"error: --data {tmp_path} has no ground_truth.ply: the "
                                                      "Gaussians that training starts from (run.py synth writes one)")
    r = _scaling("--data", tmp_path, "--model-ranks", "2,0")
    assert r.returncode == 2 and "--model-ranks: must be at least 1, got 0" in r.stderr, r.stderr


def test_scaling_on_a_tiny_city_reports_phases_bytes_and_the_cost_model(tmp_path):
    """``run.py scaling --data``: the first training views of a generated city, its ground truth perturbed."""
    from data import synthetic_city
    city = tmp_path / "city"
    synthetic_city.generate(city, preset="small", gaussians=20_000, views=10, resolution="64x36", seed=3,
                            progress=False, backend="cpu")
    r = _scaling("--data", city, "--views", "2", "--iters", "2", "--warmup", "1", "--model-ranks", "2,4",
                 "--grad-comm", "dense", "--link-gbs", "100")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert f"scaling: {city}, 2 training views; 20000 Gaussians, 64x36, 1 rank(s)" in out, out
    phases = [line.split()[0] for line in out.split("steps synced at their boundaries:\n")[1].splitlines()[1:9]]
    assert phases == ["project", "render", "loss", "backward", "owner", "optimizer", "refine", "sum"], out
    rate = float(out.split("images/s")[0].split()[-1])
    model = out.split("cost model")[1]
    assert "link 100 GB/s" in model and "dense gradients" in model and f"{rate:.1f} images/s" in model, out
    rows = [line.split() for line in model.splitlines()[2:]]
    assert [row[0] for row in rows] == ["2", "4"] and all(row[-1].endswith("x") for row in rows), out
    assert [line.split()[0] for line in out.split("halo (global loss)")[1].splitlines()[2:4]] == ["2", "4"], out
