"""The libraries ranks talk through, loaded in one place so that a missing one is one clear line.

``load_mpi()`` returns mpi4py's ``MPI`` (the first call loads libmpi and initialises MPI) or
raises ``MPIUnavailable`` naming the fix; ``load_nccl()`` returns CuPy's NCCL binding or the
reason it has none; ``loaded_libraries(stem)`` lists the shared libraries of that name this
process has loaded, so that ``run.py info`` can say which libmpi and libnccl are in use.
"""
import os
import sys
import warnings


class MPIUnavailable(ImportError):
    """MPI cannot be used here: its library does not load, or the launcher belongs to another MPI."""


def _mpi_fix():
    if sys.platform == "win32":  # PyPI's mpich is an empty placeholder on Windows
        return "`pip install impi-rt` (Intel MPI) or install Microsoft MPI"
    return "`pip install mpich` (a base dependency: `pip install -e .` brings it)"


def _mpi_load_failure(exc):
    if isinstance(exc, ModuleNotFoundError) and exc.name == "mpi4py":
        return "mpi4py is not installed: `pip install -e .` (it is a base dependency)"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if first.startswith("cannot load MPI library"):  # mpi4py's wheels: no libmpi anywhere they look
        first = "no libmpi found"
    return (f"mpi4py cannot load an MPI library ({first}): {_mpi_fix()}, or build mpi4py against "
            "your system's MPI (README.md, 'MPI on a cluster')")


def _launched_size():
    """The rank count the launcher announced (MPICH/Slurm PMI, Open MPI), or None when not launched."""
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        try:
            return int(os.environ[key])
        except (KeyError, ValueError):
            continue
    return None


def load_mpi():
    """mpi4py's ``MPI`` module; ``MPIUnavailable`` with one line naming the fix when it cannot work.

    What mpi4py reports when no libmpi loads (one line per path it tried, and warnings about
    ABIs) is summed up in that line rather than printed.  A launcher that started N ranks while
    the library sees one means the ``mpiexec`` belongs to another MPI than the library mpi4py
    loaded: every rank would train alone, so that is an error too.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError) as e:
            raise MPIUnavailable(_mpi_load_failure(e)) from None
    for w in caught:  # loaded after all: whatever it warned about is worth seeing
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    launched = _launched_size()
    if launched is not None and launched > 1 and MPI.COMM_WORLD.Get_size() == 1:
        raise MPIUnavailable(
            f"the launcher started {launched} ranks but MPI sees 1: that mpiexec belongs to another MPI than "
            f"the one mpi4py loaded ({mpi_library_name(MPI)}); launch with that MPI's mpiexec or srun "
            "(`python run.py info` shows which library mpi4py loaded)")
    return MPI


def mpi_library_name(MPI):
    """The first line of ``MPI_Get_library_version``, e.g. 'MPICH Version: 4.2.0' or 'Open MPI v5.0.3'."""
    first = MPI.Get_library_version().strip().splitlines()[0]
    return " ".join(first.split(",")[0].split())


def load_nccl():
    """``(cupy.cuda.nccl, None)`` when NCCL loads, else ``(None, reason)``.

    CuPy (14 and later, which the gpu extras install) finds the NCCL of the nvidia-nccl-cuXX wheel
    by itself; what CuPy warns when it finds none is folded into the reason.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            from cupy.cuda import nccl
            nccl.get_version()
            return nccl, None
        except ImportError as e:
            if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "cupy":
                return None, "no CuPy"
            reason = str(e)
        except Exception as e:  # CuPy without its NCCL binding: it has no get_version
            reason = f"{type(e).__name__}: {e}"
    for w in caught:  # CuPy's own account: "nccl library could not be loaded. Reason: ImportError (...)"
        for line in str(w.message).splitlines():
            if line.strip().startswith("Reason:") and "nccl" in str(w.message).lower():
                reason = line.strip()[len("Reason:"):]
    reason = reason.strip()
    return None, reason.splitlines()[0] if reason else "NCCL does not load"


def loaded_libraries(stem):
    """Paths of the shared libraries named ``stem``* this process has mapped (Linux; else empty)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if stem in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/") and os.path.basename(p).startswith(stem))
