"""The single-GPU pipeline's step: the tile loss trains, and its weight is its own."""
import pytest

from engine.single_gpu import SingleGPUTrainer
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
