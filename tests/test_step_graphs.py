"""Step graphs (engine/pipelines/step_graphs.py) on the CPU: the single-GPU trainer's host work split from
its device work so that a replayed step trains as a step run as usual, and when a graph is
captured, replayed, captured again and dropped.  The CUDA graphs themselves run on the GPU only
(tests/check_cuda_graphs.py)."""
import json

import numpy as np

from engine.pipelines.single_gpu import BinningRoom, SingleGPUTrainer
from engine.pipelines.step_graphs import StepGraphs, array_key
from test_trainer import dataset, small_config  # noqa: F401 (a fixture)


def _trained(dataset, path, graphs, until=56, refine_every=25, **settings):
    """``until`` steps over the 10 views densifying from step 4 every ``refine_every``, an opacity reset
    at 50, binning into room."""
    t = SingleGPUTrainer(dataset, path, small_config(iterations=until + 4, **settings), backend="cpu")
    t.strategy.refine_start, t.strategy.refine_every, t.strategy.reset_every = 4, refine_every, 50
    t.binning_room = True
    if graphs:
        t._graphs = StepGraphs(simulate=True)
    t.init_model()
    t.train(progress=False, until=until)
    return t


def test_replayed_steps_train_as_steps_run_as_usual(dataset, tmp_path):
    """The same model to the bit, with the step of a view seen before replayed from its capture
    (the call as captured, its view, room and SH degree fixed) wherever the key held."""
    plain, graphed = _trained(dataset, tmp_path / "plain", False), _trained(dataset, tmp_path / "graphs", True)
    assert graphed._graphs.captures > 0 and graphed._graphs.replays > 0
    assert graphed.model.adam.step_count == plain.model.adam.step_count == 56
    for k, a in plain.model.gaussians.arrays().items():
        np.testing.assert_array_equal(graphed.model.gaussians.arrays()[k], a, err_msg=k)
    for k, a in plain.strategy_state.items():
        np.testing.assert_array_equal(graphed.strategy_state[k], a, err_msg=k)


def test_the_log_psnr_of_a_replayed_step_is_its_views_psnr_now(dataset, tmp_path):
    """A replayed step keeps no render: the log's PSNR (the last step's view) is that view rendered
    after the step, not the last render of a step run as usual (which stayed in every record)."""
    from numbasplat.loss import psnr
    t = _trained(dataset, tmp_path, True, until=40)
    image, view = t._progress_view
    assert image is None and t._graphs.replays > 0
    now = psnr(t.view_image(t.model, t.data.train[view].camera), t.targets[view])
    assert t.progress_psnr() == now
    logged = [json.loads(x)["psnr"] for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(set(logged)) == len(logged), logged


def test_replayed_steps_with_every_blitzgs_switch_train_as_steps_run_as_usual(dataset, tmp_path):
    """With importance passes (every 40 steps and near the end; each starts the trainer from its
    result: the graphs are dropped), view masks and the LOD gate, 86 steps: the same model to the bit."""
    blitz = dict(until=86, refine_every=100, importance_every=40, importance_prune=1e-4, view_masks="on",
                 lod_min_px=0.5)
    plain = _trained(dataset, tmp_path / "plain", False, **blitz)
    graphed = _trained(dataset, tmp_path / "graphs", True, **blitz)
    assert graphed.workload.seconds > 0 and graphed._graphs.replays > 0
    for k, a in plain.model.gaussians.arrays().items():
        np.testing.assert_array_equal(graphed.model.gaussians.arrays()[k], a, err_msg=k)
    # the Gaussians drawn per view are counted in replayed steps too: every log step has the plain run's
    drawn = [[(r["step"], r.get("drawn_per_view")) for r in map(json.loads, (tmp_path / run / "log.jsonl").open())]
             for run in ("plain", "graphs")]
    assert drawn[0] == drawn[1] and all(d is not None and d > 0 for _, d in drawn[1]), drawn


def test_replayed_steps_on_random_backgrounds_train_as_steps_run_as_usual(dataset, tmp_path):
    """Each step's random background is written to device values that the captured step reads: the
    same model to the bit as steps run as usual on the same backgrounds (a refinement at 25, and the
    views' steps replayed around it)."""
    plain = _trained(dataset, tmp_path / "plain", False, until=40, random_background=True)
    graphed = _trained(dataset, tmp_path / "graphs", True, until=40, random_background=True)
    assert graphed._graphs.replays > 0 and graphed._random_bg is not None
    for k, a in plain.model.gaussians.arrays().items():
        np.testing.assert_array_equal(graphed.model.gaussians.arrays()[k], a, err_msg=k)


def test_a_graph_is_run_captured_replayed_and_captured_again():
    """A view's first step: run as is; its next: captured and launched; then replayed while the room
    fits; captured again at once when it does not, when the key changes, and after ``clear``."""
    calls = []
    def step(room, captured):
        calls.append((room, captured))
        return len(calls)
    graphs = StepGraphs(simulate=True)
    fits = lambda room: room >= 10  # noqa: E731
    assert graphs.run(0, "k", 10, fits, step) == (1, 10) and calls[-1] == (10, False)
    assert graphs.run(0, "k", 12, fits, step) == (2, 12) and graphs.captures == 1
    assert graphs.run(0, "k", 11, fits, step) == (3, 12) and graphs.replays == 1  # the captured room
    assert calls[-1] == (12, True)
    fits = lambda room: room >= 20  # noqa: E731
    assert graphs.run(0, "k", 25, fits, step) == (4, 25) and graphs.captures == 2
    assert graphs.run(0, "other", 26, fits, step) == (5, 26) and calls[-1] == (26, True) and graphs.captures == 3
    assert graphs.run(1, "k", None, fits, step) == (6, None) and calls[-1] == (None, False)  # first sight: as is
    assert graphs.run(1, "k", None, fits, step) == (7, None) and calls[-1] == (None, False)  # no room: as is
    graphs.clear()
    assert graphs.run(0, "other", 25, fits, step) == (8, 25) and calls[-1] == (25, True)
    assert graphs.run(0, "other", 25, fits, step) == (9, 25) and graphs.replays == 2
    assert graphs.captures == 4


def test_room_fits_while_it_leaves_half_the_margin_and_the_slack():
    room = BinningRoom()
    room.last = {0: (1000, 100)}
    half = 1 + (room.MARGIN - 1) / 2
    assert room.fits(0, 100, int(half * 1000) + room.SLACK) and not room.fits(0, 100, int(half * 1000) - 1 + room.SLACK)
    assert room.fits(0, 100, room.room(0, 100))  # a room as given fits
    assert not room.fits(0, 200, int(half * 1000) + room.SLACK)  # the model doubled since: so does the total
    assert not room.fits(1, 100, 10**9)  # a view never binned bins exactly


def test_array_key_follows_address_and_shape():
    a = np.zeros(8, np.float32)
    assert array_key([a]) == array_key([a]) != array_key([a.copy()])
    assert array_key([a]) != array_key([a[:4]])


def test_a_step_that_cannot_be_captured_runs_as_usual_until_its_key_changes():
    calls = []
    def step(room, captured):
        if captured:
            raise RuntimeError("the current stream is capturing, so H2D transfers are disallowed")
        calls.append(room)
        return len(calls)
    graphs = StepGraphs(simulate=True)
    graphs._capture = lambda call: call()  # a capture that runs the step, as a real one records it
    fits = lambda room: True  # noqa: E731
    assert [graphs.run(0, "k", 10, fits, step)[0] for _ in range(3)] == [1, 2, 3]
    assert graphs.failures == 1 and "H2D" in graphs.last_failure and graphs.captures == 0
    graphs.run(0, "new", 10, fits, step)  # a new key: captured again (and failing, run as usual)
    graphs.run(0, "new", 10, fits, step)
    assert graphs.failures == 2 and len(calls) == 5


def test_a_step_whose_graph_would_not_be_replayed_runs_as_usual():
    """``comes_again`` False: a step that would be captured runs as usual (a capture never replayed costs the
    host's and the device's time one after the other); a graph that holds is still replayed."""
    calls = []
    def step(room, captured):
        calls.append((room, captured))
        return len(calls)
    graphs = StepGraphs(simulate=True)
    fits = lambda room: True  # noqa: E731
    graphs.run(0, "k", 10, fits, step)
    assert graphs.run(0, "k", 10, fits, step, comes_again=lambda: False) == (2, 10) and calls[-1] == (10, False)
    assert graphs.captures == 0 and graphs.unreplayed == 1
    assert graphs.run(0, "k", 10, fits, step) == (3, 10) and graphs.captures == 1
    assert graphs.run(0, "k", 10, fits, step, comes_again=lambda: False) == (4, 10) and graphs.replays == 1


def test_views_not_coming_again_before_the_model_changes_are_not_captured(dataset, tmp_path):
    """Densifying every 6 steps over the 10 views, most views come once between two refinements: the trainer
    captures a view's step only where the view comes again before the graphs' key changes (its place in the
    epoch's order, or half an epoch on), so nearly every capture is replayed; the model is the same to the bit
    as steps run as usual, and where the key holds for long (densification over) views are captured as before."""
    graphed = _trained(dataset, tmp_path / "graphs", True, until=80, refine_every=6, densify_until=40)
    plain = _trained(dataset, tmp_path / "plain", False, until=80, refine_every=6, densify_until=40)
    g = graphed._graphs
    assert g.unreplayed > 10 and g.replays >= g.captures > 0, (g.captures, g.replays, g.unreplayed)
    for k, a in plain.model.gaussians.arrays().items():
        np.testing.assert_array_equal(graphed.model.gaussians.arrays()[k], a, err_msg=k)
    always = StepGraphs(simulate=True)  # the same run capturing wherever a step could be captured
    t = SingleGPUTrainer(dataset, tmp_path / "always", small_config(iterations=84, densify_until=40), backend="cpu")
    t.strategy.refine_start, t.strategy.refine_every, t.strategy.reset_every = 4, 6, 50
    t.binning_room, t._graphs, t._comes_again = True, always, lambda view: True
    t.init_model()
    t.train(progress=False, until=80)
    assert always.captures > g.captures + 10 and always.replays <= g.replays + 10, (always.captures, always.replays)
