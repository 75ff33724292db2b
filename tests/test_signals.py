"""Stopping and resuming as a scheduler does it: SIGTERM and SIGHUP (and Ctrl-C) write a snapshot and
exit 128 + signal, in one process and under mpiexec; a resumed run's log reads as one run; a bad
--iters for the snapshot is named.  (The in-process signal tests are in test_trainer.py.)"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO_ROOT, mpiexec_path
from engine.pipelines.single_gpu import SingleGPUTrainer
from engine.tools.snapshot import read_snapshot
from engine.recipe.trainer import SNAPSHOT
from test_trainer import dataset, run_cli, small_config, write_blender_capture  # noqa: F401 (a fixture)

ENV = dict(os.environ, NUMBASPLAT_BACKEND="cpu", NUMBA_NUM_THREADS="1")


def logged_steps(out):
    return [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]


def test_resumed_log_reads_as_one_run(dataset, tmp_path, monkeypatch):
    """A crash after the last snapshot leaves records of later steps, and maybe half a line: resuming
    drops them, so that the log equals an uninterrupted run's (the resume being exact)."""
    cfg = dict(iterations=16, log_every=4, snapshot_every=8)
    SingleGPUTrainer(dataset, tmp_path / "whole", small_config(**cfg), backend="cpu").train(progress=False)
    crashing = SingleGPUTrainer(dataset, tmp_path / "b", small_config(**cfg), backend="cpu")
    real = crashing.train_step

    def step():
        if crashing.step == 14:
            raise RuntimeError("killed")
        return real()
    monkeypatch.setattr(crashing, "train_step", step)
    with pytest.raises(RuntimeError):
        crashing.train(progress=False)
    assert logged_steps(tmp_path / "b") == [4, 8, 12]
    with open(tmp_path / "b" / "log.jsonl", "a") as f:
        f.write('{"step": 14, "lo')  # the write a kill cut short
    resumed = SingleGPUTrainer(dataset, tmp_path / "b", small_config(**cfg), backend="cpu")
    resumed.load_snapshot(tmp_path / "b" / SNAPSHOT)
    assert resumed.step == 8
    resumed.train(progress=False)
    whole, again = ((tmp_path / d / "log.jsonl").read_text().splitlines() for d in ("whole", "b"))
    assert logged_steps(tmp_path / "b") == [4, 8, 12, 16] and len(whole) == len(again)
    for a, b in zip(whole, again):
        a, b = json.loads(a), json.loads(b)
        assert (a["step"], a["loss"], a["gaussians"]) == (b["step"], b["loss"], b["gaussians"])
    # a new run in the same folder starts a new log
    SingleGPUTrainer(dataset, tmp_path / "b", small_config(**{**cfg, "iterations": 4}), backend="cpu").train(
        progress=False)
    assert logged_steps(tmp_path / "b") == [4]


def test_stale_temporary_files_are_removed_at_the_start(dataset, tmp_path, capsys):
    stale = [SNAPSHOT + ".tmp-4242-0123abcd", "log.jsonl.tmp-7-ffffffff"]
    kept = ["snapshot.h5.tmp-notours", "notes.tmp-1-2", "scene.ply"]
    for name in stale + kept:
        (tmp_path / name).write_text("x")
    SingleGPUTrainer(dataset, tmp_path, small_config(iterations=2), backend="cpu").train(progress=False)
    assert all(not (tmp_path / n).exists() for n in stale) and all((tmp_path / n).exists() for n in kept)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("removed ")]
    assert len(lines) == 1 and "removed 2 temporary file(s)" in lines[0] and stale[0] in lines[0], lines


@pytest.fixture(scope="module")
def capture(dataset, tmp_path_factory):
    folder = tmp_path_factory.mktemp("signals") / "capture"
    write_blender_capture(folder, dataset)
    return folder


def train_args(capture, out, *more):
    return ["train", "--data", str(capture), "--white-background", "--out", str(out), "--quiet", "--sh-degree", "1",
            "--init-points", "300", *more]


def stop_when_training(launch, out, send, timeout=300):
    """Start ``launch`` (a command line); once it has written a snapshot (it is in the training loop),
    ``send(process)`` delivers the signal; -> (return code, output)."""
    p = subprocess.Popen(launch, cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + timeout
        while not (out / SNAPSHOT).exists():
            if p.poll() is not None:
                pytest.fail(f"the run ended ({p.returncode}) before its first snapshot:\n{p.communicate()[0]}")
            assert time.time() < deadline, f"no snapshot after {timeout} s"
            time.sleep(0.2)
        send(p)
        text, _ = p.communicate(timeout=timeout)
        return p.returncode, text
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def check_snapshot_resumes(capture, out, text):
    """The snapshot of a stopped run is whole and resumes; the resumed log has no step twice."""
    _, attrs = read_snapshot(out / SNAPSHOT)
    step = attrs["step"]
    assert step >= 2 and f"stopped at step {step}" in text, text
    r = run_cli(*train_args(capture, out, "--resume", "--iters", str(step + 2)))
    assert r.returncode == 0 and f"resumed from {out / SNAPSHOT} at step {step}" in r.stdout, r.stdout + r.stderr
    steps = logged_steps(out)
    assert steps == sorted(set(steps)) and steps[-1] == step + 2, steps
    return step


@pytest.mark.timeout(900)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_scheduler_signals_stop_a_run_with_a_snapshot_that_resumes(capture, tmp_path, signum):
    out = tmp_path / "out"
    code, text = stop_when_training([sys.executable, "run.py", *train_args(capture, out, "--iters", "100000",
                                                                           "--snapshot-every", "2")],
                                    out, lambda p: p.send_signal(signum))
    assert code == 128 + signum and f"{signal.Signals(signum).name}: stopped" in text and "--resume" in text, text
    if signum == signal.SIGTERM:
        step = check_snapshot_resumes(capture, out, text)
        r = run_cli(*train_args(capture, out, "--resume", "--iters", "1"))
        assert r.returncode != 0 and f"--iters 1 is below step {step + 2}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
    else:
        assert read_snapshot(out / SNAPSHOT)[1]["step"] >= 2


def mpi_ranks(launcher_pid):
    """{rank: pid} of the processes that an mpiexec started (hydra: mpiexec -> proxy -> ranks)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" ", 1)
            children.setdefault(int(rest.rsplit(")", 1)[1].split()[1]), []).append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    ranks, todo = {}, [launcher_pid]
    while todo:
        pid = todo.pop()
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            env = {}
        if pid != launcher_pid and "PMI_RANK" in env:
            ranks[int(env["PMI_RANK"])] = pid
        else:
            todo += children.get(pid, [])
    return ranks


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_signals_stop_every_rank_with_one_snapshot(capture, tmp_path):
    """mpich's mpiexec forwards SIGTERM (and SIGINT) to every rank; a scheduler signals every rank
    itself, or maybe only some: whichever ranks get it, all stop after the same step, write one
    snapshot together and exit 128 + signal."""
    def to_rank_1(p):
        ranks = mpi_ranks(p.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGHUP)
    for name, signum, send in (("term", signal.SIGTERM, lambda p: p.send_signal(signal.SIGTERM)),
                               ("hup-rank-1", signal.SIGHUP, to_rank_1)):
        out = tmp_path / name
        cmd = [mpiexec_path(), "-n", "2", sys.executable, "run.py",
               *train_args(capture, out, "--iters", "100000", "--snapshot-every", "2")]
        code, text = stop_when_training(cmd, out, send)
        assert code == 128 + signum and f"{signal.Signals(signum).name}: stopped" in text, text
        assert "Traceback" not in text and "rank 1:" not in text, text
        arrays, attrs = read_snapshot(out / SNAPSHOT)
        assert attrs["step"] % 2 == 0 and np.isfinite(arrays["params/means"]).all()
    check_snapshot_resumes(capture, out, text)


@pytest.mark.mpi
@pytest.mark.timeout(900)
@pytest.mark.parametrize("exchange", ["gaussian", "pixel"])
def test_a_killed_rank_ends_every_rank_and_keeps_the_last_snapshot(capture, tmp_path, exchange):
    """A rank that dies without a word (SIGKILL: the OOM killer, a lost node) ends the whole job with an
    error, in either exchange, instead of leaving the others waiting in a collective; the snapshot
    written before it is whole and resumes."""
    out = tmp_path / exchange
    survivors = {}

    def kill_rank_1(p):
        ranks = mpi_ranks(p.pid)
        assert sorted(ranks) == [0, 1], ranks
        survivors.update(ranks)
        os.kill(ranks[1], signal.SIGKILL)
    cmd = [mpiexec_path(), "-n", "2", sys.executable, "run.py",
           *train_args(capture, out, "--iters", "100000", "--snapshot-every", "2", "--exchange", exchange)]
    code, text = stop_when_training(cmd, out, kill_rank_1, timeout=300)
    assert code != 0 and "Traceback" not in text, text
    time.sleep(1)
    alive = [pid for pid in survivors.values() if Path(f"/proc/{pid}").exists()
             and Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"]
    assert not alive, f"ranks {alive} outlived mpiexec:\n{text}"
    step = read_snapshot(out / SNAPSHOT)[1]["step"]
    assert step >= 2 and step % 2 == 0
    r = run_cli(*train_args(capture, out, "--resume", "--iters", str(step + 2), "--exchange", exchange))
    assert r.returncode == 0 and f"resumed from {out / SNAPSHOT} at step {step}" in r.stdout, r.stdout + r.stderr
