"""comm/alltoallv.py: the exchanges between ranks (sparse and dense, every transport on the CPU),
and one rank's error ending them all, under mpiexec."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT, mpiexec_path
from comm.sparse import decode_add, encode, scatter_add
from test_sparse import make_rows

def _mpiexec(n, *args, timeout=60, script=REPO_ROOT / "tests" / "check_mpi_comm.py"):
    exe = mpiexec_path()
    if exe is None:
        pytest.skip("no mpiexec (pip install -e '.[mpi]')")
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env["NUMBASPLAT_BACKEND"] = "cpu"
    return subprocess.run([exe, "-n", str(n), sys.executable, str(script), *args],
                          cwd=str(REPO_ROOT), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def compiled():
    """Compile (and cache) the njit kernels once here, so the ranks load them instead of all compiling."""
    G = make_rows([3, 40])
    message, _, kept = encode(G, [3, 40], backend="cpu")
    decode_add(message, [3, 40], kept, np.zeros(43, np.int32), np.zeros((1, 12), np.float32), backend="cpu")
    scatter_add(G, np.zeros(43, np.int32), np.zeros((1, 12), np.float32), backend="cpu")


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_mpi_exchanges(n, compiled):
    proc = _mpiexec(n)
    assert proc.returncode == 0, proc.stdout
    for r in range(n):
        assert f"rank {r} ok" in proc.stdout, proc.stdout


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_exchange_bench_reports_every_rank(compiled):
    proc = _mpiexec(2, "--rows", "3000", "--reps", "2", "--zero", "0.5",
                    script=REPO_ROOT / "scripts" / "exchange_bench.py")
    assert proc.returncode == 0, proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("rank ")]
    assert [ln.split()[1] for ln in lines] == ["0/2", "1/2"], proc.stdout
    for ln in lines:  # half the records are zero: the sparse message is smaller than the dense rows
        sparse_mb, dense_mb = (float(x) for x in re.findall(r"\(([\d.]+) MB\)", ln))
        assert sparse_mb < 0.7 * dense_mb, ln


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_mpi_error_on_one_rank_aborts_all(n, compiled):
    proc = _mpiexec(n, "--fail", timeout=60)  # a hang here (no abort) would hit the timeout
    assert proc.returncode != 0, proc.stdout
    assert f"rank {n - 1}: RuntimeError: deliberate failure on rank {n - 1}" in proc.stdout, proc.stdout
    assert "unreachable" not in proc.stdout


def test_cli_transports_are_the_comm_layers():
    from cli.args import TRANSPORTS as CLI_TRANSPORTS
    from comm.alltoallv import TRANSPORTS
    assert sorted(CLI_TRANSPORTS) == sorted(["auto", *TRANSPORTS])
