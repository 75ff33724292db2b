"""The browser viewer's costs (BENCHMARKS.md, "Viewer (issue 28)"), headless: no browser needed.

    python scripts/viewer_bench.py latency --demo                       # the demo scene (CPU row)
    python scripts/viewer_bench.py latency --scene .data/b1m.npz --size 1920x1080 [--frames 20]
    python scripts/viewer_bench.py slowdown --data .data/lego --white-background --iters 2000
    python scripts/viewer_bench.py slowdown --data demo --iters 300 --canvas 512 512   # (CPU row)

latency: the time of one viewer frame (render in the mode, to the host, 8-bit, JPEG as viser sends it)
at a size, median over ``--frames`` after two warm-up frames, per render mode, and the frame rate it
allows.  slowdown: ``--iters`` training steps without the viewer, then with ``train --viewer``'s hook
(``LiveView``) at its default budget and a client whose camera moves at every step (the worst case:
it always wants a frame), frames JPEG-encoded as viser sends them; images/s of both and the slowdown
(the issue's bound: 10%).  The order alternates over ``--repeats`` pairs so that warm-up and clocks
favour neither.
"""
import argparse
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from numbasplat import backend as _backend  # noqa: E402
from engine.tools import viewer as V  # noqa: E402


def jpeg(image):
    """The frame as viser encodes it (cv2 where installed, else Pillow), at the viewer's quality."""
    try:
        from viser._image_encoding import cv2_imencode_with_fallback
        return cv2_imencode_with_fallback("jpeg", image, V.JPEG_QUALITY, channel_ordering="rgb")
    except ImportError:
        from PIL import Image
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, "jpeg", quality=V.JPEG_QUALITY)
        return buf.getvalue()


def latency(a):
    import numbasplat as ns
    from data.bench_scene import load_scene
    xp = _backend.array_module()
    if a.demo:
        from engine.tools.demo import ground_truth, make_dataset
        g, cam = ground_truth(), make_dataset(size=64, n_views=8).train[0].camera
        where = "demo scene (500 Gaussians)"
    else:
        g, cam = load_scene(a.scene)
        where = f"{a.scene} ({len(g):,} Gaussians)"
    g = ns.Gaussians(**{k: xp.asarray(v) for k, v in g.arrays().items()})
    w, h = (int(x) for x in a.size.lower().split("x"))
    wxyz, position, fov, _ = V.pose_of_camera(cam)
    camera = V.camera_from_pose(wxyz, position, fov, w, h)
    print(f"viewer frame latency, {where}, {w}x{h}, backend {_backend.BACKEND}")
    points = V.centre_points(g)
    for mode in V.RENDER_MODES:
        times = []
        for i in range(a.frames + 2):
            t = time.perf_counter()
            image = V.render_frame(g, camera, mode, background=(1.0, 1.0, 1.0), points=points)
            jpeg(V.to_8bit(image))
            if i >= 2:
                times.append(time.perf_counter() - t)
        ms = 1000 * statistics.median(times)
        print(f"  {mode:8s} {ms:8.1f} ms  ({1000 / ms:6.1f} frames/s)")


class EncodingView(V.VirtualView):
    """A client that moves at every step and whose frames are JPEG-encoded as viser sends them."""

    def show(self, image):
        jpeg(image)
        super().show(image)


def slowdown(a):
    from data import load_dataset
    from engine.pipelines.single_gpu import SingleGPUTrainer
    from engine.recipe.trainer import TrainConfig
    bg = (1.0, 1.0, 1.0) if a.white_background or a.data == "demo" else (0.0, 0.0, 0.0)
    if a.data == "demo":
        from engine.tools.demo import make_dataset
        data = make_dataset()
    else:
        data = load_dataset(a.data, images=a.images, background=bg)
    rates, share = {"without": [], "with": []}, []
    kinds = ["warm-up"] + [kind for r in range(a.repeats)
                           for kind in (("without", "with") if r % 2 == 0 else ("with", "without"))]
    for kind in kinds:   # (the warm-up compiles every kernel, densification's too: it counts for neither)
        cfg = TrainConfig(iterations=a.iters, background=bg, snapshot_every=0, log_every=100)
        t = SingleGPUTrainer(data, f"/tmp/viewer_bench_{kind}", cfg, log=lambda *x: None)
        t.init_model()
        hook = None
        if kind == "with":
            viewer = V.Viewer(t.model.gaussians, V.dataset_cameras(data), bg, training=True)
            cam = data.train[0].camera
            wxyz, position, fov, _ = V.pose_of_camera(cam)
            view = viewer.add_client("bench", EncodingView(wxyz, position, fov, *a.canvas))
            hook = V.LiveView(viewer)
            t.step_hooks.append(hook)
            t.step_hooks.append(lambda trainer, rec: view.move() or 0.0)   # (always wants a frame)
        t.save_snapshot = lambda *x: None   # (the measurement is the steps)
        t.train(progress=False)
        seconds = t.train_seconds   # (the steps and the hooks; not the outputs written at the end)
        if kind in rates:
            rates[kind].append(a.iters / seconds)
        if hook:
            share.append(hook.spent / seconds)
        extra = f", {hook.frames} frames, viewer {100 * hook.spent / seconds:.1f}% of the time" if hook else ""
        print(f"  {kind:7s} viewer: {a.iters / seconds:7.1f} images/s{extra}", flush=True)
    mid = {k: statistics.median(v) for k, v in rates.items()}
    print(f"slowdown with the viewer: {100 * (1 - mid['with'] / mid['without']):.1f}% "
          f"(median of {a.repeats}: {mid['without']:.1f} -> {mid['with']:.1f} images/s; bound 10%); "
          f"the viewer's frames took {100 * statistics.median(share):.1f}% of the run")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    lat = sub.add_parser("latency")
    src = lat.add_mutually_exclusive_group(required=True)
    src.add_argument("--scene", help=".npz benchmark scene (run.py bench --make)")
    src.add_argument("--demo", action="store_true", help="the built-in demo scene")
    lat.add_argument("--size", default="1920x1080")
    lat.add_argument("--frames", type=int, default=20)
    slow = sub.add_parser("slowdown")
    slow.add_argument("--data", required=True, help="a capture, or demo: the built-in scene")
    slow.add_argument("--images", default=None)
    slow.add_argument("--white-background", action="store_true")
    slow.add_argument("--iters", type=int, default=2000)
    slow.add_argument("--repeats", type=int, default=2)
    slow.add_argument("--canvas", type=int, nargs=2, default=(1920, 1080), metavar=("W", "H"))
    a = p.parse_args()
    latency(a) if a.what == "latency" else slowdown(a)


if __name__ == "__main__":
    main()
