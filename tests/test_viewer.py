"""engine/tools/viewer.py and cli/view.py: the browser viewer (issue 28).

Without a browser: the camera conversion (viser's pose -> our Camera) against our render of the
dataset's camera, the render modes, the frame size while moving and at rest, the port-in-use and
bad-model errors, the missing extra, and ``train --viewer``'s hook (frames, panel, pause and
resume) through viser's Python API in-process.  With one: tests/test_viewer_browser.py.
"""
import socket
import sys
import threading
import time

import numpy as np
import pytest

import cli
import numbasplat as ns
from engine.tools import viewer as V
from engine.tools.demo import ground_truth, make_dataset
from engine.recipe.trainer import TrainConfig


@pytest.fixture(scope="module")
def demo():
    """(the demo's ground-truth Gaussians, a dataset of 32x32 views of them)."""
    return ground_truth(), make_dataset(size=32, n_views=12, backend="cpu")


def random_rotation(rng):
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q *= np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def test_quaternions_round_trip_and_agree_with_viser():
    rng = np.random.default_rng(0)
    half_turns = [np.diag(d) for d in ((1, -1, -1), (-1, 1, -1), (-1, -1, 1))]  # w = 0: Shepperd's other branches
    for r in [random_rotation(rng) for _ in range(50)] + half_turns + [np.eye(3)]:
        q = V.wxyz_from_rotation(r)
        assert abs(np.linalg.norm(q) - 1) < 1e-12 and q[0] >= 0
        assert np.allclose(V.rotation_from_wxyz(q), r, atol=1e-12)
    viser = pytest.importorskip("viser")
    for _ in range(10):
        q = rng.normal(size=4)
        assert np.allclose(V.rotation_from_wxyz(q), viser.transforms.SO3(q / np.linalg.norm(q)).as_matrix())


def test_pose_conversion_inverts_and_follows_viser_axes(demo):
    _, data = demo
    for v in data.views:
        wxyz, position, fov, aspect = V.pose_of_camera(v.camera)
        back = V.camera_from_pose(wxyz, position, fov, v.width, v.height)
        assert np.allclose(back.viewmat, v.camera.viewmat, atol=1e-12)
        assert np.allclose([back.fx, back.fy, back.cx, back.cy], [v.camera.fx, v.camera.fy, v.camera.cx, v.camera.cy])
        assert aspect == v.width / v.height
    # viser: wxyz is R_world_camera, OpenCV axes: the camera looks along its +Z column, up is -Y
    r = random_rotation(np.random.default_rng(1))
    position = np.array([0.3, -1.0, 2.0])
    cam = V.camera_from_pose(V.wxyz_from_rotation(r), position, np.radians(60), 200, 100)
    def pixel(world):
        p = cam.viewmat[:3, :3] @ world + cam.viewmat[:3, 3]
        return cam.fx * p[0] / p[2] + cam.cx, cam.fy * p[1] / p[2] + cam.cy
    assert np.allclose(pixel(position + 2 * r[:, 2]), (100, 50))
    u, v = pixel(position + 2 * r[:, 2] - 0.5 * r[:, 1])   # up in the world: above the centre
    assert abs(u - 100) < 1e-9 and v < 50
    u, v = pixel(position + 2 * r[:, 2] + 0.5 * r[:, 0])   # right
    assert u > 100 and abs(v - 50) < 1e-9
    top = pixel(position + r[:, 2] - np.tan(np.radians(30)) * r[:, 1])   # the vertical fov's edge: the top row
    assert np.isclose(top[1], 0.0)


def test_a_dataset_camera_set_in_the_viewer_renders_our_render(demo):
    g, data = demo
    viewer = V.Viewer(g, V.dataset_cameras(data), background=(1.0, 1.0, 1.0))
    for v in data.test[:3]:
        wxyz, position, fov, _ = V.pose_of_camera(v.camera)
        view = viewer.add_client(v.name, V.VirtualView(wxyz, position, fov, v.width, v.height))
        assert viewer.render_pending() >= 1
        ours = ns.render(g, v.camera, background=(1.0, 1.0, 1.0)).image
        assert view.frames[-1].shape == (v.height, v.width, 3)
        assert np.abs(view.frames[-1].astype(int) - V.to_8bit(ours).astype(int)).max() <= 1
        assert view.frames[-1].std() > 10   # the scene, not a blank frame
        viewer.remove_client(v.name)


def test_render_modes():
    """alpha is 1 - T; depth colours the nearer of two Gaussians red and the farther blue, and the
    empty pixels the background; centres draws each centre's dot, the nearest in front."""
    from numbasplat.math.sh import C0
    # the 3rd right in front of the 2nd, on the same pixel
    means = np.array([[-0.5, 0.0, 3.0], [0.5, 0.0, 6.0], [0.5 * 5 / 6, 0.0, 5.0]], np.float32)
    rgb = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    quats = np.tile([1.0, 0, 0, 0], (3, 1)).astype(np.float32)
    g = ns.Gaussians(means, np.log(np.full((3, 3), 0.15, np.float32)), quats,
                     np.array([4.0, 4.0, -30.0], np.float32), ((rgb - 0.5) / C0).astype(np.float32)[:, None, :])
    cam = ns.Camera(np.eye(4), 60.0, 60.0, 32.0, 16.0, 64, 32)
    bg = (0.2, 0.3, 0.4)
    frame = ns.render(g, cam, background=bg)
    alpha = V.render_frame(g, cam, "alpha", background=bg)
    assert np.allclose(alpha[..., 0], 1.0 - frame.render.trans, atol=1e-6) and np.allclose(alpha[..., 0], alpha[..., 2])
    depth = V.render_frame(g, cam, "depth", background=bg)
    a = 1.0 - frame.render.trans
    assert np.allclose(depth, V.depth_image(frame.render.depth, a, bg))
    near, far = (16, 32 + int(60 * -0.5 / 3.0)), (16, 32 + int(60 * 0.5 / 6.0))
    assert np.isclose(frame.render.depth[near] / a[near], 3.0, rtol=0.02)   # the sum of w z over alpha: depth
    assert np.isclose(frame.render.depth[far] / a[far], 6.0, rtol=0.02)
    assert np.allclose(depth[0, 0], bg) and not np.allclose(depth[near], depth[far], atol=0.1)
    centres = V.render_frame(g, cam, "centres", background=bg)
    u, v = 32 + 60 * 0.5 / 6.0, 16.0                   # both right-hand centres land here; the nearer (blue) wins
    assert np.allclose(centres[int(v), int(u)], rgb[2])
    assert np.allclose(centres[16, 32 - 10], rgb[0])
    assert (np.abs(centres - bg).max(axis=2) > 0).sum() == 2 * V.CENTRE_DOT ** 2
    with pytest.raises(ValueError, match="render mode"):
        V.render_frame(g, cam, "normals")


def test_depth_image_maps_near_to_red_far_to_blue_and_shows_the_background():
    d = np.linspace(1.0, 2.0, 200).reshape(10, 20)
    alpha = np.ones_like(d)
    alpha[0, :5] = 0.5 * V.DEPTH_ALPHA_FLOOR
    bg = (0.2, 0.3, 0.4)
    img = V.depth_image(d * alpha, alpha, bg)
    assert np.allclose(img[0, :5], bg)
    assert np.allclose(img[-1, -1], V.turbo(0.0)) and np.allclose(img[0, 5], V.turbo(1.0), atol=0.02)
    assert V.turbo(1.0)[0] > 0.4 > V.turbo(1.0)[2] and V.turbo(0.2)[2] > 0.8 > V.turbo(0.2)[0]   # red near, blue far
    img = V.depth_image(d * 0.5, np.full_like(d, 0.5), bg)   # half opaque: half the background
    assert np.allclose(img[-1, -1], 0.5 * V.turbo(0.0) + 0.5 * np.array(bg))


def test_frames_shrink_while_the_camera_moves_and_are_full_size_at_rest(demo, monkeypatch):
    g, data = demo
    viewer = V.Viewer(g, max_side=128)
    wxyz, position, fov, _ = V.pose_of_camera(data.train[0].camera)
    view = viewer.add_client("c", V.VirtualView(wxyz, position, fov, 400, 200))
    monkeypatch.setitem(V.TARGET_SECONDS, "cpu", 1e-9)   # every frame too slow: the moving ones shrink
    sizes = []
    for _ in range(4):
        view.move(position=view.pose()[1] * 1.01)
        viewer.render_pending()
        sizes.append(view.frames[-1].shape[:2])
    assert sizes[0] == (64, 128) and sizes[-1][1] < 128 and sizes[-1][1] >= 128 * V.MIN_SCALE
    assert not view.due(time.monotonic())
    view.moved_at -= V.IDLE_SECONDS   # at rest: one full-size frame
    assert view.due(time.monotonic()) and viewer.render_pending() == 1
    assert view.frames[-1].shape[:2] == (64, 128) and not view.due(time.monotonic())
    viewer.set(max_side=1000)   # never beyond the canvas
    viewer.render_pending()
    assert view.frames[-1].shape[:2] == (200, 400)


def busy_port():
    """A socket listening on a free port of 127.0.0.1: (socket, port)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]


def test_a_port_in_use_is_named_with_a_free_one():
    s, port = busy_port()
    with s, pytest.raises(ValueError, match=rf"--port {port}: .* try --port \d+") as e:
        V.check_port("127.0.0.1", port)
    other = int(str(e.value).rsplit(" ", 1)[1])
    assert other != port
    V.check_port("127.0.0.1", other)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, demo):
    """A training folder as ``train`` leaves it, of the demo's ground truth: a PLY in
    point_cloud/iteration_1 and cameras.json."""
    from types import SimpleNamespace
    from data.ply import save_ply
    from engine.tools.outputs import point_cloud_path, write_cameras_json
    g, data = demo
    out = tmp_path_factory.mktemp("model")
    save_ply(point_cloud_path(out, 1), SimpleNamespace(**g.arrays()))
    write_cameras_json(out, data)
    return out


@pytest.mark.parametrize("content, why", [(b"hello, not a model\n", "neither a PLY file nor an HDF5 snapshot"),
                                          (b"ply\nformat ascii 1.0\n", "truncated PLY header"),
                                          (None, "not a NumbaSplat snapshot (no numbasplat_meta")])
@pytest.mark.parametrize("name", ["model.ply", "model.h5", "model.bin"])
def test_a_model_that_is_no_snapshot_or_ply_is_one_clear_error(tmp_path, content, why, name):
    pytest.importorskip("viser")
    path = tmp_path / name
    if content is None:   # an HDF5 file that is not a snapshot
        import h5py
        with h5py.File(path, "w") as f:
            f["x"] = np.zeros(3)
    else:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        cli.main(["view", "--model", str(path)])
    message = str(e.value.code)
    assert message.startswith(f"error: --model {path} is not a NumbaSplat snapshot (.h5) or a 3DGS PLY (.ply)")
    assert why in message and "\n" not in message


def test_view_without_viser_names_the_extra(model_folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "viser", None)   # (import viser raises ImportError)
    assert cli.main(["view", "--model", str(model_folder)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: the viewer needs viser: pip install -e '.[viewer]' in a checkout, else pip install viser"
    assert "numbasplat[" not in err  # (numbasplat is not on PyPI)


def test_view_on_a_port_in_use_names_it(model_folder, capsys):
    pytest.importorskip("viser")
    s, port = busy_port()
    with s:
        assert cli.main(["view", "--model", str(model_folder), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"--port {port}" in err and "try --port" in err


def test_view_serves_the_model_with_the_capture_cameras(model_folder, demo, monkeypatch, capsys):
    """``run.py view`` starts the server with cameras.json's cameras as frustums; a browser (here
    viser's Python side of one) starts at the first of them."""
    pytest.importorskip("viser")
    started = {}

    def serve(self, stop=None, until=None):   # (instead of serving until Ctrl-C)
        started["viewer"] = self
    monkeypatch.setattr(V.Viewer, "serve", serve)
    port = V.free_port("127.0.0.1", 8700)
    assert cli.main(["view", "--model", str(model_folder), "--port", str(port)]) == 0
    out = capsys.readouterr().out
    viewer = started["viewer"]
    assert f"viewer: http://localhost:{port}" in out and "500 Gaussians" in out
    g, data = demo
    assert len(viewer.gui["frustums"]) == len(data.views) and viewer.server is None   # (closed after serve)
    names = sorted(v.name.rsplit(".", 1)[0] for v in data.views)
    assert [n for n, _ in viewer.cameras] == names
    assert np.allclose(viewer.home.viewmat, next(v.camera.viewmat for v in data.views
                                                 if v.name.startswith(names[0])))


def small_trainer(tmp_path, demo, iterations=30):
    from engine.pipelines.single_gpu import SingleGPUTrainer
    _, data = demo
    cfg = TrainConfig(iterations=iterations, sh_degree=1, n_random_init=300, log_every=10, snapshot_every=0,
                      background=(1.0, 1.0, 1.0))
    return SingleGPUTrainer(data, tmp_path, cfg, backend="cpu", log=lambda *a: None)


def test_train_viewer_hook_shows_frames_and_progress(tmp_path, demo):
    pytest.importorskip("viser")
    t = small_trainer(tmp_path, demo)
    hook = V.live_viewer(t, V.free_port("127.0.0.1", 8750), log=lambda *a: None)
    viewer = hook.viewer
    try:
        hook.budget = 1.0   # (the CPU renders as slowly as it trains: let every step render here)
        _, data = demo
        wxyz, position, fov, _ = V.pose_of_camera(data.test[0].camera)
        view = viewer.add_client("virtual", V.VirtualView(wxyz, position, fov, 32, 32))
        assert len(viewer.gui["frustums"]) == len(data.views)
        t.train(progress=False)
        assert hook.frames >= 1 and view.frames
        stats = viewer.gui["stats"].content
        assert "step 30 / 30" in stats and "loss" in stats and "PSNR" in stats
        assert f"{len(t.model):,} Gaussians" in stats
        # the last frame is the live model's image from the browser's camera
        ours = V.to_8bit(ns.render(t.model.gaussians, data.test[0].camera, background=(1.0, 1.0, 1.0)).image)
        view.move()
        viewer.render_pending()
        assert np.abs(view.frames[-1].astype(int) - ours.astype(int)).max() <= 1
    finally:
        viewer.close()


def test_pause_holds_training_and_resume_continues(tmp_path, demo):
    """The panel's Pause button stops the loop after the step it is in (frames still render),
    Resume lets it go on; the time paused is not training time."""
    pytest.importorskip("viser")
    t = small_trainer(tmp_path, demo, iterations=12)
    hook = V.live_viewer(t, V.free_port("127.0.0.1", 8800), log=lambda *a: None)
    viewer = hook.viewer
    try:
        _, data = demo
        wxyz, position, fov, _ = V.pose_of_camera(data.train[0].camera)
        view = viewer.add_client("virtual", V.VirtualView(wxyz, position, fov, 32, 32))
        viewer.gui["pause"].value = True   # a click, through viser's handle
        assert viewer.paused and not viewer.gui["pause"].visible and viewer.gui["resume"].visible
        runner = threading.Thread(target=t.train, kwargs={"progress": False})
        start = time.perf_counter()
        runner.start()
        time.sleep(3.0)
        assert t.step == 1 and runner.is_alive()
        assert "(paused)" in viewer.gui["stats"].content
        view.move(position=position * 1.2)   # the camera moves while paused: a frame follows
        deadline = time.monotonic() + 30
        while view.shown != view.version and time.monotonic() < deadline:
            time.sleep(0.05)
        assert view.shown == view.version
        viewer.gui["resume"].value = True
        runner.join(timeout=120)
        assert not runner.is_alive() and t.step == 12 and not viewer.paused
        assert t.train_seconds < time.perf_counter() - start - 2.9   # the 3 s and more paused are not counted
    finally:
        viewer.close()


# ------------------------------------------------------------------ in a browser
CHROMIUM_ARGS = ["--no-sandbox", "--use-gl=swiftshader", "--enable-unsafe-swiftshader", "--ignore-gpu-blocklist"]


def chromium_path():
    """A headless-capable Chromium: $NUMBASPLAT_CHROMIUM, Playwright's own download, or the system's; None."""
    import os
    import shutil
    env = os.environ.get("NUMBASPLAT_CHROMIUM")
    if env:
        return env
    try:
        from playwright.sync_api import sync_playwright
        with sync_playwright() as p:
            own = p.chromium.executable_path
        if own and os.path.exists(own):
            return None   # (Playwright finds its own)
    except Exception:   # noqa: BLE001 -- no Playwright driver: no browser test
        pass
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return False


def canvas_image(page):
    import io
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(page.locator("canvas").first.screenshot())).convert("RGB")) / 255.0


def wait_for(condition, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_in_headless_chromium(demo):
    """The page shows the model from the first dataset camera, close to our render of that camera;
    an orbit drag in the page moves the camera, and the image follows."""
    pytest.importorskip("viser")
    playwright = pytest.importorskip("playwright.sync_api", reason="no Playwright: pip install playwright")
    executable = chromium_path()
    if executable is False:
        pytest.skip("no Chromium: `playwright install chromium` or the system's chromium package")
    g, data = demo
    cameras = V.dataset_cameras(data)
    viewer = V.Viewer(g, cameras, background=(1.0, 1.0, 1.0), up=V.cameras_up(cameras), max_side=1024)
    url = viewer.serve_on(V.free_port("127.0.0.1", 8900))
    stop = threading.Event()
    renderer = threading.Thread(target=viewer.serve, args=(stop,), daemon=True)
    renderer.start()
    try:
        with playwright.sync_playwright() as p:
            try:
                browser = p.chromium.launch(executable_path=executable or None, args=CHROMIUM_ARGS)
            except playwright.Error as e:   # (a browser without its system libraries, or a revision mismatch)
                pytest.skip(f"Chromium does not start: {str(e).strip().splitlines()[0]}")
            page = browser.new_page(viewport={"width": 900, "height": 500})
            page.goto(url)
            assert wait_for(lambda: any(c.shown for c in viewer.clients.values())), "no frame reached the page"
            view = next(iter(viewer.clients.values()))
            viewer.gui["show_cameras"].value = False   # (the frustums would be drawn over the frames)
            time.sleep(2.0)
            first = canvas_image(page)
            # the browser's camera is the dataset camera's, and the page shows our render of it
            wxyz, position, fov, width, height = view.pose()
            home = cameras[0][1]
            w0, p0, f0, _ = V.pose_of_camera(home)
            assert min(np.abs(wxyz - w0).max(), np.abs(wxyz + w0).max()) < 1e-4
            assert np.allclose(position, p0, atol=1e-4) and np.isclose(fov, f0, atol=1e-4)
            ours = V.render_frame(g, V.camera_from_pose(w0, p0, f0, first.shape[1], first.shape[0]),
                                  background=(1.0, 1.0, 1.0))
            close = np.abs(first - ours).max(axis=2) < 0.1
            assert first.std() > 0.05 and (np.abs(first - 1.0).max(axis=2) > 0.1).mean() > 0.05   # not blank
            assert close.mean() > 0.9, f"only {close.mean():.2f} of the pixels match our render"
            # orbit: a drag across the canvas
            shown = view.shown
            box = page.locator("canvas").first.bounding_box()
            x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
            page.mouse.move(x, y)
            page.mouse.down()
            for k in range(1, 11):
                page.mouse.move(x + 15 * k, y + 3 * k)
                time.sleep(0.03)
            page.mouse.up()
            assert wait_for(lambda: view.shown > shown and view.full), "no new frame after the drag"
            time.sleep(2.0)
            moved = canvas_image(page)
            wxyz2, position2, fov2, _, _ = view.pose()
            assert np.abs(position2 - position).max() > 1e-3
            assert np.abs(moved - first).mean() > 0.01
            ours = V.render_frame(g, V.camera_from_pose(wxyz2, position2, fov2, moved.shape[1], moved.shape[0]),
                                  background=(1.0, 1.0, 1.0))
            assert (np.abs(moved - ours).max(axis=2) < 0.1).mean() > 0.9
            browser.close()
    finally:
        stop.set()
        viewer.close()


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_under_mpi_rank_0_shows_a_thinned_gathered_model_and_a_pause_holds_every_rank(tmp_path, mpiexec):
    """Two CPU ranks: rank 0's viewer gets a model gathered every 4 steps, every k-th Gaussian of each
    shard so that at most 100 arrive (k = ceil(total / 100)), and renders it; its pause (2 s) holds
    the other rank too, and is left out of the training time."""
    import re
    import subprocess
    from conftest import REPO_ROOT
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, str(REPO_ROOT / "tests" / "check_mpi_viewer.py"),
                        str(tmp_path)], capture_output=True, text=True, timeout=800, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"rank 0: gathered at steps \[([\d, ]+)\] sizes \[([\d, ]+)\] total (\d+) note '([^']*)' "
                  r"frames (\d+) same (\d+) wall ([\d.]+) trained ([\d.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    steps = [int(s) for s in m.group(1).split(",")]
    sizes = [int(s) for s in m.group(2).split(",")]
    total = int(m.group(3))
    assert steps[0] <= 4 and all(s % 4 == 0 or s == 24 for s in steps) and 24 in steps
    assert all(n <= 100 + 2 for n in sizes) and total > 100   # (each rank rounds its share up)
    assert m.group(4).startswith("every ") and m.group(4).endswith(f"of {total:,}")
    assert int(m.group(5)) >= 1 and int(m.group(6)) <= 1
    other = re.search(r"rank 1: step (\d+) wall ([\d.]+)", r.stdout)
    assert other and int(other.group(1)) == 24 and float(other.group(2)) >= 2.0   # held by rank 0's pause
    assert float(m.group(8)) < float(m.group(7)) - 1.9


def test_train_with_viewer_flag_serves_while_training_and_records_no_viewer_setting(tmp_path, capsys):
    """``run.py train --viewer --port P`` on a small capture: the viewer's address is printed, training
    ends as without it (no browser: the command ends), and cfg.json records neither flag; a port in
    use stops it before training, naming the port."""
    import json
    from test_trainer import write_blender_capture
    pytest.importorskip("viser")
    cap = tmp_path / "capture"
    write_blender_capture(cap, make_dataset(size=32, n_views=6, backend="cpu"))
    port = V.free_port("127.0.0.1", 8950)
    args = ["train", "--data", str(cap), "--white-background", "--iters", "5", "--quiet", "--sh-degree", "1",
            "--init-points", "200", "--viewer", "--port", str(port)]
    assert cli.main(args + ["--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"viewer: http://localhost:{port}" in out
    recorded = json.loads((tmp_path / "out" / "cfg.json").read_text())
    assert not {"viewer", "port", "host"} & set(recorded) and recorded["iterations"] == 5
    assert (tmp_path / "out" / "snapshot.h5").is_file()
    s, busy = busy_port()
    with s:
        assert cli.main(["train", *args[1:-1], str(busy), "--out", str(tmp_path / "out2")]) == 1
    assert f"--port {busy}" in capsys.readouterr().err
    assert not (tmp_path / "out2" / "snapshot.h5").exists()


def test_the_panel_sets_mode_sh_degree_size_and_background(demo):
    """The panel's controls, set through viser's handles (as a browser sets them), change the frames."""
    pytest.importorskip("viser")
    g, data = demo
    viewer = V.Viewer(g, V.dataset_cameras(data))
    viewer.serve_on(V.free_port("127.0.0.1", 9000))
    try:
        cam = data.test[1].camera
        wxyz, position, fov, _ = V.pose_of_camera(cam)
        view = viewer.add_client("virtual", V.VirtualView(wxyz, position, fov, 32, 32))
        viewer.gui["sh"].value = 0
        viewer.gui["background"].value = (0, 0, 255)
        viewer.render_pending()
        ours = ns.render(g, cam, sh_degree=0, background=(0.0, 0.0, 1.0)).image
        assert np.abs(view.frames[-1].astype(int) - V.to_8bit(ours).astype(int)).max() <= 1
        assert np.abs(V.to_8bit(ours).astype(int)
                      - V.to_8bit(ns.render(g, cam, background=(0.0, 0.0, 1.0)).image).astype(int)).max() > 5
        viewer.gui["mode"].value = V.MODE_LABELS["alpha"]
        viewer.render_pending()
        alpha = 1.0 - ns.render(g, cam).render.trans
        assert np.abs(view.frames[-1][..., 1].astype(int) - V.to_8bit(alpha).astype(int)).max() <= 1
        viewer.gui["side"].value = 64
        viewer.max_side = 16   # (below the slider's range: frames of 16 px)
        viewer.changed()
        viewer.render_pending()
        assert view.frames[-1].shape == (16, 16, 3)
    finally:
        viewer.close()


def test_a_model_without_cameras_is_seen_from_outside(demo):
    """``view`` of a lone PLY: the first view looks at the model's centre from outside its extent."""
    from cli.view import outside_view
    g, _ = demo
    cam = outside_view(g.means)
    lo, hi = np.percentile(g.means, [5, 95], axis=0)
    centre = 0.5 * (lo + hi)
    p = cam.viewmat[:3, :3] @ centre + cam.viewmat[:3, 3]
    assert np.allclose([cam.fx * p[0] / p[2] + cam.cx, cam.fy * p[1] / p[2] + cam.cy], [cam.cx, cam.cy])
    assert p[2] > 0.5 * np.linalg.norm(hi - lo)
    image = V.render_frame(g, cam, background=(1.0, 1.0, 1.0))
    assert (np.abs(image - 1.0).max(axis=2) > 0.1).mean() > 0.05   # the model is in the picture
