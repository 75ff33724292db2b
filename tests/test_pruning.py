"""engine/recipe/pruning.py and ``run.py prune``: ByteSplat's contribution and hardware-aware pruning.
The budget, P_t, P_i, Q_i and a round's choice on small cases computed by hand; the command on
a small trained model (the pruned model loads, exports and trains on)."""
import json

import numpy as np
import pytest

import cli
from engine.recipe.pruning import fused_budget, removal_mask, tile_excess, tile_of_intersections, view_pressure
from numbasplat.rendering import Binning
from numbasplat.math.tiles import H200_SMEM_PER_BLOCK, fused_smem_layout
from test_cli_evaluate import run as trained  # noqa: F401 (a fixture: a capture and a 20-step training folder)


def test_budget_from_the_kernels_layout():
    fixed, per_gaussian = fused_smem_layout()
    assert per_gaussian == 4 * 9                      # the fields before depth, float32
    assert fixed == 4 * (9 * 256 + 12 + 1)            # loss scratch, a gradient row, one flag
    budget, how = fused_budget(backend="cpu")
    assert how["smem_per_block"] == H200_SMEM_PER_BLOCK == 232448 and budget == (232448 - fixed) // 36
    assert fused_budget(20000, backend="cpu")[0] == (20000 - fixed) // 36 == 298
    assert fused_budget(9000, backend="cpu")[0] == 0  # less than the fixed part: no tile fits
    with pytest.raises(ValueError, match="--smem-budget"):
        fused_budget(0, backend="cpu")


def test_tile_excess_and_pressure_by_hand():
    counts = np.array([0, 3, 10, 5])
    np.testing.assert_allclose(tile_excess(counts, 5), [0, 0, 0.5, 0])
    # one view's binning: tile 0 holds Gaussians 0, 1; tile 1 holds 0, 2, 3, 1, 4; tile 2 none
    ranges = np.array([[0, 2], [2, 7], [7, 7]])
    ids = np.array([0, 1, 0, 2, 3, 1, 4])
    np.testing.assert_array_equal(tile_of_intersections(ranges), [0, 0, 1, 1, 1, 1, 1])
    excess = tile_excess(ranges[:, 1] - ranges[:, 0], 3)            # [0, 0.4, 0]
    pressure = np.bincount(ids, weights=excess[tile_of_intersections(ranges)], minlength=6)
    np.testing.assert_allclose(pressure, [0.4, 0.4, 0.4, 0.4, 0.4, 0.0])
    # the same binning with two padding intersections past the ranges (a GPU's count and emit
    # passes can disagree on a boundary tile): they weigh nothing
    padded = Binning(np.array([*ids, 5, 5]), ranges, len(ids) + 2)
    np.testing.assert_allclose(view_pressure(padded, ranges[:, 1] - ranges[:, 0], 3, 6), pressure)


def test_a_round_removes_the_highest_q_and_never_a_gaussian_without_pressure():
    pressure = np.array([0.0, 0.4, 0.4, 0.2, 0.0, 0.9, 0.1, 0.3, 0.3, 0.5, 0.6])
    importance = np.array([0.0, 1.0, 0.1, 0.1, 0.0, 1.0, 0.0, 0.5, 0.5, 0.2, 1.0])
    # Q = P / (I + eps) of the 9 candidates (rows 1-3, 5-10): 0.4, 4, 2, 0.9, 1e5, 0.6, 0.6, 2.5, 0.6
    assert removal_mask(pressure, importance, 10).nonzero()[0].tolist() == [6]          # 10% of 9: one
    assert sorted(removal_mask(pressure, importance, 34).nonzero()[0].tolist()) == [2, 6, 9]
    everything = removal_mask(pressure, importance, 100)
    assert everything.sum() == 9 and not everything[[0, 4]].any()
    assert not removal_mask(np.zeros(5), np.ones(5), 50).any()


def test_prune_command_writes_a_pruned_model_that_loads_and_trains(trained, tmp_path, capsys):
    cap, out = trained
    root = tmp_path
    pruned = root / "pruned"
    # a budget of 9268 + 36 * 40 bytes: 40 Gaussians a tile, fewer than the model's crowded tiles hold
    assert cli.main(["prune", "--model", str(out), "--out", str(pruned), "--smem-budget", str(9268 + 36 * 40),
                     "--fine-tune", "4", "--round-fine-tune", "2", "--rounds", "2", "--beta", "20"]) == 0
    text = capsys.readouterr().out
    assert "fused budget B = 40 Gaussians a tile" in text and "--smem-budget" in text
    report = json.loads((pruned / "metrics.json").read_text())["pruning"]
    stages = report["stages"]
    assert report["budget"] == 40 and stages[0]["stage"] == "contribution" and len(stages) >= 2
    assert stages[0]["gaussians_after"] < stages[0]["gaussians_before"]  # some Gaussians dominate no pixel
    for s in stages:
        assert s["gaussians_after"] <= s["gaussians_before"]
    for s in stages:  # each stage's quality and fine-tuning time: the ratio sweep's points
        assert s["test"]["psnr"] > 10 and s["fine_tune_step_ms"] > 0
    hardware = [s for s in stages if s["stage"].startswith("hardware")]
    assert hardware and hardware[0]["tiles_within_before"] < 1.0
    assert hardware[-1]["tiles_within_after"] >= hardware[0]["tiles_within_before"]
    after = json.loads((pruned / "metrics.json").read_text())["psnr"]
    assert report["test_before"]["psnr"] > 10 and abs(report["test_after"]["psnr"] - after) < 1e-6
    assert report["test_after"] == stages[-1]["test"]
    log = [json.loads(line) for line in (pruned / "log.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in log if "stage" in r] == [s["stage"] for s in stages]
    # the pruned folder is a training folder: export, evaluate and train on
    ply = sorted((pruned / "point_cloud").glob("iteration_*/point_cloud.ply"))[-1]
    assert cli.main(["export", "--model", str(pruned), "--ply", str(root / "again.ply")]) == 0
    assert (root / "again.ply").read_bytes() == ply.read_bytes()
    # the step on the pruned model and the unpruned one, with the tile loss, on the capture's views
    for model, n in ((out, stages[0]["gaussians_before"]), (pruned, stages[-1]["gaussians_after"])):
        assert cli.main(["scaling", "--model", str(model), "--views", "2", "--iters", "1", "--warmup", "0",
                         "--loss", "tile", "--model-ranks", "2"]) == 0
        text = capsys.readouterr().out
        assert "the model of" in text and f"{n} Gaussians, 32x32" in text and "2 training views" in text
        assert "pixel-level exchange, MB crossing ranks per image" in text  # beside the Gaussian-level bytes
    step = stages[-1]["step"]
    assert cli.main(["train", "--data", str(cap), "--white-background", "--out", str(pruned), "--resume",
                     "--iters", str(step + 4), "--quiet", "--sh-degree", "1"]) == 0


def test_prune_errors_name_the_option(trained, tmp_path, capsys):
    _, out = trained
    root = tmp_path
    for flag, value, message in (("--beta", "150", "must be a percentage above 0 and at most 100, got 150"),
                                 ("--stage", "all", "invalid choice: 'all'")):
        with pytest.raises(SystemExit) as e:
            cli.main(["prune", "--model", str(out), "--out", str(root / "x"), flag, value])
        assert e.value.code == 2 and f"argument {flag}: {message}" in capsys.readouterr().err


def test_train_with_prune_runs_the_stages_within_the_iterations(trained, tmp_path):
    """``train --prune hardware``: stage 1 to densify_until, the pruning and its fine-tuning, then on
    to --iters with densification off; a resume past the pruning does not prune again."""
    cap, _ = trained
    out = tmp_path / "run"
    args = ["train", "--data", str(cap), "--white-background", "--out", str(out), "--quiet", "--sh-degree", "1",
            "--init-points", "500", "--eval", "--densify-from", "4", "--densify-every", "4", "--densify-until", "16",
            "--prune", "hardware", "--prune-fine-tune", "4", "--prune-round-fine-tune", "2", "--prune-rounds", "2",
            "--prune-beta", "20", "--smem-budget", str(9268 + 36 * 40)]
    assert cli.main([*args, "--iters", "40"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    stages = metrics["pruning"]["stages"]
    assert metrics["iterations"] == 40 and stages[0]["stage"] == "contribution" and stages[0]["step"] == 20
    assert metrics["gaussians"] == stages[-1]["gaussians_after"] < stages[0]["gaussians_before"]
    assert json.loads((out / "cfg.json").read_text())["prune"] == "hardware"
    assert metrics["pruning"]["test_before"]["psnr"] > 10 and metrics["pruning"]["test_after"]["psnr"] > 10
    assert cli.main([*args, "--iters", "44", "--resume"]) == 0
    again = json.loads((out / "metrics.json").read_text())
    assert again["iterations"] == 44 and "pruning" not in again and again["gaussians"] == metrics["gaussians"]
    # too few iterations left after densification for I_M and the rounds' I_o: shortened to end at --iters
    short = tmp_path / "short"
    args[args.index(str(out))] = str(short)
    args[args.index("--prune-fine-tune") + 1], args[args.index("--prune-round-fine-tune") + 1] = "30", "30"
    assert cli.main([*args, "--iters", "24"]) == 0
    metrics = json.loads((short / "metrics.json").read_text())
    assert metrics["iterations"] == 24 and metrics["pruning"]["stages"][0]["step"] == 16 + 8


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_two_ranks_prune_as_one(tmp_path):
    """Under mpiexec the pruning ranks the whole model once (on the root) and cuts the shards anew:
    two ranks end with one rank's pruned model (the same batch)."""
    from test_gaussian_exchange import launch
    ref, log1 = launch(1, tmp_path / "p1", "sparse", "prune")
    got, log2 = launch(2, tmp_path / "p2", "sparse", "prune")
    stages = [line for line in log1.splitlines() if line.startswith("pruning")]
    assert stages and "hardware round 1" in stages[0], log1
    assert stages == [line for line in log2.splitlines() if line.startswith("pruning")], log2
    for g, a in ref.items():
        assert got[g].shape == a.shape, (g, log2)
        assert np.linalg.norm(got[g] - a) / np.linalg.norm(a) <= 1e-5, g
