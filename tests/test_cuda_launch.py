"""numbasplat.cuda.launch: every CUDA kernel compiles to PTX for sm_90 with its real float32
signature, the PTX cache and its key, and the register caps.

The simulator computes in float64 and catches no typing errors; this compiles
the real thing without a GPU (numba-cuda's NVVM, from the cuda-toolkit wheels).
"""
import os
import re
import shutil

import pytest


def _ptx_available():
    try:
        from numba import cuda
        cuda.compile_ptx(lambda a: None, "void(float32[::1])", cc=(9, 0))
        return True
    except Exception:
        return False


KERNEL_NAMES = {
    "_project_kernel", "_emit_kernel", "_emit_u16_kernel", "_sh_backward_kernel", "_geometry_backward_kernel",
    "_route_kernel", "_route_fill_kernel", "_raster_forward_kernel", "_raster_backward_kernel",
    "_contributions_kernel",  # raster
    "_fused_kernel", "_ssim_fwd_kernel", "_ssim_bwd_kernel", "_tile_loss_kernel", "_adam_kernel",
    "_count_kernel", "_pack_kernel", "_unpack_add_kernel", "_scatter_add_kernel",  # sparse
    "_depth_key_kernel", "_ranges_from_counts_kernel", "_screen_stats_kernel",  # binning, the strategy's statistics
    "_row_normals_kernel",  # densification's noise
    "_raster_backward_fixed_kernel", "_slot_sum_kernel",  # the raster backward of --deterministic
    "_raster_forward_carry_kernel", "_raster_backward_carry_kernel",  # a view in depth-ordered chunks
    "_raster_backward_fixed_carry_kernel",
    "_sh_adam_kernel", "_geometry_adam_kernel",  # the projection backward with Adam fused
}


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="simulator has no compiler")
def test_all_kernels_compile_to_ptx(monkeypatch):
    if not _ptx_available():
        pytest.skip("no NVVM (pip install -e '.[test]')")
    from types import SimpleNamespace

    from numba import cuda as numba_cuda
    from numba.cuda import dispatcher
    # device functions ask the current GPU for its compute capability; there is none here
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: SimpleNamespace(compute_capability=(9, 0)))
    from numbasplat.cuda import launch  # importing the package registers every kernel
    assert {name.rsplit(".", 1)[1] for name in launch.KERNELS} >= KERNEL_NAMES
    for name, (fn, sig) in launch.KERNELS.items():
        ptx, _ = numba_cuda.compile_ptx(fn, sig, cc=(9, 0))
        assert ".entry" in ptx, name
        assert re.search(r"\.f64\b", ptx.split(".entry", 1)[1]) is None, f"{name} computes in float64"
        layout = launch.param_layout(ptx)  # what a launch packs: a field per declared parameter
        entry = ptx.split(".entry", 1)[1]
        assert len(layout.format.lstrip("<").replace("x", "")) == entry[:entry.index(")")].count(".param"), name


def test_param_layout_aligns_each_parameter():
    """The launch buffer's layout from a PTX entry: each scalar at a multiple of its size (a bool
    byte, then a pointer 7 bytes on), signed 64-bit integers, float32 and float64."""
    from numbasplat.cuda.launch import param_layout
    ptx = """.visible .entry k(
        .param .u8 k_param_0,
        .param .u64 k_param_1,
        .param .f32 k_param_2,
        .param .s32 k_param_3,
        .param .f64 k_param_4
    )
    { ret; }"""
    layout = param_layout(ptx)
    assert layout.format == "<B" + "x" * 7 + "qfid" and layout.size == 32
    packed = layout.pack(1, 2**47 + 3, 1.5, -2, 0.25)
    assert packed[0] == 1 and int.from_bytes(packed[8:16], "little") == 2**47 + 3
    assert param_layout(".entry k(\n .param .u64 .ptr .global .align 4 k_param_0,\n .param .f32 k_param_1\n)").size == 12
    with pytest.raises(RuntimeError, match="not a scalar"):
        param_layout(".entry k(\n .param .align 8 .b8 k_param_0[16]\n)")



@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="simulator has no compiler")
def test_ptx_cache_compiles_once(tmp_path, monkeypatch):
    if not _ptx_available():
        pytest.skip("no NVVM (pip install -e '.[test]')")
    from numba import cuda as numba_cuda

    from numbasplat.cuda import launch
    monkeypatch.setenv("NUMBASPLAT_CACHE", str(tmp_path))

    def scale(a):
        a[0] *= 2.0
    sig = "void(float32[::1])"
    first = launch._cached_ptx(scale, sig, (9, 0))
    assert ".entry" in first and len(list(tmp_path.glob("*.ptx"))) == 1

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again although the PTX is cached")
    monkeypatch.setattr(numba_cuda, "compile_ptx", no_compile)
    assert launch._cached_ptx(scale, sig, (9, 0)) == first
    with pytest.raises(AssertionError):  # another architecture is another entry
        launch._cached_ptx(scale, sig, (8, 0))


def test_ptx_cache_key_follows_the_kernels_own_module(tmp_path, monkeypatch):
    """Kernels outside the package are keyed by their module's source too, so editing a
    kernel there never loads stale PTX."""
    import importlib
    import sys

    from numbasplat.cuda import launch
    src = tmp_path / "some_kernels.py"
    src.write_text("def k(a):\n    a[0] = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("some_kernels")
    try:
        before = launch._source_digest(mod.k)
        assert launch._source_digest(mod.k) == before
        src.write_text("def k(a):\n    a[0] = 2\n")
        assert launch._source_digest(mod.k) != before
    finally:
        sys.modules.pop("some_kernels", None)


def test_ptx_cache_key_covers_every_file_of_the_package(tmp_path):
    """A kernel compiles from its module, cuda/'s shared device functions and numbasplat.math: the
    key hashes the whole package, so editing (or moving) any of its files changes it."""
    from numbasplat.math.jit import PACKAGE, package_digest
    assert (PACKAGE / "math" / "geometry.py").is_file()
    copy = tmp_path / "numbasplat"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = package_digest(copy)
    assert before == package_digest(PACKAGE)
    geometry = copy / "math" / "geometry.py"
    geometry.write_text(geometry.read_text() + "\n# edited\n")
    edited = package_digest(copy)
    assert edited != before
    geometry.rename(copy / "math" / "geometry_moved.py")
    assert package_digest(copy) != edited


def _ptxas():
    """ptxas from the CUDA toolkit wheels (the test extra's cuda-toolkit[nvcc]: nvidia/cuda_nvcc/bin for
    CUDA 12, nvidia/cu13/bin for 13, as numba-cuda's own search, cuda-pathfinder, finds them) or the
    PATH, if any."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
        found = find_nvidia_binary_utility("ptxas")
    except (ImportError, RuntimeError):  # an older cuda-pathfinder, or none
        found = None
    return found or shutil.which("ptxas")


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="simulator has no compiler")
def test_register_caps_reach_the_assembler(monkeypatch, tmp_path):
    """Kernels declared with ``max_registers`` assemble within their cap (the directive is placed
    where ptxas reads it), and uncapped they would use more: the cap is not a no-op."""
    import subprocess
    ptxas = _ptxas()
    if not _ptx_available() or ptxas is None:
        pytest.skip("no NVVM or ptxas (pip install -e '.[test]')")
    from types import SimpleNamespace

    from numba import cuda as numba_cuda
    from numba.cuda import dispatcher
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: SimpleNamespace(compute_capability=(9, 0)))
    from numbasplat.cuda import launch, raster

    def registers(ptx):
        path = tmp_path / "k.ptx"
        path.write_text(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90", "-v", str(path), "-o", str(tmp_path / "k.cubin")],
                             capture_output=True, text=True, check=True)
        return int(re.search(r"Used (\d+) registers", out.stderr + out.stdout).group(1))

    capped = [k for k in vars(raster).values() if isinstance(k, launch.Kernel) and k.max_registers]
    assert capped
    for k in capped:
        ptx, _ = numba_cuda.compile_ptx(k.fn, k.sig, cc=(9, 0), fastmath=k.fastmath)
        assert registers(launch.with_max_registers(ptx, k.max_registers)) <= k.max_registers, k.fn.__name__
        assert registers(ptx) > k.max_registers, f"{k.fn.__name__}: the cap changes nothing"
