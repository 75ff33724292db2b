"""engine/tools/camera_path.py: the render paths look where they should, keep their distances, move
smoothly, and follow the capture whatever its world frame."""
import numpy as np
import pytest

import numbasplat as ns
from engine.tools.camera_path import (PATHS, axes, camera_path, centres, ellipse_path, focus_point, interpolated_path,
                                look_at, spiral_path, up_vector)


def camera(eye, target, up=(0.0, 0.0, 1.0), size=(41, 31)):
    w, h = size
    return ns.Camera(look_at(eye, target, up), 30.0, 31.0, w / 2, h / 2, w, h)


def ring(n=24, radius=4.0, height=1.5, centre=(0.0, 0.0, 0.5)):
    """Cameras around ``centre`` (an object capture), heights alternating a little, all looking at it."""
    c = np.asarray(centre)
    return [camera(c + (radius * np.cos(a), radius * np.sin(a), height + 0.2 * (i % 2)), c)
            for i, a in enumerate(np.linspace(0, 2 * np.pi, n, endpoint=False))]


def forward_facing(nx=5, ny=4):
    """An LLFF-like capture: a small grid of cameras all looking down +y at a wall of points."""
    cams = [camera((0.3 * i, 0.0, 0.2 * j), (0.3 * i, 10.0, 0.2 * j)) for i in range(nx) for j in range(ny)]
    rng = np.random.default_rng(0)
    points = np.stack([rng.uniform(-3, 4, 2000), rng.uniform(2.0, 8.0, 2000), rng.uniform(-2, 3, 2000)], 1)
    return cams, points


def looks_at(cam, target):
    """The angle (radians) between the camera's forward axis and the direction to ``target``."""
    eye = centres([cam])[0]
    d, f = target - eye, axes([cam], 2)[0]
    return float(np.arctan2(np.linalg.norm(np.cross(f, d)), f @ d))


def moved(transform, cams):
    """The cameras in another world frame: x_new = s R x + t."""
    s, rot, t = transform
    out = []
    for c in cams:
        c2w = np.linalg.inv(c.viewmat)
        new = np.eye(4)
        new[:3, :3] = rot @ c2w[:3, :3]
        new[:3, 3] = s * rot @ c2w[:3, 3] + t
        out.append(ns.Camera(np.linalg.inv(new), c.fx, c.fy, c.cx, c.cy, c.width, c.height))
    return out


def random_similarity(seed=1):
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    return 2.5, q * np.sign(np.linalg.det(q)), np.array([3.0, -7.0, 1.5])


def test_look_at_is_a_rotation_even_looking_along_up():
    for eye, target in (((0, 0, 5), (0, 0, 0)), ((1, 2, 3), (4, -1, 0.5))):
        m = look_at(eye, target)
        r = m[:3, :3]
        np.testing.assert_allclose(r @ r.T, np.eye(3), atol=1e-12)
        assert np.linalg.det(r) > 0
        np.testing.assert_allclose(m[:3, :3] @ np.asarray(eye, float) + m[:3, 3], 0, atol=1e-12)
        assert looks_at(ns.Camera(m, 1, 1, 1, 1, 2, 2), np.asarray(target, float)) < 1e-9


def test_up_and_centre_of_a_ring():
    cams = ring()
    np.testing.assert_allclose(up_vector(cams), [0, 0, 1], atol=0.05)
    np.testing.assert_allclose(focus_point(cams), [0, 0, 0.5], atol=1e-9)


def test_ellipse_circles_the_centre_at_the_cameras_height_looking_at_it():
    cams = ring(radius=4.0, height=1.5)
    path = ellipse_path(cams, 30)
    assert len(path) == 30
    centre = np.array([0.0, 0.0, 0.5])
    pos = centres(path)
    assert max(looks_at(c, centre) for c in path) < 1e-9
    np.testing.assert_allclose(pos[:, 2], 0.5 + 1.6, atol=1e-9)       # the cameras' median height
    radius = np.linalg.norm(pos[:, :2], axis=1)
    np.testing.assert_allclose(radius, radius.mean(), rtol=0.03)      # a circle for a ring of cameras
    assert 3.6 < radius.mean() <= 4.0                                 # 90th percentile of the offsets
    angles = np.unwrap(np.arctan2(pos[:, 1], pos[:, 0]))
    np.testing.assert_allclose(np.abs(np.diff(angles)), 2 * np.pi / 30, rtol=0.05)   # evenly, one turn
    for c in path:  # upright: the image's x axis is horizontal and its up points up
        assert abs(axes([c], 0)[0] @ [0, 0, 1]) < 1e-9 and -axes([c], 1)[0] @ [0, 0, 1] > 0.5


def test_ellipse_follows_the_cameras_spread():
    angles = np.linspace(0, 2 * np.pi, 40, endpoint=False)
    cams = [camera((6 * np.cos(a), 2 * np.sin(a), 1.0), (0, 0, 0)) for a in angles]
    pos = centres(ellipse_path(cams, 40))
    assert 5.5 < np.abs(pos[:, 0]).max() <= 6.0 + 1e-9 and 1.8 < np.abs(pos[:, 1]).max() <= 2.0 + 1e-9


@pytest.mark.parametrize("kind", PATHS)
def test_paths_move_with_the_world_frame(kind):
    """COLMAP's world frame is arbitrary: a path fitted in another frame is the same path moved."""
    cams, points = forward_facing() if kind == "spiral" else (ring(), None)
    s, rot, t = random_similarity()
    here = camera_path(kind, cams, 12, points)
    there = camera_path(kind, moved((s, rot, t), cams), 12, None if points is None else s * points @ rot.T + t)
    np.testing.assert_allclose(centres(there), s * centres(here) @ rot.T + t, atol=1e-7)
    for a, b in zip(here, there):
        np.testing.assert_allclose(axes([b], 2)[0], rot @ axes([a], 2)[0], atol=1e-7)


def test_spiral_looks_at_one_focus_point_in_front_of_a_forward_facing_capture():
    cams, points = forward_facing()
    path = spiral_path(cams, 60, points)
    assert len(path) == 60
    pos = centres(path)
    mean = centres(cams).mean(0)
    # every frame looks at one point straight ahead of the mean camera, between the near and far points
    f, c = axes(path, 2), pos
    proj = np.eye(3)[None] - f[:, :, None] * f[:, None, :]
    target = np.linalg.solve(proj.sum(0), np.einsum("nij,nj->i", proj, c))   # nearest to every axis
    for cam in path:
        assert looks_at(cam, target) < 1e-7
    assert 2.0 < target[1] - mean[1] < 8.0
    np.testing.assert_allclose(target[[0, 2]], mean[[0, 2]], atol=1e-9)
    offsets = np.abs(pos - mean)
    spread = np.percentile(np.abs(centres(cams) - mean), 90, axis=0)
    assert (offsets <= spread + 1e-9).all()                            # within the cameras' spread
    step = np.linalg.norm(np.diff(np.vstack([pos, pos[:1]]), axis=0), axis=1)
    assert step.max() < 3 * np.median(step)                            # a closed, smooth loop


def test_interp_runs_smoothly_from_the_first_view_to_the_last():
    arc = np.linspace(0, np.pi, 9)
    uneven = arc ** 1.3 / np.pi ** 0.3                                  # views unevenly spaced
    cams = [camera((5 * np.cos(a), 5 * np.sin(a), 1 + 0.2 * np.sin(3 * a)), (0, 0, 0)) for a in uneven]
    path = interpolated_path(cams, 50)
    assert len(path) == 50
    np.testing.assert_allclose(path[0].viewmat, cams[0].viewmat, atol=1e-9)
    np.testing.assert_allclose(path[-1].viewmat, cams[-1].viewmat, atol=1e-9)
    pos = centres(path)
    step = np.diff(pos, axis=0)
    length = np.linalg.norm(step, axis=1)
    assert length.max() < 1.25 * length.min()                         # constant speed, whatever the spacing
    turn = np.arccos(np.clip(np.einsum("ij,ij->i", step[1:], step[:-1]) / (length[1:] * length[:-1]), -1, 1))
    assert turn.max() < np.radians(8)                                  # no kinks at the views
    fwd = axes(path, 2)
    swing = np.arccos(np.clip(np.einsum("ij,ij->i", fwd[1:], fwd[:-1]), -1, 1))
    assert swing.max() < np.radians(8)                                 # the view turns smoothly too
    assert max(looks_at(c, np.zeros(3)) for c in path) < np.radians(5)  # and keeps looking near the centre
    radius = np.linalg.norm(pos[:, :2], axis=1)
    assert np.abs(radius - 5).max() < 0.15                             # along the views' arc


def test_paths_use_the_first_views_intrinsics_at_an_even_size():
    cams = ring()
    for kind in PATHS:
        for c in camera_path(kind, cams, 3):
            assert (c.width, c.height, c.fx, c.fy, c.cx, c.cy) == (40, 30, 30.0, 31.0, 20.5, 15.5)


def test_degenerate_captures_still_give_finite_paths():
    one = [camera((0, 0, 0), (0, 1, 0))]
    for kind in PATHS:
        path = camera_path(kind, one, 5)
        assert len(path) == 5 and all(np.isfinite(c.viewmat).all() for c in path)
    with pytest.raises(ValueError, match="unknown camera path 'zigzag'"):
        camera_path("zigzag", one, 5)
    with pytest.raises(ValueError, match="at least one frame"):
        camera_path("ellipse", one, 0)
