"""Guards of the defaults' quality (issue 57): a change of a default that costs quality fails here.

Each guard trains with the defaults on the CPU backend, over seeds 0, 1 and 2, and holds the mean
test PSNR to a floor: the mean measured when the guard was set minus a margin taken from the spread
of those runs (BENCHMARKS.md, "Quality guards").  The CPU backend is deterministic for a seed (its
backward sums in a fixed order, whatever the thread count), so a guard moves only when the code
does.  Both fail on 3335eae's schedule (the means' decay over the run).

- the built-in demo (2000 steps at 64x64, random initial points): the first thing a user runs;
- a real 360-degree capture, helmet at 34x60 for 400 steps (shared data; skipped without it).
"""
import numpy as np
import pytest

from conftest import shared_dir
from engine.pipelines.single_gpu import SingleGPUTrainer
from engine.recipe.trainer import TrainConfig

SEEDS = (0, 1, 2)

# the demo's mean with the means' rate doubled from random points: 37.97 dB (37.72, 37.59, 38.59); 36.89 before it
# (93e41fa's schedule alone), which now fails; the guard allows 0.5 dB, as issue 57 asks
DEMO_MEAN, DEMO_MARGIN = 37.97, 0.5
# helmet's proxy after the fix: 24.41 dB (24.35, 24.46, 24.41); 3335eae's schedule gives 23.78; the margin is
# three times the seeds' spread (0.10 dB)
HELMET_MEAN, HELMET_MARGIN = 24.41, 0.3


def mean_test_psnr(dataset, cfg, tmp_path):
    """The test PSNR of ``cfg`` trained on ``dataset`` (CPU), for each of ``SEEDS``."""
    out = []
    for seed in SEEDS:
        cfg.seed = seed
        t = SingleGPUTrainer(dataset, tmp_path / f"s{seed}", cfg, backend="cpu", log=lambda *a: None)
        t.train(progress=False)
        out.append(t.evaluate(lpips=False)["psnr"])
    return float(np.mean(out)), out


def test_demo_quality_holds(tmp_path):
    """The demo with today's defaults (as ``run.py demo`` trains it) stays within 0.5 dB of its
    value after issue 57's fix.  3335eae's decay over the run (2000 steps) fails it by 8-10 dB."""
    from cli.train import demo_config
    from engine.tools.demo import make_dataset
    mean, each = mean_test_psnr(make_dataset(backend="cpu"), demo_config(), tmp_path)
    assert mean >= DEMO_MEAN - DEMO_MARGIN, f"the demo's test PSNR fell: {mean:.2f} dB (seeds {each})"


def test_real_capture_proxy_quality_holds(tmp_path):
    """Helmet (a real 360-degree phone capture) at 1/16 of images_2's size, 400 steps, with the defaults
    but for densification's schedule (from step 300, every 50 steps): its mean test PSNR stays at or
    above its floor.  3335eae's schedule fails it by 0.3 dB."""
    from data import load_dataset
    data = shared_dir() / "data" / "helmet"
    if not data.is_dir():
        pytest.skip("../shared/data/helmet not present")
    dataset = load_dataset(str(data), images="images_2", test_every=8, resolution=34)  # 34x60: 1/16 of images_2
    cfg = TrainConfig(iterations=400, densify_from=300, densify_every=50, snapshot_every=0, log_every=1000)
    mean, each = mean_test_psnr(dataset, cfg, tmp_path)
    assert mean >= HELMET_MEAN - HELMET_MARGIN, f"helmet's proxy test PSNR fell: {mean:.2f} dB (seeds {each})"
