"""PLY files: Gaussians in the reference 3DGS layout, and point clouds.

The reference layout (x y z nx ny nz f_dc_* f_rest_* opacity scale_* rot_*,
pre-activation values, f_rest channel-major) is what viewers and other
trainers exchange, so we write exactly that.  Reading is lenient: properties
are found by name in any order and type, extra ones are ignored, and ascii
and both binary encodings are accepted, because exporters differ.  The same
reader serves point clouds (x y z and optional colours, as datasets ship their
initial points).  Every error is a ValueError that names the file.
"""
import os
import re
from collections.abc import Mapping

import numpy as np

from .atomic import atomic_path

PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1",
    "short": "i2", "int16": "i2", "ushort": "u2", "uint16": "u2",
    "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}
FORMATS = {"ascii": None, "binary_little_endian": "<", "binary_big_endian": ">"}
REST_TO_DEGREE = {0: 0, 9: 1, 24: 2, 45: 3}
BASE_PROPS = (["x", "y", "z"] + [f"f_dc_{i}" for i in range(3)] + ["opacity"]
              + [f"scale_{i}" for i in range(3)] + [f"rot_{i}" for i in range(4)])


def _host(a):
    """numpy view of a numpy or CuPy array (CuPy refuses np.asarray)."""
    return np.asarray(a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a)


PLY_CHUNK_ROWS = 1 << 20  # rows assembled and written at a time: a model's file is not built whole in memory
PLY_READ_ROWS = 1 << 16  # whole records read at a time where a file's properties are all float32 (``PlyGaussians``)


def _columns(g, start=0, stop=None):
    """(names, float32 (rows, P) matrix of rows ``start`` .. ``stop`` (default: to the end)) in the
    reference column order; only those rows leave the device."""
    means, scales, quats, opac, sh = g.means, g.scales, g.quats, g.opacities, g.sh
    n = means.shape[0]
    if len(sh.shape) != 3 or sh.shape[0] != n or sh.shape[2] != 3 or sh.shape[1] not in (1, 4, 9, 16):
        raise ValueError(f"sh must be (N, K, 3) with K in 1, 4, 9, 16; got {sh.shape}")
    for name, a, w in (("means", means, 3), ("scales", scales, 3), ("quats", quats, 4)):
        if tuple(a.shape) != (n, w):
            raise ValueError(f"{name} must be ({n}, {w}), got {a.shape}")
    if opac.size != n:
        raise ValueError(f"opacities must hold {n} values, got shape {opac.shape}")
    k = sh.shape[1]
    names = (["x", "y", "z", "nx", "ny", "nz"] + [f"f_dc_{i}" for i in range(3)]
             + [f"f_rest_{i}" for i in range(3 * (k - 1))] + ["opacity"]
             + [f"scale_{i}" for i in range(3)] + [f"rot_{i}" for i in range(4)])
    stop = n if stop is None else min(stop, n)
    rows = slice(start, stop)
    cols = np.zeros((max(stop - start, 0), len(names)), "<f4")  # (the normals stay 0)
    rest = 9 + 3 * (k - 1)
    cols[:, 0:3] = _host(means[rows])
    cols[:, 6:9] = _host(sh[rows, 0, :])
    cols[:, 9:rest] = _host(sh[rows, 1:, :]).transpose(0, 2, 1).reshape(len(cols), 3 * (k - 1))  # channel-major
    cols[:, rest] = _host(opac[rows]).reshape(-1)
    cols[:, rest + 1:rest + 4] = _host(scales[rows])
    cols[:, rest + 4:rest + 8] = _host(quats[rows])
    return names, cols


def save_ply(path, g):
    """Write ``g`` (means, scales, quats, opacities, sh) as a reference 3DGS PLY.

    Atomic (temp file, fsync, rename): a crash never leaves a half-written
    file where a good one was.  Rows go out ``PLY_CHUNK_ROWS`` at a time.
    """
    names, _ = _columns(g, 0, 0)  # (checks the shapes)
    n = g.means.shape[0]
    header = ("ply\nformat binary_little_endian 1.0\n"
              f"element vertex {n}\n"
              + "".join(f"property float {p}\n" for p in names) + "end_header\n")
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(header.encode("ascii"))
        for start in range(0, n, PLY_CHUNK_ROWS):
            f.write(memoryview(_columns(g, start, start + PLY_CHUNK_ROWS)[1]).cast("B"))


def _parse_header(f, path):
    """-> (format, [(element name, count, [(prop, dtype or None for list)])])."""
    if f.readline().rstrip(b"\r\n") != b"ply":
        raise ValueError(f"{path}: not a PLY file (no 'ply' magic line)")
    fmt, elements = None, []
    while True:
        raw = f.readline()
        if not raw:
            raise ValueError(f"{path}: truncated PLY header (no end_header)")
        words = raw.decode("ascii", "replace").split()
        if not words or words[0] in ("comment", "obj_info"):
            continue
        if words[0] == "end_header":
            break
        if words[0] == "format" and len(words) >= 2:
            if words[1] not in FORMATS:
                raise ValueError(f"{path}: unsupported PLY format {words[1]!r}")
            fmt = words[1]
        elif words[0] == "element" and len(words) == 3 and words[2].isdigit():
            elements.append((words[1], int(words[2]), []))
        elif words[0] == "property" and elements:
            if len(words) == 5 and words[1] == "list":
                elements[-1][2].append((words[4], None))
            elif len(words) == 3 and words[1] in PLY_TYPES:
                elements[-1][2].append((words[2], PLY_TYPES[words[1]]))
            else:
                raise ValueError(f"{path}: unsupported PLY property line {raw.strip()!r}")
        else:
            raise ValueError(f"{path}: malformed PLY header line {raw.strip()!r}")
    if fmt is None:
        raise ValueError(f"{path}: PLY header has no format line")
    return fmt, elements


def _read_vertices(f, path, fmt, elements):
    """-> ({property name: float64 or native column}, count) of the vertex element."""
    names = [e[0] for e in elements]
    if "vertex" not in names:
        raise ValueError(f"{path}: PLY has no 'vertex' element")
    vi = names.index("vertex")
    _, n, props = elements[vi]
    pnames = [p for p, _ in props]
    if len(set(pnames)) != len(pnames):
        raise ValueError(f"{path}: duplicate vertex property names")
    if any(t is None for _, t in props):
        raise ValueError(f"{path}: list properties in the vertex element are not supported")
    if fmt == "ascii":
        lines = [ln for ln in f.read().decode("ascii", "replace").splitlines() if ln.strip()]
        skip = sum(e[1] for e in elements[:vi])
        body = lines[skip:skip + n]
        if len(body) < n:
            raise ValueError(f"{path}: truncated PLY data ({len(body)} of {n} vertices)")
        try:
            rows = np.array([ln.split() for ln in body], dtype=np.float64)
        except ValueError:
            raise ValueError(f"{path}: malformed ascii PLY vertex data") from None
        if n == 0:  # np.array([]) is 1-D
            rows = rows.reshape(0, len(props))
        if rows.shape != (n, len(props)):
            raise ValueError(f"{path}: ascii PLY vertex rows do not have {len(props)} values")
        return {p: rows[:, i] for i, p in enumerate(pnames)}, n, None
    end = FORMATS[fmt]
    for name, count, eprops in elements[:vi]:  # skip fixed-size elements before the vertices
        if any(t is None for _, t in eprops):
            raise ValueError(f"{path}: list element {name!r} before the vertices is not supported")
        f.seek(count * np.dtype([(p, end + t) for p, t in eprops]).itemsize, os.SEEK_CUR)
    dtype = np.dtype([(p, end + t) for p, t in props])
    offset, size = f.tell(), os.fstat(f.fileno()).st_size
    if size - offset < n * dtype.itemsize:
        raise ValueError(f"{path}: truncated PLY data ({size - offset} of {n * dtype.itemsize} bytes)")
    # (memory-mapped: the columns are read as they are used, a slice of rows at a time where so read)
    data = np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=(n,)) if n else np.zeros(0, dtype)
    return {p: data[p] for p in pnames}, n, data


def _read_vertex_columns(path, required):
    """-> (columns as ``_read_vertices``, count, {property: PLY dtype}, the records: a memory-mapped structured
    array, None for ascii) of the vertex element of the PLY at ``path``; ValueError naming the file if it lacks a
    ``required`` one."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        fmt, elements = _parse_header(f, path)
        cols, n, records = _read_vertices(f, path, fmt, elements)
    missing = [p for p in required if p not in cols]
    if missing:
        raise ValueError(f"{path}: PLY lacks required vertex properties: {', '.join(missing)}")
    types = dict(next(props for name, _, props in elements if name == "vertex"))
    return cols, n, types, records


def load_ply_points(path):
    """Read a point cloud PLY -> (xyz (M, 3) float64, rgb (M, 3) float64 in [0, 1]).

    Colours come from red, green, blue: integers divided by their type's
    maximum (255, or 65535 for 16-bit ones), floats taken as they are unless
    some exceeds 1 (then as 0..255).  Without them every point is 0.5 grey.
    """
    cols, _, types, _ = _read_vertex_columns(path, ("x", "y", "z"))
    xyz = np.stack([np.asarray(cols[p], np.float64) for p in ("x", "y", "z")], 1)
    if not all(p in cols for p in ("red", "green", "blue")):
        return xyz, np.full_like(xyz, 0.5)
    rgb = np.stack([np.asarray(cols[p], np.float64) for p in ("red", "green", "blue")], 1)
    if types["red"].startswith("f"):
        rgb = rgb if rgb.max(initial=0.0) <= 1.0 else rgb / 255.0
    else:
        rgb = rgb / (65535.0 if types["red"].endswith("2") else 255.0)
    return xyz, np.clip(rgb, 0.0, 1.0)


def load_ply(path):
    """Read a 3DGS PLY -> dict of float32 means, scales, quats, opacities, sh (N, K, 3)."""
    return dict(PlyGaussians(path))


class PlyGaussians(Mapping):
    """A 3DGS PLY's Gaussians as ``load_ply``'s groups, each read from the memory-mapped file when it is asked
    for (``g["means"]``), or a slice of rows of every group at a time (``rows``): host memory holds the
    parameters once, or a slice of them, never the file beside them (a model of 100M Gaussians cut into
    out-of-core blocks as it is read).  Where every property is a little-endian float32 (a 3DGS trainer's file)
    the records are read as rows of one float32 table, ``PLY_READ_ROWS`` whole records at a time and their
    columns picked from them: a property at a time would read every record's cache lines once a property."""

    GROUPS = ("means", "scales", "quats", "opacities", "sh")

    def __init__(self, path):
        self.path = os.fspath(path)
        self._cols, self.n, _, records = _read_vertex_columns(self.path, BASE_PROPS)
        rest = sorted((int(m.group(1)), p) for p in self._cols if (m := re.fullmatch(r"f_rest_(\d+)", p)))
        if len(rest) not in REST_TO_DEGREE or [i for i, _ in rest] != list(range(len(rest))):
            raise ValueError(f"{self.path}: f_rest_* properties must be f_rest_0..f_rest_M-1 with "
                             f"M in 0, 9, 24, 45; got {len(rest)}")
        self.sh_degree = REST_TO_DEGREE[len(rest)]
        self.sh_bases = (self.sh_degree + 1) ** 2
        self._keys = {"means": ["x", "y", "z"], "scales": [f"scale_{i}" for i in range(3)],
                      "quats": [f"rot_{i}" for i in range(4)], "opacities": ["opacity"],
                      "sh": [f"f_dc_{i}" for i in range(3)] + [p for _, p in rest]}
        fields = records.dtype.fields if records is not None else {}
        self._table = self._place = None  # (the records as a float32 table, each property's column)
        if fields and all(t == np.dtype("<f4") for t, *_ in fields.values()) and self.n:
            self._table = records.view(np.float32).reshape(self.n, len(fields))
            self._place = {p: offset // 4 for p, (_, offset, *_) in fields.items()}

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.GROUPS)

    def __getitem__(self, group):
        if group not in self.GROUPS:
            raise KeyError(group)
        return self._group(group, self._read(self._keys[group], 0, self.n))

    def rows(self, start, stop):
        """-> ``load_ply``'s dict of rows ``start`` .. ``stop`` (every group's columns read in one pass)."""
        table, at, out = self._read([k for g in self.GROUPS for k in self._keys[g]], start, stop), 0, {}
        for g in self.GROUPS:
            out[g], at = self._group(g, table[:, at:at + len(self._keys[g])]), at + len(self._keys[g])
        return out

    def _read(self, keys, a, b):
        """The properties ``keys`` of rows ``a`` .. ``b`` as a float32 (rows, len(keys)) array."""
        out = np.empty((max(0, b - a), len(keys)), np.float32)
        if self._table is None:
            for j, p in enumerate(keys):
                out[:, j] = self._cols[p][a:b]
            return out
        columns = np.array([self._place[p] for p in keys], np.int64)
        for r in range(a, b, PLY_READ_ROWS):  # (the records read whole, then their columns taken: several times
            s = min(b, r + PLY_READ_ROWS)  # faster than indexing the mapped table's columns)
            np.take(np.asarray(self._table[r:s]), columns, axis=1, out=out[r - a:s - a])
        return out

    def _group(self, group, columns):
        """Group ``group``'s array from its properties' ``columns`` (``_read``'s, in ``_keys``' order)."""
        if group == "opacities":
            return np.ascontiguousarray(columns[:, 0])
        if group != "sh":
            return np.ascontiguousarray(columns)
        n, k = len(columns), self.sh_bases
        sh = np.empty((n, k, 3), np.float32)
        sh[:, 0, :] = columns[:, :3]
        if k > 1:  # channel-major on disk: column c*(K-1) + (k-1) holds sh[:, k, c]
            sh[:, 1:, :] = columns[:, 3:].reshape(n, 3, k - 1).transpose(0, 2, 1)
        return sh
