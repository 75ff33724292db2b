"""Training snapshots: every array needed to resume, plus JSON metadata, in one HDF5 file.

The arrays are the model's state (``params/<group>``, ``adam/m/<group>``,
``adam/v/<group>``; Adam's step count is the ``adam_step`` attribute) and the
strategy's state (``strategy/<name>``): ``state_arrays`` and ``states_of``.

One file per snapshot so a resume never mixes states; written to a temp file
and renamed (with fsyncs) so a crash mid-write leaves the previous snapshot
intact.  Metadata is one JSON string attribute because HDF5 attributes cannot
hold nested dicts or the 128-bit integers of a numpy RNG state (JSON can).
"""
import hashlib
import json
import os
import re

import h5py
import numpy as np

from data.atomic import atomic_path

FORMAT_VERSION = 1
META_ATTR = "numbasplat_meta"
VIEWS_ARRAY = "data/views"  # the training views' ``view_records`` (``records_array``)
VERSION_ATTR = "numbasplat_format"


SNAPSHOT_CHUNK_ROWS = 1 << 20  # rows of a ``read_in_slices`` array read and written at a time


def _json_default(o):
    """numpy scalars/arrays that creep into configs -> plain JSON values."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"snapshot attrs value of type {type(o).__name__} is not JSON-serialisable")


def write_snapshot(path, arrays, attrs):
    """Atomically write ``arrays`` ({"group/name": ndarray, or an array read ``SNAPSHOT_CHUNK_ROWS`` rows
    at a time: one with ``read_in_slices`` true, as ``TableRows``}) and JSON ``attrs`` to ``path``.

    A disk without room for the arrays is refused before HDF5 writes, and one that fills up
    mid-file is one OSError of the first failure (``atomic_path``'s one line), not the second
    that HDF5 raises closing the file."""
    path = os.fspath(path)
    meta = json.dumps(attrs, default=_json_default)  # fail before touching the disk
    arrays = {name: a if getattr(a, "read_in_slices", False) else np.asarray(a) for name, a in arrays.items()}
    for name in arrays:
        if not name or name.startswith("/") or "" in name.split("/"):
            raise ValueError(f"bad snapshot array name {name!r}")
    with atomic_path(path, size=len(meta) + sum(a.nbytes for a in arrays.values())) as tmp:
        f = h5py.File(tmp, "w")
        try:
            f.attrs[VERSION_ATTR] = FORMAT_VERSION
            f.attrs[META_ATTR] = meta
            for name, a in arrays.items():  # (intermediate groups from the slashes)
                if getattr(a, "read_in_slices", False):  # read a slice of rows at a time (``TableRows``)
                    d = f.create_dataset(name, shape=a.shape, dtype=a.dtype)
                    for start in range(0, len(a), SNAPSHOT_CHUNK_ROWS):
                        d[start:start + SNAPSHOT_CHUNK_ROWS] = a[start:start + SNAPSHOT_CHUNK_ROWS]
                else:
                    f.create_dataset(name, data=a)
            f.close()
        except BaseException as e:
            _close_quietly(f)
            raise _with_errno(e, tmp)


def _close_quietly(f):
    """Close an HDF5 file after a failure: closing fails again where the disk is full, and that
    second error would hide the first."""
    try:
        f.close()
    except Exception:
        pass


def _with_errno(e, filename):
    """HDF5's failure ``e`` as an OSError carrying the system's errno where only its text has it
    ("errno = 28", as a RuntimeError flushing a full disk), so that callers can tell a full disk;
    else ``e``."""
    found = None if isinstance(e, OSError) and e.errno else re.search(r"\berrno = (\d+)", str(e))
    return OSError(int(found[1]), os.strerror(int(found[1])), filename) if found else e


def state_arrays(model_state, strategy_state):
    """The snapshot arrays of a ``GaussianModel.state()`` and a strategy's state (host arrays)."""
    arrays = {f"params/{g}": a for g, a in model_state["params"].items()}
    arrays.update({f"adam/m/{g}": a for g, a in model_state["m"].items()})
    arrays.update({f"adam/v/{g}": a for g, a in model_state["v"].items()})
    arrays.update({f"strategy/{k}": a for k, a in strategy_state.items()})
    return arrays


def states_of(arrays, attrs):
    """-> (model state, strategy state) of a snapshot's arrays and attributes: ``state_arrays`` undone."""
    def group(prefix):
        return {k[len(prefix):]: a for k, a in arrays.items() if k.startswith(prefix)}
    model = {"params": group("params/"), "m": group("adam/m/"), "v": group("adam/v/"), "step": int(attrs["adam_step"])}
    return model, group("strategy/")


def read_snapshot(path):
    """-> (arrays {"group/name": ndarray}, attrs dict); ValueError naming ``path`` if unusable."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"snapshot {path} does not exist")
    try:
        with h5py.File(path, "r") as f:
            if META_ATTR not in f.attrs or VERSION_ATTR not in f.attrs:
                raise ValueError(f"{path} is not a NumbaSplat snapshot (no {META_ATTR} attribute)")
            version = int(f.attrs[VERSION_ATTR])
            if version > FORMAT_VERSION:
                raise ValueError(f"{path}: snapshot format {version} is newer than the supported "
                                 f"{FORMAT_VERSION}; upgrade NumbaSplat to resume from it")
            meta = f.attrs[META_ATTR]
            attrs = json.loads(meta.decode() if isinstance(meta, bytes) else meta)
            arrays = {}

            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    arrays[name] = np.asarray(obj[()])
            f.visititems(visit)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt snapshot metadata ({e})") from e
    except (OSError, KeyError, RuntimeError) as e:  # h5py: truncated or damaged file
        raise ValueError(f"{path} is not a readable NumbaSplat snapshot (truncated or corrupt?): {e}") from e
    return arrays, attrs


def view_records(views):
    """What a snapshot records of each training view, to know the data it trained on by content, not
    by path (the same capture under another path, or a copy, is the same data): [name, [width,
    height], digest of the pixels, digest of the camera], in the views' order."""
    return [[v.name, [v.width, v.height], _digest(v.image), _digest(_camera_numbers(v.camera))] for v in views]


def _camera_numbers(camera):
    """A camera's pose and intrinsics, as one float64 array."""
    c = camera
    return np.concatenate([np.ravel(c.viewmat), [c.fx, c.fy, c.cx, c.cy, c.width, c.height]]).astype(np.float64)


def _digest(a):
    """16 hex digits (blake2b) of an array's values, shape and type."""
    a = np.ascontiguousarray(a)
    h = hashlib.blake2b(f"{a.dtype.str}{a.shape}".encode(), digest_size=8)
    h.update(a.data)
    return h.hexdigest()


def records_fingerprint(records):
    """sha256 of ``view_records``: one string that two sets of views share only when they are the same."""
    return hashlib.sha256(json.dumps(records, separators=(",", ":")).encode()).hexdigest()


def records_array(records):
    """``view_records`` as a snapshot array (JSON bytes: too many views would outgrow an HDF5 attribute)."""
    return np.frombuffer(json.dumps(records, separators=(",", ":")).encode(), np.uint8)


def records_of(array):
    """The ``view_records`` that ``records_array`` stored."""
    return json.loads(np.asarray(array, np.uint8).tobytes())


def data_difference(recorded, current):
    """The first way the views ``current`` differ from the ``recorded`` ones (both ``view_records``),
    in words naming the image; "" where they are the same."""
    before = {r[0]: r for r in recorded}
    now = {r[0]: r for r in current}
    for names, there, where in ((before, now, "missing here"), (now, before, "new")):
        odd = [n for n in names if n not in there]
        if odd:
            return f"image {odd[0]} is {where}" + (f" ({len(odd)} images are)" if len(odd) > 1 else "")
    for name, size, image, camera in current:
        _, size_then, image_then, camera_then = before[name]
        if size != size_then:
            return (f"image {name} is {size[0]}x{size[1]} here, {size_then[0]}x{size_then[1]} in the snapshot "
                    "(another --resolution or --max-width?)")
        if image != image_then:
            return f"image {name} differs"
        if camera != camera_then:
            return f"the camera of image {name} differs"
    if list(before) != list(now):
        return "the images come in another order"
    return ""


def dataset_fingerprint(names, shapes, extra=""):
    """sha256 over sorted (image name, shape) pairs and ``extra``: detects a resume
    against a different dataset without reading any pixels (snapshots before ``view_records``)."""
    names, shapes = list(names), list(shapes)
    if len(names) != len(shapes):
        raise ValueError(f"{len(names)} names but {len(shapes)} shapes")
    items = sorted((str(n), [int(s) for s in shape]) for n, shape in zip(names, shapes))
    blob = json.dumps({"images": items, "extra": str(extra)}, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
