"""Blender (NeRF-synthetic) and instant-ngp / nerfstudio ``transforms*.json`` scenes.

Both store camera-to-world matrices in OpenGL/Blender camera axes (x right,
y up, z back).  Flipping the camera's y and z axes (``c2w[:3, 1:3] *= -1``)
gives OpenCV axes; the world-to-camera ``viewmat`` is its inverse.
"""
import json
import math
from pathlib import Path

import numpy as np

from .images import (Downscale, Intrinsics, check_sizes, has_distortion, ignored_distortion_note, image_size, load_image,
                     parallel_map)
from .ply import load_ply_points
from .scene import DataError, build_dataset, every_nth, split_views

# NeRF-synthetic objects sit inside this cube: 3DGS draws its random initial points there
BLENDER_BOX = ((-1.3, -1.3, -1.3), (1.3, 1.3, 1.3))


def read_json(path):
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("frames"), list):
        raise DataError(f"{path} has no 'frames' list")
    return meta


def opengl_to_viewmat(c2w, name):
    """World-to-camera (OpenCV axes) from an OpenGL camera-to-world matrix; DataError naming ``name``."""
    try:
        m = np.asarray(c2w, np.float64)
    except (TypeError, ValueError):
        raise DataError(f"image {name}: transform_matrix is not a numeric matrix") from None
    if m.shape == (3, 4):
        m = np.vstack([m, [0.0, 0.0, 0.0, 1.0]])
    if m.shape != (4, 4):
        raise DataError(f"image {name}: transform_matrix must be 4x4 (or 3x4), got shape {m.shape}")
    if not np.isfinite(m).all():
        raise DataError(f"image {name}: the camera pose (transform_matrix) has non-finite values")
    m = m.copy()
    m[:3, 1:3] *= -1.0
    try:
        view = np.linalg.inv(m)
    except np.linalg.LinAlgError:
        raise DataError(f"image {name}: transform_matrix is singular") from None
    if not np.isfinite(view).all():
        raise DataError(f"image {name}: transform_matrix is singular")
    return view


def _frame_image(root, file_path, meta_path, images=None):
    """The image file of a frame: ``file_path`` + '.png' first, then as is."""
    if not isinstance(file_path, str) or not file_path:
        raise DataError(f"{meta_path}: a frame has no file_path")
    rel = Path(file_path)
    if images is not None and len(rel.parts) > 1:
        parts = list(rel.parts)
        # replace the folder holding the image (nerfstudio's images/ -> images_2/)
        parts[-2] = images
        rel = Path(*parts)
    base = Path(root) / rel
    for cand in (Path(str(base) + ".png"), base):
        if cand.is_file():
            return cand
    raise DataError(f"missing image file {base}{'' if base.suffix else '.png'} (file_path {file_path!r} in {meta_path})")


def _float(meta, key, where, default=None):
    val = meta.get(key, default)
    if val is None:
        return None
    try:
        return float(val)
    except (TypeError, ValueError):
        raise DataError(f"{where}: {key} is not a number: {val!r}") from None


def _load_frames(root, meta_path, frames, intr_of, background, downscale, images=None, group_of=None):
    """Load the frames of one transforms file into Views; ``intr_of(frame, image path, name)``
    gives (``Intrinsics``, camera model name)."""
    jobs = []
    for i, fr in enumerate(frames):
        if not isinstance(fr, dict):
            raise DataError(f"{meta_path}: frame {i} is not an object")
        path = _frame_image(root, fr.get("file_path"), meta_path, images)
        try:
            name = path.relative_to(root).as_posix()
        except ValueError:
            name = path.as_posix()
        if "transform_matrix" not in fr:
            raise DataError(f"image {name}: no transform_matrix in {meta_path}")
        viewmat = opengl_to_viewmat(fr["transform_matrix"], name)
        jobs.append((name, path, fr, viewmat, *intr_of(fr, path, name)))

    def work(job):
        _, path, _, _, intr, _ = job
        return load_image(path, intr, background, downscale)

    loaded = parallel_map(work, jobs)
    groups = [group_of(j[2]) if group_of else 0 for j in jobs]
    check_sizes(loaded, [j[0] for j in jobs], groups)
    return [li.view(name, viewmat, model) for (name, _, _, viewmat, _, model), li in zip(jobs, loaded)]


# ----------------------------------------------------------------------------- Blender

def load_blender(path, images=None, background=(1.0, 1.0, 1.0), test_every=None, downscale=Downscale(),
                 distortion="undistort"):
    """NeRF-synthetic: transforms_train.json and transforms_test.json (its views for evaluation
    only); no points.  Without transforms_test.json, ``test_every`` splits the training views
    (none when it is 0 or None).  Its cameras have no distortion (``distortion`` changes nothing)."""
    root = Path(path)
    notes = []
    if images is not None:
        notes.append(f"the images option ({images!r}) is ignored for Blender scenes")
    train_json = root / "transforms_train.json"
    if not train_json.is_file():
        raise DataError(f"Blender scene {root} has no transforms_train.json")
    splits = {}
    for split in ("train", "test"):
        meta_path = root / f"transforms_{split}.json"
        if not meta_path.is_file():
            splits[split] = []
            continue
        meta = read_json(meta_path)
        angle = _float(meta, "camera_angle_x", meta_path)
        if angle is None:
            raise DataError(f"{meta_path} has no camera_angle_x")
        if not (math.isfinite(angle) and 0.0 < angle < math.pi):
            raise DataError(f"{meta_path}: camera_angle_x must be in (0, pi), got {angle}")

        def intr_of(fr, img_path, name, angle=angle, meta_path=meta_path):
            a = _float(fr, "camera_angle_x", meta_path, angle)
            w, h = image_size(img_path)
            f = 0.5 * w / math.tan(0.5 * a)
            return Intrinsics(f, f, 0.5 * w, 0.5 * h, w, h), "pinhole"

        splits[split] = _load_frames(root, meta_path, meta["frames"], intr_of, background, downscale)
    if not splits["train"]:
        raise DataError(f"{train_json} lists no frames")
    train, test, split = splits["train"], splits["test"], "transforms_test.json, for evaluation only"
    if not (root / "transforms_test.json").is_file():
        train, test = split_views(train, test_every)
        split = f"{every_nth(test_every)} of transforms_train.json"
        notes.append(f"no transforms_test.json: held out {split} for testing" if test else
                     f"no transforms_test.json: all {len(train)} views train, none is held out for evaluation")
    return build_dataset(train, test, np.zeros((0, 3)), np.zeros((0, 3)), root, "blender", init_box=BLENDER_BOX,
                         split=split, points_origin="Blender scenes have no point cloud", downscale=downscale,
                         notes=notes)


# ----------------------------------------------------------------------------- instant-ngp / nerfstudio

NGP_KEYS = ("fl_x", "fl_y", "camera_angle_x", "camera_angle_y", "cx", "cy", "w", "h",
            "k1", "k2", "k3", "k4", "p1", "p2")


def _ngp_intrinsics(glob, fr, img_path, name, meta_path):
    """(``Intrinsics``, camera model) of one frame: its own keys over the global ones; w/h default to
    the image size; the model is 'pinhole' when there is no distortion."""
    where = f"{meta_path} (image {name})"
    vals = {k: _float(fr, k, where, _float(glob, k, meta_path)) for k in NGP_KEYS}
    model = str(fr.get("camera_model", glob.get("camera_model", "OPENCV"))).upper()
    if model not in ("OPENCV", "PINHOLE", "SIMPLE_PINHOLE", "SIMPLE_RADIAL", "RADIAL"):
        raise DataError(f"{meta_path}: unsupported camera_model {model} (image {name})")
    w, h = vals["w"], vals["h"]
    if w is None or h is None:
        iw, ih = image_size(img_path)
        w = iw if w is None else w
        h = ih if h is None else h
    fx, fy = vals["fl_x"], vals["fl_y"]
    if fx is None and vals["camera_angle_x"] is not None:
        fx = 0.5 * w / math.tan(0.5 * vals["camera_angle_x"])
    if fy is None and vals["camera_angle_y"] is not None:
        fy = 0.5 * h / math.tan(0.5 * vals["camera_angle_y"])
    if fx is None and fy is None:
        raise DataError(f"{meta_path}: no focal length for image {name} (need fl_x/fl_y or camera_angle_x)")
    fx = fy if fx is None else fx
    fy = fx if fy is None else fy
    cx = 0.5 * w if vals["cx"] is None else vals["cx"]
    cy = 0.5 * h if vals["cy"] is None else vals["cy"]
    dist = tuple(vals[k] or 0.0 for k in ("k1", "k2", "k3", "k4", "p1", "p2"))
    intr = Intrinsics(fx, fy, cx, cy, w, h, dist)
    if not intr.finite():
        raise DataError(f"image {name}: non-finite intrinsics or distortion in {meta_path}")
    if fx <= 0 or fy <= 0 or w <= 0 or h <= 0:
        raise DataError(f"image {name}: invalid intrinsics in {meta_path} (fx={fx}, fy={fy}, w={w}, h={h})")
    return intr, model if has_distortion(dist) else "pinhole"


def load_ngp(path, images=None, background=(1.0, 1.0, 1.0), test_every=None, downscale=Downscale(),
             distortion="undistort"):
    """instant-ngp / nerfstudio transforms.json (and the point cloud its ``ply_file_path`` names,
    if any); every ``test_every``-th sorted image is test (0 or None: none)."""
    root = Path(path)
    meta_path = root / "transforms.json"
    if not meta_path.is_file():
        raise DataError(f"{root} has no transforms.json")
    meta = read_json(meta_path)
    if not meta["frames"]:
        raise DataError(f"{meta_path} lists no frames")

    given = []  # the intrinsics as the file gives them (for the note on ignored distortion)

    def intr_of(fr, img_path, name):
        intr, model = _ngp_intrinsics(meta, fr, img_path, name, meta_path)
        given.append(intr)
        return intr.as_loaded(distortion), model

    def group_of(fr):
        return tuple(fr.get(k, meta.get(k)) for k in NGP_KEYS) if any(k in fr for k in NGP_KEYS) else None

    views = _load_frames(root, meta_path, meta["frames"], intr_of, background, downscale, images, group_of)
    train, test = split_views(views, test_every)

    points = colors = np.zeros((0, 3))
    ply = meta.get("ply_file_path")
    origin = "transforms.json names no point cloud (ply_file_path)"
    if isinstance(ply, str) and ply:
        ply_path = root / ply
        origin = f"the point cloud {ply} that transforms.json names does not exist"
        if ply_path.is_file():
            try:
                points, colors = load_ply_points(ply_path)
                origin = ply
            except (OSError, ValueError) as exc:
                # the points only seed the model: train without them rather than fail
                origin = f"its point cloud is unreadable ({exc})"
    ignored = ignored_distortion_note(given, distortion)
    return build_dataset(train, test, points, colors, root, "ngp", split=every_nth(test_every),
                         points_origin=origin, downscale=downscale, images=images or "",
                         notes=[ignored] if ignored else [])
