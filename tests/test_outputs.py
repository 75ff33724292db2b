"""engine/tools/outputs.py: what a run leaves in Inria's layout (the PLY, cameras.json, cfg_args, renders
beside their ground truth), LPIPS when its extra is there, the TensorBoard log, video frames."""
import argparse
import contextlib
import importlib.util
import json
import os
import struct
import sys
import types

import numpy as np
import pytest
from PIL import Image

import numbasplat as ns
from data.ply import load_ply
from engine.tools import outputs
from engine.tools.demo import make_dataset
from engine.tools.outputs import (MissingExtra, PngFrames, TensorBoardLog, VideoFrames, camera_entry, iteration_of,
                            latest_point_cloud, log_scalars, lpips_metric, point_cloud_path, read_cameras_json)
from engine.pipelines.single_gpu import SingleGPUTrainer
from numbasplat.loss import psnr
from test_trainer import small_config

HAS_TENSORBOARDX = importlib.util.find_spec("tensorboardX") is not None
HAS_VIDEO = all(importlib.util.find_spec(m) is not None for m in ("imageio", "imageio_ffmpeg"))
INRIA_CAMERA_KEYS = ["id", "img_name", "width", "height", "position", "rotation", "fy", "fx"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 20-step run (two log records, the views scored at the second) with the TensorBoard log when
    tensorboardX is there."""
    out = tmp_path_factory.mktemp("run")
    dataset = make_dataset(size=32, n_views=12, backend="cpu")
    cfg = small_config(iterations=20, tensorboard=HAS_TENSORBOARDX, eval_at=(20,))
    return SingleGPUTrainer(dataset, out, cfg, backend="cpu", log=lambda *a: None).train(progress=False)


@pytest.fixture
def fresh_lpips(monkeypatch):
    """LPIPS loaded anew in this test (the module keeps one per process)."""
    monkeypatch.setattr(outputs, "_lpips_cache", {})


def sibr_arg(line, name):
    """The value SIBR's gaussian viewer reads from cfg_args (its findArg: from '=' to ',' or ')')."""
    start = line.index("=", line.index(name)) + 1
    end = min(i for i in (line.find(",", start), line.find(")", start)) if i >= 0)
    return line[start:end]


def test_training_ends_with_the_model_where_viewers_look(trained):
    out = trained.out
    ply = point_cloud_path(out, 20)
    assert ply == out / "point_cloud" / "iteration_20" / "point_cloud.ply" and ply.is_file()
    saved, model = load_ply(ply), trained.model.host_arrays()
    for k in ("means", "scales", "quats", "opacities", "sh"):
        np.testing.assert_array_equal(saved[k], model[k])
    line = (out / "cfg_args").read_text()
    assert line.startswith("Namespace(") and "\n" not in line
    args = eval(line, {"Namespace": argparse.Namespace})  # noqa: S307 -- Inria's own line, as Python wrote it
    assert args.sh_degree == 1 and args.white_background is True and args.model_path == str(out)
    assert int(sibr_arg(line, "sh_degree")) == 1 and "True" in sibr_arg(line, "white_background")
    assert sibr_arg(line, "source_path")[1:-1] == "builtin-demo"  # no folder: as it is
    assert latest_point_cloud(out) == ply and iteration_of(ply) == 20


def test_cfg_args_records_the_images_folder_and_resolution_used(tmp_path):
    """Inria's render.py loads the capture as cfg_args's images and resolution say: the folder and
    the size the views trained at (it said images='images', resolution=-1 whatever was given)."""
    from data import load_dataset
    from tests.dataset_files import colmap_scene
    wide = {"id": 1, "model": "PINHOLE", "w": 2000, "h": 8, "params": [1000.0, 1000.0, 1000.0, 4.0]}
    colmap_scene(tmp_path / "capture", ".bin", n_images=2, cams=[wide], folder="images_2")

    def recorded(**scaling):
        dataset = load_dataset(tmp_path / "capture", images="images_2", **scaling)
        outputs.write_cfg_args(tmp_path, dataset, 1, False)
        args = eval((tmp_path / "cfg_args").read_text(), {"Namespace": argparse.Namespace})  # noqa: S307
        return args.images, args.resolution
    assert recorded() == ("images_2", -1)                            # Inria's default: the 1600 px cap
    assert recorded(max_width=0) == ("images_2", 1)                  # full size
    assert recorded(resolution=2, max_width=0) == ("images_2", 2)    # a factor Inria takes for one
    assert recorded(resolution=3, max_width=0) == ("images_2", 667)  # Inria reads 3 as a width: the width
    assert recorded(resolution=400, max_width=0) == ("images_2", 400)
    assert recorded(max_width=800) == ("images_2", 800)


def test_cameras_json_as_inria_writes_it(trained):
    entries = json.loads((trained.out / "cameras.json").read_text())
    views = trained.data.test + trained.data.train  # Inria lists the test cameras first
    assert [e["id"] for e in entries] == list(range(len(views)))
    assert [e["img_name"] for e in entries] == [v.name[:-4] for v in views]
    for e, v in zip(entries, views):
        assert list(e) == INRIA_CAMERA_KEYS
        c2w = np.linalg.inv(v.camera.viewmat)
        np.testing.assert_allclose(e["rotation"], c2w[:3, :3], atol=1e-12)  # camera-to-world, rows
        np.testing.assert_allclose(e["position"], c2w[:3, 3], atol=1e-12)   # the camera's centre
        assert (e["width"], e["height"], e["fx"], e["fy"]) == (v.width, v.height, v.camera.fx, v.camera.fy)
    back = read_cameras_json(trained.out / "cameras.json")
    for (name, cam), v in zip(back, views):
        assert name == v.name[:-4] and (cam.cx, cam.cy) == (v.width / 2, v.height / 2)
        np.testing.assert_allclose(cam.viewmat, v.camera.viewmat, atol=1e-12)


def test_a_bad_cameras_json_is_named(tmp_path):
    for text in ("not json", "[]", '[{"id": 0}]', '[{"img_name": "a", "width": 4, "height": 4, "fx": 1, "fy": 1, '
                 '"position": [0, 0], "rotation": [[1, 0, 0], [0, 1, 0], [0, 0, 1]]}]'):
        path = tmp_path / "cameras.json"
        path.write_text(text)
        with pytest.raises(ValueError, match="cameras.json"):
            read_cameras_json(path)
    entry = camera_entry(3, "sub/dir/img.0001.jpg", ns.Camera(np.eye(4), 10.0, 11.0, 2.0, 2.0, 4, 4))
    assert (entry["id"], entry["img_name"], entry["fx"], entry["fy"]) == (3, "img.0001", 10.0, 11.0)


def test_latest_point_cloud_picks_the_highest_iteration(tmp_path):
    assert latest_point_cloud(tmp_path) is None
    for n in (7000, 30000, 900):
        point_cloud_path(tmp_path, n).parent.mkdir(parents=True)
        point_cloud_path(tmp_path, n).write_bytes(b"")
    (tmp_path / "point_cloud" / "iteration_99999").mkdir()  # no PLY inside: not a model
    assert latest_point_cloud(tmp_path) == point_cloud_path(tmp_path, 30000)
    assert iteration_of(tmp_path / "scene.ply") is None


def test_evaluate_writes_renders_beside_ground_truth_as_inria(trained, tmp_path):
    folder = tmp_path / "test" / "ours_20"
    summary = trained.evaluate(save_dir=folder)
    views = trained.data.test
    names = sorted(p.name for p in (folder / "renders").iterdir())
    assert names == [f"{i:05d}.png" for i in range(len(views))] == sorted(p.name for p in (folder / "gt").iterdir())
    for rec, v in zip(summary["views"], views):  # what Inria's metrics.py does: pair the files by name
        assert rec["name"] == v.name
        render = np.asarray(Image.open(folder / "renders" / rec["file"]), np.float32) / 255
        gt = np.asarray(Image.open(folder / "gt" / rec["file"]), np.float32) / 255
        np.testing.assert_allclose(gt, v.image, atol=0.5 / 255 + 1e-6)
        assert abs(psnr(render, gt) - rec["psnr"]) < 0.1
    assert summary["psnr"] == pytest.approx(np.mean([r["psnr"] for r in summary["views"]]))


def test_lpips_skipped_in_one_line_when_the_extra_is_missing(trained, fresh_lpips, monkeypatch):
    monkeypatch.setitem(sys.modules, "lpips", None)  # import lpips fails
    lines = []
    assert lpips_metric(lines.append) is None and lpips_metric(lines.append) is None
    assert lines == ["LPIPS skipped: lpips is not installed (pip install -e '.[metrics]')"]
    summary = trained.evaluate()
    assert summary["lpips"] is None and all("lpips" not in r for r in summary["views"])


@pytest.mark.parametrize("error", [
    OSError("libcudnn.so.9: cannot open shared object file: No such file or directory"),
    ImportError("libcudart.so.12: cannot open shared object file: No such file or directory"),
])
def test_lpips_skipped_in_one_line_when_torch_fails_to_load(fresh_lpips, monkeypatch, error):
    """A torch that is installed but broken (a CUDA library it links is missing) skips LPIPS in one line
    naming the error, instead of a traceback in ``eval`` (OSError) or "not installed" (ImportError)."""
    import builtins
    real_import = builtins.__import__

    def import_(name, *args, **kwargs):
        if name in ("lpips", "torch"):  # (lpips imports torch first thing)
            raise error
        return real_import(name, *args, **kwargs)
    monkeypatch.delitem(sys.modules, "lpips", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(builtins, "__import__", import_)
    lines = []
    assert lpips_metric(lines.append) is None
    assert lines == [f"LPIPS skipped: torch failed to load ({error})"]


def fake_torch():
    class Tensor:
        def __init__(self, a):
            self.a = a

        def __getitem__(self, index):
            return Tensor(self.a[index])

        def to(self, device):
            return self

        def item(self):
            return float(self.a)
    return types.SimpleNamespace(from_numpy=Tensor, no_grad=contextlib.nullcontext,
                                 cuda=types.SimpleNamespace(is_available=lambda: False))


def fake_lpips(network):
    return types.SimpleNamespace(LPIPS=network)


def test_lpips_skipped_in_one_line_when_its_weights_cannot_be_loaded(fresh_lpips, monkeypatch, capfd):
    """The download's notice (torch.hub writes it to stderr; a library may hold the original stream,
    or write below Python) is not shown: only the one line."""
    stream = sys.__stderr__  # the process's stderr, as a library that imported it early holds it

    def offline(**kw):
        sys.stderr.write('Downloading: "https://download.pytorch.org/models/vgg16.pth"\n')
        stream.write("notice on the stream kept from before\n")
        stream.flush()
        os.write(2, b"notice on file descriptor 2\n")
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    monkeypatch.setitem(sys.modules, "lpips", fake_lpips(offline))
    lines = []
    assert lpips_metric(lines.append) is None
    assert lines == ["LPIPS skipped: its VGG weights could not be loaded "
                     "(<urlopen error [Errno -3] Temporary failure in name resolution>)"]
    print("after", file=sys.stderr)
    assert capfd.readouterr().err == "after\n"


def test_lpips_reported_per_view_and_on_average_when_present(trained, fresh_lpips, monkeypatch):
    """VGG, and the images in [0, 1] given as they are, as Inria's metrics.py (lpipsPyTorch) does."""
    seen = []

    class Network:
        def __init__(self, net, verbose):
            assert net == "vgg" and verbose is False

        def to(self, device):
            return self

        def eval(self):
            return self

        def __call__(self, x, y):
            seen.append((x.a.shape, float(x.a.min()), float(x.a.max())))
            return fake_torch().from_numpy(np.array(np.abs(x.a - y.a).mean()))
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    monkeypatch.setitem(sys.modules, "lpips", fake_lpips(Network))
    summary = trained.evaluate()
    per_view = [r["lpips"] for r in summary["views"]]
    assert len(per_view) == len(trained.data.test) and all(0 < v < 1 for v in per_view)
    assert summary["lpips"] == pytest.approx(np.mean(per_view))
    assert all(shape == (1, 3, 32, 32) and 0 <= lo and hi <= 1 for shape, lo, hi in seen)


def test_log_scalars():
    rec = {"step": 300, "loss": 0.1, "psnr": 20.0, "gaussians": 10, "gaussians_total": 40, "time": 9.0}
    assert log_scalars(rec) == {"loss": 0.1, "psnr/train": 20.0, "gaussians": 40.0}
    prev = {"step": 200, "time": 7.0}
    assert log_scalars(rec, prev)["step_seconds"] == pytest.approx(0.02)
    assert "step_seconds" not in log_scalars(rec, {"step": 300, "time": 1.0})  # a resumed log's repeat


def read_events(folder):
    """{tag: [(step, value)]} of the TensorBoard event files in ``folder`` (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event
    found = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                found.setdefault(v.tag, []).append((event.step, v.simple_value))
    return found


@pytest.mark.skipif(not HAS_TENSORBOARDX, reason="tensorboardX not installed (the tensorboard extra)")
def test_training_logs_tensorboard_scalars_beside_the_jsonl_log(trained):
    events = read_events(trained.out)
    log = [json.loads(line) for line in (trained.out / "log.jsonl").read_text().splitlines()]
    assert sorted(events) == ["gaussians", "loss", "psnr/test", "psnr/train", "psnr/train_views", "step_seconds",
                              "test/view_0"]  # (the scores and the scored view's render at step 20)
    assert events["psnr/test"][0] == (20, pytest.approx(log[1]["test_psnr"]))
    assert [s for s, _ in events["loss"]] == [r["step"] for r in log] == [10, 20]
    np.testing.assert_allclose([v for _, v in events["loss"]], [r["loss"] for r in log], rtol=1e-6)
    assert events["step_seconds"][0][1] == pytest.approx((log[1]["time"] - log[0]["time"]) / 10, rel=1e-5)


def test_tensorboard_without_its_extra_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(MissingExtra, match=r"--tensorboard needs tensorboardX: pip install -e '\.\[tensorboard\]'"):
        TensorBoardLog(tmp_path)


def frames(n=6, w=40, h=30):
    x = np.linspace(0, 1, w)[None, :, None]
    return [np.broadcast_to(np.concatenate([x, np.full((1, w, 1), i / n), 1 - x], 2), (h, w, 3)).copy()
            for i in range(n)]


@pytest.mark.skipif(not HAS_VIDEO, reason="imageio / imageio-ffmpeg not installed (the video extra)")
def test_video_frames_make_an_mp4(tmp_path):
    import imageio.v2 as imageio
    path = tmp_path / "new" / "path.mp4"
    video = VideoFrames(path, fps=12)
    for f in frames():
        video.add(f)
    video.close()
    back = [frame for frame in imageio.get_reader(str(path))]  # (list() asks its length: infinite)
    assert len(back) == 6 and back[0].shape == (30, 40, 3)
    assert np.abs(back[3].astype(float) / 255 - frames()[3]).mean() < 0.05  # lossy, but the same picture


def test_video_without_its_extra_names_it_and_the_png_way(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio", None)
    monkeypatch.setitem(sys.modules, "imageio.v2", None)
    with pytest.raises(MissingExtra, match=r"pip install -e '\.\[video\]', or write PNG frames with --frames-dir"):
        VideoFrames(tmp_path / "x.mp4", fps=30)
    png = PngFrames(tmp_path / "frames")
    for f in frames(3):
        png.add(f)
    png.close()
    assert sorted(p.name for p in (tmp_path / "frames").iterdir()) == ["00000.png", "00001.png", "00002.png"]


@pytest.mark.mpi
@pytest.mark.timeout(1200)
def test_under_mpi_rank_0_writes_the_whole_model(tmp_path, mpiexec):
    from test_gaussian_exchange import launch
    final, _ = launch(2, tmp_path)
    saved = load_ply(point_cloud_path(tmp_path, 32))
    for k, a in final.items():
        np.testing.assert_array_equal(saved[k], a, err_msg=k)
    assert len(json.loads((tmp_path / "cameras.json").read_text())) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cameras.json", "cfg_args", "final.npz", "log.jsonl",
                                                          "point_cloud", "snapshot.h5"]


def test_tensorboard_flag_without_its_extra_is_one_line(tmp_path, monkeypatch, capsys):
    import cli
    from test_trainer import write_blender_capture
    write_blender_capture(tmp_path / "cap", make_dataset(size=16, n_views=4, backend="cpu"))
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    assert cli.main(["train", "--data", str(tmp_path / "cap"), "--out", str(tmp_path / "out"), "--iters", "2",
                     "--quiet", "--init-points", "50", "--tensorboard"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: --tensorboard needs tensorboardX: pip install -e '.[tensorboard]'"
