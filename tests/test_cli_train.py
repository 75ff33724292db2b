"""cli/train.py: what a run on a user's capture says and writes: the loaded data, the hold-out
options, OUT/cfg.json (a config file that repeats the run), the slow-CPU hint, a bad --out."""
import errno
import json
import os
import re
import shutil

import h5py
import numpy as np
import pytest

import cli
from cli import train
from data import Dataset, View
from data.scene import Provenance
from engine.recipe.trainer import TrainConfig
from numbasplat import Camera
from tests.dataset_files import CAMS, colmap_scene, write_png


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """Ten 32x24 views with a few SfM points."""
    root = tmp_path_factory.mktemp("capture")
    colmap_scene(root, ".bin", n_images=10, cams=[CAMS[0]])
    return root


def run(capsys, *argv):
    assert cli.main(["train", "--quiet", "--init-points", "200", "--sh-degree", "1", *argv]) == 0
    return capsys.readouterr().out


def test_every_view_trains_unless_told_and_cfg_json_repeats_the_run(capture, tmp_path, capsys):
    out = tmp_path / "all"
    said = run(capsys, "--data", str(capture), "--out", str(out), "--iters", "2", "--lr-means", "1e-4")
    assert said.splitlines()[:2] == [f"colmap scene {capture}", "images: 10 train, no test views; 32x24"]
    assert "initial points: 5 from sparse/0/points3D.bin" in said
    assert "trained on all 10 views; no test split (use --eval); 2 steps" in said.splitlines()[-1]
    assert not (out / "metrics.json").exists()
    recorded = json.loads((out / "cfg.json").read_text())
    assert {f: recorded[f] for f in ("data", "test_every", "eval", "resolution", "max_width", "batch_size")} == {
        "data": str(capture.resolve()), "test_every": None, "eval": False, "resolution": None, "max_width": None,
        "batch_size": None}
    assert (recorded["iterations"], recorded["lr_means"], recorded["sh_degree"]) == (2, 1e-4, 1)
    assert recorded["lambda_s3im"] == 0.2   # as the trainer chose it for these (opaque) images
    assert set(TrainConfig.__dataclass_fields__) <= set(recorded) and "out" not in recorded

    # the recorded file is a config file: the same run elsewhere, with every 5th view held out
    again = tmp_path / "again"
    said = run(capsys, "--config", str(out / "cfg.json"), "--out", str(again), "--test-every", "5")
    assert "images: 8 train, 2 test (every 5th image); 32x24" in said
    assert "test PSNR" in said.splitlines()[-1] and (again / "metrics.json").is_file()
    assert not (again / "test").exists()   # renders are --eval's
    assert json.loads((again / "cfg.json").read_text()) == {**recorded, "test_every": 5}

    # --eval: Inria's split, every 8th view, and the test renders
    said = run(capsys, "--config", str(out / "cfg.json"), "--out", str(tmp_path / "eval"), "--eval")
    assert "images: 8 train, 2 test (every 8th image); 32x24" in said
    assert len(list((tmp_path / "eval" / "test" / "ours_2" / "renders").glob("*.png"))) == 2   # Inria's layout


def test_the_means_rate_doubles_from_random_points_alone(capture, tmp_path, capsys):
    """A capture without SfM points starts from random points, whose means learn at twice 3DGS's rate;
    with SfM points, or from a PLY's Gaussians (--init-ply), at 3DGS's (cfg.json records it)."""
    bare = tmp_path / "bare"
    shutil.copytree(capture, bare)
    (bare / "sparse" / "0" / "points3D.bin").unlink()
    rates = {}
    for name, data, more in [("points", capture, ()), ("random", bare, ()),
                             ("ply", bare, ("--init-ply", str(tmp_path / "points" / "point_cloud" / "iteration_2"
                                                              / "point_cloud.ply")))]:
        run(capsys, "--data", str(data), "--out", str(tmp_path / name), "--iters", "2", *more)
        rates[name] = json.loads((tmp_path / name / "cfg.json").read_text())["lr_means"]
    assert rates == {"points": 1.6e-4, "random": 3.2e-4, "ply": 1.6e-4}


def test_resolution_and_max_width_reach_the_loader(capture, tmp_path, capsys):
    said = run(capsys, "--data", str(capture), "--out", str(tmp_path), "--iters", "1", "--resolution", "2")
    assert "images: 10 train, no test views; 16x12 (downscaled from 32x24: resolution 1/2)" in said
    assert "images='images'" in (tmp_path / "cfg_args").read_text()   # for Inria's render.py: as trained
    assert "resolution=2" in (tmp_path / "cfg_args").read_text()
    said = run(capsys, "--data", str(capture), "--out", str(tmp_path), "--iters", "1", "--max-width", "8",
               "--overwrite")
    assert "images: 10 train, no test views; 8x6 (downscaled from 32x24: max width 8 px)" in said
    said = run(capsys, "--data", str(capture), "--out", str(tmp_path), "--iters", "1", "--resolution", "16",
               "--overwrite")
    assert "images: 10 train, no test views; 16x12 (downscaled from 32x24: resolution 16 px wide)" in said


def test_resolution_above_8_is_a_width_and_any_resolution_lifts_the_width_cap(tmp_path):
    """Inria's rule for -r: 1, 2, 4, 8 (up to 8) divide, a larger value is the width; -1 (or none)
    keeps the 1600 px cap, which any --resolution lifts; --max-width still caps."""
    from cli.args import load_data
    wide = {"id": 1, "model": "PINHOLE", "w": 2000, "h": 8, "params": [1000.0, 1000.0, 1000.0, 4.0]}
    colmap_scene(tmp_path, ".bin", n_images=2, cams=[wide])

    def width(*argv):
        a = train.train_parser().parse_args(["--data", str(tmp_path), *argv])
        return load_data(a, (1.0, 1.0, 1.0)).train[0].width
    assert width() == width("--resolution", "-1") == 1600
    assert (width("--resolution", "1"), width("-r", "2"), width("--resolution", "500")) == (2000, 1000, 500)
    assert width("--resolution", "2", "--max-width", "800") == 800


def view_of(width, height, file_size=None):
    cam = Camera(np.eye(4), 1.0, 1.0, width / 2, height / 2, width, height)
    provenance = Provenance(file_size=file_size, scaled_size=(width, height)) if file_size else None
    return View("v.png", None, cam, provenance=provenance)


def test_slow_cpu_hint():
    hd = Dataset(train=[view_of(32, 24), view_of(1600, 900, file_size=(1920, 1080))], test=[])
    assert train.slow_cpu_hint(hd, "cpu") == "CPU backend: about 43 s a step at 1600x900; use --resolution 4 or a GPU"
    assert train.slow_cpu_hint(hd, "cuda") is None
    assert train.slow_cpu_hint(Dataset(train=[view_of(480, 270, file_size=(1920, 1080))], test=[]), "cpu") is None
    big = Dataset(train=[view_of(1000, 1000)], test=[])  # no image file: the factor is of its size
    assert train.slow_cpu_hint(big, "cpu").endswith("at 1000x1000; use --resolution 2 or a GPU")


def long_run_lines(dataset, seconds_per_step, iterations, steps=20, start=0):
    """What ``LongRunHint`` says over ``steps`` steps from ``start`` at ``seconds_per_step`` (a fake clock)."""
    from types import SimpleNamespace
    lines, trainer = [], SimpleNamespace(step=start, cfg=SimpleNamespace(iterations=iterations))
    hint = train.LongRunHint(dataset, say=lines.append, clock=lambda: trainer.step * seconds_per_step)
    for step in range(start + 1, start + steps + 1):
        trainer.step = step
        assert hint(trainer, None) == 0.0
    return lines


def test_long_cpu_run_is_told_how_to_finish_within_an_hour():
    """lego (400x400 images) on 2 CPU cores: about 6 s a step, measured over steps 5-15 (after the
    kernels compile), is 50 hours for 30k steps.  One line (once) names the --iters that fit an hour,
    and --resolution: 4 is the most that leaves 100 px, too slow alone, so with the --iters that fit."""
    lego = Dataset(train=[view_of(400, 400, file_size=(400, 400))], test=[])
    assert long_run_lines(lego, 6.0, 30_000) == [
        "CPU backend: 6 s a step, about 50.0 h for the 29,985 steps left; to finish within an hour: "
        "--iters 600, or --resolution 4 --iters 9600 (about 0.38 s a step), or a GPU"]
    # larger images: the least factor that fits the hour alone
    large = Dataset(train=[view_of(800, 800)], test=[])
    assert long_run_lines(large, 6.0, 30_000)[0].endswith(
        "--iters 600, or --resolution 8 (about 0.094 s a step), or a GPU")
    # the factor is of the image file: at --resolution 2 already, 3 s a step asks for 3 (4/9 the pixels)
    half = Dataset(train=[view_of(400, 400, file_size=(800, 800))], test=[])
    assert long_run_lines(half, 3.0, 3000, start=1000) == [
        "CPU backend: 3 s a step, about 1.7 h for the 1,985 steps left; to finish within an hour: "
        "--iters 2200, or --resolution 3 (about 1.3 s a step), or a GPU"]
    # too small to shrink below 100 px wide: the steps and a GPU only
    small = Dataset(train=[view_of(120, 90)], test=[])
    assert long_run_lines(small, 2.0, 30_000)[0].endswith("to finish within an hour: --iters 1800, or a GPU")


def test_a_run_within_the_hour_is_not_told():
    lego = Dataset(train=[view_of(400, 400)], test=[])
    assert long_run_lines(lego, 0.1, 30_000) == []        # 50 min
    assert long_run_lines(lego, 6.0, 30_000, steps=14) == []  # not measured yet


def test_train_on_the_cpu_estimates_its_time(capture, tmp_path, capsys, monkeypatch):
    """``train`` on the CPU backend measures its pace and says the line (here any run is long)."""
    monkeypatch.setattr(train, "LONG_RUN_SECONDS", 0)
    said = run(capsys, "--data", str(capture), "--out", str(tmp_path), "--iters", "20")
    hint = [line for line in said.splitlines() if line.startswith("CPU backend: ")]
    assert len(hint) == 1 and "for the 5 steps left; to finish within an hour: " in hint[0], said


def test_out_naming_a_file_is_one_error_naming_out(capture, tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("")
    for out, what in ((f, "it is a file"), (f / "sub", f"{f} is a file")):
        assert cli.main(["train", "--data", str(capture), "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert err == f"error: --out {out}: {what}, not a folder; give an output folder\n", err


def test_exposure_hint_names_appearance_where_exposure_varies():
    """``run.py train``'s note: where the images' gains vary (engine.recipe.appearance.exposure_spread over
    its threshold) it suggests --appearance; a steady capture gets none."""
    from cli.train import exposure_hint
    from test_appearance import _gained_capture
    z = np.random.default_rng(1).normal(size=(40, 3))
    assert "--appearance" in exposure_hint(_gained_capture(np.clip(np.exp(0.2 * z), 0.1, 1.9)))
    assert exposure_hint(_gained_capture([(1, 1, 1)] * 6)) is None


def test_render_ahead_outside_the_pixel_exchange_is_one_error(capture, tmp_path, capsys):
    """``--render-ahead`` renders the pixel exchange's next steps: with the Gaussian-level exchange it
    is one error naming it, not a silent no-op."""
    assert cli.main(["train", "--data", str(capture), "--out", str(tmp_path), "--render-ahead", "1"]) == 1
    assert capsys.readouterr().err == ("error: --render-ahead is for --exchange pixel (or auto): the Gaussian-level "
                                       "exchange renders no step ahead\n")


class TwoRanksWhoseAbortReturns:
    """COMM_WORLD of rank 0 of two, whose MPI_Abort returns, as MPICH's may before the process dies."""
    aborted = None

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def Abort(self, code):
        self.aborted = code


def test_a_rank_failing_under_mpi_ends_with_its_error_line_alone(monkeypatch, capsys):
    """A rank's bad input under mpiexec: its ``error:`` line, MPI_Abort, and the process ends with the
    code there, even where MPI_Abort returns (issue 58: an UnboundLocalError traceback followed)."""
    world = TwoRanksWhoseAbortReturns()
    monkeypatch.setattr(train, "mpi_comm", lambda batched=False: world)

    def bad_input(a, settings):
        raise ValueError("bad input")
    monkeypatch.setattr(train, "run_training", bad_input)
    monkeypatch.setattr("comm.alltoallv.ABORT_GRACE_S", 0)
    monkeypatch.setattr(os, "_exit", lambda code: exit(code))   # (end the call, not pytest)
    with pytest.raises(SystemExit) as ended:
        cli.main(["train", "--data", "capture", "--out", "out"])
    assert (ended.value.code, world.aborted) == (1, 1)
    assert capsys.readouterr().err == "rank 0: error: bad input\n"


def fill_the_disk_mid_write(monkeypatch):
    """HDF5 on a disk that fills up: the third array's write fails with ENOSPC (the temporary file
    holds two), and closing the file then fails again, as h5py's does (a RuntimeError)."""
    create, close = h5py.Group.create_dataset, h5py.File.close
    written = []

    def create_until_full(group, name, *args, **kwargs):
        if len(written) == 2:
            assert os.path.getsize(group.file.filename) > 0 and ".tmp-" in group.file.filename
            raise OSError(errno.ENOSPC, f"Can't synchronously write data (file write failed: filename = "
                                        f"'{group.file.filename}', errno = 28, error message = 'No space left "
                                        "on device', buf = 0x55c0669, total write size = 96)")
        written.append(name)
        return create(group, name, *args, **kwargs)

    def close_failing_again(f):
        close(f)
        if len(written) == 2:
            raise RuntimeError("Can't decrement id ref count (unable to extend file properly, errno = 28, "
                               "error message = 'No space left on device')")
    monkeypatch.setattr(h5py.Group, "create_dataset", create_until_full)
    monkeypatch.setattr(h5py.File, "close", close_failing_again)


def test_a_full_disk_at_a_snapshot_is_one_error_line_and_no_temporary_file(capture, tmp_path, capsys, monkeypatch):
    """The disk fills up writing the first snapshot, then a later one, then is full before one: each
    time one ``error:`` line naming OUT/snapshot.h5 and saying whether an earlier snapshot is kept
    (issue 58: a segfault or h5py's tracebacks, and the temporary file left behind)."""
    out = tmp_path / "out"
    snapshot = out / "snapshot.h5"
    command = ["train", "--quiet", "--init-points", "200", "--sh-degree", "1", "--data", str(capture),
               "--out", str(out)]

    def fails_saying(*argv):
        assert cli.main([*command, *argv]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and not [f for f in os.listdir(out) if ".tmp-" in f], err
        return err

    fill_the_disk_mid_write(monkeypatch)
    assert fails_saying("--iters", "2") == (f"error: no space left on device writing {snapshot} (the partial file "
                                            "is removed; no earlier snapshot.h5 to keep)\n")
    assert not snapshot.exists()
    monkeypatch.undo()

    run(capsys, "--data", str(capture), "--out", str(out), "--iters", "2", "--overwrite")  # (the failed run's log)
    kept = snapshot.read_bytes()
    fill_the_disk_mid_write(monkeypatch)
    assert fails_saying("--iters", "4", "--resume") == (
        f"error: no space left on device writing {snapshot} (the partial file is removed; the earlier "
        "snapshot.h5 is kept)\n")
    monkeypatch.undo()

    monkeypatch.setattr(shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    assert re.fullmatch(rf"error: no space left on device writing {re.escape(str(snapshot))} \(it needs 0\.\d MB, "
                        r"0\.0 MB free; the earlier snapshot\.h5 is kept\)\n", fails_saying("--iters", "4", "--resume"))
    assert snapshot.read_bytes() == kept


def test_resume_knows_the_data_by_its_contents_not_its_path(capture, tmp_path, capsys):
    """``--resume`` takes the capture it was trained on under another spelling of its path (a link,
    ``..``, a relative path) or as a copy, and refuses a copy with one image changed, naming it
    (issue 58: "trained on different data" for the same data)."""
    out = tmp_path / "out"
    snapshot = out / "snapshot.h5"
    run(capsys, "--data", str(capture), "--out", str(out), "--iters", "2")
    (tmp_path / "link").symlink_to(capture)
    copy = tmp_path / "copy"
    shutil.copytree(capture, copy)
    spellings = (tmp_path / "link", f"{capture}/../{capture.name}", os.path.relpath(capture), copy)
    for step, data in enumerate(spellings, start=2):
        said = run(capsys, "--data", str(data), "--out", str(out), "--iters", str(step + 1), "--resume")
        assert f"resumed from {snapshot} at step {step}" in said

    changed = sorted((copy / "images").iterdir())[3]
    write_png(changed, np.zeros((24, 32, 3)))
    assert cli.main(["train", "--quiet", "--data", str(copy), "--out", str(out), "--iters", "9", "--resume"]) == 1
    assert capsys.readouterr().err == (f"error: snapshot {snapshot} was trained on different data than {copy}: "
                                       f"image {changed.name} differs\n")


def test_resume_says_where_its_model_comes_from_not_the_initial_points(capture, tmp_path, capsys):
    """A resumed run starts from its snapshot's model: the summary leaves out the initial points
    (issue 58: "initial points: random ..." on --resume)."""
    data = tmp_path / "data"
    shutil.copytree(capture, data)
    (data / "sparse" / "0" / "points3D.bin").unlink()
    out = tmp_path / "out"
    said = run(capsys, "--data", str(data), "--out", str(out), "--iters", "1")
    assert "initial points: random, 200 in a box around the cameras" in said
    said = run(capsys, "--data", str(data), "--out", str(out), "--iters", "2", "--resume")
    assert "initial points" not in said and f"resumed from {out / 'snapshot.h5'} at step 1" in said


def test_a_used_out_is_refused_without_resume_or_overwrite(capture, tmp_path, capsys):
    """Training anew into a folder holding a run would leave its PLYs, metrics and renders beside the
    new model: refused, one line; --overwrite removes them first; --resume goes on."""
    out = tmp_path / "out"
    run(capsys, "--data", str(capture), "--out", str(out), "--iters", "2")
    stale = [out / "point_cloud" / "iteration_7000" / "point_cloud.ply", out / "test" / "ours_7000" / "x.png",
             out / "metrics.json"]
    for f in stale:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("")
    assert cli.main(["train", "--data", str(capture), "--out", str(out), "--iters", "2"]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: --out {out} holds an earlier run (cameras.json, cfg.json, cfg_args, ...): give --resume "
                   "to continue it, --overwrite to replace it, or another --out\n"), err
    assert all(f.exists() for f in stale) and not (out / ".lock").exists()

    said = run(capsys, "--data", str(capture), "--out", str(out), "--iters", "3", "--overwrite")
    assert said.startswith(f"--overwrite: removed the earlier run's outputs from {out}")
    assert not any(f.exists() for f in stale) and (out / "point_cloud" / "iteration_3").is_dir()
    assert "resumed from" in run(capsys, "--data", str(capture), "--out", str(out), "--iters", "4", "--resume")
    assert cli.main(["train", "--data", str(capture), "--out", str(out), "--resume", "--overwrite"]) == 1
    assert "give one" in capsys.readouterr().err


def test_one_run_at_a_time_into_an_out(capture, tmp_path, capsys):
    """OUT/.lock (PID and host) refuses a second run while the first lives; a killed run's lock is
    taken over; the lock goes at the end, also when the run fails."""
    import socket
    import subprocess
    import sys
    out, lock = tmp_path / "out", tmp_path / "out" / ".lock"
    out.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"{alive.pid} {socket.gethostname()}\n")
        assert cli.main(["train", "--data", str(capture), "--out", str(out), "--iters", "1"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: --out {out}: another run is writing there (PID {alive.pid} on this host, "
                              f"its lock {lock})") and err.count("\n") == 1, err
    finally:
        alive.kill()
        alive.wait()
    assert "trained on all 10 views" in run(capsys, "--data", str(capture), "--out", str(out), "--iters", "1")
    assert not lock.exists()   # taken over from the killed run, released at the end

    lock.write_text("4242 another-host\n")   # a run elsewhere on a shared file system
    assert cli.main(["train", "--data", str(capture), "--out", str(tmp_path / "out"), "--resume"]) == 1
    assert "(PID 4242 on another-host" in capsys.readouterr().err and lock.exists()
    lock.unlink()
    assert cli.main(["train", "--data", str(capture), "--out", str(out), "--resume", "--render-ahead", "1"]) == 1
    assert "--render-ahead is for --exchange pixel" in capsys.readouterr().err and not lock.exists()


def test_eval_of_a_model_trained_on_every_view_says_its_views_were_trained_on(capture, tmp_path, capsys):
    """``eval`` of a run without --eval would score views it trained on as "test" (issue 58: fern's
    "test PSNR 21.18 dB over 3 views", all trained on): refused without --test-every, and with it the
    scores are said to be of training views; a run with --eval is scored as before."""
    out = tmp_path / "all"
    run(capsys, "--data", str(capture), "--out", str(out), "--iters", "2")
    with pytest.raises(SystemExit) as refused:
        cli.main(["eval", "--model", str(out)])
    assert str(refused.value).startswith(f"error: {out} trained on every view (no --eval or --test-every): its test "
                                         "split would be 2 views (every 8th image) it trained on"), refused.value
    assert cli.main(["eval", "--model", str(out), "--test-every", "8"]) == 0
    assert "note: the model trained on these 2 views (every 8th image)" in capsys.readouterr().out
    held = tmp_path / "held"
    run(capsys, "--data", str(capture), "--out", str(held), "--iters", "2", "--eval")
    assert cli.main(["eval", "--model", str(held)]) == 0
    assert "note: the model trained on" not in capsys.readouterr().out
