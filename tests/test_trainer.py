"""The recipe (through the single-GPU pipeline): resume equals an uninterrupted run, the schedules, stop
signals, the progress bar, divergence, and the CLI."""
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO_ROOT
from engine.tools.demo import make_dataset
from engine.pipelines.single_gpu import SingleGPUTrainer
from engine.recipe.strategy import Context
from engine.recipe.trainer import SNAPSHOT, Interrupted, Progress, TrainConfig
from numbasplat.optim import GROUPS
from test_strategy import model_of


def small_config(**kw):
    cfg = TrainConfig(iterations=40, sh_degree=1, sh_increase_every=10, n_random_init=400, snapshot_every=0,
                      log_every=10, background=(1.0, 1.0, 1.0))
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def fast_refine(trainer):
    s = trainer.strategy
    s.refine_start, s.refine_every, s.reset_every = 5, 10, 25
    return trainer


@pytest.fixture(scope="module")
def dataset():
    return make_dataset(size=32, n_views=12, backend="cpu")


def test_resume_matches_uninterrupted_run(dataset, tmp_path):
    whole = fast_refine(SingleGPUTrainer(dataset, tmp_path / "a", small_config(), backend="cpu")).train(progress=False)
    first = fast_refine(SingleGPUTrainer(dataset, tmp_path / "b", small_config(), backend="cpu"))
    first.train(progress=False, until=23)
    resumed = fast_refine(SingleGPUTrainer(dataset, tmp_path / "b", small_config(), backend="cpu"))
    resumed.load_snapshot(tmp_path / "b" / SNAPSHOT)
    assert resumed.step == 23
    resumed.train(progress=False)
    a, b = whole.model.host_arrays(), resumed.model.host_arrays()
    assert len(whole.model) != 400, "densification did not run"
    for g in GROUPS:
        np.testing.assert_array_equal(a[g], b[g], err_msg=g)
    np.testing.assert_array_equal(whole.model.host_arrays("v")["means"], resumed.model.host_arrays("v")["means"])


@pytest.mark.parametrize("iterations, steps, at, rate", [
    (7000, None, 7000, 1.6e-6),    # over the run: its final rate at its end
    (2000, None, 2000, 1.6e-4 * 0.01 ** (2 / 7)),  # shorter than 7k: the start of a 7k decay
    (7000, 14000, 7000, 1.6e-5),   # an explicit length, twice the run: 1.6e-4 * 0.01 ** (7 / 14) at its end
    (30000, None, 15000, 1.6e-5),  # 30k: Inria's decay, half-way at 15k
    (60000, None, 45000, 1.6e-6),  # longer: the decay still ends at 30k, then its final rate
])
def test_means_learning_rate_decay(dataset, tmp_path, iterations, steps, at, rate):
    """The means' rate decays to 1/100 over ``lr_means_steps``, by default the run, at least 7k and at
    most 30k (``means_decay_steps``), and the trainer's config records the length it used."""
    t = SingleGPUTrainer(dataset, tmp_path, small_config(iterations=iterations, lr_means_steps=steps, lr_means=1.6e-4))
    t.init_model()
    t.step = at
    assert t.cfg.lr_means_steps == (steps or min(max(iterations, 7000), 30_000))
    assert t.learning_rates()[0]["means"] == pytest.approx(rate * dataset.scene_scale)


@pytest.mark.parametrize("points, given, rate", [
    (0, None, 3.2e-4),     # random initial points (the demo, Blender scenes): twice 3DGS's
    (50, None, 1.6e-4),    # SfM points: 3DGS's
    (0, 1e-4, 1e-4),       # given: kept
])
def test_means_learning_rate_by_start(dataset, tmp_path, points, given, rate):
    """The means' default rate is 3DGS's from SfM points and twice it from random points
    (``means_learning_rate``); a rate given is kept, and ``run.py train --init-ply`` starts at 3DGS's."""
    import dataclasses
    rng = np.random.default_rng(0)
    data = dataclasses.replace(dataset, points=rng.normal(size=(points, 3)).astype(np.float32),
                               colors=rng.uniform(size=(points, 3)).astype(np.float32))
    t = SingleGPUTrainer(data, tmp_path, small_config(lr_means=given), backend="cpu")
    assert t.cfg.lr_means == pytest.approx(rate)
    t.init_model()
    assert t.learning_rates()[0]["means"] == pytest.approx(rate * data.scene_scale)


def test_eval_every_scores_test_and_training_views(dataset, tmp_path):
    """``--eval-every N`` logs the test views' PSNR and SSIM and 5 training views' PSNR at every multiple
    of N (as Inria's test_iterations), equal to ``evaluate`` of the model at that step, but not at a
    step that reset the opacities; the curve reaches ``run.py plot``'s scalars."""
    from engine.tools.outputs import log_scalars
    t = fast_refine(SingleGPUTrainer(dataset, tmp_path, small_config(iterations=30, eval_every=5, log_every=100),
                                     backend="cpu"))
    t.train(progress=False, until=10)
    recs = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "test_psnr" in r] == [10]  # (step 5 reset the opacities: white background)
    assert recs[-1]["test_psnr"] == pytest.approx(t.evaluate(lpips=False)["psnr"])
    train_views = dataset.train[::-(-len(dataset.train) // 5)]
    assert 1 < len(train_views) <= 5
    assert recs[-1]["train_psnr"] == pytest.approx(t.evaluate(train_views, lpips=False)["psnr"])
    assert 0 < recs[-1]["test_ssim"] <= 1
    assert {"psnr/test", "psnr/train_views"} <= set(log_scalars(recs[-1]))
    t.train(progress=False)
    recs = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    scored = [r["step"] for r in recs if "test_psnr" in r]
    resets = [r["step"] for r in recs if r.get("opacity_reset")]
    assert resets == [5, 25] and scored == [10, 15, 20, 30]


def test_save_at_and_eval_at_write_models_and_scores_mid_run(dataset, tmp_path):
    """``--save-at`` writes the model at its steps in Inria's layout (the end's too), ``--eval-at`` scores
    the views at its steps (Inria's save_iterations and test_iterations; both 7000,30000 by default)."""
    assert TrainConfig().save_at == TrainConfig().eval_at == (7000, 30000)
    t = SingleGPUTrainer(dataset, tmp_path, small_config(iterations=30, save_at=(10, 20), eval_at=(15,), log_every=100),
                         backend="cpu")
    t.train(progress=False)
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "point_cloud").iterdir())
    assert saved == [10, 20, 30]
    recs = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "test_psnr" in r] == [15]


def test_save_at_and_eval_at_flags():
    """The steps as Inria writes them (commas), as a config file's list, or 0 for none; bad ones named."""
    from cli.train import train_parser
    p = train_parser()
    assert p.parse_args(["--save-at", "30000,7000"]).save_at == (7000, 30000)
    assert p.parse_args(["--eval-at", "7000", "12000,30000"]).eval_at == (7000, 12000, 30000)
    assert p.parse_args(["--save-at", "0"]).save_at == ()
    for bad in ("7k", "-5"):
        with pytest.raises(Exception, match="steps"):
            p.parse_args(["--save-at", bad])


def test_reference_schedule_details(dataset, tmp_path):
    """3DGS's choices that decide quality at 7k: white backgrounds reset opacities at the first
    refinement too, and nothing refines or resets at the last step (nothing would train what it changed)."""
    t = SingleGPUTrainer(dataset, tmp_path, small_config(iterations=7000))
    s = t.strategy
    assert s.reset_at_start and s.refine_stop == 7000
    assert not SingleGPUTrainer(dataset, tmp_path, small_config(background=(0.0, 0.0, 0.0))).strategy.reset_at_start
    model = model_of([3.0, 3.0], [0.01, 0.01])
    state = s.initialize_state()
    s._fresh(state, np, 2)
    assert s.after_optimizer(model, state, 500, Context(1.0, np.random.default_rng(0)))["opacity_reset"]
    model = model_of([3.0, 3.0], [0.01, 0.01])
    s = SingleGPUTrainer(dataset, tmp_path, small_config(iterations=3000)).strategy
    state = s.initialize_state()
    s._fresh(state, np, 2)
    assert "opacity_reset" not in s.after_optimizer(model, state, 3000, Context(1.0, np.random.default_rng(0)))


def test_blender_random_init_fills_the_object_box(tmp_path):
    from data.nerf import BLENDER_BOX
    ds = make_dataset(size=32, n_views=6, backend="cpu")
    ds.points, ds.init_box = np.zeros((0, 3), np.float32), BLENDER_BOX
    t = SingleGPUTrainer(ds, tmp_path, small_config())
    t.init_model()
    means = t.model.host_arrays()["means"]
    assert means.min() >= -1.3 and means.max() <= 1.3 and means.std() > 0.5
    rgb = t.model.host_arrays()["sh"][:, 0] * 0.28209479177387814 + 0.5
    assert np.abs(rgb - 0.5).max() < 0.01  # grey, as 3DGS


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_stop_signals_write_a_snapshot_at_the_step_boundary(dataset, tmp_path, monkeypatch, request, signum):
    """Ctrl-C, and what schedulers send before a kill: the step under way ends, the snapshot is written,
    and ``Interrupted`` carries the exit code 128 + signal; the handlers are put back afterwards."""
    outer = signal.signal(signum, signal.SIG_DFL)  # (under nohup SIGHUP starts ignored, and a run leaves it so)
    request.addfinalizer(lambda: signal.signal(signum, outer))
    before = signal.getsignal(signum)
    t = SingleGPUTrainer(dataset, tmp_path, small_config(), backend="cpu")
    real = t.train_step

    def step():
        if t.step == 7:
            os.kill(os.getpid(), signum)  # arrives as step 8 starts
            os.kill(os.getpid(), signal.SIGTERM if signum == signal.SIGINT else signum)  # repeats change nothing
        return real()

    monkeypatch.setattr(t, "train_step", step)
    with pytest.raises(Interrupted) as e:
        t.train(progress=False)
    assert (e.value.signum, e.value.step, e.value.saved, e.value.exit_code) == (signum, 8, True, 128 + signum)
    assert signal.getsignal(signum) == before
    back = SingleGPUTrainer(dataset, tmp_path, small_config(), backend="cpu")
    back.load_snapshot(tmp_path / SNAPSHOT)
    assert back.step == 8


def test_ignored_signals_stay_ignored(dataset, tmp_path, monkeypatch):
    """``nohup`` starts a run with SIGHUP ignored, so that closing the terminal does not end it: it does not."""
    t = SingleGPUTrainer(dataset, tmp_path, small_config(iterations=4), backend="cpu")
    real = t.train_step

    def step():
        if t.step == 2:
            os.kill(os.getpid(), signal.SIGHUP)
        return real()

    monkeypatch.setattr(t, "train_step", step)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        t.train(progress=False)
        assert t.step == 4 and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_second_ctrl_c_stops_at_once_without_a_snapshot(dataset, tmp_path, monkeypatch):
    t = SingleGPUTrainer(dataset, tmp_path, small_config(), backend="cpu")
    real = t.train_step

    def step():
        if t.step == 7:
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 10
            while not t.signals.received and time.monotonic() < deadline:  # (two signals pending at once are one)
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)
        return real()

    monkeypatch.setattr(t, "train_step", step)
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a shell's background job ignores it)
    try:
        with pytest.raises(Interrupted) as e:
            t.train(progress=False)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert not e.value.saved and e.value.exit_code == 130 and t.step == 7
    assert not (tmp_path / SNAPSHOT).exists()


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env={"NUMBASPLAT_BACKEND": "cpu", "PATH": "/usr/bin:/bin"})


def test_cli_demo_writes_metrics(tmp_path):
    r = run_cli("demo", "--iters", "30", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["iterations"] == 30 and len(m["views"]) == 5 and np.isfinite(m["psnr"])
    assert "test PSNR" in r.stdout


def test_cli_reports_bad_input_by_name(tmp_path):
    r = run_cli("train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "missing" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("export", "--model", str(tmp_path), "--ply", str(tmp_path / "x.ply"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    for flag, value in (("--iters", "-5"), ("--s3im-repeats", "0"), ("--batch-size", "two"), ("--lambda-s3im", "1.5"),
                        ("--lambda-s3im", "x"), ("--grad-threshold", "0"), ("--grad-threshold", "inf")):
        r = run_cli("train", "--data", str(tmp_path), "--out", str(tmp_path / "o"), flag, value)
        assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_training_options_reach_the_config(monkeypatch):
    import cli
    from cli import train
    seen = {}
    monkeypatch.setattr(train, "cmd_train", lambda a: seen.update(cfg=train.config_from_args(a)))
    cli.main(["train", "--data", "x", "--out", "o", "--grad-threshold", "1.5e-4", "--lambda-s3im", "0.1", "--s3im-repeats", "3",
              "--batch-lr-exponent", "1"])
    cfg = seen["cfg"]
    assert (cfg.grad_threshold, cfg.lambda_s3im, cfg.s3im_repeats, cfg.batch_lr_exponent) == (1.5e-4, 0.1, 3, 1.0)


def test_divergence_names_what_went_non_finite(dataset, tmp_path):
    t = SingleGPUTrainer(dataset, tmp_path, small_config(), backend="cpu")
    t.init_model()
    t._check_finite(0.5)  # all finite: nothing happens
    g = t.model.gaussians
    g.means[3, 1] = np.nan
    g.means[7, 0] = np.inf
    g.opacities[2] = -np.inf
    with pytest.raises(FloatingPointError) as e:
        t._check_finite(0.25)
    msg = str(e.value)
    assert "means of 2, opacities of 1" in msg and f"of {len(g)} Gaussians" in msg and "loss 0.25" in msg, msg
    assert "scales" not in msg and "quats" not in msg, msg
    t.xp = None  # a model held where the trainer's arrays are not (a GPU run's host model after a chunked view):
    with pytest.raises(FloatingPointError, match="means of 2"):  # checked with the model's own array module
        t._check_finite(0.25)


def test_tile_loss_weight_follows_the_data_unless_given(dataset, tmp_path):
    """Without --lambda-s3im, cut-out objects (alpha) get 0.5 and other images 0.2 (BENCHMARKS.md, issue 5)."""
    from dataclasses import replace
    assert not dataset.masked
    cut = replace(dataset, train=[replace(v, masked=True) for v in dataset.train])
    assert [SingleGPUTrainer(d, tmp_path, small_config(loss="tile"), backend="cpu").cfg.lambda_s3im
            for d in (dataset, cut)] == [0.2, 0.5]
    given = SingleGPUTrainer(cut, tmp_path, small_config(loss="tile", lambda_s3im=0.3), backend="cpu")
    assert given.cfg.lambda_s3im == 0.3


def write_blender_capture(folder, dataset):
    """The demo views as a Blender/NeRF capture on disk (OpenGL camera-to-world)."""
    from PIL import Image
    for split, views in (("train", dataset.train), ("test", dataset.test)):
        frames = []
        (folder / split).mkdir(parents=True)
        for v in views:
            name = f"{split}/{v.name[:-4]}"
            Image.fromarray((v.image * 255 + 0.5).astype(np.uint8)).save(folder / f"{name}.png")
            c2w = np.linalg.inv(v.camera.viewmat)
            c2w[:3, 1:3] *= -1
            frames.append({"file_path": f"./{name}", "transform_matrix": c2w.tolist()})
        fov = 2 * np.arctan(0.5 * views[0].camera.width / views[0].camera.fx)
        (folder / f"transforms_{split}.json").write_text(json.dumps({"camera_angle_x": fov, "frames": frames}))


def test_cli_train_export_and_evaluate_a_ply(dataset, tmp_path):
    cap = tmp_path / "capture"
    write_blender_capture(cap, dataset)
    out = tmp_path / "out"
    r = run_cli("train", "--data", str(cap), "--white-background", "--out", str(out), "--iters", "40", "--quiet",
                "--sh-degree", "1", "--init-points", "500", "--eval")
    assert r.returncode == 0, r.stderr
    trained = json.loads((out / "metrics.json").read_text())
    assert len(list((out / "test" / "ours_40" / "renders").glob("*.png"))) == len(dataset.test)
    r = run_cli("export", "--model", str(out), "--ply", str(out / "scene.ply"))
    assert r.returncode == 0, r.stderr
    r = run_cli("eval", "--data", str(cap), "--white-background", "--model", str(out / "scene.ply"),
                "--out", str(tmp_path / "eval"))
    assert r.returncode == 0, r.stderr
    again = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert abs(again["psnr"] - trained["psnr"]) < 1e-3 and again["gaussians"] == trained["gaussians"]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_is_tqdm():
    """On a terminal the bar is tqdm's (a dependency: there is no other bar): it moves with every step
    and shows the last log step's loss, PSNR and Gaussian count."""
    from tqdm import tqdm
    term = Terminal()
    bar = Progress(100, start=10, stream=term, min_interval=0.0)
    assert isinstance(bar.bar, tqdm)
    for step in range(11, 60):
        bar.update(step)
    bar.show(0.1234, 21.5, 12345)
    bar.update(60)
    bar.close()
    last = term.getvalue().rstrip("\n").split("\r")[-1]
    assert "60/100" in last and "it/s" in last and "loss 0.1234 psnr 21.50 gaussians 12,345" in last, last
    assert term.getvalue().endswith("\n")


def test_progress_off_a_terminal_is_plain_lines_and_quiet_is_nothing():
    log = io.StringIO()   # a batch job's log file: no carriage returns, a line per log step at most every 10 s
    bar = Progress(100, stream=log)
    for step in range(1, 101):
        bar.update(step)
        if step % 10 == 0:
            bar.show(0.5, 20.0, 1000)
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and [line.split()[1] for line in lines] == ["10/100", "100/100"], lines
    quiet = Terminal()
    bar = Progress(100, enabled=False, stream=quiet)
    bar.update(5)
    bar.show(0.5, 20.0, 1000)
    bar.close()
    assert quiet.getvalue() == ""


def test_train_moves_the_bar_every_step(dataset, tmp_path, monkeypatch):
    import engine.recipe.trainer
    calls = []

    class Recorder(Progress):
        def update(self, step):
            calls.append(("update", step))

        def show(self, loss, psnr, gaussians, extra=""):
            calls.append(("show", gaussians))

    monkeypatch.setattr(engine.recipe.trainer, "Progress", Recorder)
    SingleGPUTrainer(dataset, tmp_path, small_config(iterations=12, log_every=5), backend="cpu").train(progress=False)
    assert [s for kind, s in calls if kind == "update"] == list(range(1, 13))
    assert sum(kind == "show" for kind, _ in calls) == 3   # steps 5, 10 and the last


def test_a_snapshot_that_knows_its_data_by_path_still_resumes_from_that_path(dataset, tmp_path):
    """Snapshots written before ``view_records`` hold a fingerprint of the data's path, names and sizes:
    they resume where those match, and elsewhere say why not in one message."""
    import dataclasses
    from engine.tools.snapshot import VIEWS_ARRAY, read_snapshot, write_snapshot
    from engine.recipe.trainer import path_fingerprint
    SingleGPUTrainer(dataset, tmp_path, small_config(iterations=3), backend="cpu").train(progress=False)
    arrays, attrs = read_snapshot(tmp_path / SNAPSHOT)
    del arrays[VIEWS_ARRAY]
    old = tmp_path / "old.h5"
    write_snapshot(old, arrays, {**attrs, "fingerprint": path_fingerprint(dataset)})
    resumed = SingleGPUTrainer(dataset, tmp_path / "b", small_config(), backend="cpu")
    assert resumed.load_snapshot(old)["step"] == 3
    moved = dataclasses.replace(dataset, source="/elsewhere")
    with pytest.raises(ValueError, match=f"snapshot {old} was written by an older NumbaSplat, which knows its "
                                         "data by path, image names and sizes, and those differ from /elsewhere's"):
        SingleGPUTrainer(moved, tmp_path / "c", small_config(), backend="cpu").load_snapshot(old)


def test_the_starting_gaussians_follow_the_strategy_unless_set():
    """MCMC starts from gsplat's mcmc preset (opacity 0.5, a tenth of the neighbour distance), the
    default strategy from 3DGS's (0.1, the distance); ``init_opacity``/``init_scale`` override both."""
    from types import SimpleNamespace

    from engine.recipe.model import knn_rms_distance
    from engine.recipe.trainer import TrainConfig, initial_arrays
    pts = np.random.default_rng(0).normal(size=(50, 3)) * [1.0, 2.0, 0.5]
    data = SimpleNamespace(points=pts, colors=np.full((50, 3), 0.5), init_box=None, train=[])
    dist = np.log(knn_rms_distance(pts))
    for kw, opacity, scale in ((dict(strategy="mcmc"), 0.5, 0.1), (dict(), 0.1, 1.0),
                               (dict(strategy="mcmc", init_opacity=0.2, init_scale=2.0), 0.2, 2.0)):
        a = initial_arrays(data, TrainConfig(**kw), np.random.default_rng(0))
        np.testing.assert_allclose(1 / (1 + np.exp(-a["opacities"])), opacity, rtol=1e-5)
        np.testing.assert_allclose(a["scales"], (dist + np.log(scale))[:, None].repeat(3, 1), rtol=1e-5, atol=1e-6)
