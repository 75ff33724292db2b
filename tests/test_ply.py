"""data/ply.py: reference 3DGS PLY layout, lenient reading, atomic writes, point clouds."""
import importlib
import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import REPO_ROOT


def _load_ply_module():
    # data/ is a package once data/__init__.py lands; until then load the file directly.
    if (REPO_ROOT / "data" / "__init__.py").exists():
        return importlib.import_module("data.ply")
    spec = importlib.util.spec_from_file_location("_numbasplat_data_ply", REPO_ROOT / "data" / "ply.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ply = _load_ply_module()
FIELDS = ("means", "scales", "quats", "opacities", "sh")


def random_gaussians(n, degree, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    k = (degree + 1) ** 2
    return SimpleNamespace(
        means=rng.normal(size=(n, 3)).astype(dtype),
        scales=rng.normal(-3, 1, size=(n, 3)).astype(dtype),
        quats=rng.normal(size=(n, 4)).astype(dtype),
        opacities=rng.normal(size=n).astype(dtype),
        sh=rng.normal(size=(n, k, 3)).astype(dtype),
    )


def no_temp_files(folder):
    return [p for p in os.listdir(folder) if ".tmp" in p] == []


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_round_trip_exact(tmp_path, degree):
    g = random_gaussians(57, degree, seed=degree)
    path = tmp_path / "g.ply"
    ply.save_ply(path, g)
    out = ply.load_ply(path)
    assert set(out) == set(FIELDS)
    for f in FIELDS:
        assert out[f].dtype == np.float32
        np.testing.assert_array_equal(out[f], getattr(g, f), err_msg=f)
    assert out["sh"].shape == (57, (degree + 1) ** 2, 3)
    assert no_temp_files(tmp_path)


def test_a_float32_file_is_read_a_few_whole_records_at_a_time_as_it_is_read_a_property_at_a_time(tmp_path,
                                                                                                 monkeypatch):
    """``PlyGaussians`` reads a file of float32 properties as rows of one table, whole records a few at a time (5
    here, the last short), the columns picked from them: its groups and its slices of rows equal those read a
    property at a time (the path of other files: doubles, big-endian, ascii)."""
    monkeypatch.setattr(ply, "PLY_READ_ROWS", 5)
    g = random_gaussians(57, 3, seed=6)
    path = tmp_path / "g.ply"
    ply.save_ply(path, g)
    fast, slow = ply.PlyGaussians(path), ply.PlyGaussians(path)
    slow._table = None
    assert fast._table is not None
    for a, b in ((0, 57), (3, 22), (50, 57), (7, 7)):
        fast_rows, slow_rows = fast.rows(a, b), slow.rows(a, b)
        for f in FIELDS:
            np.testing.assert_array_equal(fast_rows[f], getattr(g, f)[a:b], err_msg=f)
            np.testing.assert_array_equal(slow_rows[f], getattr(g, f)[a:b], err_msg=f)
            assert fast_rows[f].flags.c_contiguous
    for f in FIELDS:
        np.testing.assert_array_equal(fast[f], getattr(g, f), err_msg=f)


def test_a_file_written_a_few_rows_at_a_time_is_the_file_written_whole(tmp_path, monkeypatch):
    """Rows go out in chunks (a model of 100M Gaussians is not assembled whole): 57 rows in chunks
    of 5 (the last one short) give the same bytes as one chunk."""
    g = random_gaussians(57, 2, seed=4)
    ply.save_ply(tmp_path / "whole.ply", g)
    monkeypatch.setattr(ply, "PLY_CHUNK_ROWS", 5)
    ply.save_ply(tmp_path / "chunks.ply", g)
    assert (tmp_path / "chunks.ply").read_bytes() == (tmp_path / "whole.ply").read_bytes()
    monkeypatch.setattr(ply, "PLY_CHUNK_ROWS", 1 << 20)
    names, cols = ply._columns(g, 50)
    assert cols.shape == (7, len(names)) and (cols[:, :3] == g.means[50:]).all()


def test_round_trip_float64_input_and_empty(tmp_path):
    g = random_gaussians(5, 1, dtype=np.float64)
    ply.save_ply(tmp_path / "a.ply", g)
    out = ply.load_ply(tmp_path / "a.ply")
    np.testing.assert_array_equal(out["sh"], g.sh.astype(np.float32))
    empty = random_gaussians(0, 2)
    ply.save_ply(str(tmp_path / "e.ply"), empty)
    out = ply.load_ply(str(tmp_path / "e.ply"))
    assert out["means"].shape == (0, 3) and out["sh"].shape == (0, 9, 3)


def test_header_and_channel_major_bytes(tmp_path):
    n, k = 2, 4
    g = random_gaussians(n, 1)
    # sh[i, k, c] = 1000*i + 10*k + c: every value distinct and decodable
    g.sh = (1000.0 * np.arange(n)[:, None, None] + 10.0 * np.arange(k)[None, :, None]
            + np.arange(3)[None, None, :]).astype(np.float32)
    path = tmp_path / "g.ply"
    ply.save_ply(path, g)
    raw = path.read_bytes()
    end = raw.index(b"end_header\n") + len(b"end_header\n")
    header = raw[:end].decode("ascii").splitlines()
    props = [ln.split()[2] for ln in header if ln.startswith("property")]
    expected = (["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
                + [f"f_rest_{i}" for i in range(9)]
                + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"])
    assert header[:3] == ["ply", "format binary_little_endian 1.0", f"element vertex {n}"]
    assert props == expected
    assert all(ln.split()[1] == "float" for ln in header if ln.startswith("property"))
    nprop = len(expected)
    assert len(raw) == end + n * nprop * 4

    def value(i, name):
        off = end + 4 * (i * nprop + expected.index(name))
        return np.frombuffer(raw, "<f4", count=1, offset=off)[0]

    for i in range(n):
        for c in range(3):
            assert value(i, f"f_dc_{c}") == 1000 * i + c
            assert value(i, ["nx", "ny", "nz"][c]) == 0.0
            for kk in range(1, k):
                # reference: features_rest.transpose(1, 2).flatten() -> index c*(K-1) + (k-1)
                assert value(i, f"f_rest_{c * (k - 1) + kk - 1}") == 1000 * i + 10 * kk + c
        assert value(i, "opacity") == g.opacities[i]
        assert value(i, "rot_0") == g.quats[i, 0] and value(i, "scale_2") == g.scales[i, 2]
        assert value(i, "x") == g.means[i, 0]


ASCII_PLY = """ply
format ascii 1.0
comment written by hand, properties shuffled, no normals
element camera 1
property float fov
element vertex 2
property uchar red
property float opacity
property float rot_3
property float rot_2
property float rot_1
property float rot_0
property double f_dc_2
property float f_dc_1
property float f_dc_0
property float z
property float y
property float x
property int scale_2
property float scale_1
property float scale_0
property uchar green
end_header
60.0
255 0.5 0.4 0.3 0.2 0.1 3.5 2.5 1.5 3 2 1 -3 -2 -1 7
0 -0.5 1.4 1.3 1.2 1.1 13.5 12.5 11.5 13 12 11 -13 -12 -11 8
"""


def test_ascii_shuffled_with_extras(tmp_path):
    path = tmp_path / "hand.ply"
    path.write_text(ASCII_PLY)
    out = ply.load_ply(path)
    np.testing.assert_array_equal(out["means"], np.float32([[1, 2, 3], [11, 12, 13]]))
    np.testing.assert_array_equal(out["scales"], np.float32([[-1, -2, -3], [-11, -12, -13]]))
    np.testing.assert_array_equal(out["quats"], np.float32([[0.1, 0.2, 0.3, 0.4], [1.1, 1.2, 1.3, 1.4]]))
    np.testing.assert_array_equal(out["opacities"], np.float32([0.5, -0.5]))
    assert out["sh"].shape == (2, 1, 3)
    np.testing.assert_array_equal(out["sh"][:, 0], np.float32([[1.5, 2.5, 3.5], [11.5, 12.5, 13.5]]))
    assert all(a.dtype == np.float32 for a in out.values())


def test_big_endian_double_matches(tmp_path):
    g = random_gaussians(4, 2, seed=3)
    ply.save_ply(tmp_path / "le.ply", g)
    names, cols = ply._columns(g)
    path = tmp_path / "be.ply"
    header = ("ply\nformat binary_big_endian 1.0\nelement vertex 4\n"
              + "".join(f"property double {p}\n" for p in names) + "end_header\n")
    path.write_bytes(header.encode() + cols.astype(">f8").tobytes())
    a, b = ply.load_ply(tmp_path / "le.ply"), ply.load_ply(path)
    for f in FIELDS:
        np.testing.assert_array_equal(a[f], b[f])


def test_truncated_names_file(tmp_path):
    path = tmp_path / "cut.ply"
    ply.save_ply(path, random_gaussians(10, 3))
    raw = path.read_bytes()
    path.write_bytes(raw[:-7])
    with pytest.raises(ValueError, match="truncated") as e:
        ply.load_ply(path)
    assert str(path) in str(e.value)
    path.write_bytes(raw[:30])  # inside the header
    with pytest.raises(ValueError) as e:
        ply.load_ply(path)
    assert str(path) in str(e.value)
    ascii_cut = tmp_path / "cut_ascii.ply"
    ascii_cut.write_text(ASCII_PLY.rsplit("\n", 2)[0] + "\n")
    with pytest.raises(ValueError, match="truncated") as e:
        ply.load_ply(ascii_cut)
    assert str(ascii_cut) in str(e.value)


def test_missing_properties_listed(tmp_path):
    path = tmp_path / "missing.ply"
    path.write_text(ASCII_PLY.replace("property float rot_1\n", "").replace("property float opacity\n", "")
                    .replace("255 0.5 0.4 0.3 0.2", "255 0.4 0.3").replace("0 -0.5 1.4 1.3 1.2", "0 1.4 1.3"))
    with pytest.raises(ValueError) as e:
        ply.load_ply(path)
    msg = str(e.value)
    assert str(path) in msg and "opacity" in msg and "rot_1" in msg and "rot_0" not in msg


def errors_name_the_file(tmp_path, cases, read):
    """Write each {file name: bytes} case and check that ``read`` raises a ValueError naming
    the file; -> {file name: message}."""
    messages = {}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError) as e:
            read(path)
        assert str(path) in str(e.value), name
        messages[name] = str(e.value)
    return messages


def test_bad_files(tmp_path):
    cases = {
        "notply.ply": b"solid cube\nfacet normal 0 0 1\n",
        "format.ply": b"ply\nformat binary_middle_endian 1.0\nelement vertex 0\nend_header\n",
        "rest.ply": ("ply\nformat ascii 1.0\nelement vertex 0\n"
                     + "".join(f"property float {p}\n" for p in ply.BASE_PROPS)
                     + "".join(f"property float f_rest_{i}\n" for i in range(6))
                     + "end_header\n").encode(),
    }
    errors_name_the_file(tmp_path, cases, ply.load_ply)


def test_atomic_replace_failure_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "g.ply"
    ply.save_ply(path, random_gaussians(8, 1, seed=1))
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk on fire")
    monkeypatch.setattr(ply.os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        ply.save_ply(path, random_gaussians(9, 3, seed=2))
    assert path.read_bytes() == before
    assert no_temp_files(tmp_path)


def test_atomic_failure_mid_write(tmp_path, monkeypatch):
    path = tmp_path / "g.ply"
    ply.save_ply(path, random_gaussians(8, 1, seed=1))
    before = path.read_bytes()
    real_fsync = os.fsync

    def fsync_fails(fd):  # the header and data are already written to the temp file
        assert os.fstat(fd).st_size > 0
        raise OSError("fsync failed")
    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(OSError, match="fsync failed"):
        ply.save_ply(path, random_gaussians(9, 3, seed=2))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_bytes() == before
    assert no_temp_files(tmp_path)
    # bad input fails before anything is created, too
    bad = random_gaussians(3, 1)
    bad.sh = bad.sh[:, :3]
    with pytest.raises(ValueError, match="sh must be"):
        ply.save_ply(path, bad)
    assert path.read_bytes() == before and no_temp_files(tmp_path)


# --- point clouds (a dataset's initial points) -------------------------------

def point_cloud_bytes(fmt, rec, header_extra=""):
    """A binary PLY whose vertex element holds the fields of the structured array ``rec``."""
    types = {"f4": "float", "f8": "double", "u1": "uchar", "u2": "ushort", "i4": "int"}
    header = (f"ply\nformat {fmt} 1.0\n{header_extra}element vertex {len(rec)}\n"
              + "".join(f"property {types[rec.dtype[p].str[1:]]} {p}\n" for p in rec.dtype.names)
              + "end_header\n")
    return header.encode() + rec.tobytes()


@pytest.mark.parametrize("fmt,end", [("binary_little_endian", "<"), ("binary_big_endian", ">")])
@pytest.mark.parametrize("colour,scale", [("u1", 255.0), ("u2", 65535.0), ("f4", 1.0)])
def test_point_cloud_binary_colours(tmp_path, fmt, end, colour, scale):
    rng = np.random.default_rng(0)
    xyz = rng.normal(size=(6, 3))
    rgb = rng.uniform(0, 1, (6, 3))
    rec = np.zeros(6, [(p, end + "f4") for p in "xyz"] + [(p, end + colour) for p in ("red", "green", "blue")])
    for i, p in enumerate("xyz"):
        rec[p] = xyz[:, i]
    for i, p in enumerate(("red", "green", "blue")):
        rec[p] = np.round(rgb[:, i] * scale) if scale > 1 else rgb[:, i]
    path = tmp_path / "pc.ply"
    path.write_bytes(point_cloud_bytes(fmt, rec, "comment made by hand\n"))
    got_xyz, got_rgb = ply.load_ply_points(path)
    assert got_xyz.dtype == got_rgb.dtype == np.float64
    np.testing.assert_allclose(got_xyz, xyz.astype(np.float32))
    np.testing.assert_allclose(got_rgb, rgb, atol=0.5 / scale if scale > 1 else 1e-7)


def test_point_cloud_float_colours_in_0_255_and_ascii_without_colours(tmp_path):
    path = tmp_path / "f.ply"
    path.write_text("ply\nformat ascii 1.0\nelement vertex 2\nproperty float x\nproperty float y\n"
                    "property float z\nproperty float red\nproperty float green\nproperty float blue\n"
                    "element face 0\nproperty list uchar int vertex_indices\nend_header\n"
                    "1 2 3 255 0 51\n4 5 6 0 102 300\n")
    xyz, rgb = ply.load_ply_points(path)
    np.testing.assert_array_equal(xyz, [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_allclose(rgb, [[1, 0, 0.2], [0, 0.4, 1]])      # some value above 1: 0..255, clipped
    path.write_text("ply\nformat ascii 1.0\nelement vertex 2\nproperty float x\nproperty float y\n"
                    "property float z\nend_header\n1 2 3\n4 5 6\n")
    xyz, rgb = ply.load_ply_points(path)
    np.testing.assert_array_equal(xyz, [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(rgb, np.full((2, 3), 0.5))           # no colours: grey
    path.write_text("ply\nformat ascii 1.0\nelement vertex 0\nproperty float x\nproperty float y\n"
                    "property float z\nend_header\n")
    xyz, rgb = ply.load_ply_points(path)
    assert xyz.shape == rgb.shape == (0, 3)


def test_point_cloud_bad_files_name_the_file(tmp_path):
    xyz = "property float x\nproperty float y\nproperty float z\n"
    cases = {
        "notply.ply": "solid cube\n",
        "noz.ply": "ply\nformat ascii 1.0\nelement vertex 1\nproperty float x\nproperty float y\nend_header\n1 2\n",
        "list.ply": f"ply\nformat ascii 1.0\nelement vertex 1\n{xyz}property list uchar int n\nend_header\n1 2 3 0\n",
        "short.ply": f"ply\nformat ascii 1.0\nelement vertex 3\n{xyz}end_header\n1 2 3\n",
        "header.ply": f"ply\nformat ascii 1.0\nelement vertex 1\n{xyz}",
        "type.ply": "ply\nformat ascii 1.0\nelement vertex 1\nproperty half x\nend_header\n1\n",
        "bin.ply": f"ply\nformat binary_little_endian 1.0\nelement vertex 2\n{xyz}end_header\n" + "\0" * 13,
    }
    messages = errors_name_the_file(tmp_path, {k: v.encode() for k, v in cases.items()}, ply.load_ply_points)
    assert messages["noz.ply"].endswith("lacks required vertex properties: z")
    assert "truncated" in messages["short.ply"] and "truncated" in messages["bin.ply"]
