"""comm/libraries.py: MPI and NCCL loaded in one place, each failure one line naming the fix.

The MPI library is hidden from a fresh process with ``MPI4PY_LIBMPI`` (mpi4py's wheels then look
only there), as after `pip uninstall mpich`; the other failures are simulated in this process.
"""
import importlib.abc
import os
import subprocess
import sys
import types

import pytest

from comm import libraries
from comm.libraries import MPIUnavailable, load_mpi, load_nccl, loaded_libraries, mpi_library_name
from conftest import REPO_ROOT, mpiexec_path

HIDDEN_LIBMPI = {"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"}


# --------------------------------------------------------------------------- MPI in this process

def test_load_mpi_gives_mpi4py_and_its_library():
    MPI = load_mpi()
    assert MPI.COMM_WORLD.Get_size() == 1
    name = mpi_library_name(MPI)
    assert name and "\n" not in name and "," not in name
    if sys.platform == "linux":
        assert any(os.path.basename(p).startswith("libmpi") for p in loaded_libraries("libmpi"))


def test_loaded_libraries_are_absolute_paths_of_that_name():
    load_mpi()
    for path in loaded_libraries("libmpi"):
        assert os.path.isabs(path) and os.path.basename(path).startswith("libmpi")
    assert loaded_libraries("libno-such-library") == []


class _FailingFinder(importlib.abc.MetaPathFinder):
    """Makes ``import mpi4py.MPI`` raise what mpi4py raises when no libmpi loads."""

    def __init__(self, exc):
        self.exc = exc

    def find_spec(self, fullname, path, target=None):
        if fullname == "mpi4py.MPI":
            raise self.exc
        return None


@pytest.fixture
def mpi4py_fails(monkeypatch):
    """Call with an exception: the next ``from mpi4py import MPI`` raises it (undone after the test)."""
    import mpi4py

    def arm(exc):
        monkeypatch.delattr(mpi4py, "MPI", raising=False)
        monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
        monkeypatch.setattr(sys, "meta_path", [_FailingFinder(exc), *sys.meta_path])
    return arm


def test_no_libmpi_is_one_line_naming_the_fix(mpi4py_fails):
    mpi4py_fails(RuntimeError("cannot load MPI library\n/v/lib/libmpi.so: cannot open shared object file\n"
                              "libmpi.so.12: cannot open shared object file"))
    with pytest.raises(MPIUnavailable) as e:
        load_mpi()
    message = str(e.value)
    assert "\n" not in message and "cannot open shared object" not in message
    assert "no libmpi found" in message and "pip install mpich" in message and "system's MPI" in message


def test_other_load_failures_keep_their_first_line(mpi4py_fails):
    mpi4py_fails(ImportError("libmpi.so.40: undefined symbol: ompi_mpi_comm_world\nmore detail"))
    with pytest.raises(MPIUnavailable, match=r"\(libmpi.so.40: undefined symbol: ompi_mpi_comm_world\): `pip"):
        load_mpi()


def test_messages_name_the_fix_for_the_platform(monkeypatch):
    missing = ModuleNotFoundError("No module named 'mpi4py'", name="mpi4py")
    assert libraries._mpi_load_failure(missing) == "mpi4py is not installed: `pip install -e .` (it is a base dependency)"
    monkeypatch.setattr(sys, "platform", "win32")  # PyPI's mpich is empty there
    assert "pip install impi-rt" in libraries._mpi_load_failure(RuntimeError("cannot load MPI library"))


@pytest.mark.parametrize("var", ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE"])
def test_a_launcher_of_another_mpi_is_an_error(monkeypatch, var):
    """mpiexec of MPI A starting ranks whose mpi4py loaded MPI B: each rank would see one rank and train alone."""
    monkeypatch.setenv(var, "4")
    with pytest.raises(MPIUnavailable, match="the launcher started 4 ranks but MPI sees 1: that mpiexec belongs"):
        load_mpi()
    monkeypatch.setenv(var, "1")
    assert load_mpi().COMM_WORLD.Get_size() == 1


# --------------------------------------------------------------------------- MPI hidden from a fresh process

def _run(*args, env=None, launcher=()):
    e = {"NUMBASPLAT_BACKEND": "cpu", "PATH": "/usr/bin:/bin", **(env or {})}
    return subprocess.run([*launcher, sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env=e, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def libmpi_hidden():
    """The environment that hides libmpi, or skip where mpi4py links MPI itself (a source or conda build)."""
    probe = _run("-c", "from mpi4py import MPI", env=HIDDEN_LIBMPI)
    if probe.returncode == 0:
        pytest.skip("this mpi4py is linked to its MPI (not the wheel that loads one): it cannot be hidden")
    return HIDDEN_LIBMPI


def test_batch_size_without_libmpi_is_one_line(libmpi_hidden, tmp_path):
    r = _run("run.py", "train", "--data", str(tmp_path), "--out", str(tmp_path / "out"), "--batch-size", "2",
             env=libmpi_hidden)
    assert r.returncode == 1
    assert r.stderr.splitlines() == [
        "error: mpi4py cannot load an MPI library (no libmpi found): `pip install mpich` (a base dependency: "
        "`pip install -e .` brings it), or build mpi4py against your system's MPI (README.md, 'MPI on a cluster')"]


def test_info_without_libmpi_says_so_quietly(libmpi_hidden):
    r = _run("run.py", "info", env=libmpi_hidden)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    mpi = [ln for ln in r.stdout.splitlines() if ln.startswith("MPI:")]
    assert len(mpi) == 1 and mpi[0].startswith("MPI: unavailable: mpi4py cannot load an MPI library"), r.stdout
    assert "cannot open shared object" not in r.stdout


@pytest.mark.mpi
def test_mpiexec_without_libmpi_is_one_line_per_rank(libmpi_hidden, tmp_path):
    exe = mpiexec_path()
    if exe is None:
        pytest.skip("no mpiexec")
    r = _run("run.py", "train", "--data", str(tmp_path), "--out", str(tmp_path / "out"), env=libmpi_hidden,
             launcher=(exe, "-n", "2"))
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 2 and len(set(lines)) == 1 and "no libmpi found" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


# --------------------------------------------------------------------------- NCCL

def _fake_cupy(monkeypatch, nccl):
    """A ``cupy`` whose ``cupy.cuda.nccl`` is ``nccl`` (a module, or a callable run on access)."""
    cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    cupy.cuda = cuda
    cuda.__getattr__ = lambda name: nccl() if name == "nccl" else (_ for _ in ()).throw(AttributeError(name))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.delitem(sys.modules, "cupy.cuda.nccl", raising=False)


def test_nccl_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert load_nccl() == (None, "no CuPy")


def test_nccl_that_loads(monkeypatch):
    module = types.SimpleNamespace(get_version=lambda: 22707)
    _fake_cupy(monkeypatch, lambda: module)
    assert load_nccl() == (module, None)


def test_nccl_missing_is_cupys_reason_without_its_warning(monkeypatch, recwarn):
    """CuPy warns a paragraph and leaves a binding without functions when libnccl does not load."""
    def nccl():
        import warnings
        warnings.warn("\nnccl library could not be loaded.\n\nReason: ImportError (libnccl.so.2: cannot open shared "
                      "object file: No such file or directory)\n\nYou can install the library by:\n  $ ...\n")
        return types.SimpleNamespace(available=False)
    _fake_cupy(monkeypatch, nccl)
    assert load_nccl() == (None, "ImportError (libnccl.so.2: cannot open shared object file: No such file or directory)")
    assert len(recwarn) == 0
