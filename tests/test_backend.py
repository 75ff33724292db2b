"""numbasplat.backend: the choice of backend, the kernel packages it dispatches to, its device
helpers and numbasplat.device's on the CPU and in the simulator; and the package's layers, which
import only downward."""

import numpy as np
import pytest

from conftest import REPO_ROOT, run_sim
from test_loss import run_python

PACKAGE = REPO_ROOT / "numbasplat"


def test_the_environment_chooses_the_backend():
    r = run_python("from numbasplat import backend; print(backend.BACKEND, backend.on_gpu())", NUMBASPLAT_BACKEND="cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu", "False"]
    r = run_python("import numbasplat", NUMBASPLAT_BACKEND="metal")
    assert r.returncode != 0 and "NUMBASPLAT_BACKEND must be 'cpu' or 'cuda'" in r.stderr


def test_kernels_are_the_backend_packages_with_the_same_entry_points():
    import numbasplat.cpu
    import numbasplat.cuda
    from numbasplat import backend
    assert backend.kernels("cpu") is numbasplat.cpu
    assert backend.kernels("cuda") is numbasplat.cuda
    assert backend.kernels() is backend.kernels(backend.BACKEND)
    with pytest.raises(ValueError, match="backend must be 'cpu' or 'cuda'"):
        backend.kernels("metal")
    cpu, cuda = set(numbasplat.cpu.__all__), set(numbasplat.cuda.__all__)
    assert cpu - cuda == {"adam_table_rows", "copy_table_rows"}  # the host's own (the out-of-core tiers: no device
    # runs them)
    assert cuda - cpu == {"fused_budget", "fused_raster_loss_backward"}
    for name in cpu & cuda:
        assert callable(getattr(numbasplat.cpu, name)) == callable(getattr(numbasplat.cuda, name)), name
    assert not numbasplat.cpu.FUSED_TILE_LOSS and numbasplat.cuda.FUSED_TILE_LOSS


def test_device_helpers_on_the_cpu():
    from numbasplat import backend, device
    assert not backend.on_gpu("cpu")
    assert backend.on_gpu("cuda") == (not backend.SIM)
    assert backend.synchronize("cpu") is None  # a no-op: nothing to wait for
    assert backend.array_module("cpu") is np
    a = np.arange(3.0)
    assert backend.asarray(a, "cpu") is a and backend.to_host(a) is a
    assert not backend.is_device(a) and backend.array_module_of(a) is np
    assert device.HostCopy(a).get() is a
    assert backend.kernels("cpu").launch_count() is None
    into = np.empty(3)
    device.queue_to_host(a, into)
    assert (into == a).all() and device.stream_event() is None and device.address(a) == a.ctypes.data
    values = device.DeviceValues(2, np.float32, "cpu")
    where = device.address(values.array)
    for step in range(3):  # rewritten in place, where a step graph would read it
        assert values.write([step, -step]) is values.array and device.address(values.array) == where
        assert values.array.tolist() == [step, -step]


@pytest.mark.sim
@pytest.mark.timeout(300)
def test_device_helpers_in_the_simulator():
    """The simulator is CUDA without a GPU: the CUDA kernels take numpy arrays, nothing to wait for."""
    out = run_sim("""
        import numpy as np
        from numbasplat import backend
        assert backend.SIM and backend.BACKEND == "cuda"
        assert not backend.on_gpu() and not backend.on_gpu("cuda")
        backend.synchronize()
        assert backend.array_module("cuda") is np and backend.array_module() is np
        assert backend.kernels() is backend.kernels("cuda")
        assert backend.backend_of(np.zeros(3)) == "cuda"
        assert backend.kernels().launch_count() == 0
        print("sim helpers ok")
    """, timeout=300)
    assert "sim helpers ok" in out.stdout

