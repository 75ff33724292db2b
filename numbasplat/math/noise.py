"""Counter-based Gaussian noise: the draw for element ``index`` under ``key`` is a pure function of
the two, so each element can be drawn where it lives (any rank, any device, any order) and a
model's noise does not depend on how its rows are sharded.  Densification draws the children of
split Gaussians this way on the device, instead of drawing every row of the model on the host.

``mix64`` is SplitMix64's output function (Steele, Lea and Flood 2014) of ``key`` advanced
``index + 1`` times.  One 64-bit hash gives two 24-bit uniforms in [-1, 1), and Marsaglia's polar
method a standard normal from those inside the unit circle (no trigonometry: libdevice's sine and
cosine carry a float64 path).  Everything is uint64, int32 and float32, so the CUDA kernels stay
in single precision (a mixed int64/uint64 operation would be float64 in Numba, and a uint64
converts to float32 through float64).
"""
import math

from numba import float32, int32, uint64

from .jit import shared

GOLDEN = uint64(0x9E3779B97F4A7C15)   # SplitMix64's increment
MUL1 = uint64(0xBF58476D1CE4E5B9)
MUL2 = uint64(0x94D049BB133111EB)
LOW24 = uint64(0xFFFFFF)
HALF_UNIT = float32(1.0 / (1 << 23))  # a 24-bit integer times HALF_UNIT, less 1: a float32 in [-1, 1), exactly
ATTEMPTS = 40                         # pairs tried per draw: all 40 outside the circle has probability 1e-27


@shared
def mix64(key, index):
    """A 64-bit hash of (``key``, ``index``), both 64-bit integers (the key's bits taken as they are)."""
    z = uint64(key) + (uint64(index) + uint64(1)) * GOLDEN
    z = (z ^ (z >> uint64(30))) * MUL1
    z = (z ^ (z >> uint64(27))) * MUL2
    return z ^ (z >> uint64(31))


@shared
def hashed_normal(key, index):
    """A standard normal draw (float32) for element ``index`` under ``key``: the first pair (v1, v2)
    of the hashes under key, key + MUL1, key + 2 MUL1, ... that lies inside the unit circle gives
    v1 sqrt(-2 ln s / s), s = v1^2 + v2^2 (1.27 pairs on average); 0 if none of ``ATTEMPTS`` does."""
    seed = uint64(key)
    for _ in range(ATTEMPTS):
        z = mix64(seed, index)
        v1 = float32(int32(z >> uint64(40))) * HALF_UNIT - float32(1.0)
        v2 = float32(int32((z >> uint64(16)) & LOW24)) * HALF_UNIT - float32(1.0)
        s = v1 * v1 + v2 * v2
        if float32(0.0) < s < float32(1.0):
            return v1 * math.sqrt(float32(-2.0) * math.log(s) / s)
        seed += MUL1
    return float32(0.0)
