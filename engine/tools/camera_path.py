"""Camera paths around or through a capture's views, for videos of a trained scene.

Fitted to the capture's cameras as gsplat's and nerfstudio's render trajectories are, but
without assuming that the world frame was normalised first (COLMAP's is arbitrary):

* the up vector is the cameras' mean up;
* the centre is the point nearest to every optical axis (least squares), where the axes
  converge (cameras around an object); where they are nearly parallel (a forward-facing
  capture) it is the mean camera's centre moved forward by the focus depth;
* the focus depth weighs the near and far bounds of the scene's points in disparity, as
  mip-NeRF's and gsplat's spiral do (without points: the distance to the centre, else twice
  the cameras' spread);
* radii come from the cameras' spread (the 90th percentile of their offsets, as gsplat).

The paths:

    spiral   forward-facing captures (LLFF-style): two turns of a spiral around the mean
             camera, every frame looking at the focus point in front of it
    ellipse  captures around an object: an ellipse around the centre at the cameras' mean
             height, its axes along the spread of the cameras, every frame looking at the centre
    interp   any capture: a smooth curve through the views in the order given (the CLI sorts
             them by name: the order they were captured in), at constant speed

Every path is a list of ``numbasplat.Camera`` with the intrinsics of the first view, its width
and height made even (video encoders want even sizes).  Cameras use OpenCV axes (x right,
y down, z forward), world-to-camera, as everywhere else.
"""
import numpy as np

from numbasplat.rendering import Camera

PATHS = ("spiral", "ellipse", "interp")

CONVERGING_AXES = 0.02   # sin^2 of about 8 degrees: optical axes spread less than this are parallel
SPIRAL_TURNS = 2
SPIRAL_Z_RATE = 0.5      # the spiral's in-and-out motion: half a period per turn (gsplat's zrate)
FOCUS_FAR_WEIGHT = 0.75  # focus depth = 1 / ((1 - w) / near + w / far)  (gsplat's focus_distance)
INTERP_SAMPLES = 64      # samples per segment of the interpolating spline, to measure its length
INTERP_ROTATION_WEIGHT = 0.1   # how much turning counts against moving in the constant-speed spacing


def look_at(eye, target, up=(0.0, 0.0, 1.0)):
    """World-to-camera (OpenCV axes: x right, y down, z forward) of a camera at ``eye`` looking
    at ``target``, its image's up as close to ``up`` as looking there allows."""
    eye, target, up = (np.asarray(a, np.float64) for a in (eye, target, up))
    z = target - eye
    z /= np.linalg.norm(z)
    x = np.cross(z, up)
    if np.linalg.norm(x) < 1e-9 * np.linalg.norm(up):  # looking along ``up``: any sideways axis will do
        x = np.cross(z, np.eye(3)[np.argmin(np.abs(z))])
    x /= np.linalg.norm(x)
    y = np.cross(z, x)
    m = np.eye(4)
    m[:3, :3] = np.stack([x, y, z])
    m[:3, 3] = -m[:3, :3] @ eye
    return m


def centres(cameras):
    """(N, 3) camera centres in world coordinates."""
    return np.array([-c.viewmat[:3, :3].T @ c.viewmat[:3, 3] for c in cameras])


def axes(cameras, k):
    """(N, 3) world directions of each camera's axis ``k`` (0: right, 1: down, 2: forward)."""
    return np.array([c.viewmat[k, :3] for c in cameras])


def _unit(v, fallback):
    n = np.linalg.norm(v)
    return v / n if n > 1e-9 else np.asarray(fallback, np.float64)


def up_vector(cameras):
    """The cameras' mean up (OpenCV's y points down), or the normal of the plane they span when
    their ups cancel out."""
    mean_up = -axes(cameras, 1).mean(0)
    if np.linalg.norm(mean_up) > 1e-6:
        return mean_up / np.linalg.norm(mean_up)
    c = centres(cameras)
    normal = np.linalg.svd(c - c.mean(0))[2][-1] if len(c) >= 3 else np.array([0.0, 0.0, 1.0])
    return normal


def axes_meeting_point(cameras):
    """The point nearest to every optical axis (least squares), or None where the axes are nearly
    parallel or meet behind the cameras (a forward-facing capture)."""
    c, f = centres(cameras), axes(cameras, 2)
    projectors = np.eye(3)[None] - f[:, :, None] * f[:, None, :]   # I - f f^T: off-axis part
    a = projectors.sum(0)
    if len(cameras) < 2 or np.linalg.eigvalsh(a / len(cameras))[0] < CONVERGING_AXES:
        return None
    p = np.linalg.solve(a, np.einsum("nij,nj->i", projectors, c))
    return p if np.median(np.einsum("ni,ni->n", f, p - c)) > 0 else None


def spread(cameras):
    """How far the cameras are from their mean centre (the largest distance; 0 for one camera)."""
    c = centres(cameras)
    return float(np.linalg.norm(c - c.mean(0), axis=1).max())


def focus_depth(cameras, eye, forward, points=None):
    """How far in front of ``eye`` (looking along ``forward``) the scene's centre of interest is:
    the points' near and far bounds (5th and 95th percentile of the depths in front) weighed in
    disparity; without points, the distance to where the optical axes meet; else twice the
    cameras' spread (1 when they are all at one place)."""
    if points is not None and len(points):
        depths = (np.asarray(points, np.float64).reshape(-1, 3) - eye) @ forward
        depths = depths[depths > 1e-6]
        if len(depths) >= 10:
            near, far = np.percentile(depths, [5.0, 95.0])
            return float(1.0 / ((1.0 - FOCUS_FAR_WEIGHT) / near + FOCUS_FAR_WEIGHT / far))
    meet = axes_meeting_point(cameras)
    if meet is not None and (meet - eye) @ forward > 1e-6:
        return float((meet - eye) @ forward)
    return 2.0 * spread(cameras) or 1.0


def mean_pose(cameras):
    """(centre, forward, up) of the mean camera: the mean centre, the mean viewing direction
    (where the views cancel out, a direction level with the horizon), the mean up."""
    up = up_vector(cameras)
    sideways = np.eye(3)[np.argmin(np.abs(up))]
    forward = _unit(axes(cameras, 2).mean(0), _unit(sideways - (sideways @ up) * up, sideways))
    return centres(cameras).mean(0), forward, up


def focus_point(cameras, points=None):
    """The centre a path looks at: where the optical axes meet, else the focus point in front of
    the mean camera."""
    meet = axes_meeting_point(cameras)
    if meet is not None:
        return meet
    eye, forward, _ = mean_pose(cameras)
    return eye + focus_depth(cameras, eye, forward, points) * forward


def _with_intrinsics(viewmats, like):
    """Cameras of ``viewmats`` with the intrinsics of ``like``, width and height made even."""
    w, h = like.width - like.width % 2 or 2, like.height - like.height % 2 or 2
    return [Camera(m, like.fx, like.fy, like.cx, like.cy, w, h) for m in viewmats]


def spiral_path(cameras, n_frames, points=None, turns=SPIRAL_TURNS, z_rate=SPIRAL_Z_RATE):
    """``n_frames`` cameras on a spiral around the mean camera (gsplat's forward-facing
    spiral), all looking at the focus point in front of it; a closed loop."""
    eye, forward, up = mean_pose(cameras)
    depth = focus_depth(cameras, eye, forward, points)
    target = eye + depth * forward
    mean_cam = look_at(eye, target, up)[:3, :3]          # rows: right, down, forward
    offsets = (centres(cameras) - eye) @ mean_cam.T
    radii = np.percentile(np.abs(offsets), 90, axis=0)
    if radii.max() < 1e-9 * depth:                       # one camera: still move a little
        radii = np.array([0.05, 0.05, 0.0]) * depth
    theta = np.linspace(0.0, 2.0 * np.pi * turns, n_frames, endpoint=False)
    local = radii * np.stack([np.cos(theta), -np.sin(theta), -np.sin(theta * z_rate)], 1)
    positions = eye + local @ mean_cam
    return _with_intrinsics([look_at(p, target, up) for p in positions], cameras[0])


def ellipse_path(cameras, n_frames, points=None):
    """``n_frames`` cameras on an ellipse around the centre, in the plane perpendicular to the up
    vector at the cameras' median height, its axes along the cameras' spread in that plane
    (their 90th percentile offsets), all looking at the centre; a closed loop."""
    up = up_vector(cameras)
    centre = focus_point(cameras, points)
    offsets = centres(cameras) - centre
    height = float(np.median(offsets @ up))
    flat = offsets - np.outer(offsets @ up, up)
    _, spreads, basis = np.linalg.svd(flat)
    major = basis[0]
    if len(spreads) < 2 or spreads[1] > 0.95 * spreads[0]:   # about round: start at the first view
        major = flat[0]
    e1 = _unit(major - (major @ up) * up, np.cross(up, np.eye(3)[np.argmin(np.abs(up))]))
    e1 = -e1 if e1 @ flat[0] < 0 else e1                     # (an axis's sign is arbitrary: face the first view)
    e2 = np.cross(up, e1)
    a, b = (float(np.percentile(np.abs(flat @ e), 90)) for e in (e1, e2))
    if min(a, b) < 1e-6 * max(a, b):                      # cameras along a line: a circle as wide
        a = b = max(a, b)
    if max(a, b) < 1e-9:                                  # cameras on the up axis: a circle at the focus depth
        a = b = focus_depth(cameras, *mean_pose(cameras)[:2], points)
    theta = np.linspace(0.0, 2.0 * np.pi, n_frames, endpoint=False)
    ring = centre + height * up + np.outer(a * np.cos(theta), e1) + np.outer(b * np.sin(theta), e2)
    return _with_intrinsics([look_at(p, centre, up) for p in ring], cameras[0])


def _catmull_rom(keys, samples):
    """The uniform Catmull-Rom spline through ``keys`` (K, D), ``samples`` points per segment,
    ends extended by reflection; -> ((K - 1) * samples + 1, D)."""
    padded = np.concatenate([2 * keys[:1] - keys[1:2], keys, 2 * keys[-1:] - keys[-2:-1]])
    t = np.linspace(0.0, 1.0, samples, endpoint=False)[:, None]
    weights = 0.5 * np.stack([-t**3 + 2 * t**2 - t, 3 * t**3 - 5 * t**2 + 2,
                              -3 * t**3 + 4 * t**2 + t, t**3 - t**2])       # (4, S, 1)
    parts = [sum(weights[i] * padded[j + i] for i in range(4)) for j in range(len(keys) - 1)]
    return np.concatenate(parts + [keys[-1:]])


def interpolated_path(cameras, n_frames):
    """``n_frames`` cameras along a smooth curve through ``cameras`` in the order given, from the
    first to the last, evenly spaced along it.  The curve interpolates each camera's centre, a
    point in front of it and a point above it (gsplat's way), so the view turns smoothly as well."""
    c = centres(cameras)
    reach = spread(cameras) or 1.0
    look = c + reach * axes(cameras, 2)
    above = c - reach * axes(cameras, 1)
    keys = np.concatenate([c, look, above], axis=1)
    if len(cameras) == 1:
        return _with_intrinsics([cameras[0].viewmat] * n_frames, cameras[0])
    curve = _catmull_rom(keys, INTERP_SAMPLES)
    step = np.diff(curve, axis=0)
    length = (np.linalg.norm(step[:, :3], axis=1)
              + INTERP_ROTATION_WEIGHT * (np.linalg.norm(step[:, 3:6], axis=1) + np.linalg.norm(step[:, 6:], axis=1)))
    along = np.concatenate([[0.0], np.cumsum(length)])
    if along[-1] <= 0:                                    # every view the same: stand still
        return _with_intrinsics([cameras[0].viewmat] * n_frames, cameras[0])
    at = np.linspace(0.0, along[-1], n_frames)
    frames = np.stack([np.interp(at, along, curve[:, d]) for d in range(curve.shape[1])], 1)
    return _with_intrinsics([look_at(f[:3], f[3:6], f[6:] - f[:3]) for f in frames], cameras[0])


def camera_path(kind, cameras, n_frames, points=None):
    """The ``kind`` path (one of ``PATHS``) of ``n_frames`` cameras fitted to ``cameras``;
    ``points`` (the scene's, e.g. the model's means) set the spiral's focus depth."""
    if not cameras:
        raise ValueError("a camera path needs at least one view")
    if n_frames < 1:
        raise ValueError(f"a camera path needs at least one frame, got {n_frames}")
    if kind == "spiral":
        return spiral_path(cameras, n_frames, points)
    if kind == "ellipse":
        return ellipse_path(cameras, n_frames, points)
    if kind == "interp":
        return interpolated_path(cameras, n_frames)
    raise ValueError(f"unknown camera path {kind!r}; expected one of {', '.join(PATHS)}")
