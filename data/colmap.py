"""COLMAP sparse models (binary and text) and the COLMAP scene loader.

Binary layout (little endian)::

    cameras.bin   uint64 n; n x [int32 id, int32 model_id, uint64 width, uint64 height, float64 params[k]]
    images.bin    uint64 n; n x [int32 id, float64 qw qx qy qz tx ty tz, int32 camera_id, name '\\0',
                                 uint64 n2d, n2d x (float64 x, float64 y, int64 point3D_id)]
    points3D.bin  uint64 n; n x [uint64 id, float64 x y z, uint8 r g b, float64 error,
                                 uint64 track_len, track_len x (int32 image_id, int32 point2D_idx)]

Text: the same fields, whitespace separated, ``#`` comments; images.txt has
two lines per image (the second, the 2D points, may be empty).

The pose (q, t) maps world to camera in OpenCV axes: viewmat = [[R(q), t], [0, 0, 0, 1]].
"""
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .images import (IMAGE_EXTENSIONS, Downscale, Intrinsics, check_sizes, ignored_distortion_note, is_image_file,
                     list_image_files, load_image, parallel_map)
from .scene import DataError, build_dataset, every_nth, split_indices, split_views

# id -> (name, number of params); only the first five are supported.
CAMERA_MODELS = {
    0: ("SIMPLE_PINHOLE", 3),
    1: ("PINHOLE", 4),
    2: ("SIMPLE_RADIAL", 4),
    3: ("RADIAL", 5),
    4: ("OPENCV", 8),
    5: ("OPENCV_FISHEYE", 8),
    6: ("FULL_OPENCV", 12),
    7: ("FOV", 5),
    8: ("SIMPLE_RADIAL_FISHEYE", 4),
    9: ("RADIAL_FISHEYE", 5),
    10: ("THIN_PRISM_FISHEYE", 12),
    11: ("RAD_TAN_THIN_PRISM_FISHEYE", 16),
}
SUPPORTED_MODELS = ("SIMPLE_PINHOLE", "PINHOLE", "SIMPLE_RADIAL", "RADIAL", "OPENCV")
MODEL_IDS = {name: i for i, (name, _) in CAMERA_MODELS.items()}
NUM_PARAMS = {name: n for name, n in CAMERA_MODELS.values()}


@dataclass
class ColmapCamera:
    id: int
    model: str
    width: int
    height: int
    params: np.ndarray   # float64

    def intrinsics(self):
        """``Intrinsics`` (fx, fy, cx, cy at width x height, radial-tangential distortion)."""
        p = [float(v) for v in self.params]
        if self.model == "SIMPLE_PINHOLE":
            f, cx, cy = p
            return Intrinsics(f, f, cx, cy, self.width, self.height)
        if self.model == "PINHOLE":
            fx, fy, cx, cy = p
            return Intrinsics(fx, fy, cx, cy, self.width, self.height)
        if self.model == "SIMPLE_RADIAL":
            f, cx, cy, k = p
            return Intrinsics(f, f, cx, cy, self.width, self.height, (k, 0.0, 0.0, 0.0, 0.0, 0.0))
        if self.model == "RADIAL":
            f, cx, cy, k1, k2 = p
            return Intrinsics(f, f, cx, cy, self.width, self.height, (k1, k2, 0.0, 0.0, 0.0, 0.0))
        if self.model == "OPENCV":
            fx, fy, cx, cy, k1, k2, p1, p2 = p
            return Intrinsics(fx, fy, cx, cy, self.width, self.height, (k1, k2, 0.0, 0.0, p1, p2))
        raise DataError(f"camera {self.id}: unsupported camera model {self.model}")


@dataclass
class ColmapImage:
    id: int
    qvec: np.ndarray     # (4,) qw qx qy qz
    tvec: np.ndarray     # (3,)
    camera_id: int
    name: str
    xys: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    point3D_ids: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.int64))


@dataclass
class ColmapPoints:
    ids: np.ndarray      # (M,) int64
    xyz: np.ndarray      # (M, 3) float64
    rgb: np.ndarray      # (M, 3) uint8
    error: np.ndarray    # (M,) float64


def qvec_to_rotmat(q):
    """Rotation matrix of a (w, x, y, z) quaternion (normalized first)."""
    q = np.asarray(q, np.float64)
    n = np.linalg.norm(q)
    if not np.isfinite(n) or n < 1e-12:
        raise ValueError(f"quaternion {q.tolist()} is zero or not finite")
    w, x, y, z = q / n
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


def rotmat_to_qvec(R):
    """(w, x, y, z) of a rotation matrix, w >= 0."""
    R = np.asarray(R, np.float64)
    K = np.array([
        [R[0, 0] - R[1, 1] - R[2, 2], 0, 0, 0],
        [R[1, 0] + R[0, 1], R[1, 1] - R[0, 0] - R[2, 2], 0, 0],
        [R[2, 0] + R[0, 2], R[2, 1] + R[1, 2], R[2, 2] - R[0, 0] - R[1, 1], 0],
        [R[1, 2] - R[2, 1], R[2, 0] - R[0, 2], R[0, 1] - R[1, 0], R[0, 0] + R[1, 1] + R[2, 2]],
    ]) / 3.0
    vals, vecs = np.linalg.eigh(K)
    q = vecs[[3, 0, 1, 2], np.argmax(vals)]
    return -q if q[0] < 0 else q


def _model_name(model, path):
    """Check a camera model (id or name) is supported; return its name."""
    if isinstance(model, (int, np.integer)):
        if int(model) not in CAMERA_MODELS:
            raise DataError(f"{path}: unknown camera model id {int(model)}")
        name = CAMERA_MODELS[int(model)][0]
        label = f"{name} (model id {int(model)})"
    else:
        name = str(model).upper()
        label = name
    if name not in SUPPORTED_MODELS:
        raise DataError(f"{path}: unsupported camera model {label}; supported: {', '.join(SUPPORTED_MODELS)} "
                        f"(undistort the images with `colmap image_undistorter` first)")
    return name


# ----------------------------------------------------------------------------- binary

class _Reader:
    """Bounds-checked little-endian reader over a whole file."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self.buf = self.path.read_bytes()
        except OSError as exc:
            raise DataError(f"cannot read COLMAP file {self.path}: {exc}") from None
        self.pos = 0

    def truncated(self, what):
        return DataError(f"truncated or corrupt COLMAP file {self.path}: ran out of data reading {what} "
                         f"at byte {self.pos} of {len(self.buf)}")

    def need(self, n, what):
        if n < 0 or self.pos + n > len(self.buf):
            raise self.truncated(what)

    def unpack(self, fmt, what):
        size = struct.calcsize(fmt)
        self.need(size, what)
        vals = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return vals

    def array(self, dtype, count, what):
        dtype = np.dtype(dtype)
        self.need(dtype.itemsize * count, what)
        out = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += dtype.itemsize * count
        return out

    def cstring(self, what):
        end = self.buf.find(b"\0", self.pos)
        if end < 0:
            raise self.truncated(what)
        raw = self.buf[self.pos:end]
        self.pos = end + 1
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("latin-1")

    def count(self, min_record, what):
        (n,) = self.unpack("<Q", f"the number of {what}")
        if n * min_record > len(self.buf) - self.pos:
            raise DataError(f"truncated or corrupt COLMAP file {self.path}: header says {n} {what} "
                            f"but only {len(self.buf) - self.pos} bytes follow")
        return n


def read_cameras_binary(path):
    r = _Reader(path)
    cams = {}
    n = r.count(24, "cameras")
    for i in range(n):
        cid, model_id, width, height = r.unpack("<iiQQ", f"camera {i}")
        _model_name(model_id, r.path)
        name, k = CAMERA_MODELS[model_id]
        params = r.array("<f8", k, f"the parameters of camera {cid}").astype(np.float64)
        cams[cid] = ColmapCamera(cid, name, int(width), int(height), params)
    return cams


_POINT2D = np.dtype([("x", "<f8"), ("y", "<f8"), ("id", "<i8")])


def read_images_binary(path):
    r = _Reader(path)
    images = {}
    n = r.count(64 + 1 + 8, "images")
    for i in range(n):
        vals = r.unpack("<i7di", f"image {i}")
        iid, q, t, cam_id = vals[0], np.array(vals[1:5]), np.array(vals[5:8]), vals[8]
        name = r.cstring(f"the name of image {iid}")
        (n2d,) = r.unpack("<Q", f"the 2D point count of image {name!r}")
        pts = r.array(_POINT2D, n2d, f"the 2D points of image {name!r}")
        images[iid] = ColmapImage(iid, q, t, cam_id, name,
                                  np.stack([pts["x"], pts["y"]], 1).astype(np.float64),
                                  pts["id"].astype(np.int64))
    return images


def read_points3D_binary(path):
    r = _Reader(path)
    n = r.count(43 + 8, "points")
    ids = np.empty(n, np.int64)
    xyz = np.empty((n, 3), np.float64)
    rgb = np.empty((n, 3), np.uint8)
    err = np.empty(n, np.float64)
    rec = struct.Struct("<Q3d3BdQ")
    buf = r.buf
    size = len(buf)
    pos = r.pos
    for i in range(n):
        if pos + rec.size > size:
            r.pos = pos
            raise r.truncated(f"point {i}")
        pid, x, y, z, cr, cg, cb, e, tlen = rec.unpack_from(buf, pos)
        pos += rec.size + 8 * tlen
        if pos > size:
            r.pos = pos - 8 * tlen
            raise r.truncated(f"the track of point {pid}")
        ids[i] = pid
        xyz[i] = (x, y, z)
        rgb[i] = (cr, cg, cb)
        err[i] = e
    return ColmapPoints(ids, xyz, rgb, err)


# ----------------------------------------------------------------------------- text

def _text_lines(path):
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"cannot read COLMAP file {path}: {exc}") from None
    return [(i + 1, line.strip()) for i, line in enumerate(text.splitlines()) if not line.lstrip().startswith("#")]


def _bad_line(path, lineno, what, exc=None):
    extra = f" ({exc})" if exc is not None else ""
    return DataError(f"malformed COLMAP file {path}, line {lineno}: expected {what}{extra}")


def read_cameras_text(path):
    cams = {}
    for lineno, line in _text_lines(path):
        if not line:
            continue
        tok = line.split()
        if len(tok) < 4:
            raise _bad_line(path, lineno, "CAMERA_ID MODEL WIDTH HEIGHT PARAMS[]")
        model = tok[1].upper()
        if model.isdigit():
            model = CAMERA_MODELS.get(int(model), (model, 0))[0]
        if model not in NUM_PARAMS:
            raise DataError(f"{path}: unknown camera model {tok[1]!r} (line {lineno})")
        _model_name(model, path)
        try:
            cid, width, height = int(tok[0]), int(tok[2]), int(tok[3])
            params = np.array([float(v) for v in tok[4:]], np.float64)
        except ValueError as exc:
            raise _bad_line(path, lineno, "CAMERA_ID MODEL WIDTH HEIGHT PARAMS[]", exc) from None
        if len(params) != NUM_PARAMS[model]:
            raise _bad_line(path, lineno, f"{NUM_PARAMS[model]} parameters for {model}, got {len(params)}")
        cams[cid] = ColmapCamera(cid, model, width, height, params)
    return cams


def read_images_text(path):
    lines = _text_lines(path)
    images = {}
    i = 0
    while i < len(lines):
        lineno, line = lines[i]
        i += 1
        if not line:
            continue
        tok = line.split(maxsplit=9)
        if len(tok) < 10:
            raise _bad_line(path, lineno, "IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID NAME")
        try:
            iid = int(tok[0])
            q = np.array([float(v) for v in tok[1:5]])
            t = np.array([float(v) for v in tok[5:8]])
            cam_id = int(tok[8])
        except ValueError as exc:
            raise _bad_line(path, lineno, "IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID NAME", exc) from None
        name = tok[9]
        pts_line = ""
        if i < len(lines):
            pts_lineno, pts_line = lines[i]
            i += 1
        tok2 = pts_line.split()
        if len(tok2) % 3:
            raise _bad_line(path, pts_lineno, f"POINTS2D[] as (X, Y, POINT3D_ID) triples for image {name!r}")
        try:
            arr = np.array([float(v) for v in tok2], np.float64).reshape(-1, 3)
        except ValueError as exc:
            raise _bad_line(path, pts_lineno, f"POINTS2D[] for image {name!r}", exc) from None
        images[iid] = ColmapImage(iid, q, t, cam_id, name, arr[:, :2].copy(), arr[:, 2].astype(np.int64))
    return images


def read_points3D_text(path):
    ids, xyz, rgb, err = [], [], [], []
    for lineno, line in _text_lines(path):
        if not line:
            continue
        tok = line.split()
        if len(tok) < 8 or (len(tok) - 8) % 2:
            raise _bad_line(path, lineno, "POINT3D_ID X Y Z R G B ERROR TRACK[]")
        try:
            ids.append(int(tok[0]))
            xyz.append([float(v) for v in tok[1:4]])
            rgb.append([int(v) for v in tok[4:7]])
            err.append(float(tok[7]))
        except ValueError as exc:
            raise _bad_line(path, lineno, "POINT3D_ID X Y Z R G B ERROR TRACK[]", exc) from None
    return ColmapPoints(np.array(ids, np.int64).reshape(-1), np.array(xyz, np.float64).reshape(-1, 3),
                        np.clip(np.array(rgb, np.int64).reshape(-1, 3), 0, 255).astype(np.uint8),
                        np.array(err, np.float64).reshape(-1))


# ----------------------------------------------------------------------------- model

def _model_file(folder, stem):
    """``folder/stem.bin``, else ``folder/stem.txt``, else None."""
    for ext in (".bin", ".txt"):
        p = Path(folder) / f"{stem}{ext}"
        if p.is_file():
            return p
    return None


def model_dir(root):
    """The folder holding the COLMAP model of the scene ``root`` (``sparse/0`` or ``sparse``), or None."""
    root = Path(root)
    for cand in (root / "sparse" / "0", root / "sparse"):
        if all(_model_file(cand, stem) is not None for stem in ("cameras", "images")):
            return cand
    return None


def read_model(folder):
    """(cameras, images, points) of a COLMAP model folder (.bin preferred over .txt).

    ``points`` is None when there is no points3D file.
    """
    folder = Path(folder)
    readers = {
        "cameras": (read_cameras_binary, read_cameras_text),
        "images": (read_images_binary, read_images_text),
        "points3D": (read_points3D_binary, read_points3D_text),
    }
    out = []
    for stem, (rb, rt) in readers.items():
        p = _model_file(folder, stem)
        if p is None:
            if stem == "points3D":
                out.append(None)
                continue
            raise DataError(f"COLMAP model {folder} has no {stem}.bin or {stem}.txt")
        out.append(rb(p) if p.suffix == ".bin" else rt(p))
    return tuple(out)


def viewmat_of(image):
    """4x4 world-to-camera of a COLMAP image; DataError naming it on bad values."""
    q = np.asarray(image.qvec, np.float64)
    t = np.asarray(image.tvec, np.float64)
    if not (np.isfinite(q).all() and np.isfinite(t).all()):
        raise DataError(f"image {image.name}: the pose has non-finite values (q={q.tolist()}, t={t.tolist()})")
    try:
        R = qvec_to_rotmat(q)
    except ValueError as exc:
        raise DataError(f"image {image.name}: {exc}") from None
    M = np.eye(4)
    M[:3, :3] = R
    M[:3, 3] = t
    return M


# ----------------------------------------------------------------------------- image folder matching

def _image_folder(root, images):
    if images is None:
        images = "images"
    folder = Path(images) if Path(images).is_absolute() else Path(root) / images
    if folder.is_dir():
        return folder
    subdirs = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
    with_images = [d for d in subdirs if any(is_image_file(f) for f in (Path(root) / d).iterdir())]
    listed = with_images or subdirs
    raise DataError(f"image folder {folder} does not exist; folders in {root}: "
                    f"{', '.join(listed) if listed else '(none)'}")


def _listing(names, most=5):
    """'a, b, c' or 'a, b, c, d, e and 7 more'."""
    names = [str(n) for n in names]
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _missing_from_sequence(files, count):
    """{first number: the names missing} where ``files`` are a numbered sequence such as image000.png
    ... image019.png (one prefix, number of digits and extension) that should hold ``count`` files:
    for each numbering that fits them, from 0 or from 1 (LLFF's folders count from 0), the gaps and
    the numbers beyond the files' ends, so a deleted first or last file is named too; else from the
    files' first number, where the gaps alone make up the count.  {} when they are no such sequence."""
    parts = [re.fullmatch(r"(.*?)(\d+)(\.[^.]+)", f) for f in files]
    if not parts or not all(parts) or len({(m[1], len(m[2]), m[3]) for m in parts}) != 1:
        return {}
    prefix, width, ext = parts[0][1], len(parts[0][2]), parts[0][3]
    numbers = {int(m[2]) for m in parts}
    lo, hi = min(numbers), max(numbers)
    fits = {}
    for first in sorted({0, 1, lo}):
        last = first + count - 1
        if first <= lo and hi <= last and (first in (0, 1) or hi == last):
            fits[first] = [f"{prefix}{i:0{width}d}{ext}" for i in range(first, last + 1) if i not in numbers]
    return fits


def match_images(folder, names):
    """(files, note): map model image names to (relative) file names in ``folder``.

    Exact names first; then the same stem with another image extension;
    then, if no name matched and the folder holds exactly as many images as
    the model, sorted model names pair with sorted files (the LLFF renaming),
    which ``note`` says.
    """
    folder = Path(folder)
    names = list(names)
    exact = {n: n for n in names if (folder / n).is_file()}
    if len(exact) == len(names):
        return exact, None
    files = list_image_files(folder)
    if not files:
        raise DataError(f"image folder {folder} holds no image files ({', '.join(IMAGE_EXTENSIONS)}); the COLMAP "
                        f"model lists {len(names)} images, such as {sorted(names)[0]}")
    by_stem = {}
    for f in files:
        by_stem.setdefault(Path(f).stem, []).append(f)
    found = dict(exact)
    for n in names:
        if n not in found:
            cands = by_stem.get(Path(n).stem, [])
            if len(cands) == 1 and (Path(n).parent == Path(".")):
                found[n] = cands[0]
    if len(found) == len(names):
        return found, None
    if found:
        missing = sorted(n for n in names if n not in found)
        if len(missing) == 1:
            raise DataError(f"missing image file {folder / missing[0]}: the COLMAP model lists it, and the "
                            f"{len(found)} other images are there")
        raise DataError(f"missing {len(missing)} of the {len(names)} image files the COLMAP model lists, in "
                        f"{folder}: {_listing(missing)}")
    if len(files) == len(names):
        note = (f"none of the COLMAP image names exist in {folder}: paired the {len(names)} model images with "
                f"the {len(files)} files there in sorted order ({sorted(names)[0]} -> {files[0]}, ...)")
        return dict(zip(sorted(names), files)), note
    holds = (f"{folder} holds {len(files)} image files ({files[0]} ... {files[-1]}) for the {len(names)} images "
             f"of the COLMAP model, none of them by its name ({sorted(names)[0]}, ...), and renamed files pair "
             f"with the model's images in sorted order only when their numbers match")
    fits = list(_missing_from_sequence(files, len(names)).values())
    if not fits:
        raise DataError(holds)
    plural = "s" if len(fits[0]) > 1 else ""
    missing = f"missing image file{plural} {_listing(folder / m for m in fits[0])}"
    if len(fits) == 2:  # from 0 or from 1
        missing += f" if the numbers start at 0, or {_listing(fits[1])} if they start at 1"
    raise DataError(f"{missing}: {holds}")


# ----------------------------------------------------------------------------- loader

def load(path, images=None, background=(1.0, 1.0, 1.0), test_every=None, downscale=Downscale(), train_views=None,
         distortion="undistort"):
    """Load a COLMAP scene into a ``Dataset`` (the arguments as ``load_dataset``'s).  With
    ``train_views``, only the images of the first that many training views are read."""
    root = Path(path)
    model = model_dir(root)
    if model is None:
        raise DataError(f"no COLMAP model in {root}: looked for sparse/0/ and sparse/ with "
                        f"cameras and images (.bin or .txt)")
    cams, imgs, pts = read_model(model)
    folder = _image_folder(root, images)
    if not imgs:
        raise DataError(f"COLMAP model {model} has no images")

    imgs = sorted(imgs.values(), key=lambda im: im.name)
    jobs = []
    for im in imgs:
        if im.camera_id not in cams:
            raise DataError(f"image {im.name} refers to camera {im.camera_id}, which is not in "
                            f"{_model_file(model, 'cameras')}")
        cam = cams[im.camera_id]
        intr = cam.intrinsics()
        if not intr.finite():
            raise DataError(f"image {im.name}: camera {cam.id} ({_model_file(model, 'cameras')}) has "
                            f"non-finite parameters {cam.params.tolist()} or size {cam.width}x{cam.height}")
        if cam.width <= 0 or cam.height <= 0 or intr.fx <= 0 or intr.fy <= 0:
            raise DataError(f"image {im.name}: camera {cam.id} ({_model_file(model, 'cameras')}) has invalid "
                            f"size {cam.width}x{cam.height} or focal length {intr.fx}, {intr.fy}")
        jobs.append((im, cam, intr, viewmat_of(im)))

    files, pairing = match_images(folder, [im.name for im in imgs])
    notes = [pairing] if pairing else []
    if train_views:
        train_jobs, _ = split_indices([files[j[0].name] for j in jobs], test_every)
        jobs = [jobs[i] for i in train_jobs[:train_views]]
        notes.append(f"read the first {len(jobs)} of the {len(train_jobs)} training views, no test views")
    ignored = ignored_distortion_note([intr for _, _, intr, _ in jobs], distortion)
    notes += [ignored] if ignored else []
    jobs = [(im, cam, intr.as_loaded(distortion), vm) for im, cam, intr, vm in jobs]

    def work(job):
        im, cam, intr, _ = job
        return load_image(folder / files[im.name], intr, background, downscale)

    loaded = parallel_map(work, jobs)
    check_sizes(loaded, [files[j[0].name] for j in jobs], [j[0].camera_id for j in jobs])

    views = []
    stretched = {}
    for (im, cam, intr, viewmat), li in zip(jobs, loaded):
        name = files[im.name]
        views.append(li.view(name, viewmat, cam.model))
        sx, sy = li.native[0] / cam.width, li.native[1] / cam.height
        if abs(sx - sy) > 0.02 * max(sx, sy):
            stretched.setdefault(cam.id, (name, li.native, cam))
    for name, (w, h), cam in stretched.values():
        notes.append(f"the images of camera {cam.id} ({name}: {w}x{h}) do not have its aspect ratio "
                     f"({cam.width}x{cam.height}); scaling the axes separately")

    train, test = (views, []) if train_views else split_views(views, test_every)
    if pts is None:
        xyz, rgb = np.zeros((0, 3)), np.zeros((0, 3))
        origin = f"the COLMAP model {model.relative_to(root).as_posix()} has no points3D file"
    else:
        xyz, rgb = pts.xyz, pts.rgb.astype(np.float32) / 255.0
        origin = _model_file(model, "points3D").relative_to(root).as_posix()
        origin = origin if len(xyz) else f"{origin} holds no points"
    return build_dataset(train, test, xyz, rgb, root, "colmap", split=every_nth(test_every), points_origin=origin,
                         downscale=downscale, images=str(images or "images"), notes=notes)
