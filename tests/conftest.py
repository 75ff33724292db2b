"""Shared test helpers.

* The CUDA simulator's polling loop is patched (tests/_simpatch.py) when this
  pytest process runs with ``NUMBA_ENABLE_CUDASIM=1``.
* ``shared_dir()`` -> Path of ../shared (or $NUMBASPLAT_SHARED), else skip.
* ``run_sim(script_or_code, timeout)`` -> run Python in a simulator subprocess.
* ``simulator_test(script_or_code, passed, timeout)`` -> a test of a script run by ``run_sim``.
* ``mpiexec_path()`` -> the mpiexec beside this Python (mpich wheel) or on PATH.

Use them as plain functions (``from conftest import run_sim, shared_dir``) or as
fixtures of the same names (``def test_x(shared_dir, run_sim): ...``; the
``shared_dir`` fixture is the Path itself, ``run_sim`` the function).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import _simpatch  # noqa: E402

# (a) in-process: only when the simulator is on for this pytest run.
_simpatch.apply()

_OUTPUT_LIMIT = 20000  # characters of subprocess output shown on failure


def shared_dir():
    """Path of the shared data folder beside the checkout, or skip the test.

    ``$NUMBASPLAT_SHARED`` overrides the default ``<repo>/../shared``.
    """
    env = os.environ.get("NUMBASPLAT_SHARED")
    path = Path(env).expanduser() if env else REPO_ROOT.parent / "shared"
    if not path.is_dir():
        if env:
            pytest.skip(f"NUMBASPLAT_SHARED={env} not present")
        pytest.skip("../shared not present")
    return path.resolve()


def _tail(text):
    text = text or ""
    if len(text) > _OUTPUT_LIMIT:
        return "... [truncated] ...\n" + text[-_OUTPUT_LIMIT:]
    return text


_BOOTSTRAP = """\
import runpy, sys
sys.path[:0] = [{tests!r}, {root!r}]
import _simpatch
_simpatch.apply()
sys.path.remove({tests!r})
script = {script!r}
if {is_path!r}:  # like `python script.py`: the script's folder comes first
    sys.path.insert(0, {script_dir!r})
sys.argv = [script] + {argv!r}
runpy.run_path(script, run_name="__main__")
"""


def run_sim(script_or_code, timeout=600, args=(), env=None, cwd=None):
    """Run a Python script (path) or code (string) under the CUDA simulator.

    The subprocess gets ``NUMBA_ENABLE_CUDASIM=1``, no ``NUMBASPLAT_BACKEND``,
    the repo root on ``sys.path`` and the simulator patch applied before the
    script runs.  Code strings are dedented, so an indented triple-quoted
    block is fine.  ``args`` become ``sys.argv[1:]``; ``env`` adds variables.
    Fails the calling test (with the output) on a non-zero exit or after
    ``timeout`` seconds; returns the ``CompletedProcess`` (stdout and stderr
    together in ``.stdout``) otherwise.
    """
    is_path = isinstance(script_or_code, os.PathLike) or (
        isinstance(script_or_code, str)
        and "\n" not in script_or_code
        and script_or_code.endswith(".py")
        and Path(script_or_code).is_file()
    )
    sub_env = dict(os.environ)
    sub_env.pop("NUMBASPLAT_BACKEND", None)
    sub_env["NUMBA_ENABLE_CUDASIM"] = "1"
    sub_env["PYTHONUNBUFFERED"] = "1"
    sub_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    if env:
        sub_env.update({k: str(v) for k, v in env.items()})

    with tempfile.TemporaryDirectory(prefix="numbasplat_sim_") as tmp:
        if is_path:
            script = str(Path(script_or_code).resolve())
            label = script
        else:
            script = os.path.join(tmp, "sim_script.py")
            with open(script, "w") as f:
                f.write(textwrap.dedent(script_or_code))
            label = "<code>"
        boot = _BOOTSTRAP.format(
            tests=str(TESTS_DIR),
            root=str(REPO_ROOT),
            script=script,
            is_path=bool(is_path),
            script_dir=os.path.dirname(script),
            argv=[str(a) for a in args],
        )
        timed_out = None
        try:
            proc = subprocess.run(
                [sys.executable, "-c", boot],
                cwd=str(cwd or REPO_ROOT),
                env=sub_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            timed_out = exc.stdout or exc.output or ""
            if isinstance(timed_out, bytes):
                timed_out = timed_out.decode(errors="replace")
    if timed_out is not None:
        pytest.fail(
            f"simulator run of {label} timed out after {timeout} s; output:\n{_tail(timed_out)}",
            pytrace=False,
        )
    if proc.returncode != 0:
        pytest.fail(
            f"simulator run of {label} exited {proc.returncode}; output:\n{_tail(proc.stdout)}",
            pytrace=False,
        )
    return proc


def simulator_test(script_or_code, passed, timeout):
    """A test (assign it to a ``test_*`` name) that runs ``script_or_code`` under the CUDA
    simulator (``run_sim``; marked ``sim``, failed after ``timeout`` seconds) and passes when the
    output has ``passed``, the line the script prints once all its checks held."""
    @pytest.mark.sim
    @pytest.mark.timeout(timeout)
    def test():
        out = run_sim(script_or_code, timeout=timeout).stdout
        assert passed in out, out
    return test


def pytest_collection_modifyitems(config, items):
    """The simulator tests first, as pytest-xdist's workers will take them: they take minutes each.
    Their timeouts stand for their times; the workers are dealt the first tests in turn, so the
    longest go in "snake" order (1 2 2 1 for two workers: the longest with the shortest), and the
    short tests fill in after."""
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

    def allowed(item):
        timeout = item.get_closest_marker("timeout")
        return timeout.args[0] if timeout and timeout.args else 0
    slow = sorted((i for i in items if i.get_closest_marker("sim")), key=allowed, reverse=True)
    rounds = [slow[k:k + workers] for k in range(0, len(slow), workers)]
    slow = [i for r, chunk in enumerate(rounds) for i in (chunk[::-1] if r % 2 else chunk)]
    items[:] = slow + [i for i in items if not i.get_closest_marker("sim")]


def mpiexec_path():
    """The mpiexec of the mpich wheel in this environment, else the one on PATH, else None."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec")


@pytest.fixture(name="shared_dir")
def _shared_dir_fixture():
    return shared_dir()


@pytest.fixture(name="run_sim")
def _run_sim_fixture():
    return run_sim


@pytest.fixture(name="mpiexec")
def _mpiexec_fixture():
    exe = mpiexec_path()
    if exe is None:
        pytest.skip("no mpiexec (pip install -e '.[mpi]')")
    return exe
