"""``eval``, ``render`` and ``export``: what a trained model (a training output folder, a snapshot or
a PLY) gives.

Outputs follow Inria's layout, so that its tools work on them unchanged: ``eval`` writes each test
view's render and ground truth to OUT/test/ours_N/renders/00000.png and OUT/test/ours_N/gt/00000.png
(N: the model's iteration; Inria's metrics.py pairs them by name) and the scores to OUT/metrics.json;
``render`` does the same for a split (``--split train``: OUT/train/ours_N/...), or, with ``--path``,
renders a camera path around or through the capture's views into an mp4 or PNG frames.  OUT is
``--out``, by default the model's training folder.

As Inria's render.py reads the model folder's cfg_args, the capture options that the command line
leaves out (``--data``, ``--images``, the scaling, the split, the background) come from the
training folder's cfg.json, which ``train`` writes; a flag given here overrides it.
"""
import argparse

from .args import add_data_options, count, load_data, output_folder, positive, write_metrics
from .config import ConfigError, read_mapping
from .train import HOLD_OUT_EVERY, config_from_args

PATHS = ("spiral", "ellipse", "interp")  # engine.tools.camera_path.PATHS (engine is imported late: numba)


def model_file(model):
    """The file ``--model`` names: a snapshot or PLY as given; for a folder its snapshot.h5, else the
    PLY of its latest point_cloud/iteration_N (ours, or Inria's own outputs)."""
    from pathlib import Path
    from engine.tools.outputs import latest_point_cloud
    from engine.recipe.trainer import SNAPSHOT
    src = Path(model)
    if src.is_dir():
        found = src / SNAPSHOT if (src / SNAPSHOT).is_file() else latest_point_cloud(src)
        if found is None:
            raise SystemExit(f"error: --model {src} holds no {SNAPSHOT} and no "
                             "point_cloud/iteration_N/point_cloud.ply")
        return found
    if not src.is_file():
        raise SystemExit(f"error: --model {src} does not exist")
    return src


def model_folder(a):
    """The training folder of ``--model``: the folder itself, a snapshot's folder, or the folder
    above point_cloud/iteration_N of a PLY there; None for a PLY anywhere else."""
    from pathlib import Path
    from engine.tools.outputs import iteration_of
    src = Path(a.model)
    if src.is_dir():
        return src
    if src.suffix != ".ply":
        return src.parent
    return src.parents[2] if iteration_of(src) is not None else None


def results_folder(a):
    """``--out`` (made where missing; one error naming it where it cannot be a folder), else the
    model's training folder (where Inria's render.py writes too)."""
    if a.out:
        return str(output_folder(a.out))
    folder = model_folder(a)
    if folder is None:
        raise SystemExit(f"error: give --out: {a.model} is not in a training folder")
    return str(folder)


def data_defaults():
    """{option: default} of the capture options (``add_data_options``), ``--out`` aside."""
    p = argparse.ArgumentParser()
    add_data_options(p, need_data=False, need_out=False)
    return {k: v for k, v in vars(p.parse_args([])).items() if k != "out"}


def recorded_settings(a):
    """The settings that the training folder of ``--model`` recorded in its cfg.json ({} where it has none)."""
    folder = model_folder(a)
    if folder is None or not (folder / "cfg.json").is_file():
        return {}
    try:
        return read_mapping(folder / "cfg.json")
    except ConfigError as e:
        raise SystemExit(f"error: {e}")


def fill_capture_options(a):
    """Set the capture options of ``a`` that the command line left None: from the training folder's
    cfg.json where it records them, else their defaults.  ``background`` (a setting of the run,
    not a flag of these commands) comes from there too, unless ``--[no-]white-background`` is given.  The test split: the recorded
    ``--test-every``, else every ``HOLD_OUT_EVERY``-th view (the ``--eval`` split)."""
    folder = model_folder(a)
    recorded = recorded_settings(a)
    # the recorded background, unless --white-background or --no-white-background says otherwise
    a.background = recorded.get("background") if a.white_background is None else None
    options = vars(a)  # (a's own: filled in here)
    for name, default in data_defaults().items():
        if options[name] is None:
            value = recorded.get(name)
            options[name] = default if value is None else value
    if a.test_every is None:
        a.test_every = HOLD_OUT_EVERY
    if not a.data:
        where = f"{folder / 'cfg.json'} does not name one" if recorded else f"no cfg.json in {folder or a.model}"
        raise SystemExit(f"error: give --data (the capture whose views to render): {where}")


def read_model(src):
    """-> (parameter arrays, the iteration trained to or None, the training config or {}) of a
    snapshot or PLY file."""
    from data.ply import load_ply
    from engine.tools.outputs import iteration_of
    from engine.tools.snapshot import read_snapshot
    from numbasplat.optim import GROUPS
    try:
        if src.suffix == ".ply":
            return load_ply(src), iteration_of(src), {}
        arrays, attrs = read_snapshot(str(src))
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    return {g: arrays[f"params/{g}"] for g in GROUPS}, int(attrs["step"]), attrs.get("config", {})


def trained_model(a):
    """A trainer holding the model ``--model`` names and the capture ``--data`` names (split as
    ``--eval`` splits it), rendering at the model's SH degree."""
    from engine.pipelines import PipelineOptions, make_trainer
    src = model_file(a.model)  # (before loading the capture: a wrong --model is told at once)
    fill_capture_options(a)
    cfg = config_from_args(a)
    dataset = load_data(a, cfg.background)
    t = make_trainer(dataset, results_folder(a), cfg, PipelineOptions())  # (one process, the model in memory)
    if src.suffix == ".ply":
        params, iteration, _ = read_model(src)
        t.start_from({"params": params})
        t.step = iteration or 0
    else:
        try:
            attrs = t.load_snapshot(src, check_data=False)
        except (ValueError, OSError) as e:
            raise SystemExit(f"error: {e}")
        t.cfg.antialias = bool(attrs.get("config", {}).get("antialias", False))
    t.cfg.sh_degree = t.model.gaussians.sh_degree()
    return t


def trained_on_every_view(a):
    """Whether the training folder of ``--model`` recorded a run that held no view out (no ``--eval``,
    no ``--test-every``): its every-N-th views are training views, not a test."""
    recorded = recorded_settings(a)
    return bool(recorded) and not recorded.get("eval") and not recorded.get("test_every")


def held_out_check(a, dataset, asked_split):
    """Refuse to call training views "test": where the model trained on every view and the test split is
    every N-th view (not a capture's own test file, such as Blender's transforms_test.json), ``eval``
    needs ``--test-every`` (``asked_split``), and then says that those views were trained on."""
    if not (dataset.test and dataset.split.startswith("every") and trained_on_every_view(a)):
        return
    views = f"{len(dataset.test)} views ({dataset.split})"
    if not asked_split:
        raise SystemExit(f"error: {model_folder(a) or a.model} trained on every view (no --eval or --test-every): its "
                         f"test split would be {views} it trained on; give --test-every N to score them anyway, or "
                         "train with --eval")
    print(f"note: the model trained on these {views}: the scores are not of held-out views")


def cmd_eval(a):
    from engine.tools.outputs import split_dir
    asked_split = a.test_every is not None
    t = trained_model(a)
    held_out_check(a, t.data, asked_split)
    folder = split_dir(t.out, "test", t.step)
    write_metrics(t.evaluate(save_dir=folder), t.out)
    print(f"renders in {folder / 'renders'}, ground truth in {folder / 'gt'}")


def cmd_render(a):
    if a.path:
        return render_path(a)
    if a.video or a.frames_dir:
        raise SystemExit("error: --video and --frames-dir render a camera path: give --path too")
    from engine.tools.outputs import split_dir
    t = trained_model(a)
    views = t.data.test if a.split == "test" else t.data.train
    folder = split_dir(t.out, a.split, t.step)
    t.evaluate(views, save_dir=folder, lpips=False)
    print(f"wrote {len(views)} renders to {folder / 'renders'} and their ground truth to {folder / 'gt'}")


def path_cameras(a, background):
    """The capture's cameras sorted by image name: from ``--data``, else from the model folder's
    cameras.json."""
    from engine.tools.outputs import CAMERAS_JSON, read_cameras_json
    if a.data:
        fill_capture_options(a)
        views = load_data(a, background).views
        return [v.camera for v in sorted(views, key=lambda v: v.name)]
    folder = model_folder(a)
    if folder is None or not (folder / CAMERAS_JSON).is_file():
        raise SystemExit(f"error: --path needs the capture's cameras: give --data, or a --model folder "
                         f"holding {CAMERAS_JSON} (training writes it)")
    try:
        return [c for _, c in sorted(read_cameras_json(folder / CAMERAS_JSON), key=lambda nc: nc[0])]
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def render_path(a):
    """Render the ``--path`` camera path with the model into ``--video`` and/or ``--frames-dir``."""
    import numpy as np
    import numbasplat as ns
    from numbasplat import backend as _backend
    from engine.tools.camera_path import camera_path
    from engine.tools.outputs import PngFrames, VideoFrames, render_image
    if not (a.video or a.frames_dir):
        raise SystemExit("error: --path needs --video FILE.mp4 or --frames-dir DIR")
    sinks = [VideoFrames(a.video, a.fps)] if a.video else []  # first: a missing extra fails before any work
    sinks += [PngFrames(a.frames_dir)] if a.frames_dir else []
    params, _, config = read_model(model_file(a.model))
    background = (1.0, 1.0, 1.0) if a.white_background else tuple(config.get("background", (0.0, 0.0, 0.0)))
    cameras = camera_path(a.path, path_cameras(a, background), a.frames, points=params["means"])
    xp = _backend.array_module()
    gaussians = ns.Gaussians(**{k: xp.asarray(np.asarray(v, np.float32)) for k, v in params.items()})
    for camera in cameras:
        image = _backend.to_host(render_image(gaussians, camera, None, background, bool(config.get("antialias"))))
        for sink in sinks:
            sink.add(image)
    for sink in sinks:
        sink.close()
    size = f"{cameras[0].width}x{cameras[0].height}"
    print(f"wrote {len(cameras)} frames ({a.path} path, {size}) to " + " and ".join(str(s.path) for s in sinks))


def cmd_export(a):
    from pathlib import Path
    from types import SimpleNamespace
    from data.ply import save_ply
    params, _, _ = read_model(model_file(a.model))
    save_ply(Path(a.ply), SimpleNamespace(**params))
    print(f"wrote {a.ply}")


def add_commands(sub):
    for name, fn, hlp in (("eval", cmd_eval, "evaluate a trained scene on the test split"),
                          ("render", cmd_render, "render the views of a split, or a camera path as a video")):
        e = sub.add_parser(name, help=hlp)
        add_data_options(e, need_out=False, need_data=False)  # the capture may come from the model's cfg.json
        e.add_argument("--model", required=True,
                       help="training output folder, snapshot .h5 or .ply (OUT defaults to the training folder)")
        if name == "render":
            e.add_argument("--split", choices=["test", "train"], default="test",
                           help="the views to render into OUT/<split>/ours_N/renders and gt (default test)")
            e.add_argument("--path", choices=PATHS,
                           help="render a camera path instead: spiral (forward-facing captures), ellipse "
                                "(around an object) or interp (through the views in name order)")
            e.add_argument("--video", default=None, help="with --path: write an mp4 (the video extra)")
            e.add_argument("--frames-dir", default=None, help="with --path: write PNG frames to this folder")
            e.add_argument("--frames", type=count(1), default=120, help="frames of the path (default 120)")
            e.add_argument("--fps", type=positive, default=30.0, help="frames per second of the video (default 30)")
        e.set_defaults(**dict.fromkeys(data_defaults(), None))  # None unless given: see fill_capture_options
        e.set_defaults(fn=fn)
    x = sub.add_parser("export", help="write the trained scene as a PLY file")
    x.add_argument("--model", required=True, help="training output folder or snapshot .h5")
    x.add_argument("--ply", required=True, help="output .ply path (missing folders are created)")
    x.set_defaults(fn=cmd_export)

