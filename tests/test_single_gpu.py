"""The single-GPU pipeline's step: the tile loss trains, and its weight is its own; binning into
kept room trains as exact binning does, and a step whose intersections outgrow it is skipped."""
import numpy as np
import pytest

from engine.pipelines.single_gpu import BinningRoom, SingleGPUTrainer
from test_trainer import dataset, small_config  # noqa: F401 (a fixture)


def test_tile_loss_training_runs_and_learns(dataset, tmp_path):
    t = SingleGPUTrainer(dataset, tmp_path, small_config(loss="tile", iterations=30), backend="cpu")
    t.init_model()
    before = t.evaluate()["psnr"]
    t.train(progress=False)
    assert t.evaluate()["psnr"] > before + 1.0


def test_tile_loss_weight_is_its_own(dataset, tmp_path):
    """lambda_s3im weighs the tile loss's S3IM term; the global loss's lambda_dssim leaves it alone.
    At 0 the tile loss is the L1 term alone, as is the global loss at lambda_dssim 0."""
    def first_loss(loss="tile", **kw):
        t = SingleGPUTrainer(dataset, tmp_path, small_config(loss=loss, **kw), backend="cpu")
        t.init_model()
        return float(t.train_step()[0])
    base = first_loss()
    assert first_loss(lambda_dssim=0.9) == base
    l1_only = first_loss(lambda_s3im=0.0)
    assert abs(l1_only - base) > 1e-4
    assert l1_only == pytest.approx(first_loss("global", lambda_dssim=0.0), rel=1e-6)


def _trained(dataset, path, binning_room, steps=30, room=None):
    t = SingleGPUTrainer(dataset, path, small_config(iterations=steps), backend="cpu")
    t.binning_room = binning_room
    t.init_model()
    if room is not None:
        t._room = room
    t.train(progress=False)
    return t


def test_binning_into_room_trains_as_exact_binning(dataset, tmp_path):
    """30 steps over the training views (densifying; 20 steps binned into room): the same model,
    to the bit, and no overflow."""
    exact = _trained(dataset, tmp_path / "exact", False)
    roomy = _trained(dataset, tmp_path / "room", True)
    assert roomy._room.pending is None and roomy._room.overflows == 0
    assert len(roomy._room.last) == len(dataset.train) == 10
    for k, a in exact.model.gaussians.arrays().items():
        np.testing.assert_array_equal(roomy.model.gaussians.arrays()[k], a, err_msg=k)


def test_room_holds_the_totals_from_before_an_opacity_reset():
    """After a reset a view's room stays at least its total from before it, grown with the model
    since, for its next HOLD_VISITS binnings, then follows its own totals again; a view first seen
    after the reset bins exactly."""
    room = BinningRoom()
    room.last = {0: (1000, 100), 1: (50, 100)}
    room.hold_totals()
    room.last[0] = (200, 100)  # the reset's render: the reach shrank with the opacities
    held = int(room.MARGIN * 1000) + room.SLACK
    for _ in range(room.HOLD_VISITS):
        assert room.room(0, 100) == held
        assert room.room(0, 600) == int(room.MARGIN * 1000 * 6) + room.SLACK  # the model's growth since counts
        room.held[0][2] -= 1  # what plan() does at each binning
        if not room.held[0][2]:
            del room.held[0]
    assert room.room(0, 100) == int(room.MARGIN * 200) + room.SLACK
    assert room.room(1, 100) == int(room.MARGIN * 50) + room.SLACK and room.room(2, 100) is None


def test_binning_into_room_across_opacity_resets_trains_as_exact_binning(dataset, tmp_path):
    """30 steps with opacity resets at steps 12 and 24: the same model to the bit, and the room
    held after each reset (released after HOLD_VISITS binnings of each view)."""
    def trained(binning_room, path):
        t = SingleGPUTrainer(dataset, path, small_config(iterations=30), backend="cpu")
        t.strategy.refine_start, t.strategy.refine_every, t.strategy.reset_every = 4, 6, 12
        t.binning_room = binning_room
        t.init_model()
        t.train(progress=False, until=26)
        return t
    exact, roomy = trained(False, tmp_path / "exact"), trained(True, tmp_path / "room")
    assert roomy._room.held and all(0 < left <= roomy._room.HOLD_VISITS for _, _, left in roomy._room.held.values())
    for k, a in exact.model.gaussians.arrays().items():
        np.testing.assert_array_equal(roomy.model.gaussians.arrays()[k], a, err_msg=k)


class _NoRoom(BinningRoom):
    """Every view seen before gets 1 slot: its step overflows."""
    def room(self, view, gaussians):
        return None if view not in self.last else 1


class _OnceTooSmall(BinningRoom):
    """The first view seen twice gets 1 slot on its second binning, then room as usual; the views
    binned are kept in order."""
    def __init__(self):
        super().__init__()
        self.binned, self.short = [], None

    def room(self, view, gaussians):
        if view in self.last and self.short is None:
            self.short = view
            return 1
        return super().room(view, gaussians)

    def plan(self, view, gaussians):
        self.binned.append(view)
        return super().plan(view, gaussians)


def test_a_skipped_view_trains_again_a_step_later(dataset, tmp_path):
    """A view whose intersections outgrew its room is trained again at the next step but one (its
    overflow is read as the next step bins), so every view keeps its turns in the epoch."""
    t = _trained(dataset, tmp_path, True, steps=16, room=_OnceTooSmall())
    room = t._room
    assert room.overflows == 1 and not room.skipped
    at = room.binned.index(room.short, 10)  # its second binning (the second epoch's first), the one skipped
    assert at == 10 and room.binned[at + 2] == room.short and room.binned[at + 1] != room.short
    counts = np.bincount(room.binned, minlength=10)
    assert counts[room.short] == 3 and counts.sum() == 16


def test_a_step_that_outgrows_its_room_is_skipped(dataset, tmp_path):
    """After the first pass over the 10 training views (binned exactly), every step overflows: Adam leaves
    the model alone and the strategy's statistics do not count the step; the log says how many."""
    t = _trained(dataset, tmp_path, True, steps=10, room=_NoRoom())
    before = {k: a.copy() for k, a in t.model.gaussians.arrays().items()}
    count = t.strategy_state["count"].copy()
    t.cfg.iterations = 14
    t.train(progress=False)
    assert t.log_extra()["binning_overflows"] == 4
    for k, a in before.items():
        np.testing.assert_array_equal(t.model.gaussians.arrays()[k], a, err_msg=k)
    np.testing.assert_array_equal(t.strategy_state["count"], count)
