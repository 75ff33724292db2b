"""``train`` and ``demo``: the settings (defaults, a config file, the flags), what was loaded, a
pipeline for the ranks at hand, the run."""
import argparse
import contextlib
import os
from dataclasses import asdict, fields, replace
from pathlib import Path

from .args import (Parser, add_data_options, add_viewer_options, claimed_output, count, load_data, mpi_comm,
                   output_folder, switch, write_metrics)
from .config import NOT_RECORDED, ConfigError, add_config_options, resolve, write_settings

HOLD_OUT_EVERY = 8  # with --eval, every 8th image (sorted by name) is a test view, as Inria's llffhold
CPU_SLOW_PIXELS = 250_000     # views larger than this train slowly on the CPU backend: a hint says so
CPU_SECONDS_PER_PIXEL = 3e-5  # a step's rough cost per pixel of its view on the CPU backend
LONG_RUN_SECONDS = 3600       # a CPU run estimated to take longer than this is told how to shorten it
PACE_FROM, PACE_STEPS = 5, 10  # ... estimated from the pace of these steps (the first ones compile kernels)
MIN_HINT_WIDTH = 100          # a --resolution it suggests leaves the images at least this wide


def settings_from_args(settings, a):
    """The dataclass ``settings`` (``TrainConfig``, ``PipelineOptions``) of the options in ``a``: its
    fields that ``a`` holds and are not None (a list as the tuple the field holds), the others at
    their defaults."""
    given = {f: vars(a).get(f.name) for f in fields(settings)}
    return settings(**{f.name: tuple(v) if isinstance(f.default, tuple) else v for f, v in given.items()
                       if v is not None})


def config_from_args(a):
    """The ``TrainConfig`` of the options in ``a`` (``settings_from_args``; ``--white-background``
    is ``--background 1 1 1``)."""
    from engine.recipe.trainer import TrainConfig
    cfg = settings_from_args(TrainConfig, a)
    if vars(a).get("white_background"):
        if tuple(cfg.background) not in (TrainConfig.background, (1.0, 1.0, 1.0)):
            raise ValueError(f"--white-background and --background {' '.join(map(str, cfg.background))} "
                             "disagree: give one of them")
        cfg.background = (1.0, 1.0, 1.0)
    return cfg


class StoppedTogether(SystemExit):
    """Every rank stopped training for a signal after the same step and wrote the snapshot: an
    orderly exit with the signal's code, not a failure for ``abort_on_error`` to spread."""


def options_from_args(a):
    """The ``PipelineOptions`` of the options in ``a`` (``settings_from_args``)."""
    from engine.pipelines import PipelineOptions
    return settings_from_args(PipelineOptions, a)


def train_model(dataset, a, cfg, settings=None, step_hooks=(), resumable=True):
    """Train on ``dataset`` with the pipeline that the options ``a`` (all of ``train``'s) ask for on
    the ranks at hand (``engine.pipelines``); ``settings`` (the command's options) are written with
    the trainer's config to ``OUT/cfg.json`` before the first step; ``step_hooks`` run after every
    step (``Trainer.step_hooks``).  ``resumable``: a stopped run says how to go on (``--resume``)."""
    from engine.pipelines import make_trainer, train_handing_over
    from engine.recipe.pruning import train_then_prune
    from engine.recipe.trainer import SNAPSHOT, Interrupted
    options = options_from_args(a)
    comm = mpi_comm(batched=options.batch_size is not None)
    if a.init_ply and cfg.lr_means is None:  # trained Gaussians, not random points: 3DGS's rate
        from engine.recipe.trainer import MEANS_LR
        cfg = replace(cfg, lr_means=MEANS_LR)
    t = make_trainer(dataset, a.out, cfg, options, comm)
    if a.init_ply:
        from data.ply import PlyGaussians
        start = PlyGaussians(a.init_ply)  # (read as the model is made of it: the file is not held beside it)
        t.start_from({"params": start})
        t.cfg.sh_degree = min(t.cfg.sh_degree, start.sh_degree)
    if a.resume:
        snap = Path(a.out) / SNAPSHOT
        if not snap.is_file():
            raise SystemExit(f"error: --resume but no snapshot at {snap}")
        t.load_snapshot(snap)
        if cfg.iterations < t.step:
            raise SystemExit(f"error: --iters {cfg.iterations} is below step {t.step} of the snapshot to resume "
                             f"({snap}): give --iters {t.step} or more")
        t.cfg.iterations = cfg.iterations
        if comm is None or comm.Get_rank() == 0:
            print(f"resumed from {snap} at step {t.step}")
    if settings is not None and t.is_root:
        write_settings(t.out / "cfg.json", recorded_settings(settings, t, comm))
    t.step_hooks.extend(step_hooks)
    rank = comm.Get_rank() if comm is not None else 0
    say = print if comm is None else (lambda line: print(f"rank {rank}: {line}"))  # a measurement's report lines
    if a.timeline:
        from engine.tools.timeline import TrainingTimeline
        name = "timeline.json.gz" if comm is None else f"timeline_rank{rank}.json.gz"
        t.step_hooks.append(TrainingTimeline(*a.timeline, keep=Path(a.out) / name, log=say))
    if a.host_profile:
        from engine.tools.timeline import HostProfile
        t.step_hooks.append(HostProfile(*a.host_profile, log=say))
    if a.viewer:
        from engine.tools.viewer import DEFAULT_HOST, DEFAULT_PORT, live_viewer
        t.live_view = live_viewer(t, a.port or DEFAULT_PORT, a.host or DEFAULT_HOST)
    try:
        root = comm is None or comm.Get_rank() == 0
        progress = not a.quiet and root
        t = train_handing_over(t, cfg, options, comm, progress, choose_again=not a.viewer)
        t.pruning = train_then_prune(t, progress=progress)  # (metrics.json's)
    except Interrupted as e:  # SIGINT, SIGTERM or SIGHUP
        if not e.saved:  # a second Ctrl-C
            raise SystemExit(e.exit_code)
        if resumable and (comm is None or comm.Get_rank() == 0):
            print("to continue, run the same command with --resume")
        raise StoppedTogether(e.exit_code)
    except KeyboardInterrupt:
        raise SystemExit(130)
    except FloatingPointError as e:
        raise SystemExit(f"error: {e}")
    except MemoryError as e:
        if os.environ.get("NUMBASPLAT_DEBUG"):  # (the traceback, as for bad input: cli/__init__.py)
            raise
        raise SystemExit(f"error: out of memory ({e}); try --max-gaussians N, --resolution 2 (or more), "
                         "or --densify-until with an earlier step")
    return t


def recorded_settings(settings, t, comm):
    """What ``OUT/cfg.json`` holds: the command's settings (paths made absolute, the batch size the
    ranks make) and the trainer's config as it trains (the S3IM weight the data chose, the SH
    degree of an ``--init-ply``), by name, as a ``--config`` file takes them."""
    recorded = {k: v for k, v in settings.items() if k not in NOT_RECORDED}
    for k in ("data", "init_ply"):
        if recorded.get(k):
            recorded[k] = str(Path(recorded[k]).resolve())
    if recorded.get("batch_size") is None and comm is not None:
        recorded["batch_size"] = t.batch  # the ranks' batch (buckets of views a step with --exchange pixel)
    recorded.update(asdict(t.cfg))
    return recorded


def cmd_train(a):
    settings = resolve(a, train_parser())
    for name, value in (("data", a.data), ("out", a.out)):
        if value is None:
            raise ConfigError(f"--{name} is required (on the command line or in a --config file)")
    comm = mpi_comm(batched=a.batch_size is not None)
    if comm is None:
        return run_training(a, settings)
    from comm import abort_on_error
    with abort_on_error(comm):  # one rank failing stops them all, with its message
        try:
            return run_training(a, settings)
        except StoppedTogether as e:
            stopped = e
        except (ValueError, OSError) as e:  # bad input: the message, not a traceback
            if os.environ.get("NUMBASPLAT_DEBUG"):
                raise
            raise SystemExit(f"error: {e}")
    raise SystemExit(stopped.code)


def run_training(a, settings):
    from engine.tools.outputs import split_dir
    from engine.recipe.trainer import SNAPSHOT
    from numbasplat.backend import BACKEND
    if a.timeline:
        from engine.tools.timeline import check_available
        check_available()  # before the capture loads
    output_folder(a.out)
    comm = mpi_comm(batched=a.batch_size is not None)
    root = comm is None or comm.Get_rank() == 0
    with claimed_output(a.out, a.resume, a.overwrite) if root else contextlib.nullcontext():
        cfg = config_from_args(a)
        # every view trains unless --eval (Inria's split) or --test-every holds some out
        dataset = load_data(a, cfg.background, HOLD_OUT_EVERY if a.eval else None)
        if root:  # (a resumed run's model is its snapshot's: no initial points to describe)
            print("\n".join(dataset.summary(None if a.init_ply else cfg.n_random_init, points=not a.resume)))
            if a.init_ply and not a.resume:
                print(f"initial Gaussians: from {a.init_ply} (--init-ply), not the points above")
            for hint in (slow_cpu_hint(dataset, BACKEND), None if cfg.appearance else exposure_hint(dataset)):
                if hint:
                    print(hint)
        hints = [LongRunHint(dataset, say=tqdm_print)] if root and BACKEND == "cpu" else []
        t = train_model(dataset, a, cfg, settings, step_hooks=hints)
        if dataset.test:
            summary = t.evaluate(save_dir=split_dir(a.out, "test", t.step) if a.eval else None)
            if summary is not None:  # rank 0 of a distributed run
                write_metrics({**summary, "pruning": t.pruning} if t.pruning else summary, a.out)
        elif root:
            print(f"trained on all {len(dataset.train)} views; no test split{'' if a.eval else ' (use --eval)'}; "
                  f"{t.step} steps in {t.train_seconds:.1f} s; snapshot {Path(a.out) / SNAPSHOT}")
    keep_viewer_open(t)


def keep_viewer_open(t):
    """After ``train --viewer``: while a browser is connected the viewer stays, showing the trained
    model, until Ctrl-C (rank 0; without a browser the command ends at once)."""
    live = getattr(t, "live_view", None)
    viewer = live.viewer if live is not None else None
    if viewer is None:
        return
    try:
        if viewer.clients:
            viewer.training = False
            if getattr(t, "comm", None) is None:  # (under MPI: the last model rank 0 gathered)
                viewer.set_model(t.model.gaussians)
            viewer.show_training(t.step, t.cfg.iterations, force=True)
            print(f"training done; the viewer stays open at {viewer.url()} until Ctrl-C")
            viewer.serve()
    except KeyboardInterrupt:
        pass
    finally:
        viewer.close()


def tqdm_print(line):
    """Print ``line`` above the progress bar, which is redrawn below it."""
    from tqdm import tqdm
    tqdm.write(line)


def exposure_hint(dataset):
    """One line when the training images' exposure varies (``engine.recipe.appearance.exposure_spread`` above
    ``EXPOSURE_SPREAD_HINT``): ``--appearance`` corrects it per image; None otherwise."""
    from engine.recipe.appearance import EXPOSURE_SPREAD_HINT, exposure_spread
    spread = exposure_spread(dataset)
    if spread is None or spread <= EXPOSURE_SPREAD_HINT:
        return None
    return (f"note: the training images' exposure or white balance varies (spread {spread:.2f} of log gain, "
            f"over {EXPOSURE_SPREAD_HINT}): --appearance corrects it per image (README)")


def slow_cpu_hint(dataset, backend):
    """One line when training on the ``backend`` will be slow (the CPU, views above
    ``CPU_SLOW_PIXELS``): a step's rough time at the largest training view and the ``--resolution``
    that brings its image file under that size; None otherwise."""
    if backend != "cpu" or not dataset.train:
        return None
    view, (width, height) = _largest_view(dataset)
    pixels = view.width * view.height
    if pixels <= CPU_SLOW_PIXELS:
        return None
    factor = 2
    while (width / factor) * (height / factor) > CPU_SLOW_PIXELS:
        factor *= 2
    return (f"CPU backend: about {pixels * CPU_SECONDS_PER_PIXEL:.0f} s a step at {view.width}x{view.height}; "
            f"use --resolution {factor} or a GPU")


def _largest_view(dataset):
    """-> (the largest training view, the (width, height) of its image file, or of the view without one)."""
    view = max(dataset.train, key=lambda v: v.width * v.height)
    p = view.provenance
    return view, (p.file_size if p is not None and p.file_size[0] else (view.width, view.height))


def _duration(seconds):
    """Seconds as minutes, or as hours from an hour and a half on."""
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


class LongRunHint:
    """A step hook for the CPU backend: from the pace of ``PACE_STEPS`` steps after the first
    ``PACE_FROM`` (which compile kernels), the time the run has left; when that is over
    ``LONG_RUN_SECONDS``, one line says so and how to finish within it (``advice``).  Once a run.

    The CPU trains lego (400x400) at 5.5-7 s a step on 2 cores, two days for 30k steps, where the
    pre-training hint (``slow_cpu_hint``: views above ``CPU_SLOW_PIXELS``) says nothing."""

    def __init__(self, dataset, say=print, clock=None):
        import time
        self.dataset, self.say, self.clock = dataset, say, clock or time.perf_counter
        self.calls, self.mark, self.done = 0, None, False

    def __call__(self, trainer, rec):
        if self.done:
            return 0.0
        self.calls += 1
        if self.calls == PACE_FROM:
            self.mark = (trainer.step, self.clock())
        elif self.calls == PACE_FROM + PACE_STEPS:
            self.done = True
            step0, t0 = self.mark
            seconds_per_step = (self.clock() - t0) / max(1, trainer.step - step0)
            line = self.advice(seconds_per_step, trainer.step, trainer.cfg.iterations)
            if line:
                self.say(line)
        return 0.0

    def advice(self, seconds_per_step, step, iterations):
        """The line for a run at ``step`` of ``iterations`` going at ``seconds_per_step``; None when
        what is left takes ``LONG_RUN_SECONDS`` or less.  It names the most ``--iters`` that finish
        within that time, the least ``--resolution`` that does (a step's time taken as proportional
        to its pixels; the images at least ``MIN_HINT_WIDTH`` wide) or, where none does, the largest
        with the ``--iters`` that fit at its pace, and a GPU."""
        left = iterations - step
        if seconds_per_step * left <= LONG_RUN_SECONDS:
            return None
        options = []
        if (fitting := _iterations_within(step, seconds_per_step)) > step:
            options.append(f"--iters {fitting}")
        view, (width, height) = _largest_view(self.dataset)
        factors = [f for f in range(1, width // MIN_HINT_WIDTH + 1) if width / f < view.width]  # smaller than now
        if factors:
            factor = next((f for f in factors if _pace_at(f, seconds_per_step, view, width, height) * left
                           <= LONG_RUN_SECONDS), factors[-1])
            pace = _pace_at(factor, seconds_per_step, view, width, height)
            option = f"--resolution {factor}"
            if pace * left > LONG_RUN_SECONDS:
                option += f" --iters {_iterations_within(step, pace)}"
            options.append(f"{option} (about {pace:.2g} s a step)")
        return (f"CPU backend: {seconds_per_step:.2g} s a step, about {_duration(seconds_per_step * left)} for the "
                f"{left:,} steps left; to finish within an hour: {', or '.join(options + ['a GPU'])}")


def _pace_at(factor, seconds_per_step, view, width, height):
    """A step's seconds at ``--resolution factor`` of a ``width`` x ``height`` image file, from
    ``seconds_per_step`` at ``view``'s size: proportional to the pixels (a lower bound: part of a
    step's cost is per Gaussian)."""
    return seconds_per_step * (width / factor) * (height / factor) / (view.width * view.height)


def _iterations_within(step, seconds_per_step):
    """The most iterations, a multiple of 100, that a run at ``step`` finishes within ``LONG_RUN_SECONDS``."""
    return (step + int(LONG_RUN_SECONDS / seconds_per_step)) // 100 * 100


def demo_config(iterations=None):
    """The demo's settings: the defaults but for its length (2000 steps), SH degree 1, random initial
    points and a white background (tests/test_quality_guard.py holds its quality)."""
    from engine.recipe.trainer import TrainConfig
    return TrainConfig(iterations=iterations or 2000, sh_degree=1, sh_increase_every=500, n_random_init=3000,
                       background=(1.0, 1.0, 1.0), snapshot_every=0, log_every=50)


def cmd_demo(a):
    """The default command: train the built-in procedural scene and print its test PSNR."""
    import tempfile
    from engine.tools.demo import make_dataset
    print("NumbaSplat demo: rendering the built-in scene (the first run compiles kernels: about a minute)")
    dataset = make_dataset()
    cfg = demo_config(a.iterations)
    run = train_parser().parse_args([])  # train's options at their defaults: the default pipeline, no viewer
    run.out = a.out or tempfile.mkdtemp(prefix="numbasplat-demo-")
    t = train_model(dataset, run, cfg, resumable=False)
    write_metrics(t.evaluate(), run.out)


def add_train_options(p):
    """The ``train`` command's options: the capture, the run, and every ``PipelineOptions`` and
    ``TrainConfig`` field."""
    add_data_options(p, need_data=False, need_out=False)  # --data and --out may come from a config file
    switch(p, "--eval", help=f"hold out every {HOLD_OUT_EVERY}th image (or every --test-every), evaluate on them "
                             "and save their renders (without it and --test-every every view trains)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/snapshot.h5")
    p.add_argument("--overwrite", action="store_true",
                   help="remove an earlier run's outputs from OUT first (without it or --resume, a folder holding "
                        "one is refused)")
    p.add_argument("--init-ply", default=None, help="start from the Gaussians of a PLY file (3DGS layout)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--viewer", action="store_true",
                   help="serve the model in the browser while it trains (the viewer extra; rank 0 under MPI; "
                        "--port, --host); it takes at most about 5%% of the training's time")
    add_viewer_options(p)
    p.add_argument("--timeline", type=step_window, default=None, metavar="START:STEPS",
                   help="record STEPS steps after step START under CUPTI (needs torch): print kernels, device busy "
                        "and idle time and host waits per step, keep the trace in OUT/timeline.json.gz (Perfetto)")
    p.add_argument("--host-profile", type=step_window, default=None, metavar="START:STEPS",
                   help="profile the host's Python over STEPS steps after step START and print the functions by "
                        "their own and by their cumulative time a step (where --timeline finds a step bound by its "
                        "host; the cumulative list finds a rare phase, such as a refinement)")
    add_config_options(p)


def step_window(text):
    """argparse type of ``--timeline`` and ``--host-profile``: START:STEPS, two integers (START >= 0, STEPS >= 2)."""
    try:
        start, steps = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:STEPS (two integers), got {text!r}") from None
    if start < 0 or steps < 2:
        raise argparse.ArgumentTypeError(f"START must be at least 0 and STEPS at least 2, got {text!r}")
    return start, steps


def train_parser():
    """The ``train`` options on a parser of their own, with their defaults: what reads a config file."""
    p = Parser(prog="run.py train", exit_on_error=False)
    add_train_options(p)
    return p


def add_commands(sub):
    t = sub.add_parser("train", help="train on a capture")
    add_train_options(t)
    # every option None unless given: a --config file or the default fills it in (cli/config.resolve)
    t.set_defaults(**dict.fromkeys(vars(t.parse_args([])), None))
    t.set_defaults(fn=cmd_train)
    d = sub.add_parser("demo", help="train the built-in scene (also: no arguments)")
    d.add_argument("--iters", dest="iterations", type=count(1), default=None)
    d.add_argument("--out", default=None)
    d.set_defaults(fn=cmd_demo)
