"""Distributed training over MPI (CPU backend): P ranks end with 1 rank's parameters."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT, mpiexec_path

SCRIPT = REPO_ROOT / "tests" / "mpi_train_check.py"


def launch(n, out, grad_comm="sparse"):
    env = dict(os.environ, NUMBASPLAT_BACKEND="cpu", NUMBA_NUM_THREADS="1")
    r = subprocess.run([mpiexec_path(), "-n", str(n), sys.executable, str(SCRIPT), str(out), grad_comm],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(np.load(out / "final.npz")), r.stdout


@pytest.mark.mpi
@pytest.mark.timeout(1200)
def test_two_and_four_ranks_match_one(tmp_path):
    ref, log = launch(1, tmp_path / "p1")
    assert len(ref["means"]) != 300, "densification did not run: " + log
    for n, comm in ((2, "sparse"), (4, "sparse"), (2, "dense")):
        got, log = launch(n, tmp_path / f"p{n}{comm}", comm)
        for g, a in ref.items():
            assert got[g].shape == a.shape, (n, comm, g, log)
            err = np.linalg.norm(got[g] - a) / np.linalg.norm(a)
            assert err <= 1e-5, (n, comm, g, err)
