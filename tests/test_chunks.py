"""A view rendered in depth-ordered chunks of its Gaussians (numbasplat.chunks) equals one render of
them all: images and every gradient, on the CPU backend (to the bit: its state is float64), and
the CUDA kernels' chunked passes against the CPU backend under the simulator (check_chunks.py)."""
from pathlib import Path

import numpy as np
import pytest

import numbasplat as ns
from conftest import simulator_test
from numbasplat.compose import compose
from tests.scenes import central_differences, edge_case_scene, look_at_camera, tied_scene

BG = (0.2, 0.4, 0.1)
H_STEP = 1e-6


def weights(cam, dtype, seed=1):
    rng = np.random.default_rng(seed)
    H, W = cam.height, cam.width
    return (rng.normal(size=(H, W, 3)).astype(dtype), rng.normal(size=(H, W)).astype(dtype),
            (0.1 * rng.normal(size=(H, W))).astype(dtype))


def chunked(g, cam, size, w, keep=False, antialias=False, deterministic=False):
    chunks = ns.depth_chunks(g, cam, size, antialias=antialias, backend="cpu")
    frame = ns.render_chunked(g, cam, chunks, background=BG, antialias=antialias, backend="cpu", keep=keep,
                              deterministic=deterministic)
    records = np.zeros((len(g), ns.GRAD_FIELDS), g.means.dtype)
    grads = ns.render_chunked_backward(g, frame, *w, records=records, backend="cpu")
    return frame, grads, records


def test_depth_chunks_follow_the_binning_order():
    """The chunks, in order, are the drawn Gaussians in bin_tiles' depth order (ties by index),
    and the tied Gaussians fall into several chunks of 3."""
    g = tied_scene()
    cam = look_at_camera()
    b = ns.bin_tiles(ns.project(g, cam, backend="cpu"), backend="cpu", deterministic=True)
    counts = ns.project(g, cam, backend="cpu").counts
    chunks = ns.depth_chunks(g, cam, 3, backend="cpu")
    order = np.concatenate(chunks)
    assert np.array_equal(order, b.order[:np.count_nonzero(counts)])
    assert all(len(c) == 3 for c in chunks[:-1]) and 1 <= len(chunks[-1]) <= 3
    tied = [k for k, c in enumerate(chunks) if np.isin(c, (8, 9, 10, 11)).any()]
    assert len(tied) >= 2, "the tie does not straddle a chunk boundary"
    assert np.array_equal(order[np.isin(order, (8, 9, 10, 11))], [8, 9, 10, 11])  # ties by index
    assert len(ns.depth_chunks(g, cam, 100, backend="cpu")) == 1
    with pytest.raises(ValueError, match="chunk_size"):
        ns.depth_chunks(g, cam, 0, backend="cpu")


def test_nothing_drawn_is_one_empty_chunk():
    g = tied_scene()
    away = np.eye(4)
    away[2, 3] = -100.0  # every Gaussian behind the camera
    cam = ns.Camera(away, 36.0, 36.0, 20.0, 15.0, 40, 30)
    chunks = ns.depth_chunks(g, cam, 4, backend="cpu")
    assert len(chunks) == 1 and len(chunks[0]) == 0
    w = weights(cam, np.float64)
    frame, grads, _ = chunked(g, cam, 4, w)
    ref = ns.render(g, cam, background=BG, backend="cpu")
    assert np.array_equal(frame.image, ref.image) and np.array_equal(frame.render.trans, ref.render.trans)
    assert all(not a.any() for a in grads.arrays().values())


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("antialias", [False, True])
def test_chunked_equals_unchunked(dtype, antialias):
    """Every chunk count from one chunk to one Gaussian a chunk, chunks kept or projected again in
    the backward: image, alpha, depth, gradient records and parameter gradients all equal."""
    g = tied_scene(dtype)
    cam = look_at_camera()
    w = weights(cam, dtype)
    ref = ns.render(g, cam, background=BG, antialias=antialias, backend="cpu")
    ref_grads, ref_records = ns.render_backward(g, ref, *w, backend="cpu")
    assert (ref.render.trans <= 1e-3).any(), "no pixel saturates"
    n_drawn = int(np.count_nonzero(ref.projection.counts))
    early = False
    for size in (n_drawn, 7, 5, 3, 2, 1):
        for keep in (False, True):
            frame, grads, records = chunked(g, cam, size, w, keep=keep, antialias=antialias)
            assert len(frame.chunks) == -(-n_drawn // size)
            where = f"chunks of {size}, keep={keep}"
            np.testing.assert_array_equal(frame.image, ref.image, where)
            np.testing.assert_array_equal(frame.render.alpha, ref.render.alpha, where)
            np.testing.assert_array_equal(frame.render.depth, ref.render.depth, where)
            np.testing.assert_array_equal(records, ref_records, where)
            for name, a in ref_grads.arrays().items():
                np.testing.assert_array_equal(getattr(grads, name), a, f"{name}, {where}")
            early |= len(frame.chunks) > 1 and bool((frame.ended < len(frame.chunks) - 1).any())
    assert early, "no pixel saturates in a chunk before the last"


def test_saturation_in_the_first_chunk_stops_the_chunks_behind():
    """Pixels that end at T_MIN in the first chunk take nothing from the chunks behind, though a
    Gaussian behind would not take their transmittance under T_MIN by itself: composing the
    chunks' independent partial images (numbasplat.compose) differs there, chunking does not."""
    g = tied_scene()
    cam = look_at_camera()
    w = weights(cam, np.float64)
    frame, _, _ = chunked(g, cam, 7, w)
    ref = ns.render(g, cam, background=BG, backend="cpu")
    first = frame.ended == 0
    assert first.any() and len(frame.chunks) > 2
    np.testing.assert_array_equal(frame.image, ref.image)
    # the chunks as independent partial images, composed
    colours, trans = [], []
    for idx in frame.chunks:
        r = ns.render(g.take(idx), cam, background=(0, 0, 0), backend="cpu").render
        colours.append(r.image)
        trans.append(r.trans)
    composed, _ = compose(np.stack(colours), np.stack(trans), BG)
    assert np.abs(composed - ref.image)[first].max() > 1e-9, "saturation changes nothing here: a weak test"


def test_deterministic_chunks_equal_unchunked():
    g = tied_scene(np.float32)
    cam = look_at_camera()
    w = weights(cam, np.float32)
    ref = ns.render(g, cam, background=BG, backend="cpu", deterministic=True)
    ref_grads, _ = ns.render_backward(g, ref, *w, backend="cpu", deterministic=True)
    _, grads, _ = chunked(g, cam, 4, w, deterministic=True)
    for name, a in ref_grads.arrays().items():
        np.testing.assert_array_equal(getattr(grads, name), a, name)


def test_accumulate_and_overwrite():
    g = tied_scene()
    cam = look_at_camera()
    w = weights(cam, np.float64)
    frame, grads, _ = chunked(g, cam, 4, w)
    acc = ns.Gaussians(**{k: np.ones_like(a) for k, a in g.arrays().items()})
    ns.render_chunked_backward(g, frame, *w, out=acc, accumulate=True, backend="cpu")
    over = ns.Gaussians(**{k: np.ones_like(a) for k, a in g.arrays().items()})
    ns.render_chunked_backward(g, frame, *w, out=over, backend="cpu")
    for name, a in grads.arrays().items():
        np.testing.assert_allclose(getattr(acc, name), a + 1, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(getattr(over, name), a)


def test_state_is_checked():
    g = tied_scene()
    cam = look_at_camera()
    p = ns.project(g, cam, backend="cpu")
    b = ns.bin_tiles(p, backend="cpu")
    with pytest.raises(ValueError, match="state must be"):
        ns.rasterize(p, b, BG, backend="cpu", state=np.zeros((6, 30, 40), np.float32))
    with pytest.raises(ValueError, match="state must be"):
        ns.rasterize(p, b, BG, backend="cpu", state=np.zeros((5, 30, 40)))


def test_chunked_gradients_match_finite_differences():
    """The chunked backward against float64 central differences of the chunked forward, over
    every parameter (the chunks fixed; a scene without ties, where a step would reorder them)."""
    g = edge_case_scene(degree=0)
    cam = look_at_camera()
    w = weights(cam, np.float64, seed=3)
    chunks = ns.depth_chunks(g, cam, 7, backend="cpu")  # the opaque stack in the first of 4

    def objective():
        r = ns.render_chunked(g, cam, chunks, background=BG, backend="cpu").render
        return float((r.image * w[0]).sum() + (r.alpha * w[1]).sum() + (r.depth * w[2]).sum())

    frame = ns.render_chunked(g, cam, chunks, background=BG, backend="cpu")
    assert len(chunks) > 2 and (frame.ended < len(chunks) - 1).any()
    grads = ns.render_chunked_backward(g, frame, *w, backend="cpu")
    for name, arr in g.arrays().items():
        fd = central_differences(arr, objective, H_STEP)
        analytic = getattr(grads, name)
        assert np.abs(fd).sum() > 0, name
        err = np.linalg.norm(analytic - fd) / max(np.linalg.norm(fd), 1e-12)
        assert err <= 1e-4, (name, err)


test_cuda_chunked_kernels_match_cpu_in_simulator = simulator_test(
    Path(__file__).with_name("check_chunks.py"), "all chunk checks passed", timeout=400)
