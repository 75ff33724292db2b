"""The training images as the loss reads them (the targets), kept on the training device.

The loss reads float32, 12 bytes a pixel.  A capture of many large views fills a GPU with them
before it holds a Gaussian (the large city's 1312 training views at 1600x900 take 23 GB), so
they may be kept at 8 bits a channel instead, 3 bytes a pixel, and widened to float32 when a step
reads one (one elementwise launch).  The rounding is exact for 8-bit images that the loader
neither resized, undistorted nor composited on a background (it made them u x
``EIGHT_BIT_LEVEL``, as the widening does), and within half a level (1/510) for the others.

``cfg.targets``: float32, uint8, or auto, which keeps uint8 where float32 targets would take more
than ``AUTO_SHARE`` of the GPU's memory, and float32 on the CPU backend (its arrays are the
loader's own: no copy to save).
"""
import numpy as np

from data.images import EIGHT_BIT_LEVEL
from numbasplat import backend as _backend

FORMATS = ("auto", "float32", "uint8")
AUTO_SHARE = 1 / 8          # auto: uint8 where float32 targets would take more than this of the GPU


def choose_format(requested, float32_bytes, device_bytes):
    """The format for ``requested`` (one of ``FORMATS``), where float32 targets would take
    ``float32_bytes`` of a device of ``device_bytes`` (0: no GPU)."""
    if requested not in FORMATS:
        raise ValueError(f"--targets {requested}: unknown (one of {', '.join(FORMATS)})")
    if requested != "auto":
        return requested
    return "uint8" if device_bytes and float32_bytes > AUTO_SHARE * device_bytes else "float32"


def to_levels(image):
    """(H, W, 3) float32 in [0, 1] -> the nearest of the 256 levels of each channel, uint8."""
    return np.rint(np.clip(image, 0.0, 1.0) * np.float32(255.0)).astype(np.uint8)


def _device_bytes(backend):
    """The GPU's memory in bytes (0 on the CPU backend and the simulator)."""
    if not _backend.on_gpu(backend):
        return 0
    import cupy
    return int(cupy.cuda.runtime.memGetInfo()[1])


class Targets:
    """The training views' images on the device, ``targets[i]`` the i-th as an (H, W, 3) float32
    array (a widened copy where they are kept as uint8)."""

    def __init__(self, images, requested="auto", backend=None):
        self.xp = _backend.array_module(backend)
        self.float32_bytes = sum(4 * int(np.prod(im.shape)) for im in images)
        self.device_memory = _device_bytes(backend)
        self.format = choose_format(requested, self.float32_bytes, self.device_memory)
        wide = self.format == "float32"
        self._stored = [self.xp.asarray(im if wide else to_levels(im)) for im in images]

    def __len__(self):
        return len(self._stored)

    def __getitem__(self, i):
        a = self._stored[i]
        return a if self.format == "float32" else self.xp.multiply(a, EIGHT_BIT_LEVEL, dtype=np.float32)

    @property
    def nbytes(self):
        """The bytes they take as kept."""
        return sum(int(a.nbytes) for a in self._stored)

    @property
    def device_bytes(self):
        """The GPU memory they take (0 where they are host arrays: the CPU backend, the simulator)."""
        return sum(int(a.nbytes) for a in self._stored if _backend.is_device(a))

    def describe(self):
        """One line for the log where they are kept as uint8 on a GPU (None otherwise)."""
        if self.format != "uint8" or not self.device_memory:
            return None
        gb = 1e9
        return (f"training images kept at 8 bits a channel on the GPU ({self.nbytes / gb:.1f} GB; as float32 "
                f"{self.float32_bytes / gb:.1f} GB of its {self.device_memory / gb:.1f} GB)")
