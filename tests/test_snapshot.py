"""engine/tools/snapshot.py: HDF5 snapshot round trip, RNG state, atomicity, corruption."""
import glob
import os

import h5py
import numpy as np
import pytest

from engine.tools import snapshot as snap


def sample_arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "params/means": rng.normal(size=(10, 3)).astype(np.float32),
        "params/sh": rng.normal(size=(10, 16, 3)).astype(np.float32),
        "adam/m": rng.normal(size=50),  # float64
        "adam/step_count": np.array(1234, np.int64),
        "strategy/grad_accum": rng.normal(size=10).astype(np.float32),
        "strategy/counts": rng.integers(0, 100, size=10, dtype=np.int32),
        "strategy/visible": rng.random(10) > 0.5,
        "top_level": np.arange(4, dtype=np.uint8),
    }


def no_temp_files(folder):
    return [p for p in os.listdir(folder) if ".tmp" in p] == []


def test_round_trip_arrays_attrs_and_rng(tmp_path):
    rng = np.random.default_rng(5)
    rng.random(17)  # move away from the seed state
    state = rng.bit_generator.state
    assert state["state"]["state"] > 2**64  # a real 128-bit integer
    expected_draws = rng.random(8)
    arrays = sample_arrays()
    attrs = {
        "step": 7000,
        "config": {"lr": {"means": 1.6e-4, "sh": 2.5e-3}, "sh_degree": 3, "densify": True, "name": "garden",
                   "none": None, "np_int": np.int64(4), "np_float": np.float32(0.5)},
        "dataset_fingerprint": snap.dataset_fingerprint(["a.png"], [(4, 5, 3)]),
        "rng": state,
        "format_version": snap.FORMAT_VERSION,
    }
    path = tmp_path / "snap.h5"
    snap.write_snapshot(path, arrays, attrs)
    out, meta = snap.read_snapshot(path)
    assert set(out) == set(arrays)
    for k, a in arrays.items():
        assert out[k].dtype == a.dtype, k
        assert out[k].shape == a.shape, k
        np.testing.assert_array_equal(out[k], a, err_msg=k)
    assert meta["rng"] == state
    assert meta["config"]["np_int"] == 4 and meta["config"]["np_float"] == 0.5
    assert {k: v for k, v in meta.items() if k != "config"} == {k: v for k, v in attrs.items() if k != "config"}
    restored = np.random.default_rng(0)
    restored.bit_generator.state = meta["rng"]
    np.testing.assert_array_equal(restored.random(8), expected_draws)
    with h5py.File(path, "r") as f:
        assert isinstance(f["params"], h5py.Group) and "numbasplat_meta" in f.attrs
    assert no_temp_files(tmp_path)


def test_overwrite_replaces(tmp_path):
    path = str(tmp_path / "snap.h5")
    snap.write_snapshot(path, {"a": np.zeros(3)}, {"step": 1})
    snap.write_snapshot(path, {"b/c": np.ones(2)}, {"step": 2})
    out, meta = snap.read_snapshot(path)
    assert list(out) == ["b/c"] and meta == {"step": 2}


def _old_snapshot(tmp_path):
    path = tmp_path / "snap.h5"
    snap.write_snapshot(path, sample_arrays(1), {"step": 100})
    return path, path.read_bytes()


def _assert_old_intact(path, before):
    assert path.read_bytes() == before
    out, meta = snap.read_snapshot(path)
    assert meta == {"step": 100}
    np.testing.assert_array_equal(out["params/means"], sample_arrays(1)["params/means"])
    assert no_temp_files(path.parent)


def test_failure_mid_write_keeps_old(tmp_path, monkeypatch):
    path, before = _old_snapshot(tmp_path)
    real_create = h5py.Group.create_dataset
    calls = []

    def create_then_fail(self, name, *a, **k):
        calls.append(name)
        if len(calls) == 3:  # two datasets already in the temp file
            (tmp,) = glob.glob(f"{path}.tmp-*")
            assert os.path.getsize(tmp) > 0
            raise OSError("disk full")
        return real_create(self, name, *a, **k)
    monkeypatch.setattr(h5py.Group, "create_dataset", create_then_fail)
    with pytest.raises(OSError, match="disk full"):
        snap.write_snapshot(path, sample_arrays(2), {"step": 200})
    monkeypatch.undo()
    _assert_old_intact(path, before)


def test_replace_failure_keeps_old(tmp_path, monkeypatch):
    path, before = _old_snapshot(tmp_path)

    def boom(*a, **k):
        raise OSError("rename failed")
    monkeypatch.setattr(snap.os, "replace", boom)
    with pytest.raises(OSError, match="rename failed"):
        snap.write_snapshot(path, sample_arrays(2), {"step": 200})
    monkeypatch.undo()
    _assert_old_intact(path, before)


def test_only_our_stale_temporary_files_are_removed(tmp_path, monkeypatch):
    """What a kill mid-write leaves (the temporary file of ``atomic_path``) is recognised and removed;
    nothing else is, however alike its name."""
    from data.atomic import remove_stale_temps
    path, _ = _old_snapshot(tmp_path)
    left = []
    monkeypatch.setattr(snap.os, "replace", lambda tmp, dst: left.append(tmp))  # killed before the rename
    snap.write_snapshot(path, sample_arrays(2), {"step": 200})
    monkeypatch.undo()
    (left,) = left
    others = ["snapshot.h5.tmp-", "snapshot.h5.tmp-12-abc", "snapshot.h5.tmp-12-0123abcd.bak", "a.tmp-x-0123abcd"]
    for name in others:
        (tmp_path / name).write_text("")
    (tmp_path / "dir.tmp-1-0123abcd").mkdir()
    assert remove_stale_temps(tmp_path) == [os.path.basename(left)]
    assert sorted(os.listdir(tmp_path)) == sorted(others + ["dir.tmp-1-0123abcd", "snap.h5"])


def test_bad_input_keeps_old(tmp_path):
    path, before = _old_snapshot(tmp_path)
    with pytest.raises(TypeError):
        snap.write_snapshot(path, sample_arrays(2), {"obj": object()})
    with pytest.raises(ValueError, match="bad snapshot array name"):
        snap.write_snapshot(path, {"a//b": np.zeros(1)}, {"step": 200})
    _assert_old_intact(path, before)


@pytest.mark.parametrize("keep", [0.5, 0.95, 100])
def test_truncated_is_valueerror_naming_file(tmp_path, keep):
    path, before = _old_snapshot(tmp_path)
    cut = tmp_path / "cut.h5"
    cut.write_bytes(before[:int(len(before) * keep)] if keep < 1 else before[:keep])
    with pytest.raises(ValueError) as e:
        snap.read_snapshot(cut)
    assert str(cut) in str(e.value)


def test_not_a_snapshot_and_newer_version(tmp_path):
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(ValueError, match="not a NumbaSplat snapshot") as e:
        snap.read_snapshot(plain)
    assert str(plain) in str(e.value)
    text = tmp_path / "text.h5"
    text.write_text("hello")
    with pytest.raises(ValueError) as e:
        snap.read_snapshot(text)
    assert str(text) in str(e.value)
    newer = tmp_path / "newer.h5"
    snap.write_snapshot(newer, {}, {"step": 1})
    with h5py.File(newer, "a") as f:
        f.attrs[snap.VERSION_ATTR] = snap.FORMAT_VERSION + 1
    with pytest.raises(ValueError, match="newer") as e:
        snap.read_snapshot(newer)
    assert str(newer) in str(e.value)
    bad_meta = tmp_path / "badmeta.h5"
    snap.write_snapshot(bad_meta, {}, {"step": 1})
    with h5py.File(bad_meta, "a") as f:
        f.attrs[snap.META_ATTR] = "{not json"
    with pytest.raises(ValueError, match="corrupt") as e:
        snap.read_snapshot(bad_meta)
    assert str(bad_meta) in str(e.value)
    with pytest.raises(FileNotFoundError):
        snap.read_snapshot(tmp_path / "nope.h5")


def test_dataset_fingerprint():
    fp = snap.dataset_fingerprint(["b.png", "a.png"], [(10, 20, 3), (5, 6, 3)], extra="downscale=2")
    assert len(fp) == 64 and int(fp, 16) >= 0
    # order of the input does not matter; each shape stays with its name
    assert fp == snap.dataset_fingerprint(["a.png", "b.png"], [(5, 6, 3), (10, 20, 3)], "downscale=2")
    assert fp == snap.dataset_fingerprint(("a.png", "b.png"), [np.array([5, 6, 3]), (10, 20, 3)], "downscale=2")
    assert fp != snap.dataset_fingerprint(["a.png", "b.png"], [(10, 20, 3), (5, 6, 3)], "downscale=2")
    assert fp != snap.dataset_fingerprint(["b.png", "a.png"], [(10, 20, 3), (5, 6, 3)], "downscale=4")
    assert fp != snap.dataset_fingerprint(["b.png", "c.png"], [(10, 20, 3), (5, 6, 3)], "downscale=2")
    # pinned: the fingerprint must not change between releases (it guards resumes)
    assert snap.dataset_fingerprint(["x"], [(1, 2)]) == \
        "faf00d24a47f439346af1ac47915568ea919beb3ca12cd846c946528c732e5b0"
    with pytest.raises(ValueError):
        snap.dataset_fingerprint(["a"], [])


def test_training_state_layout(tmp_path):
    """A model's and a strategy's state are stored under the names of format 1 and read back as they were."""
    rng = np.random.default_rng(3)
    groups = {"means": (6, 3), "scales": (6, 3), "quats": (6, 4), "opacities": (6,), "sh": (6, 4, 3)}
    model = {w: {g: rng.normal(size=shape).astype(np.float32) for g, shape in groups.items()}
             for w in ("params", "m", "v")}
    model["step"] = 42
    strategy = {"grad": rng.random(6).astype(np.float32), "count": np.arange(6, dtype=np.int32)}
    arrays = snap.state_arrays(model, strategy)
    assert set(arrays) == ({f"params/{g}" for g in groups} | {f"adam/m/{g}" for g in groups}
                           | {f"adam/v/{g}" for g in groups} | {"strategy/grad", "strategy/count"})
    path = tmp_path / "state.h5"
    snap.write_snapshot(path, arrays, {"adam_step": model["step"]})
    model_back, strategy_back = snap.states_of(*snap.read_snapshot(path))
    assert model_back["step"] == 42 and set(strategy_back) == set(strategy)
    for w in ("params", "m", "v"):
        for g, a in model[w].items():
            np.testing.assert_array_equal(model_back[w][g], a, err_msg=f"{w} {g}")
    for k, a in strategy.items():
        np.testing.assert_array_equal(strategy_back[k], a, err_msg=k)
        assert strategy_back[k].dtype == a.dtype


def test_view_records_tell_which_image_or_camera_differs(tmp_path):
    """A snapshot knows its data by the views' contents (``view_records``): the first difference is said
    naming the image; equal views are equal whatever their path; the records survive the snapshot."""
    from data import View
    from numbasplat import Camera

    def view(name, value=0.5, fx=30.0, width=8):
        return View(name, np.full((6, width, 3), value, np.float32), Camera(np.eye(4), fx, fx, width / 2, 3, width, 6))
    views = [view("a.png"), view("b.png"), view("c.png")]
    recorded = snap.view_records(views)
    assert snap.data_difference(recorded, snap.view_records([view("a.png"), view("b.png"), view("c.png")])) == ""
    for others, says in (
            (views[:2], "image c.png is missing here"),
            (views[:1], "image b.png is missing here (2 images are)"),
            ([*views, view("d.png")], "image d.png is new"),
            ([views[0], view("b.png", value=0.6), views[2]], "image b.png differs"),
            ([views[0], views[1], view("c.png", fx=31.0)], "the camera of image c.png differs"),
            ([views[0], view("b.png", width=4), views[2]],
             "image b.png is 4x6 here, 8x6 in the snapshot (another --resolution or --max-width?)"),
            (views[::-1], "the images come in another order")):
        assert snap.data_difference(recorded, snap.view_records(others)) == says
    assert snap.records_fingerprint(recorded) != snap.records_fingerprint(snap.view_records(views[::-1]))
    snap.write_snapshot(tmp_path / "s.h5", {snap.VIEWS_ARRAY: snap.records_array(recorded)}, {})
    assert snap.records_of(snap.read_snapshot(tmp_path / "s.h5")[0][snap.VIEWS_ARRAY]) == recorded
