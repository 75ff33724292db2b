"""cli/evaluate.py: eval, render and export on a trained folder, in Inria's layout: renders beside
their ground truth, camera-path videos and frames, a model read from snapshot.h5 or from
point_cloud/iteration_N, exports into new folders."""
import importlib.util
import json
import shutil

import numpy as np
import pytest
from PIL import Image

import cli
from cli.evaluate import PATHS
from engine.tools.camera_path import PATHS as ENGINE_PATHS
from engine.tools.demo import make_dataset
from test_trainer import write_blender_capture

HAS_VIDEO = all(importlib.util.find_spec(m) is not None for m in ("imageio", "imageio_ffmpeg"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A Blender capture and a 20-step ``train --eval`` on it: (capture, output folder)."""
    root = tmp_path_factory.mktemp("cli")
    cap, out = root / "capture", root / "out"
    write_blender_capture(cap, make_dataset(size=32, n_views=12, backend="cpu"))
    assert cli.main(["train", "--data", str(cap), "--white-background", "--out", str(out), "--iters", "20",
                     "--quiet", "--sh-degree", "1", "--init-points", "500", "--eval"]) == 0
    return cap, out


def pairs(folder):
    renders = sorted(p.name for p in (folder / "renders").iterdir())
    assert renders == sorted(p.name for p in (folder / "gt").iterdir())
    return renders


def test_train_eval_leaves_inria_layout(run):
    cap, out = run
    assert (out / "point_cloud" / "iteration_20" / "point_cloud.ply").is_file()
    assert (out / "cameras.json").is_file() and (out / "cfg_args").is_file()
    assert f"source_path='{cap}'" in (out / "cfg_args").read_text()
    metrics = json.loads((out / "metrics.json").read_text())
    assert pairs(out / "test" / "ours_20") == [f"{i:05d}.png" for i in range(len(metrics["views"]))]
    assert "lpips" in metrics


def test_eval_writes_into_the_model_folder_by_default(run, tmp_path):
    cap, out = run
    trained = json.loads((out / "metrics.json").read_text())
    inria = tmp_path / "inria"  # a folder as Inria's train.py leaves it: no snapshot, a point cloud
    shutil.copytree(out / "point_cloud", inria / "point_cloud")
    ply = inria / "point_cloud" / "iteration_20" / "point_cloud.ply"
    for model, folder in ((out, out), (inria, inria), (ply, inria)):
        (folder / "metrics.json").unlink(missing_ok=True)
        assert cli.main(["eval", "--data", str(cap), "--white-background", "--model", str(model)]) == 0
        again = json.loads((folder / "metrics.json").read_text())
        assert abs(again["psnr"] - trained["psnr"]) < 1e-3 and again["iterations"] == 20
        assert len(pairs(folder / "test" / "ours_20")) == len(trained["views"])


def test_eval_reads_the_capture_from_the_training_folder(run, tmp_path, capsys):
    """As Inria's render.py reads cfg_args: without --data, the capture, its split and the white
    background come from OUT/cfg.json; a flag given overrides the recorded setting."""
    cap, out = run
    trained = json.loads((out / "metrics.json").read_text())
    assert cli.main(["eval", "--model", str(out), "--out", str(tmp_path / "a")]) == 0
    again = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert again["views"] == trained["views"] and abs(again["psnr"] - trained["psnr"]) < 1e-3
    assert cli.main(["eval", "--model", str(out), "--out", str(tmp_path / "b"), "--resolution", "2"]) == 0
    assert Image.open(tmp_path / "b" / "test" / "ours_20" / "renders" / "00000.png").size == (16, 16)
    assert cli.main(["eval", "--model", str(out), "--out", str(tmp_path / "c"), "--no-white-background"]) == 0
    black = json.loads((tmp_path / "c" / "metrics.json").read_text())
    assert black["psnr"] < trained["psnr"] - 1  # the same Gaussians on the other background
    (tmp_path / "file").write_text("")
    assert cli.main(["eval", "--model", str(out), "--out", str(tmp_path / "file")]) == 1
    assert f"--out {tmp_path}/file: it is a file, not a folder" in capsys.readouterr().err
    bad = tmp_path / "bad"
    shutil.copytree(out, bad, ignore=shutil.ignore_patterns("test"))
    (bad / "cfg.json").write_text("{")
    with pytest.raises(SystemExit, match=f"config file {bad}/cfg.json: not valid JSON"):
        cli.main(["eval", "--model", str(bad)])


def test_render_a_split(run, tmp_path):
    cap, out = run
    assert cli.main(["render", "--data", str(cap), "--white-background", "--model", str(out), "--split", "train",
                     "--out", str(tmp_path)]) == 0
    n_views = len(json.loads((out / "cameras.json").read_text()))
    n_train = n_views - len(json.loads((out / "metrics.json").read_text())["views"])
    assert len(pairs(tmp_path / "train" / "ours_20")) == n_train


def test_render_a_camera_path_from_cameras_json(run, tmp_path, capsys):
    _, out = run
    for kind in PATHS:
        frames = tmp_path / kind
        args = ["render", "--model", str(out), "--path", kind, "--frames", "5", "--frames-dir", str(frames)]
        if HAS_VIDEO:
            args += ["--video", str(tmp_path / "videos" / f"{kind}.mp4"), "--fps", "10"]
        assert cli.main(args) == 0
        pngs = sorted(frames.iterdir())
        assert len(pngs) == 5 and Image.open(pngs[0]).size == (32, 32)
        image = np.asarray(Image.open(pngs[2]), np.float32)
        assert image.std() > 1.0  # the scene, not an empty frame
        if HAS_VIDEO:
            import imageio.v2 as imageio
            assert len([f for f in imageio.get_reader(str(tmp_path / "videos" / f"{kind}.mp4"))]) == 5
    assert "wrote 5 frames (interp path, 32x32)" in capsys.readouterr().out
    assert PATHS == ENGINE_PATHS


def test_render_path_errors_name_what_to_give(run, tmp_path):
    cap, out = run
    for args, message in (
            (["--path", "spiral"], "--path needs --video FILE.mp4 or --frames-dir DIR"),
            (["--video", "x.mp4"], "give --path too")):
        with pytest.raises(SystemExit, match=message):
            cli.main(["render", "--model", str(out), *args])
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(out / "snapshot.h5", lone)
    with pytest.raises(SystemExit, match=f"give --data .*: no cfg.json in {lone}"):
        cli.main(["render", "--model", str(lone)])
    with pytest.raises(SystemExit, match="give --data, or a --model folder holding cameras.json"):
        cli.main(["render", "--model", str(lone), "--path", "ellipse", "--frames-dir", str(tmp_path / "f")])
    with pytest.raises(SystemExit, match="holds no snapshot.h5 and no point_cloud"):
        cli.main(["render", "--model", str(tmp_path), "--path", "ellipse", "--frames-dir", str(tmp_path / "f")])
    with pytest.raises(SystemExit) as e:
        cli.main(["render", "--model", str(out), "--path", "ellipse", "--frames", "0"])
    assert e.value.code == 2


def test_export_into_a_new_folder(run, tmp_path, capsys):
    _, out = run
    target = tmp_path / "not" / "yet" / "scene.ply"
    assert cli.main(["export", "--model", str(out), "--ply", str(target)]) == 0
    assert target.read_bytes() == (out / "point_cloud" / "iteration_20" / "point_cloud.ply").read_bytes()
    (tmp_path / "file").write_text("")
    assert cli.main(["export", "--model", str(out), "--ply", str(tmp_path / "file" / "scene.ply")]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path}/file/scene.ply" in err and ".tmp-" not in err
