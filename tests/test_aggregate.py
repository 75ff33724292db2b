"""The aggregate device (numbasplat/placement.py, engine/pipelines/aggregate.py): every operator split N
ways as N devices would split it (``--virtual-devices N``) trains the model of one device.

On the CPU backend each Gaussian's gradient is added tile by tile in the same order whatever the
split, and every per-Gaussian and per-element operator is its own row's, so N = 2 and 3 give N = 1's
bits; the tests allow 1e-6.  The scene: a non-square image (the tile rows split unevenly), rotated
Gaussians of uneven scales.  The simulator test runs the CUDA kernels' tile-row launches."""
import numpy as np
import pytest

import numbasplat as ns
from conftest import simulator_test
from data import Dataset, View
from engine.pipelines import PipelineOptions, check, make_trainer
from engine.recipe.trainer import SNAPSHOT, TrainConfig
from engine.tools.camera_path import look_at
from engine.tools.demo import ground_truth
from numbasplat.optim import GROUPS
from numbasplat.placement import Placement, SplitBinning, even_ranges
from placement_step import split_step
from scenes import edge_case_scene

WIDTH, HEIGHT = 56, 40  # 4 x 3 tiles: 2 parts take tile rows 2 + 1, 3 parts 1 + 1 + 1 (the last 8 pixels high)
TOLERANCE = 1e-6


def camera(width=WIDTH, height=HEIGHT):
    """A camera off the scene's axes, its principal point off-centre."""
    return ns.Camera(look_at((4.0, -3.0, 2.5), (0, 0, 0.5)), 0.9 * width, 0.95 * width, 0.53 * width,
                     0.46 * height, width, height)


def test_even_ranges_cover_every_row_once():
    assert even_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert even_ranges(2, 3) == [(0, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("shared_binning", [True, False], ids=["shared-binning", "binning-per-part"])
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_each_split_operator_gives_the_whole_ones_values(parts, shared_binning):
    """Projection, binning (one the parts share, or each part's of its tile rows), raster forward, loss,
    raster and projection backward, split, against one part (5 parts over 3 tile rows: some parts have
    no tiles)."""
    g = edge_case_scene(n=60, seed=3, dtype=np.float32)
    cam = ns.Camera(np.eye(4), 36.0, 40.0, WIDTH * 0.52, HEIGHT * 0.47, WIDTH, HEIGHT)
    target = np.random.default_rng(0).random((HEIGHT, WIDTH, 3)).astype(np.float32)
    whole, _ = split_step(1, g, cam, target)
    split, b = split_step(parts, g, cam, target, shared_binning=shared_binning)
    assert isinstance(b, SplitBinning) and len(b.parts) == parts and (b.shared is not None) == shared_binning
    roomy, b = split_step(parts, g, cam, target, into_room=True, shared_binning=shared_binning)
    assert b.total is not None
    for k in whole:
        np.testing.assert_allclose(roomy[k], whole[k], rtol=0, atol=TOLERANCE, err_msg=f"{k}, into room")
    assert np.abs(whole["grad"]).max() > 0 and (whole["counts"] > 0).sum() > 20  # (not an empty scene)
    for k in whole:
        np.testing.assert_allclose(split[k], whole[k], rtol=0, atol=TOLERANCE, err_msg=k)


def test_separate_gradient_records_add_up_to_the_whole_ones():
    """Each part's raster backward into its own records (as separate GPUs do), added up in the placement:
    one view's gradients equal one part's to float rounding (the sums grouped by part)."""
    g = edge_case_scene(n=60, seed=3, dtype=np.float32)
    cam = ns.Camera(np.eye(4), 36.0, 40.0, WIDTH * 0.52, HEIGHT * 0.47, WIDTH, HEIGHT)
    target = np.random.default_rng(0).random((HEIGHT, WIDTH, 3)).astype(np.float32)
    whole, _ = split_step(1, g, cam, target)
    split, _ = split_step(3, g, cam, target, separate_gradients=True)
    for k in ("grad", "d_means", "d_scales", "d_quats", "d_opacities", "d_sh"):
        np.testing.assert_allclose(split[k], whole[k], rtol=1e-5, atol=TOLERANCE, err_msg=k)


def test_each_part_bins_only_its_own_tiles():
    """A part's ranges cover its tile rows only, and each of its tiles holds the whole binning's list."""
    g = edge_case_scene(n=60, seed=3, dtype=np.float32)
    cam = ns.Camera(np.eye(4), 36.0, 40.0, WIDTH * 0.52, HEIGHT * 0.47, WIDTH, HEIGHT)
    p = ns.project(g, cam, backend="cpu")
    whole = ns.bin_tiles(p, backend="cpu")
    tx = cam.tiles[0]
    total = 0
    for (first, last), _, part in Placement(2, "cpu", shared_binning=False).bin_tiles(p).parts:
        mine = np.zeros(len(part.ranges), bool)
        mine[first * tx:last * tx] = True
        assert (part.ranges[~mine] == 0).all()
        for t in np.flatnonzero(mine):
            a, b = part.ranges[t]
            w0, w1 = whole.ranges[t]
            np.testing.assert_array_equal(part.ids[a:b], whole.ids[w0:w1])
        total += int((part.ranges[:, 1] - part.ranges[:, 0]).sum())
    assert total == whole.n_isect


def test_a_split_binning_into_room_bins_as_the_exact_one():
    """Each part binned into room of its own (no sync) holds the exact split binning's intersections in
    its tiles' ranges, its total on the device; a part whose room is too small raises the view's flag."""
    g = edge_case_scene(n=60, seed=3, dtype=np.float32)
    cam = ns.Camera(np.eye(4), 36.0, 40.0, WIDTH * 0.52, HEIGHT * 0.47, WIDTH, HEIGHT)
    p = ns.project(g, cam, backend="cpu")
    placement = Placement(3, "cpu", shared_binning=False)
    exact = placement.bin_tiles(p)
    assert exact.overflow is None and exact.total is None and min(exact.part_slots) > 0
    roomy = placement.bin_tiles(p, room=[n + 7 for n in exact.part_slots])
    assert roomy.total.tolist() == list(exact.part_slots) and int(roomy.overflow[0]) == 0
    for (rows, _, a), (_, _, b) in zip(exact.parts, roomy.parts):
        np.testing.assert_array_equal(b.ranges, a.ranges, err_msg=str(rows))
        for t in np.flatnonzero(a.ranges[:, 1] > a.ranges[:, 0]):
            np.testing.assert_array_equal(b.ids[slice(*b.ranges[t])], a.ids[slice(*a.ranges[t])])
    short = list(exact.part_slots)
    short[1] -= 1  # one part's room a slot short: the view's flag, that part's total still counted
    tight = placement.bin_tiles(p, room=short)
    assert int(tight.overflow[0]) == 1 and tight.total.tolist() == list(exact.part_slots)
    with pytest.raises(ValueError, match="room for 2 parts, the split has 3"):
        placement.bin_tiles(p, room=[10, 10])


def test_binning_room_of_a_split_keeps_each_parts_room():
    """Split, a view's rooms and totals are each part's: a room per part from its last total (grown with the
    model), fitting only where every part's does, and an overflow where any part's total outgrew its room."""
    from engine.pipelines.single_gpu import BinningRoom
    room = BinningRoom(parts=2)
    room.last = {0: ((1000, 10), 100)}
    assert room.room(0, 100) == (int(room.MARGIN * 1000) + room.SLACK, int(room.MARGIN * 10) + room.SLACK)
    assert room.room(0, 200)[0] == int(room.MARGIN * 2000) + room.SLACK and room.room(1, 100) is None
    half = 1 + (room.MARGIN - 1) / 2
    assert room.fits(0, 100, (int(half * 1000) + room.SLACK, int(half * 10) + room.SLACK))
    assert not room.fits(0, 100, (10**9, int(half * 10) - 1 + room.SLACK))
    room._total[:] = (900, 20)  # as a step's copy of its parts' totals lands
    room.pending = (0, 100, (1000, 15), None)
    room.settle()
    assert room.last[0] == ((900, 20), 100) and room.overflows == 1 and room.skipped == [0]


def trained_into_room(dataset, out, parts, shared_binning):
    """``trained``'s run, every step after a view's first binning into room (as on GPUs); the parts
    sharing one binning of each view (one room), or each binning its own rows (a room each, as parts
    on separate GPUs do)."""
    t = make_trainer(dataset, out, config(), PipelineOptions(virtual_devices=parts), backend="cpu",
                     log=lambda *a: None)
    assert t.placement.shared_binning  # (virtual devices share one device)
    if not shared_binning:
        t.placement = Placement(parts, "cpu", shared_binning=False)
    t.binning_room = True
    t.train(progress=False)
    binnings = 1 if shared_binning else parts
    assert t._room.parts == (binnings if binnings > 1 else None) and t._room.overflows == 0
    assert len(t._room.last) == len(dataset.train)
    assert all(len(total) == parts for total, _ in t._room.last.values()) if binnings > 1 else True
    return t


@pytest.mark.parametrize("shared_binning", [True, False], ids=["shared-binning", "binning-per-part"])
@pytest.mark.parametrize("parts", [2, 3])
def test_virtual_devices_binning_into_room_train_the_model_of_one_device(dataset, one_device, parts, shared_binning,
                                                                         tmp_path):
    """50 steps densifying, binning into room after a view's first step (one room for the binning the
    parts share, or one for each part's): every parameter and moment as one device's exact binning
    (the room changes no bit)."""
    split = trained_into_room(dataset, tmp_path, parts, shared_binning)
    assert len(split.model) == len(one_device.model)
    for which in ("params", "m", "v"):
        a, b = one_device.model.host_arrays(which), split.model.host_arrays(which)
        for group in GROUPS:
            np.testing.assert_allclose(b[group], a[group], rtol=0, atol=TOLERANCE, err_msg=f"{which} {group}")


def test_split_adam_updates_every_row_as_the_whole():
    """Three visible-only Adam steps of 17 Gaussians split 3 ways (every group's block of each part's
    rows: a launch each) against one launch."""
    from numbasplat.optim import Adam, FlatParams, column_lrs
    g = edge_case_scene(n=17, seed=1, dtype=np.float32, degree=1)
    lrs = column_lrs({"means": 1e-2, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}, 4)
    size = FlatParams.from_gaussians(g).size
    grads = np.random.default_rng(1).normal(size=(3, size)).astype(np.float32)
    visible = np.arange(17) % 4 != 1
    results = []
    for parts in (1, 3):
        params = FlatParams.from_gaussians(g)
        adam = Adam(params, backend="cpu")
        placement = Placement(parts, "cpu")
        for step in range(3):
            adam.set_step(lrs)
            placement.prepare_adam(adam)  # (what the update uploads, before it: a step graph may capture it)
            uploaded = set(adam._span_layouts)
            placement.adam_update(adam, grads[step], visible=visible)
            assert set(adam._span_layouts) == uploaded
        results.append((params.data, adam.m, adam.v))
    assert not np.array_equal(results[0][0], FlatParams.from_gaussians(g).data)
    for a, b in zip(*results):
        np.testing.assert_array_equal(b, a)


def recorded_cpu_kernels(monkeypatch, fake):
    """Every CPU kernel noted as a launch on ``fake``'s current stream (a ``RecordingCuda``) when called."""
    from numbasplat import cpu
    for name in cpu.__all__:
        if callable(getattr(cpu, name)) and name not in ("array_module", "launch_count", "fused_layout"):
            monkeypatch.setattr(cpu, name, fake.recording(getattr(cpu, name), name))


def split_scene():
    g = edge_case_scene(n=60, seed=3, dtype=np.float32)
    cam = ns.Camera(np.eye(4), 36.0, 40.0, WIDTH * 0.52, HEIGHT * 0.47, WIDTH, HEIGHT)
    return g, cam, np.random.default_rng(0).random((HEIGHT, WIDTH, 3)).astype(np.float32)


PARTS_SIDE_BY_SIDE = {"part 0", "part 1", "part 2"}


@pytest.mark.parametrize("deterministic", [False, True])
def test_part_streams_fork_before_and_join_after_each_split_operator(monkeypatch, deterministic):
    """3 parts on streams of their own (``device.PartStreams`` over a recording fake of CuPy's streams,
    the CPU kernels noted as launches on the current stream): every launch comes after every launch the
    host queued before it but for the other parts' of its operator (each part's stream waits for an event
    on the caller's stream, the caller's for every part's); projection, raster, loss, raster backward and
    projection backward each run their parts side by side, the deterministic raster backward on the
    caller's stream, part after part; the values are those of the parts one after another."""
    from fake_streams import RecordingCuda
    from numbasplat.device import PartStreams
    g, cam, target = split_scene()
    plain, _ = split_step(3, g, cam, target, deterministic=deterministic, part_streams=False)
    fake = RecordingCuda()
    recorded_cpu_kernels(monkeypatch, fake)
    streamed, _ = split_step(3, g, cam, target, deterministic=deterministic, part_streams=PartStreams(3, api=fake))
    for k in plain:
        np.testing.assert_array_equal(streamed[k], plain[k], err_msg=k)
    assert fake.unordered() == []
    windows = fake.windows()
    assert len(windows) == (4 if deterministic else 5) and all(w == PARTS_SIDE_BY_SIDE for w in windows.values())
    backward = [launch.stream.name for launch in fake.launches if launch.name == "raster_backward"]
    assert backward == (["caller"] * 3 if deterministic else ["part 0", "part 1", "part 2"])
    assert fake.current is fake.caller


def adam_by_parts(g, part_streams):
    """One Adam step of ``g``'s parameters on random gradients, split 3 ways.  -> (params, m, v)."""
    from numbasplat.optim import Adam, FlatParams, column_lrs
    params = FlatParams.from_gaussians(g)
    adam = Adam(params, backend="cpu")
    adam.set_step(column_lrs({"means": 1e-2, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3},
                             g.sh.shape[1]))
    grads = np.random.default_rng(1).normal(size=params.size).astype(np.float32)
    Placement(3, "cpu", part_streams=part_streams).adam_update(adam, grads)
    return params.data, adam.m, adam.v


def test_part_streams_of_adam_and_of_binnings_per_part(monkeypatch):
    """Adam's parts, and parts that bin their own tile rows, side by side on their streams, ordered as
    ``test_part_streams_fork_before_and_join_after_each_split_operator`` asks: the bits of the parts one
    after another."""
    from fake_streams import RecordingCuda
    from numbasplat.device import PartStreams
    g, cam, target = split_scene()
    plain, _ = split_step(3, g, cam, target, shared_binning=False, part_streams=False)
    plain_adam = adam_by_parts(g, False)
    fake = RecordingCuda()
    recorded_cpu_kernels(monkeypatch, fake)
    streams = PartStreams(3, api=fake)
    streamed, _ = split_step(3, g, cam, target, shared_binning=False, part_streams=streams)
    for k in plain:
        np.testing.assert_array_equal(streamed[k], plain[k], err_msg=k)
    for a, b in zip(plain_adam, adam_by_parts(g, streams)):
        np.testing.assert_array_equal(b, a)
    assert fake.unordered() == []
    # projection, the parts' binnings, raster, loss, raster backward, projection backward, Adam
    assert len(fake.windows()) == 7 and all(w == PARTS_SIDE_BY_SIDE for w in fake.windows().values())


def test_the_fork_join_check_finds_a_part_that_does_not_wait_or_is_not_joined(monkeypatch):
    """The check of the tests above fails where a part's stream skips the fork's event, or the join skips a
    part's stream."""
    from fake_streams import FakeEvent, RecordingCuda
    from numbasplat.device import PartStreams

    class NoFork(PartStreams):
        def on_part(self, k, fork):
            return super().on_part(k, FakeEvent()) if k == 1 else super().on_part(k, fork)

    class NoJoin(PartStreams):
        def join(self):
            last = self.streams.pop()
            super().join()
            self.streams.append(last)

    g, cam, target = split_scene()
    for broken in (NoFork, NoJoin):
        fake = RecordingCuda()
        recorded_cpu_kernels(monkeypatch, fake)
        split_step(3, g, cam, target, part_streams=broken(3, api=fake))
        assert fake.unordered(), broken.__name__


def aggregate_dataset(n_views=8):
    """Views of the demo's scene (rotated Gaussians, uneven scales) at WIDTH x HEIGHT."""
    g = ground_truth(0)
    views = []
    for i in range(n_views):
        ang = 2 * np.pi * i / n_views
        eye = (4.5 * np.cos(ang), 4.5 * np.sin(ang), 1.5 + (i % 2))
        cam = ns.Camera(look_at(eye, (0, 0, 0.5)), 0.9 * WIDTH, 0.95 * WIDTH, 0.53 * WIDTH, 0.46 * HEIGHT, WIDTH,
                        HEIGHT)
        img = np.clip(ns.render(g, cam, background=(1.0, 1.0, 1.0), backend="cpu").image, 0, 1)
        views.append(View(f"view{i:03d}.png", np.ascontiguousarray(img, np.float32), cam))
    return Dataset(train=views[1:], test=views[:1], points=np.zeros((0, 3), np.float32),
                   colors=np.zeros((0, 3), np.float32), scene_scale=5.0, source="aggregate-test", fmt="demo")


@pytest.fixture(scope="module")
def dataset():
    return aggregate_dataset()


STEPS, STOP = 50, 27


def config():
    """50 steps from 300 random points, SH up to degree 1, densifying every 10 steps from step 5 and
    an opacity reset at 25."""
    return TrainConfig(iterations=STEPS, sh_degree=1, sh_increase_every=10, n_random_init=300, snapshot_every=0,
                       log_every=10, save_at=(0,), eval_at=(0,), background=(1.0, 1.0, 1.0), densify_from=5,
                       densify_every=10, opacity_reset_every=25, grad_threshold=5e-5)


def trained(dataset, out, parts, stop_at=None):
    """A run on ``parts`` virtual devices (made by ``make_trainer``, as ``run.py train`` makes it): to
    the end, or stopped at ``stop_at`` (its snapshot written) and resumed by a new trainer."""
    options = PipelineOptions(virtual_devices=parts)
    t = make_trainer(dataset, out, config(), options, backend="cpu", log=lambda *a: None)
    assert t.placement.parts == parts and t.options.virtual_devices == parts
    if stop_at is None:
        return t.train(progress=False)
    t.train(progress=False, until=stop_at)
    t = make_trainer(dataset, out, config(), options, backend="cpu", log=lambda *a: None)
    t.load_snapshot(out / SNAPSHOT)
    assert t.step == stop_at
    return t.train(progress=False)


@pytest.fixture(scope="module")
def one_device(dataset, tmp_path_factory):
    return trained(dataset, tmp_path_factory.mktemp("one"), 1)


@pytest.mark.parametrize("parts", [2, 3])
def test_virtual_devices_train_the_model_of_one_device(dataset, one_device, parts, tmp_path):
    """50 steps with densification and an opacity reset, stopped at step 27 (a snapshot) and resumed,
    on N virtual devices, against one device without a stop: every parameter and Adam moment."""
    split = trained(dataset, tmp_path, parts, stop_at=STOP)
    assert len(one_device.model) != 300, "densification did not run"
    assert len(split.model) == len(one_device.model)
    for which in ("params", "m", "v"):
        a, b = one_device.model.host_arrays(which), split.model.host_arrays(which)
        for group in GROUPS:
            np.testing.assert_allclose(b[group], a[group], rtol=0, atol=TOLERANCE, err_msg=f"{which} {group}")


def test_virtual_devices_train_lego_as_one_device(tmp_path):
    """lego (../shared/data/lego, 48x48, 12 views), 50 steps with densification, a stop at 27 and a
    resume, on 3 virtual devices against one device."""
    from conftest import shared_dir
    from data import load_dataset
    lego = load_dataset(shared_dir() / "data" / "lego", resolution=48, train_views=12)
    one = trained(lego, tmp_path / "one", 1)
    split = trained(lego, tmp_path / "three", 3, stop_at=STOP)
    assert len(one.model) != 300 and len(split.model) == len(one.model)
    for group in GROUPS:
        np.testing.assert_allclose(split.model.host_arrays()[group], one.model.host_arrays()[group], rtol=0,
                                   atol=TOLERANCE, err_msg=group)


REFUSED = [
    (dict(), dict(virtual_devices=0), "--virtual-devices 0: the parts"),
    (dict(loss="tile"), dict(virtual_devices=2), "--virtual-devices 2 trains with --loss global"),
    (dict(visible_adam=True), dict(virtual_devices=2, offload="host"), "--virtual-devices 2 with --offload host"),
    (dict(), dict(virtual_devices=2, devices="2"), "--virtual-devices splits one device: not with --devices 2"),
    (dict(), dict(devices="2"), "--devices 2: no GPU here"),
    (dict(), dict(devices="two"), "--devices two: a count of GPUs, or all"),
    (dict(), dict(devices_allow_pcie=True), "--devices-allow-pcie is for --devices"),
    (dict(), dict(gpu_memory=2**30, virtual_devices=2), "--gpu-memory is for --offload host or disk, or --devices 1"),
]


@pytest.mark.parametrize("changes, options, message", REFUSED, ids=[r[2][:40] for r in REFUSED])
def test_check_refuses_what_the_aggregate_device_cannot_do(changes, options, message):
    with pytest.raises(ValueError, match=message):
        check(TrainConfig(**changes), PipelineOptions(**options))


def test_check_refuses_virtual_devices_over_ranks():
    class Ranks:
        def Get_size(self):
            return 2
    with pytest.raises(ValueError, match="--virtual-devices 3: the aggregate device trains in one process"):
        check(TrainConfig(), PipelineOptions(virtual_devices=3), Ranks())


def test_the_flags_reach_the_options():
    from cli import train
    a = train.train_parser().parse_args(["--virtual-devices", "3", "--devices", "all", "--devices-allow-pcie"])
    options = train.options_from_args(a)
    assert (options.virtual_devices, options.devices, options.devices_allow_pcie) == (3, "all", True)


SIM_SCRIPT = """
import numpy as np
import numbasplat as ns
from numbasplat import backend
from scenes import edge_case_scene
from placement_step import split_step
assert backend.BACKEND == "cuda"
W, H = 40, 20  # 3 x 2 tiles
g = edge_case_scene(n=14, seed=5, dtype=np.float32, degree=1)
cam = ns.Camera(np.eye(4), 30.0, 33.0, W * 0.52, H * 0.47, W, H)
target = np.random.default_rng(0).random((H, W, 3)).astype(np.float32)
one = split_step(1, g, cam, target, "cuda")[0]
assert np.abs(one["grad"]).max() > 0 and (one["counts"] > 0).sum() > 5
for two in (split_step(2, g, cam, target, "cuda")[0], split_step(2, g, cam, target, "cuda", deterministic=True)[0],
            split_step(2, g, cam, target, "cuda", into_room=True)[0]):
    for k in one:  # (float atomics: the sums' order varies)
        assert np.allclose(two[k], one[k], rtol=1e-5, atol=1e-6), (k, np.abs(np.asarray(two[k]) - one[k]).max())
one = split_step(1, g, cam, target, "cuda", deterministic=True)[0]
for parts in (2, 3):  # the fixed order: each part's sums continue the last part's, so the split changes no bit
    split = split_step(parts, g, cam, target, "cuda", deterministic=True)[0]
    for k in one:  # (the loss: the parts' sums added, a reported value that no gradient reads)
        assert np.array_equal(np.asarray(split[k]), np.asarray(one[k])) or k == "loss", (parts, k)
print("AGGREGATE SIM OK")
"""

test_two_virtual_devices_equal_one_under_the_simulator = simulator_test(
    f"import sys; sys.path.insert(0, {str(__import__('conftest').TESTS_DIR)!r})\n" + SIM_SCRIPT,
    "AGGREGATE SIM OK", timeout=420)


SIM_STREAMS_SCRIPT = """
import numpy as np
import numbasplat as ns
from numbasplat import backend
from numbasplat.cuda import launch
from numbasplat.device import PartStreams
from fake_streams import RecordingCuda
from scenes import edge_case_scene
from placement_step import split_step
assert backend.BACKEND == "cuda"
W, H = 24, 40  # 2 x 3 tiles: a tile row a part
g = edge_case_scene(n=14, seed=5, dtype=np.float32, degree=1)
cam = ns.Camera(np.eye(4), 30.0, 33.0, W * 0.52, H * 0.47, W, H)
target = np.random.default_rng(0).random((H, W, 3)).astype(np.float32)
for deterministic in (False, True):
    plain = split_step(3, g, cam, target, "cuda", deterministic=deterministic, part_streams=False)[0]
    fake = RecordingCuda()
    launch.Kernel.__getitem__ = fake.recording(unrecorded := launch.Kernel.__getitem__)
    streamed = split_step(3, g, cam, target, "cuda", deterministic=deterministic,
                          part_streams=PartStreams(3, api=fake))[0]
    launch.Kernel.__getitem__ = unrecorded
    assert np.abs(plain["grad"]).max() > 0 and (plain["counts"] > 0).sum() > 5
    for k in plain:  # (the simulator runs a launch at once: the same sums in the same order)
        assert np.array_equal(np.asarray(streamed[k]), np.asarray(plain[k])), (deterministic, k)
    assert not fake.unordered(), [(a.name, a.stream.name, b.name, b.stream.name) for a, b in fake.unordered()][:5]
    windows = fake.windows()
    assert len(windows) == (4 if deterministic else 5), windows
    assert all(w == {"part 0", "part 1", "part 2"} for w in windows.values()), windows
    on_caller = {a.name for a in fake.launches if a.stream is fake.caller}
    assert any("slot_sum" in name for name in on_caller) == deterministic, on_caller
print("PART STREAMS SIM OK")
"""

test_part_streams_fork_and_join_the_cuda_launches_under_the_simulator = simulator_test(
    f"import sys; sys.path.insert(0, {str(__import__('conftest').TESTS_DIR)!r})\n" + SIM_STREAMS_SCRIPT,
    "PART STREAMS SIM OK", timeout=360)


def test_bench_times_the_split_step(tmp_path, capsys):
    """``run.py bench --virtual-devices 3`` times the step split as training splits it."""
    import cli
    path = tmp_path / "b.npz"
    assert cli.main(["bench", "--make", "500", "--res", "40x36", "--out", str(path)]) == 0
    capsys.readouterr()
    assert cli.main(["bench", "--scene", str(path), "--iters", "1", "--warmup", "0", "--virtual-devices", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 virtual devices" in out and "step_ms=" in out, out


@pytest.mark.parametrize("parts", [1, 3])
def test_bench_into_room_steps_as_binning_exactly(parts):
    """``bench.run(into_room=True)``: the steps after the first bin into its slots (each part its own) and
    train the scene as exact binning does: the same loss after 3 steps."""
    from numbasplat import bench
    g = edge_case_scene(n=80, seed=2, dtype=np.float32, degree=1)
    cam = ns.Camera(np.eye(4), 36.0, 40.0, WIDTH * 0.52, HEIGHT * 0.47, WIDTH, HEIGHT)
    said = {}
    for into_room in (False, True):
        lines = []
        bench.run((g, cam), iters=2, warmup=1, backend="cpu", virtual_devices=parts, into_room=into_room,
                  out=lines.append)
        said[into_room] = lines[0].split("loss value ")[1]
    assert said[True] == said[False]


@pytest.mark.parametrize("parts", [1, 3])
def test_bench_graphs_replay_the_step_into_room(parts):
    """``bench.run(graphs=True)``: after the step that makes the room, one step captured and replayed (on
    the CPU the step itself in the graph's place): the same loss after 4 steps as the steps run one by one,
    the whole step timed and its stages not; without ``into_room`` one clear error."""
    from numbasplat import bench
    g = edge_case_scene(n=80, seed=2, dtype=np.float32, degree=1)
    cam = ns.Camera(np.eye(4), 36.0, 40.0, WIDTH * 0.52, HEIGHT * 0.47, WIDTH, HEIGHT)
    said, med = {}, {}
    for graphs in (False, True):
        lines = []
        med[graphs] = bench.run((g, cam), iters=2, warmup=2, backend="cpu", virtual_devices=parts, into_room=True,
                                graphs=graphs, out=lines.append)
        said[graphs] = lines[0].split("loss value ")[1]
    assert said[True] == said[False]
    assert "step" in med[True] and "adam" not in med[True] and "adam" in med[False]
    with pytest.raises(ValueError, match="into_room"):
        bench.run((g, cam), iters=1, backend="cpu", graphs=True)


def test_info_says_which_gpus_reach_each_other(monkeypatch):
    from cli import bench
    from numbasplat import device
    monkeypatch.setattr(device, "peer_access", lambda: {(0, 1): True, (1, 0): True})
    assert bench._peer_line() == "GPU peer access (every pair): 0->1 yes, 1->0 yes"
    monkeypatch.setattr(device, "peer_access", lambda: {(0, 1): True, (1, 0): False})
    assert bench._peer_line() == ("GPU peer access (not every pair: train --devices needs --devices-allow-pcie): "
                                  "0->1 yes, 1->0 no")


def test_run_py_train_on_virtual_devices(tmp_path, capsys):
    """``run.py train --virtual-devices 2`` on a capture (32x24 views): the line that says so, and the
    setting in cfg.json (a resume repeats it)."""
    import json

    import cli
    from tests.dataset_files import CAMS, colmap_scene
    colmap_scene(tmp_path / "capture", ".bin", n_images=4, cams=[CAMS[0]])
    out = tmp_path / "out"
    assert cli.main(["train", "--quiet", "--init-points", "200", "--sh-degree", "1", "--data",
                     str(tmp_path / "capture"), "--out", str(out), "--iters", "3", "--virtual-devices", "2"]) == 0
    assert "aggregate device: every operator split 2 ways, one after another on this device" in capsys.readouterr().out
    assert json.loads((out / "cfg.json").read_text())["virtual_devices"] == 2
