"""numbasplat.bench.load_scene: a benchmark scene file, or one line naming the file and what is wrong with it."""
import subprocess
import sys

import numpy as np
import pytest

from numbasplat.bench import SCENE_KEYS, load_scene

from conftest import REPO_ROOT


def scene_arrays(n=20, W=32, H=24, sh_degree=1):
    """The arrays of a scene as shared/bench/scene_gen.py writes them."""
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
        with pytest.raises(SystemExit) as e:
            load_scene(str(path))
        message = str(e.value)
        assert message.startswith(f"error: {path} is not a benchmark scene: ") and what in message, message
        assert "\n" not in message and "pickle" not in message, message


def test_missing_file_names_it(tmp_path):
    with pytest.raises(SystemExit, match="cannot read benchmark scene .*missing.npz: No such file"):
        load_scene(str(tmp_path / "missing.npz"))


def test_scene_keys_are_what_scene_gen_writes():
    assert set(SCENE_KEYS) == set(scene_arrays())


def test_cli_bench_on_a_text_file(tmp_path):
    """What was seen: `run.py bench --scene notes.npz` answered with NumPy's allow_pickle advice."""
    path = tmp_path / "notes.npz"
    path.write_text("not an archive\n")
    r = subprocess.run([sys.executable, "run.py", "bench", "--scene", str(path)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300, env={"NUMBASPLAT_BACKEND": "cpu",
                                                                         "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"error: {path} is not a benchmark scene: not a NumPy .npz archive "
                                              "(make one with shared/bench/scene_gen.py)"], r.stderr
