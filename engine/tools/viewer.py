"""The browser viewer (issue 28): a trained model, or the model as it trains, in a web page.

Built on viser (the ``viewer`` extra: its browser client ships inside its wheel), which draws the
page, the panel of controls and the cameras' frustums, and reports each browser's camera; the
frames are ours: the rasterizer renders each browser's view (CUDA where there is a GPU, else the
CPU backend) and viser shows it as the scene's background image.

Cameras.  viser reports a browser's camera as ``wxyz``, the camera-to-world rotation as a
quaternion, ``position``, its centre, and ``fov``, its vertical field of view, in OpenCV axes
(x right, y down, z forward): the axes of ``numbasplat.Camera`` (world-to-camera).
``camera_from_pose`` makes a ``Camera`` of them, square pixels with the principal point at the
image centre, at the canvas's aspect; ``pose_of_camera`` is the reverse, for the dataset's
cameras (their frustums, and jumping to one).

Frame rate.  A frame's longest side is at most ``max_side`` pixels (the panel's slider; by default
``MAX_SIDE`` of the backend).  While the camera moves, frames shrink or grow so that one takes
about ``TARGET_SECONDS`` of the backend; once it rests for ``IDLE_SECONDS`` it gets a frame at
full size.

Threads.  viser's callbacks only record what changed (a camera, a setting); frames are rendered in
one thread: the ``view`` command's loop (``Viewer.serve``), or, while training, the training loop
between two steps (``LiveView``), so that a render never sees a half-updated model and needs no
lock around it.  ``LiveView`` renders only while the viewer's share of the wall time stays below
``BUDGET`` (5%), so that the viewer slows training by about that much at most; pausing stops the
steps and leaves the viewer all the time.

Under MPI rank 0 serves the viewer.  The distributed pipelines' renders need every rank, so rank
0 does not render through them: every ``SYNC_EVERY`` steps the ranks agree (one small broadcast)
whether rank 0 wants a fresh model, and if so each rank sends it every k-th Gaussian of its
shard, k chosen so that rank 0 receives at most ``MAX_GATHERED``; rank 0 renders that copy
(``Trainer.view_model``).  A model larger than that is shown thinned, which the panel says.
A pause stops rank 0 at its next step boundary, and the other ranks wait for it in the step's
exchanges.
"""
import math
import socket
import threading
import time

import numpy as np
from numba import njit

import numbasplat as ns
from numbasplat import C0
from numbasplat import backend as _backend

from engine.pipelines.options import check
from .outputs import MissingExtra, install_hint

RENDER_MODES = ("rgb", "depth", "alpha", "centres")
MODE_LABELS = {"rgb": "RGB", "depth": "depth", "alpha": "alpha", "centres": "Gaussian centres"}
DEFAULT_PORT = 8080
DEFAULT_HOST = "127.0.0.1"   # this machine only; --host 0.0.0.0 serves other machines too (ssh -L works with this)
MAX_SIDE = {"cpu": 512, "cuda": 1920}           # a frame's longest side at full size, pixels, per backend
TARGET_SECONDS = {"cpu": 0.2, "cuda": 1 / 30}   # a frame's time while the camera moves, per backend
MIN_SCALE = 0.125            # frames shrink to this share of the full size at most while moving
IDLE_SECONDS = 0.3           # a camera at rest this long gets a full-size frame
REFRESH_SECONDS = 1.0        # while training, a browser's frame is renewed this often (the model changes)
BUDGET = 0.05                # while training: the viewer's most share of the wall time
SYNC_EVERY = 50              # under MPI: steps between the ranks' agreements on gathering a model for rank 0
MAX_GATHERED = 500_000       # under MPI: the most Gaussians rank 0 gathers to show (~120 MB at SH degree 3)
JPEG_QUALITY = 90
DEPTH_ALPHA_FLOOR = 0.05     # depth mode: pixels less opaque than this show the background
CENTRE_DOT = 2               # centres mode: each centre is a dot of this many pixels a side
FRUSTUM_SIZE = 0.03          # the cameras' frustums: their depth, a share of the cameras' spread
FRUSTUM_LINE_PX = 1.5        # their lines' width on the screen


def require_viser():
    """The viser module; ``MissingExtra`` naming the extra when it is not installed (and viser itself,
    which is on PyPI, where numbasplat is not: ``pip install numbasplat[viewer]`` would find nothing)."""
    try:
        import viser
    except ImportError:
        raise MissingExtra(f"the viewer needs viser: {install_hint('viewer')} in a checkout, "
                           "else pip install viser") from None
    return viser


# ------------------------------------------------------------------ the port
def _bind(host, port):
    """Bind a listening socket to (host, port) and close it; OSError when that cannot be done.
    SO_REUSEADDR as the server's own (asyncio) sockets, so a port in TIME_WAIT counts as free."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(1)


def free_port(host, start):
    """The first port from ``start`` on that ``host`` can listen on (None: none of the next 100)."""
    for port in range(start, min(start + 100, 65536)):
        try:
            _bind(host, port)
            return port
        except OSError:
            continue
    return None


def check_port(host, port):
    """ValueError naming ``port`` and a free one when the viewer cannot listen on it (viser itself
    would silently move to another port, which the user would not find)."""
    try:
        _bind(host, port)
    except OSError as e:
        other = free_port(host, port + 1)
        hint = f"; try --port {other}" if other else ""
        raise ValueError(f"--port {port}: cannot serve the viewer on {host}:{port} ({e.strerror or e}: "
                         f"another program uses it){hint}") from None


# ------------------------------------------------------------------ cameras
def wxyz_from_rotation(r):
    """The unit quaternion (w, x, y, z), w >= 0, of the rotation matrix ``r`` (Shepperd's method)."""
    r = np.asarray(r, np.float64)
    tr = np.trace(r)
    if tr > 0:
        s = 2.0 * math.sqrt(tr + 1.0)
        q = [0.25 * s, (r[2, 1] - r[1, 2]) / s, (r[0, 2] - r[2, 0]) / s, (r[1, 0] - r[0, 1]) / s]
    elif r[0, 0] > r[1, 1] and r[0, 0] > r[2, 2]:
        s = 2.0 * math.sqrt(1.0 + r[0, 0] - r[1, 1] - r[2, 2])
        q = [(r[2, 1] - r[1, 2]) / s, 0.25 * s, (r[0, 1] + r[1, 0]) / s, (r[0, 2] + r[2, 0]) / s]
    elif r[1, 1] > r[2, 2]:
        s = 2.0 * math.sqrt(1.0 + r[1, 1] - r[0, 0] - r[2, 2])
        q = [(r[0, 2] - r[2, 0]) / s, (r[0, 1] + r[1, 0]) / s, 0.25 * s, (r[1, 2] + r[2, 1]) / s]
    else:
        s = 2.0 * math.sqrt(1.0 + r[2, 2] - r[0, 0] - r[1, 1])
        q = [(r[1, 0] - r[0, 1]) / s, (r[0, 2] + r[2, 0]) / s, (r[1, 2] + r[2, 1]) / s, 0.25 * s]
    q = np.asarray(q) / np.linalg.norm(q)
    return -q if q[0] < 0 else q


def rotation_from_wxyz(wxyz):
    """The rotation matrix of the quaternion ``wxyz`` (normalised first)."""
    w, x, y, z = np.asarray(wxyz, np.float64) / np.linalg.norm(wxyz)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                     [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                     [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])


def camera_from_pose(wxyz, position, fov, width, height):
    """The ``numbasplat.Camera`` of a viser camera: ``wxyz`` its camera-to-world rotation, ``position``
    its centre (OpenCV axes both), ``fov`` its vertical field of view in radians, rendering
    ``width`` x ``height`` pixels (square, the principal point at the centre)."""
    r = rotation_from_wxyz(wxyz)
    viewmat = np.eye(4)
    viewmat[:3, :3] = r.T
    viewmat[:3, 3] = -r.T @ np.asarray(position, np.float64)
    f = 0.5 * height / math.tan(0.5 * float(fov))
    return ns.Camera(viewmat, f, f, 0.5 * width, 0.5 * height, width, height)


def pose_of_camera(camera):
    """-> (wxyz, position, vertical fov, aspect) of ``camera`` as viser takes them (``camera_from_pose``
    reversed)."""
    r = camera.viewmat[:3, :3].T
    return (wxyz_from_rotation(r), -r @ camera.viewmat[:3, 3], 2.0 * math.atan(0.5 * camera.height / camera.fy),
            camera.width / camera.height)


def frame_size(aspect, side):
    """(width, height) of a frame of ``aspect`` (width / height) whose longest side is ``side`` pixels."""
    side = max(1, int(side))
    if aspect >= 1.0:
        return side, max(1, round(side / aspect))
    return max(1, round(side * aspect)), side


# ------------------------------------------------------------------ frames
def turbo(t, xp=np):
    """Google's Turbo colour map (its polynomial fit) of ``t`` in [0, 1] -> (..., 3), on ``xp``'s arrays."""
    t = xp.clip(t, 0.0, 1.0)[..., None]
    out = xp.zeros(t.shape[:-1] + (3,), t.dtype)
    for k in range(5, -1, -1):   # Horner
        out = out * t + xp.asarray(TURBO[:, k], t.dtype)
    return xp.clip(out, 0.0, 1.0)


TURBO = np.array([[0.13572138, 4.61539260, -42.66032258, 132.13108234, -152.94239396, 59.28637943],
                  [0.09140261, 2.19418839, 4.84296658, -14.18503333, 4.27729857, 2.82956604],
                  [0.10667330, 12.64194608, -60.58204836, 110.36276771, -89.90310912, 27.34824973]])
DEPTH_SAMPLES = 65536   # depth mode: its near and far percentiles are of at most this many opaque pixels


def depth_image(depth_sum, alpha, background, xp=np):
    """Expected depth (the rasterizer's sum of w z over its alpha) in Turbo colours, near red to far
    blue between the 1st and 99th percentile of the opaque pixels' depths (of at most
    ``DEPTH_SAMPLES`` of them, evenly spread), blended on the background by alpha; pixels less
    opaque than ``DEPTH_ALPHA_FLOOR`` show the background.  On ``xp``'s arrays (the device's)."""
    alpha = xp.clip(xp.asarray(alpha), 0.0, 1.0)
    opaque = alpha > DEPTH_ALPHA_FLOOR
    depth = xp.where(opaque, xp.asarray(depth_sum) / xp.maximum(alpha, 1e-12), 0.0)
    t = xp.zeros_like(depth)
    values = depth[opaque]
    if values.size:
        values = values[::max(1, values.size // DEPTH_SAMPLES)]
        near, far = (float(x) for x in _backend.to_host(xp.percentile(values, xp.asarray([1.0, 99.0]))))
        t = (depth - near) / max(far - near, 1e-9)
    colours = turbo(1.0 - t, xp)
    a = xp.where(opaque, alpha, 0.0)[..., None]
    return a * colours + (1.0 - a) * xp.asarray(np.asarray(background), colours.dtype)


def centre_points(gaussians):
    """(means (N, 3), colours (N, 3)) on the host: the Gaussians' centres and their colour seen
    from no direction in particular (SH band 0), what the centres mode draws."""
    means = np.asarray(_backend.to_host(gaussians.means), np.float64)
    colours = np.clip(np.asarray(_backend.to_host(gaussians.sh[:, 0]), np.float64) * C0 + 0.5, 0.0, 1.0)
    return means, colours


def centres_image(points, camera, background, dot=CENTRE_DOT):
    """The Gaussians' centres (``centre_points``) in front of ``camera`` as dots of ``dot`` pixels, the
    nearest in front where dots overlap (the first of equals), on the background: one compiled pass
    with a depth buffer."""
    means, colours = points
    image = np.empty((camera.height, camera.width, 3))
    image[...] = np.asarray(background, np.float64)
    _draw_centres(means, colours, np.asarray(camera.viewmat, np.float64), float(camera.fx), float(camera.fy),
                  float(camera.cx), float(camera.cy), int(dot), image)
    return image


@njit(cache=True)
def _draw_centres(means, colours, viewmat, fx, fy, cx, cy, dot, image):
    h, w = image.shape[0], image.shape[1]
    nearest = np.full((h, w), np.inf)
    for i in range(means.shape[0]):
        x, y, z = means[i, 0], means[i, 1], means[i, 2]
        cz = viewmat[2, 0] * x + viewmat[2, 1] * y + viewmat[2, 2] * z + viewmat[2, 3]
        if cz <= 1e-6:
            continue
        cx_ = viewmat[0, 0] * x + viewmat[0, 1] * y + viewmat[0, 2] * z + viewmat[0, 3]
        cy_ = viewmat[1, 0] * x + viewmat[1, 1] * y + viewmat[1, 2] * z + viewmat[1, 3]
        u = fx * cx_ / cz + cx - 0.5 * (dot - 1)
        v = fy * cy_ / cz + cy - 0.5 * (dot - 1)
        if not (-dot < u < w and -dot < v < h):   # (off the image; also keeps the integers small)
            continue
        u0, v0 = int(np.floor(u)), int(np.floor(v))
        for py in range(max(v0, 0), min(v0 + dot, h)):
            for px in range(max(u0, 0), min(u0 + dot, w)):
                if cz < nearest[py, px]:
                    nearest[py, px] = cz
                    image[py, px, 0] = colours[i, 0]
                    image[py, px, 1] = colours[i, 1]
                    image[py, px, 2] = colours[i, 2]


def render_frame(gaussians, camera, mode="rgb", sh_degree=None, background=(0.0, 0.0, 0.0), antialias=False,
                 backend=None, points=None):
    """One frame of the viewer: (H, W, 3) float host image in [0, 1] of ``gaussians`` from ``camera``.
    ``mode``: rgb (the render, as ``eval`` renders it), depth (``depth_image``), alpha (the
    accumulated opacity, grey), centres (``centres_image``; ``points``: its ``centre_points``,
    computed when None)."""
    if mode not in RENDER_MODES:
        raise ValueError(f"render mode {mode!r}: expected one of {', '.join(RENDER_MODES)}")
    if mode == "centres":
        return centres_image(centre_points(gaussians) if points is None else points, camera, background)
    frame = ns.render(gaussians, camera, sh_degree=sh_degree, background=background, antialias=antialias,
                      backend=backend, check=False)
    xp = _backend.array_module(backend)
    if mode == "rgb":
        image = frame.image
    elif mode == "alpha":
        image = xp.repeat((1.0 - frame.render.trans)[..., None], 3, axis=2)
    else:
        image = depth_image(frame.render.depth, 1.0 - frame.render.trans, background, xp)
    return np.clip(np.asarray(_backend.to_host(image), np.float64), 0.0, 1.0)


def to_8bit(image):
    return (np.clip(image, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


# ------------------------------------------------------------------ browsers
class ClientView:
    """What the renderer knows of one browser: its camera (``pose``), how its frames go, and where
    they go (``show``).  ``version`` counts its camera's changes, ``shown`` the version its last
    frame showed; ``scale`` the share of the full size that keeps a moving camera's frames near
    the target time."""

    def __init__(self):
        self.version = 1
        self.shown = 0
        self.moved_at = time.monotonic()
        self.last_frame = -math.inf
        self.full = False
        self.scale = 1.0

    def moved(self):
        self.version += 1
        self.moved_at = time.monotonic()

    def due(self, now, refresh=None):
        """Whether it needs a frame: its camera changed, it rests after small frames, or (``refresh``
        seconds, while training) its frame is old."""
        if self.pose() is None:
            return False
        if self.version != self.shown:
            return True
        if not self.full and now - self.moved_at >= IDLE_SECONDS:
            return True
        return refresh is not None and now - self.last_frame >= refresh

    def pose(self):
        """(wxyz, position, fov, canvas width, canvas height), or None before the browser told it."""
        raise NotImplementedError

    def show(self, image):
        """Send a (H, W, 3) uint8 frame."""
        raise NotImplementedError


class BrowserView(ClientView):
    """A browser connected through viser."""

    def __init__(self, client):
        super().__init__()
        self.client = client

    def pose(self):
        c = self.client.camera
        try:
            if c.image_width <= 0 or c.image_height <= 0:
                return None
            return c.wxyz, c.position, c.fov, c.image_width, c.image_height
        except AssertionError:  # (viser: no camera message yet)
            return None

    def show(self, image):
        self.client.scene.set_background_image(image, format="jpeg", jpeg_quality=JPEG_QUALITY)


class VirtualView(ClientView):
    """A client without a browser, for tests and measurements: a camera set in code, and the frames
    kept (``frames``; the last ``keep``)."""

    def __init__(self, wxyz, position, fov, width, height, keep=2):
        super().__init__()
        self.camera = (np.asarray(wxyz, np.float64), np.asarray(position, np.float64), float(fov), width, height)
        self.frames = []
        self.keep = keep

    def pose(self):
        return self.camera

    def move(self, wxyz=None, position=None, fov=None):
        w, p, f, width, height = self.camera
        self.camera = (w if wxyz is None else np.asarray(wxyz, np.float64),
                       p if position is None else np.asarray(position, np.float64), f if fov is None else fov,
                       width, height)
        self.moved()

    def show(self, image):
        self.frames = (self.frames + [image])[-self.keep:]


class Viewer:
    """A model in browsers: a viser server (``serve_on``), its panel and the cameras' frustums, and
    the frames of each browser's view.

    ``gaussians``: the model (device arrays; ``set_model`` replaces it); ``cameras``: [(name,
    numbasplat.Camera)], drawn as frustums and listed to jump to; ``up``: the world's up (orbiting
    turns around it); ``training``: the panel shows the run's progress and pause/resume; ``home``:
    the camera a browser starts at (default the first of ``cameras``)."""

    def __init__(self, gaussians, cameras=(), background=(0.0, 0.0, 0.0), antialias=False, backend=None,
                 up=None, training=False, max_side=None, note="", home=None):
        self.backend = backend or _backend.BACKEND
        self.kind = "cuda" if _backend.on_gpu(self.backend) else "cpu"
        self.cameras = list(cameras)
        self.home = home if home is not None or not self.cameras else self.cameras[0][1]
        self.antialias = bool(antialias)
        self.up = None if up is None else np.asarray(up, np.float64)
        self.training = training
        self.mode = "rgb"
        self.background = tuple(float(c) for c in background)
        self.max_side = int(max_side or MAX_SIDE[self.kind])
        self.note = note
        self.clients = {}
        self.lock = threading.Lock()     # the clients and settings, between viser's threads and the renderer
        self.wake = threading.Event()    # something changed: the render loop looks
        self.paused = False
        self.server = None
        self.gui = {}
        self.frame_note = ""
        self._stats_shown = 0.0
        self.gaussians, self.points, self.max_degree = None, None, 0
        self.sh_choice = None   # the panel's SH degree; None: the model's highest
        self.set_model(gaussians)

    # -------------------------------------------------------------- the model and settings
    def set_model(self, gaussians, note=None):
        """Show ``gaussians`` from now on (frames follow at the next ``render_pending``)."""
        self.gaussians = gaussians
        self.points = None   # the centres mode's host copy, made when asked for
        self.max_degree = gaussians.sh_degree()
        if note is not None:
            self.note = note
        if not self.training:
            self.changed()

    @property
    def sh_degree(self):
        """The SH degree frames render with: the panel's choice, at most the model's."""
        return self.max_degree if self.sh_choice is None else min(self.sh_choice, self.max_degree)

    def changed(self):
        """A setting changed: every view needs a frame, at full size."""
        with self.lock:
            for c in self.clients.values():
                c.version += 1
        self.wake.set()

    def set(self, mode=None, sh_degree=None, max_side=None, background=None):
        """Change the render settings (what the panel's controls call)."""
        if mode is not None:
            if mode not in RENDER_MODES:
                raise ValueError(f"render mode {mode!r}: expected one of {', '.join(RENDER_MODES)}")
            self.mode = mode
        if sh_degree is not None:
            self.sh_choice = max(0, int(sh_degree))
        if max_side is not None:
            self.max_side = max(16, int(max_side))
        if background is not None:
            self.background = tuple(float(c) for c in background)
        self.changed()

    def pause(self):
        self._set_paused(True)

    def resume(self):
        self._set_paused(False)

    def _set_paused(self, paused):
        self.paused = paused
        if "pause" in self.gui:
            self.gui["pause"].visible = not paused
            self.gui["resume"].visible = paused
        self.wake.set()

    # -------------------------------------------------------------- clients
    def add_client(self, key, view):
        with self.lock:
            self.clients[key] = view
        self.wake.set()
        return view

    def remove_client(self, key):
        with self.lock:
            self.clients.pop(key, None)

    def wants_frames(self, now=None, refresh=None):
        """Whether some view needs a frame (``ClientView.due``)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            return any(c.due(now, refresh) for c in self.clients.values())

    def camera_for(self, view, now=None):
        """The ``Camera`` of ``view``'s next frame: its pose, at the full size at rest, else scaled."""
        wxyz, position, fov, width, height = view.pose()
        now = time.monotonic() if now is None else now
        moving = now - view.moved_at < IDLE_SECONDS
        side = min(self.max_side, max(width, height)) * (view.scale if moving else 1.0)   # (no more than the canvas)
        w, h = frame_size(width / height, side)
        return camera_from_pose(wxyz, position, fov, w, h), moving

    def frame(self, camera):
        """The current model's frame from ``camera`` with the current settings, as float [0, 1]."""
        if self.mode == "centres" and self.points is None:
            self.points = centre_points(self.gaussians)
        return render_frame(self.gaussians, camera, self.mode, self.sh_degree, self.background, self.antialias,
                            self.backend, self.points)

    def render_pending(self, refresh=None):
        """Render and send a frame to every view that needs one; -> the frames sent."""
        now = time.monotonic()
        with self.lock:
            due = [c for c in self.clients.values() if c.due(now, refresh)]
        for view in due:
            version = view.version
            camera, moving = self.camera_for(view, now)
            t = time.perf_counter()
            try:
                image = self.frame(camera)
            except ValueError as e:   # e.g. too many intersections at this size: say so, keep serving
                self.frame_note = f"render failed: {e}"
                view.shown, view.full = version, True
                continue
            view.show(to_8bit(image))
            seconds = time.perf_counter() - t
            if moving:   # the next moving frame's size: about the target time
                factor = min(1.5, max(0.5, math.sqrt(TARGET_SECONDS[self.kind] / max(seconds, 1e-6))))
                view.scale = min(1.0, max(MIN_SCALE, view.scale * factor))
            view.shown, view.full, view.last_frame = version, not moving, now
            self.frame_note = f"{camera.width}x{camera.height}, {1000 * seconds:.0f} ms"
        if due:
            self._update_frame_note()
        return len(due)

    def serve(self, stop=None, until=None):
        """Render frames as the views change, until ``stop`` (a threading.Event) is set, ``until``
        (seconds) passes, or Ctrl-C."""
        end = math.inf if until is None else time.monotonic() + until
        while (stop is None or not stop.is_set()) and time.monotonic() < end:
            self.wake.wait(0.05)
            self.wake.clear()
            self.render_pending()

    # -------------------------------------------------------------- the server
    def serve_on(self, port=DEFAULT_PORT, host=DEFAULT_HOST):
        """Start the viser server on ``host``:``port`` with the panel and the frustums; -> its URL.
        ValueError naming the port when it is taken."""
        viser = require_viser()
        check_port(host, port)
        server = viser.ViserServer(host=host, port=port, verbose=False)
        if server.get_port() != port:   # taken between the check and the server's start
            server.stop()
            check_port(host, port)
            raise ValueError(f"--port {port}: taken by another program; try --port {free_port(host, port + 1)}")
        self.server = server
        server.gui.configure_theme(show_share_button=False)   # (sharing goes through viser's tunnel server)
        server.gui.main_panel.dock_right()   # the panel beside the frames, not over them
        if self.up is not None:
            server.scene.set_up_direction(tuple(self.up))
        self._panel(server)
        self._frustums(server)
        server.on_client_connect(self._connect)
        server.on_client_disconnect(lambda client: self.remove_client(client.client_id))
        shown = "localhost" if host in ("127.0.0.1", "0.0.0.0", "::") else host
        return f"http://{shown}:{port}"

    def url(self):
        return f"http://localhost:{self.server.get_port()}" if self.server else None

    def close(self):
        if self.server is not None:
            self.server.stop()
            self.server = None

    def _connect(self, client):
        view = BrowserView(client)
        if self.home is not None:   # start at the first dataset camera
            self.jump(client, self.home)
        client.camera.on_update(lambda _: self._moved(client.client_id))
        self.add_client(client.client_id, view)

    def _moved(self, key):
        with self.lock:
            view = self.clients.get(key)
            if view is not None:
                view.moved()
        self.wake.set()

    def jump(self, client, camera):
        """Put ``client``'s camera where ``camera`` is, looking as it looks (its vertical field of
        view; the canvas keeps its aspect); orbiting then turns about a point in front of it."""
        wxyz, position, fov, _ = pose_of_camera(camera)
        r = rotation_from_wxyz(wxyz)
        means = np.asarray(_backend.to_host(self.gaussians.means), np.float64)
        centre = np.median(means, axis=0) if len(means) else position
        reach = max(float((centre - position) @ r[:, 2]), 1e-3 * (1.0 + float(np.linalg.norm(position))))
        with client.atomic():
            client.camera.fov = fov
            client.camera.position = position
            client.camera.look_at = position + reach * r[:, 2]
            client.camera.up_direction = -r[:, 1]

    def _panel(self, server):
        gui = server.gui
        with gui.add_folder("View"):
            mode = gui.add_dropdown("Render", [MODE_LABELS[m] for m in RENDER_MODES], initial_value=MODE_LABELS["rgb"])
            sh = gui.add_slider("SH degree", 0, max(self.max_degree, 1), 1, self.sh_degree,
                                disabled=self.max_degree == 0)
            side = gui.add_slider("Max size (px)", 64, 4096, 32, self.max_side,
                                  hint="the longest side of a frame at rest (smaller while the camera moves)")
            bg = gui.add_rgb("Background", tuple(int(round(255 * c)) for c in self.background))
            labels = {v: k for k, v in MODE_LABELS.items()}
            mode.on_update(lambda _: self.set(mode=labels[mode.value]))
            sh.on_update(lambda _: self.set(sh_degree=sh.value))
            side.on_update(lambda _: self.set(max_side=side.value))
            bg.on_update(lambda _: self.set(background=tuple(c / 255.0 for c in bg.value)))
            self.gui.update(mode=mode, sh=sh, side=side, background=bg)
            if self.cameras:
                names = ["(choose a camera)"] + [name for name, _ in self.cameras]
                go = gui.add_dropdown("Go to camera", names, initial_value=names[0])

                def jump_to(event):
                    if go.value != names[0] and event.client is not None:
                        self.jump(event.client, self.cameras[names.index(go.value) - 1][1])
                go.on_update(jump_to)
                show = gui.add_checkbox("Show cameras", True)
                show.on_update(lambda _: [setattr(f, "visible", show.value) for f in self.gui.get("frustums", [])])
                self.gui.update(go=go, show_cameras=show)
            self.gui["frame"] = gui.add_markdown(self._frame_text())
        if self.training:
            with gui.add_folder("Training"):
                self.gui["stats"] = gui.add_markdown("starting")
                pause = gui.add_button("Pause", icon=None)
                resume = gui.add_button("Resume", visible=False)
                pause.on_click(lambda _: self.pause())
                resume.on_click(lambda _: self.resume())
                self.gui.update(pause=pause, resume=resume)
        gui.add_markdown("Drag: orbit. Right-drag: pan. Scroll: zoom. W A S D, Q E: fly. Arrow keys: look. "
                         "Click a camera to look through it.")

    def _frustums(self, server):
        if not self.cameras:
            return
        centres = np.array([pose_of_camera(c)[1] for _, c in self.cameras])
        size = FRUSTUM_SIZE * max(float(np.linalg.norm(centres - centres.mean(0), axis=1).max()), 1e-3)
        frustums = []
        for i, (name, camera) in enumerate(self.cameras):
            wxyz, position, fov, aspect = pose_of_camera(camera)
            colour = (220, 80, 40) if name.startswith("test") else (40, 90, 220)
            f = server.scene.add_camera_frustum(f"/cameras/{i:05d}", fov, aspect, scale=size, wxyz=wxyz,
                                                position=position, color=colour, thickness=FRUSTUM_LINE_PX,
                                                thickness_units="screen")
            f.on_click(lambda event, camera=camera: event.client is not None and self.jump(event.client, camera))
            frustums.append(f)
        self.gui["frustums"] = frustums

    def _frame_text(self):
        model = f"{len(self.gaussians):,} Gaussians" + (f" ({self.note})" if self.note else "")
        return f"{model}; {self.backend}" + (f"; frame {self.frame_note}" if self.frame_note else "")

    def _update_frame_note(self):
        if "frame" in self.gui:
            self.gui["frame"].content = self._frame_text()

    def show_training(self, step, iterations, record=None, force=False):
        """The run's progress in the panel: the step, and the last log record's loss, PSNR and
        Gaussians (at most every half second unless ``record`` or ``force``)."""
        now = time.monotonic()
        if record is not None:
            self.last_record = record
        if "stats" not in self.gui or (record is None and not force and now - self._stats_shown < 0.5):
            return
        self._stats_shown = now
        rec = getattr(self, "last_record", None) or {}
        parts = [f"step {step:,} / {iterations:,}" + (" (paused)" if self.paused else "")]
        if "loss" in rec:
            parts.append(f"loss {rec['loss']:.4f}, PSNR {rec['psnr']:.2f} dB")
        if "gaussians" in rec:
            parts.append(f"{rec.get('gaussians_total', rec['gaussians']):,} Gaussians")
        self.gui["stats"].content = "  \n".join(parts)


# ------------------------------------------------------------------ while training
class LiveView:
    """The training loop's hook (``Trainer.step_hooks``) that keeps a ``Viewer`` live while training:
    after a step it shows the progress, renders the views that need a frame while the viewer's share
    of the wall time stays under ``budget``, and holds the loop while the viewer is paused.  Returns
    the seconds paused, which the loop leaves out of the training time.  ``viewer``: rank 0's, None
    on the other ranks (under MPI they only take part in ``view_model``'s gathers)."""

    def __init__(self, viewer, budget=BUDGET, sync_every=SYNC_EVERY, max_gathered=MAX_GATHERED):
        self.viewer, self.budget = viewer, budget
        self.sync_every, self.max_gathered = sync_every, max_gathered
        self.start = None
        self.spent = 0.0       # seconds of viewer work (renders, gathers), pauses apart
        self.frames = 0
        self.holding = False   # the loop is held by a pause now

    def within_budget(self, now):
        return self.spent <= self.budget * (now - self.start)

    def __call__(self, trainer, record):
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        v = self.viewer
        ranked = getattr(trainer, "comm", None) is not None
        if v is not None:
            v.show_training(trainer.step, trainer.cfg.iterations, record)
        if ranked:   # every SYNC_EVERY steps the ranks agree on a gather for rank 0 (a collective)
            if trainer.step % self.sync_every == 0 or trainer.step == trainer.cfg.iterations:
                want = v is not None and (v.paused or (v.wants_frames(refresh=REFRESH_SECONDS)
                                                       and self.within_budget(now)))
                if trainer.from_root(want):
                    model = trainer.view_model(self.max_gathered)
                    if v is not None:
                        every = math.ceil(trainer.total / self.max_gathered)
                        v.set_model(model, f"every {every}th of {trainer.total:,}" if every > 1 else "")
        elif v is not None and (v.paused or v.wants_frames(refresh=REFRESH_SECONDS)) and self.within_budget(now):
            v.set_model(trainer.model.gaussians)
        if v is not None and v.gaussians is not None and self.within_budget(now):
            self.frames += v.render_pending(refresh=REFRESH_SECONDS)
        paused = 0.0
        if v is not None and v.paused and (not ranked or trainer.step % self.sync_every == 0):
            t = time.perf_counter()
            v.show_training(trainer.step, trainer.cfg.iterations, force=True)
            self.holding = True
            while v.paused and not trainer.signals.received:
                v.wake.wait(0.05)
                v.wake.clear()
                self.frames += v.render_pending()
            self.holding = False
            paused = time.perf_counter() - t
            v.show_training(trainer.step, trainer.cfg.iterations, force=True)
        self.spent += time.perf_counter() - now - paused
        return paused


def dataset_cameras(dataset):
    """[(name, camera)] of a dataset's views for the viewer: "train/NAME", then "test/NAME"."""
    return ([(f"train/{v.name}", v.camera) for v in dataset.train]
            + [(f"test/{v.name}", v.camera) for v in dataset.test])


def cameras_up(cameras):
    """The cameras' mean up (``camera_path.up_vector``), or None without cameras."""
    from .camera_path import up_vector
    return up_vector([c for _, c in cameras]) if cameras else None


def live_viewer(trainer, port=DEFAULT_PORT, host=DEFAULT_HOST, log=print):
    """Serve ``trainer``'s model while it trains (``train --viewer``): rank 0 starts the server (a
    taken port stops it with the port named), every rank hooks a ``LiveView`` into the loop.
    -> the LiveView (its ``viewer`` None on the other ranks)."""
    check(trainer.cfg, trainer.options, trainer.comm, live_view=True)
    viewer = None
    if trainer.model is None:   # (every rank: a pipeline over ranks keeps its shard)
        trainer.init_model()
    if trainer.is_root:
        require_viser()
        cameras = dataset_cameras(trainer.data)
        model = (trainer.model.gaussians if getattr(trainer, "comm", None) is None
                 else _placeholder(trainer.model.sh_bases, trainer.backend))
        viewer = Viewer(model, cameras, trainer.cfg.background, trainer.cfg.antialias, trainer.backend,
                        up=cameras_up(cameras), training=True)
        url = viewer.serve_on(port, host)
        log(f"viewer: {url} (rank 0 renders it; --port to change)")
    hook = LiveView(viewer)
    trainer.step_hooks.append(hook)
    return hook


def _placeholder(sh_bases, backend=None):
    """A model of one transparent Gaussian with ``sh_bases`` SH coefficients, shown until rank 0 has
    gathered one."""
    xp = _backend.array_module(backend)
    return ns.Gaussians(xp.zeros((1, 3), np.float32), xp.full((1, 3), -10.0, np.float32),
                        xp.asarray(np.array([[1, 0, 0, 0]], np.float32)), xp.full(1, -20.0, np.float32),
                        xp.zeros((1, sh_bases, 3), np.float32))
