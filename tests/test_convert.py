"""``run.py convert`` (cli/convert.py, data/convert.py): photos -> a COLMAP capture, through pycolmap.

The real run maps 20 photos of ../shared/data/helmet (every second frame of its 360-degree orbit,
frames 1 to 39: about 200 degrees, downscaled to 480 px high) and checks the capture it writes loads
(``load_dataset``) and that its camera centres and orientations agree with the shipped COLMAP
model's up to a similarity (Umeyama: rotation, translation, scale).  It skips, in one line, without
pycolmap or ../shared.  Two photos of noise among them must be left out, and named.  The error messages are tested without mapping (and without pycolmap).
"""
import sys

import numpy as np
import pytest
from PIL import Image

from cli import main
from conftest import shared_dir

CAPTURE = "helmet"
FRAMES = range(1, 40, 2)   # 20 of the 68 frames, 1.jpg ... 39.jpg: neighbours 2 frames (about 10 degrees) apart
HEIGHT = 480               # the photos' size for the test (helmet's images_2 are 540x960)


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def error_line(err):
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def write_photos(folder, n, size=(32, 24)):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), np.uint8)).save(folder / f"{i:03d}.png")
    return folder


# ----------------------------------------------------------------------------- the errors, without mapping

def test_missing_folder(tmp_path, capsys):
    rc, _, err = run(["convert", "--images", str(tmp_path / "nope"), "--out", str(tmp_path / "data")], capsys)
    assert rc == 1
    assert error_line(err) == f"error: image folder {tmp_path / 'nope'} does not exist"
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("n", [0, 2])
def test_too_few_images(tmp_path, capsys, n):
    photos = write_photos(tmp_path / "photos", n)
    (photos / "notes.txt").write_text("not a photo")
    rc, _, err = run(["convert", "--images", str(photos), "--out", str(tmp_path / "data")], capsys)
    assert rc == 1
    line = error_line(err)
    assert line.startswith(f"error: image folder {photos} holds {'no images' if n == 0 else 'only 2 images'} (")
    assert "at least 3 overlapping photos" in line
    assert not (tmp_path / "data").exists()


def test_pycolmap_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pycolmap", None)  # `import pycolmap` raises ImportError
    photos = write_photos(tmp_path / "photos", 3)
    rc, _, err = run(["convert", "--images", str(photos), "--out", str(tmp_path / "data")], capsys)
    assert rc == 1
    assert error_line(err).startswith("error: convert needs pycolmap: pip install pycolmap")


def test_photos_where_convert_writes_and_an_earlier_conversion(tmp_path, capsys):
    data = tmp_path / "data"
    photos = write_photos(data / "images", 3)
    rc, _, err = run(["convert", "--images", str(photos), "--out", str(data)], capsys)
    assert rc == 1 and f"error: the photos in {photos.resolve()} are where convert writes" in error_line(err)
    photos = write_photos(tmp_path / "photos", 3)
    (data / "sparse").mkdir()
    rc, _, err = run(["convert", "--images", str(photos), "--out", str(data)], capsys)
    assert rc == 1 and "already holds images, sparse" in error_line(err) and "--overwrite" in error_line(err)


def test_mapping_failed(tmp_path, capsys):
    """Noise photos share no features: no model, one line saying how many registered."""
    pytest.importorskip("pycolmap", reason="convert needs pycolmap (the convert extra)")
    photos = write_photos(tmp_path / "photos", 3, size=(64, 48))
    rc, _, err = run(["convert", "--images", str(photos), "--out", str(tmp_path / "data"), "--threads", "1",
                      "--quiet"], capsys)
    assert rc == 1
    assert error_line(err) == (f"error: mapping failed: only 0 of 3 images of {photos} registered; try more overlap "
                               f"between the photos (--verbose shows COLMAP's log)")
    assert err.count("\n") == 1, "COLMAP's own log lines stay off without --verbose"
    assert not (tmp_path / "data").exists(), "a failed conversion leaves nothing behind"


def test_downscaled_size():
    from data.convert import downscaled_size
    assert downscaled_size((268, 480), 2) == (134, 240)
    assert downscaled_size((268, 480), 8) == (34, 60)    # 33.5 rounds up, as ImageMagick's -resize 12.5%
    assert downscaled_size((5, 3), 8) == (1, 1)


# ----------------------------------------------------------------------------- a real capture

def umeyama(src, dst):
    """(s, R, t) minimising |dst - (s R src + t)|^2 over the rows (Umeyama 1991)."""
    mu_s, mu_d = src.mean(0), dst.mean(0)
    xs, xd = src - mu_s, dst - mu_d
    U, D, Vt = np.linalg.svd(xd.T @ xs / len(src))
    S = np.diag([1.0, 1.0, np.sign(np.linalg.det(U) * np.linalg.det(Vt)) or 1.0])
    R = U @ S @ Vt
    s = np.trace(np.diag(D) @ S) / (xs ** 2).sum(1).mean()
    return s, R, mu_d - s * R @ mu_s


def test_umeyama_recovers_a_similarity():
    rng = np.random.default_rng(1)
    src = rng.normal(size=(10, 3))
    q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    q *= np.sign(np.linalg.det(q))
    s, R, t = umeyama(src, 2.5 * src @ q.T + [1.0, -2.0, 3.0])
    assert np.isclose(s, 2.5) and np.allclose(R, q) and np.allclose(t, [1.0, -2.0, 3.0])


def pose(viewmat):
    """(centre, camera-to-world rotation) of a world-to-camera 4x4."""
    R, t = viewmat[:3, :3], viewmat[:3, 3]
    return -R.T @ t, R.T


def test_convert_helmet_agrees_with_the_shipped_model(tmp_path, capsys):
    pytest.importorskip("pycolmap", reason="convert needs pycolmap (the convert extra)")
    scene = shared_dir() / "data" / CAPTURE
    from data.colmap import read_model, viewmat_of
    from data.convert import downscaled_size
    from data.dataset import load_dataset

    photos = tmp_path / "photos"
    photos.mkdir()
    for i in FRAMES:
        with Image.open(scene / "images_2" / f"{i}.jpg") as im:
            w, h = im.size
            im.resize((round(w * HEIGHT / h), HEIGHT), Image.LANCZOS).save(photos / f"{i}.jpg", quality=95)
    rng = np.random.default_rng(0)  # two photos of nothing in the scene: left out, and said so
    for name in ("noise_a.jpg", "noise_b.jpg"):
        Image.fromarray(rng.integers(0, 255, (HEIGHT, w * HEIGHT // h, 3), np.uint8)).save(photos / name)
    data = tmp_path / "data"
    rc, out, err = run(["convert", "--images", str(photos), "--out", str(data), "--threads", "1"], capsys)
    assert rc == 0, err
    note, summary = out.strip().splitlines()[:2]
    assert note.startswith("note: 2 of the 22 photos did not register and are left out") and \
        note.endswith(": noise_a.jpg, noise_b.jpg"), out
    assert summary.startswith(f"wrote {data}: 20 of 22 images registered, "), out
    assert " points, mean reprojection error " in summary and "PINHOLE camera" in summary, out
    assert "convert: mapping" in err and "5/5 stages" in err, "the progress bar over the stages"

    d = load_dataset(data, test_every=0)
    assert len(d.train) == len(FRAMES) and len(d.points) > 100
    _, shipped, _ = read_model(scene / "sparse" / "0")
    truth = {im.name: pose(viewmat_of(im)) for im in shipped.values()}
    names = [v.name for v in d.train]
    ours = [pose(v.camera.viewmat) for v in d.train]
    src = np.array([c for c, _ in ours])
    dst = np.array([truth[n][0] for n in names])
    s, R, t = umeyama(src, dst)
    rms = np.sqrt(((src @ (s * R).T + t - dst) ** 2).sum(1).mean())
    extent = np.linalg.norm(dst[:, None] - dst[None], axis=-1).max()   # the cameras' diameter
    angles = [np.degrees(np.arccos(np.clip((np.trace(truth[n][1].T @ R @ r) - 1) / 2, -1, 1)))
              for n, (_, r) in zip(names, ours)]
    print(f"helmet, {len(names)} photos: centres RMS {rms / extent:.2%} of the cameras' extent, "
          f"rotations within {max(angles):.2f} deg")
    assert rms < 0.03 * extent, (rms, extent)
    assert max(angles) < 3.0, angles

    for name in names:
        with Image.open(data / "images" / name) as im:
            full = im.size
        for f in (2, 4, 8):
            with Image.open(data / f"images_{f}" / name) as im:
                assert im.size == downscaled_size(full, f), (name, f, im.size, full)
    quarter = load_dataset(data, images="images_4", test_every=0)
    assert (quarter.train[0].width, quarter.train[0].height) == downscaled_size(full, 4)
    assert (data / "distorted" / "database.db").is_file() and (data / "distorted" / "sparse" / "0").is_dir()
