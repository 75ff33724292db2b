"""data.bench_scene.load_scene: a benchmark scene file, or a DataError of one line naming the file and what is wrong
with it."""
import subprocess
import sys

import numpy as np
import pytest

import cli
from cli.bench import gaussian_count
from data import DataError, bench_scene
from data.bench_scene import SCENE_KEYS, load_scene, make_scene
from numbasplat import bench

from conftest import REPO_ROOT


def scene_arrays(n=20, W=32, H=24, sh_degree=1):
    """The arrays of a scene as ``run.py bench --make`` writes them (made by hand, small)."""
    rng = np.random.default_rng(0)
    viewmat = np.eye(4)
    viewmat[2, 3] = 4.0
    return {
        "means": rng.normal(size=(n, 3)).astype(np.float32),
        "scales": np.full((n, 3), -2.0, np.float32),
        "quats": rng.normal(size=(n, 4)).astype(np.float32),
        "opacities": np.zeros(n, np.float32),
        "sh": rng.normal(size=(n, (sh_degree + 1) ** 2, 3)).astype(np.float32),
        "viewmat": viewmat,
        "K": np.array([[30.0, 0, W / 2], [0, 30.0, H / 2], [0, 0, 1]]),
        "W": np.int64(W),
        "H": np.int64(H),
    }


def test_reads_a_scene(tmp_path):
    path = tmp_path / "scene.npz"
    np.savez(path, **scene_arrays())
    g, cam = load_scene(str(path))
    assert len(g) == 20 and g.sh_degree() == 1 and (cam.width, cam.height) == (32, 24) and cam.fx == 30.0


def _bad_files(tmp_path):
    """(file, what the message must say) for every way a file seen so far is not a scene."""
    cases = []
    text = tmp_path / "notes.npz"
    text.write_text("not an archive\n")
    cases.append((text, "not a NumPy .npz archive"))
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    cases.append((empty, "an empty file"))
    good = tmp_path / "good.npz"
    np.savez(good, **scene_arrays())
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[:200])
    cases.append((truncated, "damaged or truncated"))
    other = tmp_path / "other.npz"
    np.savez(other, a=np.zeros(3))
    cases.append((other, "it lacks the arrays means, scales"))
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    cases.append((single, "a single .npy array"))
    objects = tmp_path / "objects.npz"
    np.savez(objects, **{**scene_arrays(), "sh": np.array([None, {}], dtype=object)})
    cases.append((objects, "sh holds Python objects"))
    shapes = tmp_path / "shapes.npz"
    np.savez(shapes, **{**scene_arrays(), "quats": np.zeros((3, 4), np.float32)})
    cases.append((shapes, "do not fit together"))
    return cases


def test_each_bad_file_is_one_line_naming_it(tmp_path):
    for path, what in _bad_files(tmp_path):
        with pytest.raises(DataError) as e:
            load_scene(str(path))
        message = str(e.value)
        assert message.startswith(f"{path} is not a benchmark scene: ") and what in message, message
        assert "\n" not in message and "pickle" not in message, message


def test_missing_file_names_it(tmp_path):
    with pytest.raises(DataError, match="cannot read benchmark scene .*missing.npz: No such file"):
        load_scene(str(tmp_path / "missing.npz"))


def test_scene_keys_are_what_make_scene_writes():
    assert set(SCENE_KEYS) == set(scene_arrays()) == set(make_scene(10, 32, 24))


def test_cli_bench_on_a_text_file(tmp_path):
    """What was seen: `run.py bench --scene notes.npz` answered with NumPy's allow_pickle advice."""
    path = tmp_path / "notes.npz"
    path.write_text("not an archive\n")
    r = subprocess.run([sys.executable, "run.py", "bench", "--scene", str(path)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300, env={"NUMBASPLAT_BACKEND": "cpu",
                                                                         "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"error: {path} is not a benchmark scene: not a NumPy .npz archive "
                                              "(make one with run.py bench --make 1M --out FILE.npz)"], r.stderr


def test_make_writes_a_scene_that_bench_times(tmp_path, capsys):
    """``run.py bench --make N --out FILE.npz`` writes a scene (in the project, no longer a script outside
    it) that ``bench --scene FILE.npz`` reads and times: here 2000 Gaussians at 64x48 on the CPU."""
    path = tmp_path / "b2k.npz"
    assert cli.main(["bench", "--make", "2k", "--res", "64x48", "--out", str(path)]) == 0
    assert capsys.readouterr().out == f"wrote {path}: 2000 Gaussians, 64x48, seed 0\n"
    g, cam = load_scene(str(path))
    assert len(g) == 2000 and g.sh_degree() == 3 and (cam.width, cam.height) == (64, 48)
    lines = []
    med = bench.run((g, cam), iters=1, warmup=0, backend="cpu", out=lines.append)
    assert med["step"] > 0 and lines[-1].startswith("step_ms=")


def test_made_scenes_lie_before_the_camera_and_repeat_by_seed():
    """Depths 2 to 20, centres within 1.2 fields of view, footprints of a few pixels (median 2.5), unit
    quaternions; the same seed gives the same scene, another seed another one."""
    scene = make_scene(20_000, 320, 200)
    means, f = scene["means"], scene["K"][0, 0]
    assert np.all((means[:, 2] >= 2) & (means[:, 2] <= 20))
    assert np.all(np.abs(means[:, 0] / means[:, 2] * f) <= 0.6 * 320 + 1e-3)
    assert np.all(np.abs(means[:, 1] / means[:, 2] * f) <= 0.6 * 200 + 1e-3)
    footprint = np.exp(scene["scales"]) * f / means[:, 2:3]
    assert 2.2 < np.median(footprint) < 2.8
    np.testing.assert_allclose(np.linalg.norm(scene["quats"], axis=1), 1, atol=1e-5)
    again, other = make_scene(20_000, 320, 200), make_scene(20_000, 320, 200, seed=1)
    assert all(np.array_equal(scene[k], again[k]) for k in SCENE_KEYS)
    assert not np.array_equal(scene["means"], other["means"])


@pytest.mark.parametrize("count, size", [("1M", (1297, 840)), ("6M", (1920, 1080)), ("2M", (1297, 840))])
def test_make_uses_the_standard_cameras(count, size, tmp_path, monkeypatch):
    """1M at 1297x840 and 6M at 1920x1080, BENCHMARKS.md's scenes; other counts the 1M's camera."""
    made = []
    monkeypatch.setattr(bench_scene, "make_scene",
                        lambda n, w, h, seed: made.append((n, w, h, seed)) or make_scene(1, w, h))
    assert cli.main(["bench", "--make", count, "--out", str(tmp_path / "s.npz")]) == 0
    assert made == [(gaussian_count(count), *size, 0)]


def test_gaussian_counts():
    assert [gaussian_count(t) for t in ("2000", "100k", "1M", "6m", "2.5M")] == [2000, 100_000, 10**6, 6 * 10**6,
                                                                               2_500_000]
    for bad in ("0", "1.5", "M", "lots"):
        with pytest.raises(Exception, match="expected"):
            gaussian_count(bad)


def test_make_needs_out_and_only_make_takes_it(capsys, tmp_path):
    assert cli.main(["bench", "--make", "10"]) == 1
    assert capsys.readouterr().err == "error: bench --make needs --out FILE.npz, the scene file to write\n"
    assert cli.main(["bench", "--scene", str(tmp_path / "s.npz"), "--res", "64x48"]) == 1
    assert capsys.readouterr().err == "error: --out and --res are for bench --make (the scene to write)\n"
