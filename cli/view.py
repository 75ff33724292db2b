"""``view``: a trained model (a training folder, a snapshot or a PLY) in the browser, through
``engine/tools/viewer.py`` (the ``viewer`` extra, viser).

The cameras drawn and listed to jump to are the capture's: ``--data`` (or the capture the training
folder's cfg.json names, split as ``eval`` splits it), else the folder's cameras.json (training
writes it), else none (the viewer then starts looking at the model from outside it).  The
background is the run's (its snapshot's settings or cfg.json), ``--white-background`` or
``--no-white-background`` overriding it.
"""
from .args import add_data_options, add_viewer_options, count, load_data
from .evaluate import data_defaults, fill_capture_options, model_file, model_folder, recorded_settings

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def read_view_model(src):
    """-> (parameter arrays, the run's settings or {}) of a snapshot or 3DGS PLY, whatever its file
    name says (the first bytes decide); one error naming the file for anything else."""
    from data.ply import load_ply
    from engine.tools.snapshot import read_snapshot
    from numbasplat.optim import GROUPS
    with open(src, "rb") as f:
        head = f.read(8)
    try:
        if head.startswith(b"ply"):
            return load_ply(src), {}
        if head == HDF5_MAGIC:
            arrays, attrs = read_snapshot(str(src))
            return {g: arrays[f"params/{g}"] for g in GROUPS}, attrs.get("config", {})
        why = "neither a PLY file nor an HDF5 snapshot"
    except (ValueError, KeyError) as e:
        why = f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)
    raise SystemExit(f"error: --model {src} is not a NumbaSplat snapshot (.h5) or a 3DGS PLY (.ply): {why}")


def view_cameras(a, background):
    """[(name, Camera)] of the capture (``--data``, else cfg.json's), else of the folder's cameras.json,
    else [] ; and a line saying where they came from."""
    from engine.tools.outputs import CAMERAS_JSON, read_cameras_json
    from engine.tools.viewer import dataset_cameras
    from pathlib import Path
    folder = model_folder(a)
    recorded = recorded_settings(a).get("data")
    if a.data or (recorded and Path(recorded).exists()):   # (a capture moved since: its cameras.json)
        fill_capture_options(a)
        return dataset_cameras(load_data(a, background)), f"cameras of {a.data}"
    if folder is not None and (folder / CAMERAS_JSON).is_file():
        try:
            named = sorted(read_cameras_json(folder / CAMERAS_JSON), key=lambda nc: nc[0])
        except ValueError as e:
            raise SystemExit(f"error: {e}")
        return named, f"cameras of {folder / CAMERAS_JSON}"
    return [], "no cameras (give --data to see the capture's)"


def outside_view(means, up=(0.0, 0.0, 1.0)):
    """A camera looking at the model's centre from outside it, for a model without cameras."""
    import numpy as np
    from engine.tools.camera_path import look_at
    from numbasplat.rendering import Camera
    lo, hi = np.percentile(means, [5, 95], axis=0) if len(means) else (np.zeros(3) - 1, np.zeros(3) + 1)
    centre, reach = 0.5 * (lo + hi), max(float(np.linalg.norm(hi - lo)), 1e-3)
    eye = centre + reach * np.array([1.0, -1.0, 0.7]) / np.linalg.norm([1.0, -1.0, 0.7])
    return Camera(look_at(eye, centre, up), 500.0, 500.0, 400.0, 300.0, 800, 600)


def cmd_view(a):
    import numpy as np
    import numbasplat as ns
    from numbasplat import backend as _backend
    from engine.tools.viewer import DEFAULT_HOST, DEFAULT_PORT, Viewer, cameras_up, require_viser
    require_viser()   # (before any work: a missing extra is told at once)
    src = model_file(a.model)
    params, config = read_view_model(src)
    recorded = recorded_settings(a)
    if a.white_background is None:
        background = tuple(config.get("background", recorded.get("background", (0.0, 0.0, 0.0))))
    else:
        background = (1.0, 1.0, 1.0) if a.white_background else (0.0, 0.0, 0.0)
    cameras, where = view_cameras(a, background)
    xp = _backend.array_module()
    gaussians = ns.Gaussians(**{k: xp.asarray(np.asarray(v, np.float32)) for k, v in params.items()})
    up = cameras_up(cameras)
    home = None if cameras else outside_view(params["means"], (0.0, 0.0, 1.0) if up is None else up)
    viewer = Viewer(gaussians, cameras, background, bool(config.get("antialias", False)), up=up,
                    max_side=a.max_size, home=home)
    url = viewer.serve_on(a.port or DEFAULT_PORT, a.host or DEFAULT_HOST)
    print(f"{src}: {len(gaussians):,} Gaussians, SH degree {gaussians.sh_degree()}; {where}")
    print(f"viewer: {url} ({_backend.BACKEND} backend; Ctrl-C to stop)")
    try:
        viewer.serve()
    except KeyboardInterrupt:
        pass
    finally:
        viewer.close()


def add_commands(sub):
    v = sub.add_parser("view", help="look at a trained model in the browser (the viewer extra)")
    add_data_options(v, need_out=False, need_data=False)
    v.add_argument("--model", required=True, help="training output folder, snapshot .h5 or .ply")
    add_viewer_options(v)
    v.add_argument("--max-size", type=count(16), default=None, metavar="PX",
                   help="a frame's longest side at rest, pixels (default 1920 on a GPU, 512 on the CPU; the "
                        "panel changes it); frames shrink while the camera moves to keep it fluid")
    v.set_defaults(**dict.fromkeys(data_defaults(), None))  # None unless given (the cfg.json's otherwise)
    v.set_defaults(fn=cmd_view)
