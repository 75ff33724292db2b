"""The training images kept at 8 bits a channel (engine/recipe/targets.py): exact for 8-bit images, within
half a level for the others, chosen by auto only where float32 would crowd the GPU, and training
on them as on float32 where they are exact."""
import dataclasses

import numpy as np
import pytest

from engine.pipelines.single_gpu import SingleGPUTrainer
from data.images import EIGHT_BIT_LEVEL
from engine.recipe.targets import AUTO_SHARE, Targets, choose_format
from test_trainer import dataset, small_config  # noqa: F401 (a fixture)


def _eight_bit(rng, shape=(5, 7, 3)):
    """An image as the loader makes an 8-bit file of: u / 255 in float32 (data/images.py)."""
    return rng.integers(0, 256, shape, dtype=np.uint8).astype(np.float32) * EIGHT_BIT_LEVEL


def test_eight_bit_images_come_back_exactly():
    rng = np.random.default_rng(0)
    ends = np.array([[[0, 255, 254]]], np.uint8).astype(np.float32) * EIGHT_BIT_LEVEL
    images = [_eight_bit(rng) for _ in range(3)] + [ends]
    t = Targets(images, "uint8", backend="cpu")
    assert t.format == "uint8" and len(t) == 4
    for i, im in enumerate(images):
        assert t[i].dtype == np.float32
        np.testing.assert_array_equal(t[i], im)
    assert t.nbytes == sum(im.size for im in images)  # a byte a channel
    assert t.device_bytes == 0  # host arrays on the CPU backend


def test_other_images_come_back_within_half_a_level():
    rng = np.random.default_rng(1)
    image = rng.uniform(-0.1, 1.1, (9, 11, 3)).astype(np.float32)  # resampled values, a little out of range
    back = Targets([image], "uint8", backend="cpu")[0]
    clipped = np.clip(image, 0, 1)
    assert np.abs(back - clipped).max() <= 0.5 / 255 + 1e-7
    assert np.abs(back - clipped).max() > 0.1 / 255  # they were rounded: not the float32 image itself


def test_float32_keeps_the_loaders_arrays():
    image = np.random.default_rng(2).uniform(0, 1, (4, 4, 3)).astype(np.float32)
    t = Targets([image], "float32", backend="cpu")
    assert t[0] is image or np.shares_memory(t[0], image)
    assert t.nbytes == image.nbytes


def test_auto_keeps_float32_unless_they_would_crowd_the_gpu():
    gpu = 80 * 2**30
    assert choose_format("auto", int(AUTO_SHARE * gpu), gpu) == "float32"
    assert choose_format("auto", int(AUTO_SHARE * gpu) + 1, gpu) == "uint8"
    assert choose_format("auto", 10**15, 0) == "float32"  # the CPU backend: no GPU to spare
    assert choose_format("float32", 10**15, gpu) == "float32"
    assert choose_format("uint8", 1, gpu) == "uint8"
    with pytest.raises(ValueError, match="--targets half"):
        choose_format("half", 1, gpu)
    assert Targets([np.zeros((2, 2, 3), np.float32)], backend="cpu").format == "float32"


def test_training_on_eight_bit_targets_equals_float32(dataset, tmp_path):
    """The same capture at 8 bits: 20 steps with the targets kept as uint8 end with the model that
    float32 targets give, to the bit; on the capture's own (rendered, not 8-bit) images they differ."""
    views = [dataclasses.replace(v, image=np.rint(v.image * 255).astype(np.float32) * EIGHT_BIT_LEVEL)
             for v in dataset.train]
    eight_bit = dataclasses.replace(dataset, train=views)

    def trained(data, fmt, name):
        t = SingleGPUTrainer(data, tmp_path / name, small_config(iterations=20, targets=fmt), backend="cpu")
        t.init_model()
        t.train(progress=False)
        return t.model.host_arrays()

    wide, narrow = trained(eight_bit, "float32", "a"), trained(eight_bit, "uint8", "b")
    for k, a in wide.items():
        np.testing.assert_array_equal(narrow[k], a, err_msg=k)
    rendered = trained(dataset, "uint8", "c")
    assert any(not np.array_equal(rendered[k], a) for k, a in trained(dataset, "float32", "d").items())
